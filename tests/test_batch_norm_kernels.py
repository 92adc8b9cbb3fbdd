"""Pallas batch-norm passes: TPU interpret mode vs the jnp reference, and AOT compiles."""

import math
import re

import aot_skip
import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torus_collectives import registry, tiling
from torus_collectives.kernels import batch_norm as kbn
from torus_collectives.norm import passes
from torus_collectives.norm.batch_norm import batch_norm
from torus_collectives.norm.block_sizes import BlockSizes
from torus_collectives.tuning import tables


def _operands(shape, dtype, seed=0):
  kx, kd, kc = jax.random.split(jax.random.key(seed), 3)
  channels = shape[-1]
  x = (50.0 + 3.0 * jax.random.normal(kx, shape)).astype(dtype)
  dy = jax.random.normal(kd, shape).astype(dtype)
  stats = passes.stats_reference(x)
  rows = x.size // channels
  mul = jax.lax.rsqrt(stats[1] / rows + 1e-5) * (1 + 0.1 * jax.random.normal(kc, (channels,)))
  coef = jnp.stack(
    [
      stats[0],
      mul,
      jnp.linspace(-1, 1, channels),
      0.01 * jnp.ones(channels),
      -0.02 * jnp.ones(channels),
    ]
  )
  return x, dy, coef


def _all_passes(passes, block_sizes=None):
  kw = {} if block_sizes is None else {"block_sizes": block_sizes}
  return jax.jit(
    lambda x, dy, coef: (
      passes.stats(x, **kw),
      passes.normalize(x, coef[:3], relu=True, **kw),
      passes.backward_sums(x, dy, coef[:3], relu=True, **kw),
      passes.backward_dx(x, dy, coef, relu=True, **kw),
    )
  )


# Channels-last activations and block sizes over their [R, S, C] view (tiling.bn_view):
# NHWC in XLA's conv layout [H*W, N, C] as one block and with a ragged last row block;
# two channel blocks with a ragged row block; C = 64 (half a lane row); C = 2048 in
# default blocks (four channel blocks of 512); and the row-major view of a batch that
# does not fill 8 sublanes, C = 3. (C = 96 and a rank-3 input: the tests below.)
SHAPES = [
  ((8, 4, 4, 128), None),
  ((16, 3, 5, 128), BlockSizes(block_rows=4, block_channels=128)),
  ((8, 2, 3, 256), BlockSizes(block_rows=4, block_channels=128)),
  ((8, 3, 3, 64), BlockSizes(block_rows=4, block_channels=64)),
  ((8, 2, 2, 2048), None),
  ((6, 5, 5, 3), BlockSizes(block_rows=16, block_channels=3)),
]


