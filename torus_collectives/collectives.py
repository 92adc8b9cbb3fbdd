"""Drop-in replacements for ``lax.psum_scatter``, ``lax.all_gather`` and ``lax.psum``.

Called inside ``jax.shard_map`` over a mesh with named axes, they take the same arguments
and give the same shapes, chunk order (row-major over a tuple of axis names), ``tiled``
meaning and gradients as their ``lax`` counterparts, with a choice of implementation (see
``registry``). The work here is the part every implementation shares: validating the
request before any device work, bringing the scattered or gathered dimension to the front
and flattening, and the autodiff rules (a Pallas kernel has no transpose of its own):

  reduce_scatter^T = all_gather,  all_gather^T = reduce_scatter,  all_reduce^T = all_reduce
  (under ``check_vma=True`` the transpose of the invariant all-reduce is ``pvary``, as for
  ``lax.psum``: no communication).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import registry
from torus_collectives._vma import ensure_varying, mark_invariant, vma_checked
from torus_collectives.configs import KernelConfig
from torus_collectives.registry import Implementation

AxisName = Hashable | tuple[Hashable, ...]
# A torus has at most three dimensions on every TPU generation (v4 and v5p are 3-D).
MAX_TORUS_AXES = 3


def _bound_axes(axis_name: AxisName) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """The named axes as a tuple and their sizes, checked against the enclosing mesh."""
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not 1 <= len(axes) <= MAX_TORUS_AXES:
    raise ValueError(
      f"{axis_name=}: give one mesh axis or a tuple of up to {MAX_TORUS_AXES} (the torus), "
      f"not {len(axes)}"
    )
  if len(set(axes)) != len(axes):
    raise ValueError(f"{axis_name=} names an axis twice")
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  for axis in axes:
    if axis not in manual:
      bound = sorted(manual) or "none"
      raise ValueError(
        f"axis {axis!r} is not bound here (bound mesh axes: {bound}); call this inside "
        "jax.shard_map over a mesh that has that axis"
      )
  return tuple(axes), tuple(int(mesh.shape[a]) for a in axes)


def _implementation(op: str, implementation: str, dtype, config) -> tuple[str, KernelConfig | None]:
  """(concrete implementation, kernel config): the ``impl`` key the flat collectives take."""
  if config is not None and not isinstance(config, KernelConfig):
    raise ValueError(f"config must be a tc.KernelConfig or None, got {config=}")
  return registry.resolve(op, implementation, dtype), config


def _dimension(value: int, ndim: int, name: str) -> int:
  if not -ndim <= value < ndim:
    raise ValueError(f"{name}={value} is out of range for {ndim} dimensions")
  return value % ndim


# Flat, differentiable collectives: the backend does the work, the VJP pairs them up.
# ``impl`` is the (name, config) pair from ``_implementation``; both are hashable.


def _linear_collective(name: str):
  """The backend's ``name`` collective, differentiable through a custom VJP (set below)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
  def op(x, impl, axes, torus):
    return getattr(registry.collective_backend(*impl), name)(x, axes, torus)

  return op


_flat_reduce_scatter = _linear_collective("reduce_scatter")
_flat_all_gather = _linear_collective("all_gather")
# Each is the other's transpose.
for _op, _transpose in (
  (_flat_reduce_scatter, _flat_all_gather),
  (_flat_all_gather, _flat_reduce_scatter),
):
  _op.defvjp(
    lambda x, impl, axes, torus, op=_op: (op(x, impl, axes, torus), None),
    lambda impl, axes, torus, _, ct, t=_transpose: (t(ct, impl, axes, torus),),
  )
del _op, _transpose


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _flat_all_reduce(x, impl, axes, torus, invariant):
  out = registry.collective_backend(*impl).all_reduce(x, axes, torus)
  return mark_invariant(out, axes) if invariant else out


def _flat_all_reduce_fwd(x, impl, axes, torus, invariant):
  return _flat_all_reduce(x, impl, axes, torus, invariant), None


def _flat_all_reduce_bwd(impl, axes, torus, invariant, _, ct):
  if invariant:  # d(sum)/dx_i is the identity on each device: no communication.
    return (lax.pcast(ct, axes, to="varying"),)
  return (_flat_all_reduce(ct, impl, axes, torus, False),)


_flat_all_reduce.defvjp(_flat_all_reduce_fwd, _flat_all_reduce_bwd)


# Public API.


def reduce_scatter(
  x: jax.Array,
  axis_name: AxisName,
  *,
  scatter_dimension: int = 0,
  tiled: bool = False,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
) -> jax.Array:
  """Sums ``x`` over ``axis_name`` and keeps this device's chunk; as ``lax.psum_scatter``."""
  axes, torus = _bound_axes(axis_name)
  impl = _implementation("reduce_scatter", implementation, x.dtype, config)
  p = math.prod(torus)
  dim = _dimension(scatter_dimension, x.ndim, "scatter_dimension")
  size = x.shape[dim]
  if tiled and size % p:
    raise ValueError(
      f"tiled reduce_scatter over {axes} (size {p}) needs x.shape[{dim}]={size} to be a "
      f"multiple of {p}; pad that dimension"
    )
  if not tiled and size != p:
    raise ValueError(
      f"untiled reduce_scatter over {axes} needs x.shape[{dim}]={size} to equal the axis "
      f"size {p}; reshape, or pass tiled=True"
    )
  if impl[0] == "xla":
    return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
  moved = jnp.moveaxis(x, dim, 0)
  out = _flat_reduce_scatter(ensure_varying(moved.reshape(-1), axes), impl, axes, torus)
  if not tiled:
    return out.reshape(moved.shape[1:])
  return jnp.moveaxis(out.reshape((size // p,) + moved.shape[1:]), 0, dim)


def all_gather(
  x: jax.Array,
  axis_name: AxisName,
  *,
  axis: int = 0,
  tiled: bool = False,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
) -> jax.Array:
  """Concatenates (``tiled``) or stacks ``x`` from every device; as ``lax.all_gather``."""
  axes, torus = _bound_axes(axis_name)
  impl = _implementation("all_gather", implementation, x.dtype, config)
  p = math.prod(torus)
  dim = _dimension(axis, x.ndim if tiled else x.ndim + 1, "axis")
  if impl[0] == "xla":
    return lax.all_gather(x, axis_name, axis=dim, tiled=tiled)
  gathered = _flat_all_gather(ensure_varying(x.reshape(-1), axes), impl, axes, torus)
  stacked = jnp.moveaxis(gathered.reshape((p,) + x.shape), 0, dim)
  if not tiled:
    return stacked
  return stacked.reshape(x.shape[:dim] + (p * x.shape[dim],) + x.shape[dim + 1 :])


def all_reduce(
  x: jax.Array,
  axis_name: AxisName,
  *,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
) -> jax.Array:
  """Sums ``x`` over ``axis_name``; as ``lax.psum``."""
  axes, torus = _bound_axes(axis_name)
  impl = _implementation("all_reduce", implementation, x.dtype, config)
  if impl[0] == "xla":
    return lax.psum(x, axis_name)
  flat = ensure_varying(x.reshape(-1), axes)
  return _flat_all_reduce(flat, impl, axes, torus, vma_checked()).reshape(x.shape)
