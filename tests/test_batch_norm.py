"""Distributed batch norm's flax module ("xla" path) vs flax.linen.BatchNorm, and bad input.

Every cross-replica case runs under jax.shard_map on a 2x4 mesh of simulated devices,
differentiating the sum of all replicas' losses (jax's shard_map autodiff semantics). The
op against float64 and gathered-batch references, for every implementation and torus
rank, is test_conformance_batch_norm.py's.
"""

import flax.linen as fnn
import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batch_norm_cases import REPLICAS, C
from batch_norm_cases import assert_close as _assert_close
from batch_norm_cases import inputs as _inputs
from batch_norm_cases import loss as _loss
from jax.sharding import PartitionSpec as P

from torus_collectives.norm.batch_norm import batch_norm
from torus_collectives.norm.linen import BatchNorm

AXES = ("x", "y")
MESH_SHAPE = (2, 4)


def _grads_in_shard_map(module, x, weights, scale, bias):
  """Per-replica y, new batch stats and d(sum of losses)/d(x, scale, bias)."""

  def body(x, scale, bias):
    def loss(x, scale, bias):
      variables = {
        "params": {"scale": scale, "bias": bias},
        "batch_stats": {"mean": jnp.zeros(C), "var": jnp.ones(C)},
      }
      y, state = module.apply(variables, x, mutable=["batch_stats"])
      return _loss(y, weights), (y, state["batch_stats"])

    (_, (y, stats)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, scale, bias)
    return y, stats, grads

  rep = P(AXES)
  stats_spec = {"mean": P(AXES), "var": P(AXES)}
  f = jax.shard_map(
    lambda *a: jax.tree.map(
      lambda s: s[None] if s.ndim == 1 else s, body(*a), is_leaf=lambda s: isinstance(s, jax.Array)
    ),
    mesh=harness.mesh(MESH_SHAPE),
    in_specs=(rep, P(), P()),
    out_specs=(rep, stats_spec, (rep, rep, rep)),
    check_vma=False,
  )
  return jax.jit(f)(x, scale, bias)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group_size", [None, 1])
def test_module_matches_flax(dtype, group_size):
  """Whole mesh vs flax with axis_name; group of 1 vs flax's local batch norm."""
  x, weights, scale, bias = _inputs(dtype)
  ours = BatchNorm(
    use_running_average=False,
    axis_name=AXES,
    group_size=group_size,
    dtype=dtype,
    implementation="xla",
  )
  flax_bn = fnn.BatchNorm(
    use_running_average=False, dtype=dtype, axis_name=AXES if group_size is None else None
  )
  got = _grads_in_shard_map(ours, x, weights, scale, bias)
  want = _grads_in_shard_map(flax_bn, x, weights, scale, bias)
  count = x.size // C // (1 if group_size is None else REPLICAS)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    _assert_close(a, b, dtype, count)


def test_large_mean_bfloat16_statistics_are_exact():
  """Mean 512, spread 1, 2**20 values per channel: E[x^2] - E[x]^2 in float32 fails."""
  rows, channels = 1 << 20, 2
  x = (512.0 + jax.random.normal(jax.random.key(1), (rows, channels))).astype(jnp.bfloat16)
  x64 = np.asarray(x, np.float64)
  want_var = x64.var(axis=0)
  _, mean, var = jax.jit(
    lambda x: batch_norm(x, jnp.ones(channels), jnp.zeros(channels), implementation="xla")
  )(x)
  np.testing.assert_allclose(mean, x64.mean(axis=0), rtol=1e-6)
  np.testing.assert_allclose(var, want_var, rtol=1e-4)
  xf = x.astype(jnp.float32)
  naive = jnp.mean(xf * xf, axis=0) - jnp.mean(xf, axis=0) ** 2
  assert np.max(np.abs(np.asarray(naive) - want_var) / want_var) > 1e-2