def _assert_within_sum_rounding(got, want, absolute_sum, rows):
  """``got`` equals ``want`` within ``sqrt(rows) * u * absolute_sum`` per channel: the size
  of float32 rounding in a sum of ``rows`` terms reordered (a random walk of ulps)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  bound = math.sqrt(rows) * 2.0**-24 * np.asarray(absolute_sum, np.float64)
  excess = np.abs(got - want) - bound
  assert np.all(excess <= 0), f"worst channel exceeds its bound by {excess.max()}"


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,block_sizes", SHAPES, ids=lambda v: str(v))
def test_passes_match_reference_in_interpret_mode(interpret, shape, block_sizes, dtype):
  x, dy, coef = _operands(shape, dtype)
  stats, y, sums, dx = _all_passes(kbn.PALLAS, block_sizes)(x, dy, coef)
  want_stats, want_y, want_sums, want_dx = _all_passes(passes.REFERENCE)(x, dy, coef)
  assert y.shape == dx.shape == shape and y.dtype == dx.dtype == dtype
  np.testing.assert_allclose(stats[0], want_stats[0], rtol=1e-6)
  # M2 = s2 - s1**2 / R from float32 sums of the shifted rows d, in another order: each sum
  # rounds by about sqrt(R) * u of its terms' absolute sum (u = 2**-24; the worst case is
  # R * u), and s1**2 / R <= s2 = sum(d**2), so 4 * sqrt(R) * u * sum(d**2) per channel.
  rows = x.size // shape[-1]
  x32 = np.asarray(x, np.float32).reshape(rows, -1)
  d = x32 - x32[0]
  _assert_within_sum_rounding(stats[1], want_stats[1], 4 * np.sum(d * d, axis=0), rows)
  out_tol = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32), **out_tol)
  # sum(g) and sum(g * xc): 2 * sqrt(R) * u of the absolute sum of their terms, per channel.
  xc, g = passes._centred_cotangent_reference(x, dy, coef[:3], relu=True)
  terms = [np.abs(np.asarray(t, np.float32)).reshape(rows, -1).sum(0) for t in (g, g * xc)]
  for got, want, absolute in zip(sums, want_sums, terms):
    _assert_within_sum_rounding(got, want, 2 * absolute, rows)
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx, np.float32), **out_tol)


@pytest.mark.interpret
def test_passes_are_exact_on_small_integers_in_interpret_mode(interpret):
  """Integers in [-4, 4], dyadic coefficients and 128 rows: the mean, y, the sums and dx
  are exact in float32, so the kernels must equal the reference bit for bit (C = 96); M2
  comes from differently ordered sums of squares."""
  shape = (8, 4, 4, 96)
  kx, kd = jax.random.split(jax.random.key(7))
  x = jax.random.randint(kx, shape, -4, 5).astype(jnp.float32)
  dy = jax.random.randint(kd, shape, -4, 5).astype(jnp.float32)
  coef = jnp.array([1.0, 0.5, 0.25, 0.125, -0.5])[:, None] * jnp.ones(96)
  block_sizes = BlockSizes(block_rows=8, block_channels=96)  # a Chan merge of equal halves
  (stats, *rest) = _all_passes(kbn.PALLAS, block_sizes)(x, dy, coef)
  (want_stats, *want_rest) = _all_passes(passes.REFERENCE)(x, dy, coef)
  np.testing.assert_array_equal(stats[0], want_stats[0])
  np.testing.assert_allclose(stats[1], want_stats[1], rtol=1e-6)
  for a, b in zip(rest, want_rest):
    np.testing.assert_array_equal(a, b)


@pytest.mark.interpret
@pytest.mark.parametrize("global_shape", [(16, 4, 4, 64), (64, 3, 5, 128)])
def test_pallas_op_matches_xla_op_across_a_group_in_interpret_mode(interpret, global_shape):
  """Per replica (2, 4, 4, 64): the row-major view; (8, 3, 5, 128): XLA's conv layout."""
  mesh = harness.mesh((2, 4))
  channels = global_shape[-1]
  x = 10.0 + jax.random.normal(jax.random.key(3), global_shape)
  scale, bias = jnp.linspace(0.5, 1.5, channels), jnp.linspace(-1, 1, channels)
  weights = jax.random.normal(jax.random.key(4), global_shape[1:])

  def grads(implementation):
    def body(x, scale, bias):
      def loss(x, scale, bias):
        y, mean, var = batch_norm(
          x,
          scale,
          bias,
          axis_name=("x", "y"),
          group_size=2,
          relu=True,
          implementation=implementation,
        )
        return jnp.sum(y * y * weights), (y, mean[None], var[None])

      return jax.grad(loss, (0, 1, 2), has_aux=True)(x, scale, bias)

    spec = P(("x", "y"))
    f = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(spec, P(), P()),
      out_specs=((spec, P(), P()), (spec, spec, spec)),
      check_vma=False,
    )
    return jax.jit(f)(x, scale, bias)

  for a, b in zip(jax.tree.leaves(grads("pallas")), jax.tree.leaves(grads("xla"))):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b))))


