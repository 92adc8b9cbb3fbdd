"""Distributed batch normalization over groups of replicas that tile the torus.

``batch_norm(x, scale, bias, axis_name=..., group_size=g)`` normalizes the NHWC (or any
channels-last) activation ``x`` with the batch statistics of the g replicas of its tile
(see ``groups``): g = 1 is local batch norm, the whole mesh is synchronized batch norm,
and a small tile lets a per-replica batch of a few images still normalize over tens of
them, as in Ying et al., "Image Classification at Supercomputer Scale" (2018).

Forward, per channel, with n rows per replica and N = g * n in the group:

1. each replica computes the mean and M2 = sum((x - mean)**2) of its rows (one HBM pass,
   numerically sound; ``norm.passes``);
2. group sum of the local means -> the group mean;
3. group sum of M2_i + n * (mean_i - mean)**2 -> the group M2, var = M2 / N. Every term
   is non-negative, so no cancellation; the price is a second latency round of C floats;
4. y = (x - mean) * scale * rsqrt(var + eps) + bias, optionally ReLU'd (one HBM pass).

Backward (``jax.custom_vjp``), with g the output cotangent after the ReLU mask and
xhat = (x - mean) * rsqrt(var + eps): one group sum of (sum g, sum g * xhat), then
dx = scale * rsqrt(var + eps) * (g - sum g / N - xhat * sum(g * xhat) / N). The local
(sum g, sum g * xhat) are d bias and d scale, summed over the mesh axes the parameters
are replicated on, as jax's own transpose of an implicit broadcast would.

``mean`` and ``var`` are returned for running averages and carry no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import axes, collectives, groups, registry
from torus_collectives.norm import passes
from torus_collectives.norm.block_sizes import BlockSizes
from torus_collectives.registry import Implementation


@dataclasses.dataclass(frozen=True)
class _Config:
  axis_names: tuple[str, ...]
  tile: tuple[int, ...]
  epsilon: float
  relu: bool
  implementation: str  # concrete: a registered backend with batch norm
  block_sizes: BlockSizes | None


def _pass(cfg: _Config, name: str, *args, **kwargs):
  """Runs one per-replica pass of the configured implementation; a ``local_*`` pass
  only for a group of one, and None where the implementation does not run it."""
  fn = getattr(registry.batch_norm_passes(cfg.implementation), name)
  if name.startswith("local_") and (fn is None or math.prod(cfg.tile) > 1):
    return None
  if registry.BACKENDS[cfg.implementation].pallas_kernels:
    kwargs["block_sizes"] = cfg.block_sizes
  return fn(*args, **kwargs)


def _group_sum(x, cfg: _Config):
  return collectives.group_sum(x, cfg.axis_names, cfg.tile) if cfg.axis_names else x


def _forward(x, scale, bias, cfg: _Config):
  fused = _pass(cfg, "local_forward", x, scale, bias, epsilon=cfg.epsilon, relu=cfg.relu)
  if fused is not None:
    y, stats = fused
    mean, var = stats[passes.LOCAL_MEAN], stats[passes.LOCAL_VAR]
  else:
    rows = x.size // x.shape[-1]
    group = math.prod(cfg.tile)
    local = _pass(cfg, "stats", x)
    local_mean, local_m2 = local[passes.STATS_MEAN], local[passes.STATS_M2]
    mean = _group_sum(local_mean, cfg) / group
    m2 = _group_sum(local_m2 + rows * (local_mean - mean) ** 2, cfg)
    var = m2 / (rows * group)
  rstd = lax.rsqrt(var + cfg.epsilon)
  # Rows COEF_MEAN, COEF_MUL, COEF_BIAS.
  coef = jnp.stack([mean, scale.astype(jnp.float32) * rstd, bias.astype(jnp.float32)])
  if fused is None:
    y = _pass(cfg, "normalize", x, coef, relu=cfg.relu)
  return (y, mean, var), (x, coef, rstd, scale, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _batch_norm(x, scale, bias, cfg: _Config):
  return _forward(x, scale, bias, cfg)[0]


def _varying_axes(v) -> frozenset:
  """Mesh axes along which ``v`` varies inside shard_map (its type's ``{V:...}``)."""
  return jax.typeof(v).mat.varying


def _to_primal_type(ct, primal):
  """Sums a cotangent over the mesh axes its primal is replicated (invariant) on."""
  extra = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
  ct = lax.psum(ct, extra) if extra else ct
  return ct.astype(primal.dtype)


def _backward(cfg: _Config, residuals, cotangents):
  x, coef, rstd, scale, bias = residuals
  dy = cotangents[0]  # mean and var leave under stop_gradient: no cotangent to carry.
  count = x.size // x.shape[-1] * math.prod(cfg.tile)
  mul = coef[passes.COEF_MUL]
  # dx = mul * g + k_xc * (x - mean) + k_0, with k_xc = a * sum(g * (x - mean)) and
  # k_0 = b * sum(g) over the group.
  a, b = -mul * rstd * rstd / count, -mul / count
  factors = jnp.stack([a, b])  # rows COEF_A, COEF_B after coef's
  fused = _pass(cfg, "local_backward", x, dy, jnp.concatenate([coef, factors]), relu=cfg.relu)
  if fused is not None:
    dx, local = fused
  else:
    local = _pass(cfg, "backward_sums", x, dy, coef, relu=cfg.relu)
    total = _group_sum(local, cfg)
    # Rows COEF_K_XC, COEF_K_0 after coef's.
    k = jnp.stack([a * total[passes.SUM_G_XC], b * total[passes.SUM_G]])
    dx = _pass(cfg, "backward_dx", x, dy, jnp.concatenate([coef, k]), relu=cfg.relu)
  dscale = local[passes.SUM_G_XC] * rstd
  dbias = local[passes.SUM_G]
  return (_to_primal_type(dx, x), _to_primal_type(dscale, scale), _to_primal_type(dbias, bias))


_batch_norm.defvjp(lambda x, scale, bias, cfg: _forward(x, scale, bias, cfg), _backward)


def _axis_sizes(axis_names: tuple[str, ...]) -> tuple[int, ...]:
  try:
    return tuple(lax.axis_size(a) for a in axis_names)
  except NameError as e:
    raise ValueError(
      f"axis_name={axis_names} is not bound here: call batch_norm inside jax.shard_map "
      "over a mesh with these axes, or pass axis_name=None for local batch norm"
    ) from e


def batch_norm(
  x: jax.Array,
  scale: jax.Array,
  bias: jax.Array,
  *,
  axis_name: str | Sequence[str] | None = None,
  group_size: groups.GroupSize = None,
  epsilon: float = 1e-5,
  relu: bool = False,
  implementation: Implementation = "auto",
  block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Training-mode batch norm with statistics summed over a tile of replicas.

  Args:
    x: channels-last activation, e.g. NHWC; statistics reduce over all other axes.
    scale, bias: per-channel ``[C]`` parameters.
    axis_name: mesh axis name or tuple of names bound by the enclosing ``jax.shard_map``;
      None for local statistics.
    group_size: replicas whose statistics are combined: None for all replicas of
      ``axis_name``; an int g for a tile of g replicas filled along the last named axis
      first; a tuple for the tile shape, one extent per named axis.
    epsilon: added to the variance.
    relu: apply ReLU to the output (fused into the normalize pass).
    implementation: "pallas" (TPU kernels; on CPU only under
      ``pltpu.force_tpu_interpret_mode``), "xla" (jnp), or "auto" (see ``registry``).
    block_sizes: block shape of the Pallas passes (default: from the shape); ignored by
      the other implementations.

  Returns:
    ``(y, mean, var)``: y in ``x.dtype`` (compute is float32), and the group's float32
    batch mean and biased variance per channel, without gradient.

  Raises:
    ValueError: on a bad shape (an empty batch included), dtype, epsilon,
      implementation, unbound axis, or a ``group_size`` that is not a tile of the mesh.
    TypeError: on a ``group_size`` that is not None, an int or a tuple of ints.
  """
  x, scale, bias = jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias)
  if x.ndim < 2:
    raise ValueError(f"x must have a batch axis and a trailing channel axis, got {x.shape=}")
  channels = x.shape[-1]
  for name, p in (("scale", scale), ("bias", bias)):
    if p.shape != (channels,):
      raise ValueError(
        f"{name} must have shape ({channels},) to match x's channel axis, "
        f"got {name}.shape={p.shape}"
      )
  if x.size == 0:
    raise ValueError(f"batch norm needs at least one row of statistics, got {x.shape=}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be floating point, got {x.dtype=}")
  if not epsilon > 0:
    raise ValueError(f"epsilon must be positive, got {epsilon=}")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a tc.BlockSizes or None, got {block_sizes=}")
  if axis_name is None:
    if group_size not in (None, 1):
      raise ValueError(f"{group_size=} needs axis_name: the mesh axes the group spans")
    axis_names, tile = (), ()
  else:
    axis_names = axes.names(axis_name)
    tile = groups.resolve_tile(group_size, _axis_sizes(axis_names))
  request = registry.Request("batch_norm", (x.dtype,), x.size * x.dtype.itemsize, tile)
  impl = registry.resolve(implementation, request)
  cfg = _Config(axis_names, tile, float(epsilon), bool(relu), impl, block_sizes)
  y, mean, var = _batch_norm(x, scale, bias, cfg)
  return y, lax.stop_gradient(mean), lax.stop_gradient(var)