def test_running_averages_and_eval_match_flax():
  x, _, _, _ = _inputs(jnp.float32, batch=8)
  ours = BatchNorm(momentum=0.9, implementation="xla")
  theirs = fnn.BatchNorm(momentum=0.9)
  variables = theirs.init(jax.random.key(0), x, use_running_average=False)
  assert jax.tree.map(
    jnp.shape, ours.init(jax.random.key(0), x, use_running_average=False)
  ) == jax.tree.map(jnp.shape, variables)
  stats = {"ours": variables["batch_stats"], "theirs": variables["batch_stats"]}
  for step in range(2):
    xs = x * (step + 1) + step
    for name, module in (("ours", ours), ("theirs", theirs)):
      _, new = module.apply(
        {**variables, "batch_stats": stats[name]},
        xs,
        use_running_average=False,
        mutable=["batch_stats"],
      )
      stats[name] = new["batch_stats"]
  for a, b in zip(jax.tree.leaves(stats["ours"]), jax.tree.leaves(stats["theirs"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not np.allclose(stats["ours"]["mean"], 0)
  evaluated = {
    name: module.apply({**variables, "batch_stats": stats["ours"]}, x, use_running_average=True)
    for name, module in (("ours", ours), ("theirs", theirs))
  }
  np.testing.assert_allclose(evaluated["ours"], evaluated["theirs"], rtol=1e-6, atol=1e-6)


def test_module_on_non_last_feature_axis_matches_flax():
  x = jnp.moveaxis(_inputs(jnp.float32, batch=4)[0], -1, 1)
  variables = fnn.BatchNorm(axis=1).init(jax.random.key(0), x, use_running_average=False)
  got, _ = BatchNorm(axis=1, use_running_average=False).apply(variables, x, mutable=["batch_stats"])
  want, _ = fnn.BatchNorm(axis=1, use_running_average=False).apply(
    variables, x, mutable=["batch_stats"]
  )
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_core_package_does_not_import_flax():
  import subprocess
  import sys

  code = (
    "import sys, torus_collectives, torus_collectives.norm.batch_norm, "
    "torus_collectives.groups; assert 'flax' not in sys.modules"
  )
  subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- bad input


def _call_in_shard_map(**kwargs):
  x = jnp.ones((REPLICAS, 2, C))
  f = jax.shard_map(
    lambda x: batch_norm(x, jnp.ones(C), jnp.zeros(C), **kwargs)[0],
    mesh=harness.mesh(MESH_SHAPE),
    in_specs=P(AXES),
    out_specs=P(AXES),
  )
  jax.eval_shape(f, x)


def test_group_size_that_does_not_divide_the_mesh_raises():
  with pytest.raises(ValueError, match=r"group_size=3 .*valid group sizes: \[1, 2, 4, 8\]"):
    _call_in_shard_map(axis_name=AXES, group_size=3)


def test_group_shape_that_is_not_a_tile_raises():
  with pytest.raises(ValueError, match=r"group_size=\(2, 3\) is not a tile"):
    _call_in_shard_map(axis_name=AXES, group_size=(2, 3))


def test_group_size_without_axis_name_raises():
  with pytest.raises(ValueError, match="needs axis_name"):
    batch_norm(jnp.ones((4, C)), jnp.ones(C), jnp.zeros(C), group_size=2)


def test_unbound_axis_name_raises():
  with pytest.raises(ValueError, match="not bound here"):
    batch_norm(jnp.ones((4, C)), jnp.ones(C), jnp.zeros(C), axis_name="x")


def test_scale_shape_mismatch_raises():
  with pytest.raises(ValueError, match=r"scale must have shape \(16,\)"):
    batch_norm(jnp.ones((4, C)), jnp.ones(C + 1), jnp.zeros(C))


def test_x_without_batch_axis_raises():
  with pytest.raises(ValueError, match="batch axis"):
    batch_norm(jnp.ones((C,)), jnp.ones(C), jnp.zeros(C))


def test_integer_x_raises():
  with pytest.raises(ValueError, match="floating point"):
    batch_norm(jnp.ones((4, C), jnp.int32), jnp.ones(C), jnp.zeros(C))


def test_non_positive_epsilon_raises():
  with pytest.raises(ValueError, match="epsilon must be positive"):
    batch_norm(jnp.ones((4, C)), jnp.ones(C), jnp.zeros(C), epsilon=0.0)


def test_unknown_implementation_raises():
  with pytest.raises(ValueError, match="implementation must be one of"):
    batch_norm(jnp.ones((4, C)), jnp.ones(C), jnp.zeros(C), implementation="cuda")


# Every field of flax.linen.BatchNorm and its mask= argument, against flax itself.

ROWS_GROUPS = [[0, 1], [2, 3], [4, 5], [6, 7]]  # (1, 2) tiles of the 2x4 mesh
STRIDED_GROUPS = [[0, 2], [1, 3], [4, 6], [5, 7]]  # not tiles: flax's statistics via tc.pmean


def _forward_in_shard_map(module, x, mask=None):
  """Per-replica output and new batch stats of ``module`` (forward, training mode)."""

  def body(x, mask):
    variables = module.init(jax.random.key(0), x, use_running_average=False)
    y, state = module.apply(
      variables, x, use_running_average=False, mask=mask, mutable=["batch_stats"]
    )
    return y, jax.tree.map(lambda s: s[None], state["batch_stats"])

  rep = P(AXES)
  mesh = harness.mesh(MESH_SHAPE)
  f = jax.shard_map(body, mesh=mesh, in_specs=(rep, rep), out_specs=(rep, rep), check_vma=False)
  return jax.jit(f)(x, jnp.ones(x.shape, bool) if mask is None else mask)


FLAX_FIELDS = [
  dict(axis_index_groups=ROWS_GROUPS),
  dict(axis_index_groups=STRIDED_GROUPS),
  dict(use_fast_variance=False),
  dict(use_fast_variance=True, axis=(2, 3)),
  dict(force_float32_reductions=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
  dict(use_scale=False, use_bias=False, epsilon=1e-3, momentum=0.5),
]


@pytest.mark.parametrize("fields", FLAX_FIELDS, ids=lambda f: ",".join(f))
@pytest.mark.parametrize("masked", [False, True])
def test_module_fields_and_mask_match_flax(fields, masked):
  """bf16 fields in bf16 arithmetic: tolerance of bf16 rounding; else f32 sums of 32 rows."""
  x, _, _, _ = _inputs(jnp.float32, offset=1.0)
  mask = None
  if masked:
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, x.shape)
    mask = mask.at[..., 0, 0, :].set(True)  # every replica keeps rows of every channel
  kwargs = dict(axis_name=AXES, **fields)
  got = _forward_in_shard_map(BatchNorm(**kwargs, implementation="xla"), x, mask)
  want = _forward_in_shard_map(fnn.BatchNorm(**kwargs), x, mask)
  dtype = fields.get("dtype", jnp.float32)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    _assert_close(a, b, dtype, x.size // C)