@pytest.mark.interpret
@pytest.mark.parametrize(
  "shape,block_sizes",
  [((8, 3, 5, 128), BlockSizes(block_rows=4, block_channels=128)), ((5, 7, 3), None)],
  ids=str,
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_local_op_keeps_x_on_chip_and_matches_xla_in_interpret_mode(
  interpret, shape, block_sizes, dtype
):
  """Without a group the fused kernels run (x and dy resident in VMEM between their two
  phases; ragged row blocks in the first shape) and equal the "xla" op: y, mean, var and
  the gradients of a weighted loss."""
  channels = shape[-1]
  x = (5.0 + 3.0 * jax.random.normal(jax.random.key(0), shape)).astype(dtype)
  weights = jax.random.normal(jax.random.key(1), shape)
  scale, bias = jnp.linspace(0.5, 1.5, channels), jnp.linspace(-1, 1, channels)

  def grads(implementation):
    def loss(x, scale, bias):
      y, mean, var = batch_norm(
        x, scale, bias, relu=True, implementation=implementation, block_sizes=block_sizes
      )
      return jnp.sum(y.astype(jnp.float32) * weights), (y, mean, var)

    return jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))

  fn = grads("pallas")
  text = str(jax.make_jaxpr(fn)(x, scale, bias))
  assert "bn_local_forward" in text and "bn_local_backward" in text and "bn_stats" not in text
  got, want = fn(x, scale, bias), grads("xla")(x, scale, bias)
  tol = dict(rtol=1e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=2e-5, atol=2e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def test_block_channels_that_do_not_divide_channels_raise():
  with pytest.raises(ValueError, match="block_channels=128 must divide channels=192"):
    BlockSizes(block_rows=16, block_channels=128).check((64, 8, 192))


def test_block_rows_beyond_the_view_raise():
  with pytest.raises(ValueError, match="block_rows=20 must be at most the view's rows=16"):
    BlockSizes(block_rows=20, block_channels=128).check((16, 8, 128))


@pytest.mark.parametrize(
  "device_kind,view_shape,expected",
  [
    # 2**18 float32 elements on 16 MiB of scoped VMEM: 64 rows of 32 x 128.
    ("TPU v5 lite", (784, 32, 128), BlockSizes(64, 128)),
    # 32 MiB on v6e: twice the rows; 2048 channels in blocks of 512.
    ("TPU v6 lite", (49, 32, 2048), BlockSizes(32, 512)),
    # C = 64 occupies a whole 128-lane tile in VMEM; never more rows than the view's.
    ("TPU v5 lite", (16, 8, 64), BlockSizes(16, 64)),
  ],
)
def test_default_block_sizes_follow_shape_and_generation(device_kind, view_shape, expected):
  assert BlockSizes.default(view_shape, device_kind) == expected


def test_block_sizes_reach_the_kernels_through_the_public_op(monkeypatch):
  """``batch_norm(block_sizes=...)`` is what every Pallas pass is called with."""
  seen = []

  def spy(name):
    def pass_(*args, block_sizes=None, **kwargs):
      seen.append((name, block_sizes))
      if name.startswith("local_"):  # declines, so the four passes run too
        return None
      return getattr(passes.REFERENCE, name)(*args, **kwargs)

    return pass_

  fake = passes.Passes(*(spy(n) for n in passes.Passes._fields))
  monkeypatch.setattr(registry, "batch_norm_passes", lambda name: fake)
  bs = BlockSizes(block_rows=2, block_channels=8)
  x = jnp.ones((8, 2, 2, 8))
  jax.grad(
    lambda x: jnp.sum(
      batch_norm(x, jnp.ones(8), jnp.zeros(8), implementation="pallas", block_sizes=bs)[0]
    )
  )(x)
  assert sorted(seen) == sorted((n, bs) for n in passes.Passes._fields)


def test_bn_view_is_a_bitcast_of_xla_conv_layout():
  """NHWC with 8 | N: [H*W, N, C], H, W, N, C being {3,0,2,1} major to minor; otherwise
  the row-major rows; the inverse restores the activation."""
  assert tiling.bn_view((32, 28, 28, 128)) == ((1, 2, 0, 3), (784, 32, 128))
  assert tiling.bn_view((4, 28, 28, 128)) == ((0, 1, 2, 3), (392, 8, 128))
  assert tiling.bn_view((5, 7, 3)) == ((0, 1, 2), (35, 1, 3))
  x = jnp.arange(8 * 3 * 5 * 2).reshape(8, 3, 5, 2)
  v = tiling.to_bn_view(x)
  np.testing.assert_array_equal(v[2 * 5 + 1, 6], x[6, 2, 1])
  np.testing.assert_array_equal(tiling.from_bn_view(v, x.shape), x)


@pytest.mark.parametrize("shape", [(32, 28, 28, 128), (8, 7, 7, 2048), (8, 112, 112, 64)])
def test_auto_is_xla_for_batch_norm_even_where_pallas_was_measured_faster(monkeypatch, shape):
  """Timed alone the kernels win, but inside a network they lose XLA's fusion with the
  neighbouring convolutions, which a tuning measurement cannot see."""
  monkeypatch.setattr(tables, "lookup", lambda *args: "pallas")
  with harness.interpret_mode():
    choice = registry.auto_implementation(
      "batch_norm", jnp.bfloat16, nbytes=2 * math.prod(shape), torus=(1,)
    )
  assert choice == "xla"


def test_non_positive_block_sizes_raise():
  with pytest.raises(ValueError, match="block sizes must be positive"):
    BlockSizes(block_rows=0, block_channels=128)


# ---------------------------------------------------------------------- AOT for TPU

TOPOLOGIES = ["v4:2x2x2", "v5e:4x4", "v5p:2x2x2", "v6e:4x4"]


def tpu_train_step(topology_name, per_replica_batch, hwc, group_size=2):
  """Compiled forward+backward of the Pallas op, sharded over all chips of a topology."""
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
  devices = np.array(topo.devices)
  mesh = harness.mesh((2, devices.size // 2), devices=topo.devices)
  spec = P(("x", "y"))
  channels = hwc[-1]

  def step(x, scale, bias):
    def loss(x, scale, bias):
      y, _, _ = batch_norm(
        x,
        scale,
        bias,
        axis_name=("x", "y"),
        group_size=group_size,
        relu=True,
        implementation="pallas",
      )
      return jnp.sum(y.astype(jnp.float32))

    return jax.grad(loss, (0, 1, 2))(x, scale, bias)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, P(), P())))
  x = jax.ShapeDtypeStruct(
    (per_replica_batch * devices.size, *hwc), jnp.bfloat16, sharding=NamedSharding(mesh, spec)
  )
  p = jax.ShapeDtypeStruct((channels,), jnp.float32, sharding=NamedSharding(mesh, P()))
  return f.lower(x, p, p).compile()


# Every generation at the largest folded shape; v5e also at the widest and batch 8.
AOT_CASES = [(t, 32, (56, 56, 64)) for t in TOPOLOGIES] + [
  ("v5e:4x4", 32, (7, 7, 2048)),
  ("v5e:4x4", 8, (14, 14, 1024)),
  ("v5e:4x4", 8, (7, 7, 512)),
]


@pytest.mark.aot
@pytest.mark.parametrize("topology_name,per_replica_batch,hwc", AOT_CASES)
def test_compiles_for_tpu(topology_name, per_replica_batch, hwc):
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  compiled = tpu_train_step(topology_name, per_replica_batch, hwc)
  assert "bn_backward_dx" in compiled.as_text()


# Per-replica bfloat16 activations: two the kernels read at their floor (C = 128 at batch
# 32, C = 2048 at batch 8), one in XLA's conv layout but half lane padding (C = 64), and
# one whose batch does not fill the sublanes (batch 4).
BYTES_CASES = [(32, 28, 28, 128), (8, 7, 7, 2048), (8, 56, 56, 64), (4, 14, 14, 256)]
RELAYOUT_OPS = ("copy", "transpose", "reshape", "fusion")
_ENTRY_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(")


def _relayouts(compiled, size: int) -> list[str]:
  """Ops of the entry computation other than kernels, bitcasts and XLA's memory-space
  prefetches (copy-start/done) that produce a quarter of the activation or more."""
  entry = compiled.as_text().split("\nENTRY ", 1)[1]
  found = []
  for line in entry.splitlines():
    match = _ENTRY_OP.match(line)
    if match and match.group(2) in RELAYOUT_OPS:
      dims = [int(d) for d in match.group(1).split(",") if d]
      if math.prod(dims) * 4 >= size:
        found.append(line.strip()[:160])
  return found


@pytest.mark.aot
@pytest.mark.parametrize("shape", BYTES_CASES, ids=lambda s: "x".join(map(str, s)))
def test_v5e_kernels_skip_relayouts_and_auto_is_xla(monkeypatch, shape):
  """Forward plus backward compiled for v5e: the "xla" path moves flax's bytes; on XLA's
  conv layout the Pallas path has no relayout around its kernels and moves at most XLA's
  bytes; "auto", even with a measurement that prefers Pallas everywhere, is XLA's."""
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from jax.experimental import topologies

  from bench import batch_norm_report

  device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
  monkeypatch.setattr(tables, "lookup", lambda *args: "pallas")

  def bytes_and_relayouts(implementation):
    compiled = batch_norm_report.compile_batch_norm(implementation, shape, True, device)
    return compiled.cost_analysis()["bytes accessed"], _relayouts(compiled, math.prod(shape))

  xla_bytes, xla_relayouts = bytes_and_relayouts("xla")
  # The jnp passes never reshape x, so they compile like flax's own batch norm: no
  # relayout, and flax's bytes up to a few per-channel float32 vectors (32 of them are
  # less than one activation's bytes at every shape here).
  flax_bytes, _ = bytes_and_relayouts("flax")
  assert xla_relayouts == []
  assert xla_bytes <= flax_bytes + 32 * shape[-1] * 4
  pallas_bytes, relayouts = bytes_and_relayouts("pallas")
  auto_bytes, _ = bytes_and_relayouts("auto")
  if shape[0] % tiling.SUBLANES == 0:
    assert relayouts == []
    assert pallas_bytes <= xla_bytes
  else:  # a batch short of a sublane tile: the kernels pay relayout copies
    assert relayouts
  assert auto_bytes == xla_bytes


@pytest.mark.aot
@pytest.mark.parametrize("topology_name", TOPOLOGIES)
def test_local_kernels_compile_for_tpu(topology_name):
  """A group of one replica runs the fused kernels, x and dy resident in VMEM."""
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  compiled = tpu_train_step(topology_name, 8, (14, 14, 256), group_size=1)
  text = compiled.as_text()
  assert "bn_local_forward" in text and "bn_local_backward" in text and "bn_stats" not in text
