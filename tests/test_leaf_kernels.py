"""The leaf kernels: a bucket's leaves summed over the torus where they lie.

``leaf_grid`` cuts each leaf along its rows, in tiles, hierarchically in the order a
stream visits the torus axes. Its pure functions are checked exhaustively on small grids:
every unit of every leaf is owned by exactly one (stream, device), the traced cut inside a
kernel gives the same ranges as the static one, and the rotations spread a bucket's
extra units round the parts. ``pallas_backend.all_reduce_leaves`` must equal
``lax.psum`` of each leaf bitwise on small integers (every partial sum exact), in TPU
interpret mode with the race detector, in both DMA modes, on a ring, a 2-D and a 3-D
torus. ``all_reduce_gradients(implementation="pallas")`` sums such leaves with no
concatenate or slice in its program. Compiled ahead of time for v5e, a step that sums
its weight gradients with the leaf kernels has the same compute ops as the step that
sums them with ``lax.psum``, and no copy: compiler output, not a run.
"""

import collections
import itertools
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import torus_collectives as tc
from torus_collectives import schedule as schedule_lib
from torus_collectives.kernels import leaf_grid, pallas_backend

# Leaves of a bucket as a model has them: convolution kernels (HWIO, the input channels a
# whole number of tiles, so the 2-D view is a bitcast), a dense kernel, vectors and a stem
# kernel (3 input channels), which are moved whole, and a scalar, which is packed.
F32_LEAVES = [(3, 3, 8, 16), (1, 1, 128, 40), (16, 1000), (16,), ()]
BF16_LEAVES = [(3, 3, 16, 16), (1, 1, 128, 48), (7, 7, 3, 8)]


def _owned_ranges(grid: leaf_grid.LeafGrid, leaf: int):
  """(start, units) of the part of ``leaf`` each (stream, device) owns when the
  reduce-scatter ends: the cut down every level."""
  torus = grid.schedule.torus
  for stream in range(grid.schedule.num_streams):
    last = grid.axis_order(stream)[-1]
    for coords in itertools.product(*map(range, torus)):
      yield grid.path(leaf, stream, coords, last, coords[last])


@pytest.mark.parametrize("torus", [(8,), (2, 4), (4, 4), (2, 2, 2), (16, 16)])
def test_every_unit_is_owned_once(torus):
  shapes = [(8 * u, 128) for u in (1, 3, 7, 64, 200, 1111)] + [(16,), (7, 7, 3, 8)]  # two whole
  schedule = schedule_lib.build("reduce_scatter", torus, schedule_lib.default_variant(torus))
  grid = leaf_grid.LeafGrid(tuple(shapes), 4, schedule)
  for leaf in range(len(shapes)):
    owners = np.zeros(grid.units(leaf), int)
    for path in _owned_ranges(grid, leaf):
      start, size = leaf_grid.piece(grid.units(leaf), path)
      owners[start : start + size] += 1
    np.testing.assert_array_equal(owners, 1)


@pytest.mark.parametrize("torus", [(8,), (2, 4), (2, 2, 2)])
def test_a_traced_cut_is_the_static_one(torus):
  """Inside a kernel the slab index and coordinates are traced: ``piece`` then selects
  between the two static block sizes of each level (here on arrays of every device's
  coordinates and every slab index at once). Every slab of every phase, both ways."""
  shapes = [(8 * u, 128) for u in (1, 5, 13, 100)] + [(1000,)]
  schedule = schedule_lib.build("reduce_scatter", torus, schedule_lib.default_variant(torus))
  grid = leaf_grid.LeafGrid(tuple(shapes), 4, schedule)
  points = list(itertools.product(*map(range, torus), range(max(torus))))
  for leaf, stream in itertools.product(range(len(shapes)), range(schedule.num_streams)):
    for axis in grid.axis_order(stream):
      chosen = [(*c, i) for *c, i in points if i < torus[axis]]
      static = [
        leaf_grid.piece(grid.units(leaf), grid.path(leaf, stream, c, axis, i)) for *c, i in chosen
      ]
      columns = [jnp.asarray(col, jnp.int32) for col in zip(*chosen)]
      traced = leaf_grid.piece(
        grid.units(leaf), grid.path(leaf, stream, columns[:-1], axis, columns[-1])
      )
      np.testing.assert_array_equal(np.stack(traced, axis=1), np.asarray(static))


def test_the_extra_units_go_round_the_parts():
  """Leaves with fewer units than parts: without rotation every leaf would give its
  units to the first parts. With it, the parts' unit counts differ by at most one."""
  torus = (16,)
  schedule = schedule_lib.build("reduce_scatter", torus, "ring")
  shapes = tuple((8 * u, 128) for u in (3, 5, 7, 9, 11, 2))
  grid = leaf_grid.LeafGrid(shapes, 4, schedule)
  counts = np.zeros(16, int)
  for leaf in range(len(shapes)):
    for d in range(16):
      counts[d] += leaf_grid.piece(grid.units(leaf), grid.path(leaf, 0, (d,), 0, d))[1]
  assert counts.sum() == 37 and counts.max() - counts.min() <= 1, counts


@pytest.mark.parametrize(
  "units", [[1], [3, 5], [1000, 1, 1, 1], [1] * 20, [40, 1, 2, 900, 3, 3, 7, 1, 1]]
)
def test_add_groups_are_min_of_eight_and_the_leaves_runs_none_empty(units):
  """The reduce-scatter's add groups: contiguous, covering every leaf once, none empty,
  exactly ``min(ADD_GROUPS, leaves)`` of them (what the step report prices), even where
  one leaf holds most of the elements."""
  from torus_collectives.kernels import leaf_kernels

  schedule = schedule_lib.build("reduce_scatter", (4,), "ring")
  grid = leaf_grid.LeafGrid(tuple((8 * u, 128) for u in units), 4, schedule)
  groups = leaf_kernels.add_groups(grid)
  assert len(groups) == min(leaf_kernels.ADD_GROUPS, len(units))
  assert all(groups) and [leaf for g in groups for leaf in g] == list(range(len(units)))


@pytest.mark.parametrize(
  "shape, itemsize, view",
  [
    ((3, 3, 64, 128), 4, "as is"),
    ((3, 3, 64, 64), 2, "as is"),
    ((1, 1, 8, 64), 4, "as is"),
    ((1, 1, 8, 64), 2, "whole"),  # 16-bit tiles are 16 rows
    ((1, 1, 256, 64), 4, "transposed"),
    ((2048, 1000), 4, "transposed"),
    ((2048, 1000), 2, None),  # 1000 rows are no whole number of 16-row tiles, 4 MB
    ((7, 7, 3, 64), 4, "whole"),  # the cut dimension is no whole tile
    ((1000,), 4, "whole"),
    ((16384,), 4, "whole"),  # WHOLE_BYTES
    ((16385,), 4, None),
    ((), 4, None),
    ((4, 0, 8), 4, None),
    ((8, 128), 1, None),
  ],
)
def test_kernel_view(shape, itemsize, view):
  assert leaf_grid.kernel_view(shape, itemsize) == view


def test_a_leaf_too_large_to_move_whole_is_refused_by_the_grid():
  schedule = schedule_lib.build("reduce_scatter", (4,), "ring")
  assert leaf_grid.LeafGrid(((16384,), (3, 8, 128)), 4, schedule).units(0) == 1
  with pytest.raises(ValueError, match="pack it instead"):
    leaf_grid.LeafGrid(((16385,),), 4, schedule)


def _leaf_sums(mesh, shapes, dtype, mode, seed=0):
  axes = mesh.axis_names
  torus = tuple(mesh.shape[a] for a in axes)
  p = mesh.size
  leaves = [harness.small_integers((p, *s), dtype, seed=seed + i) for i, s in enumerate(shapes)]
  want = harness.per_device(lambda *ls: [lax.psum(v, axes) for v in ls], mesh, *leaves)
  ours = lambda *ls: pallas_backend.all_reduce_leaves(ls, axes, torus)
  got = harness.interpreted(mode, harness.sharded(ours, mesh, check_vma=False), *leaves)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize(
  "shape, dtype, mode",
  [
    ((8,), jnp.float32, "eager"),  # the bidirectional ring
    ((2, 4), jnp.bfloat16, "on_wait"),  # the split torus: four streams
    ((2, 2, 2), jnp.float32, "on_wait"),  # six streams
  ],
)
def test_leaf_sums_equal_lax_psum(shape, dtype, mode):
  shapes = F32_LEAVES if dtype == jnp.float32 else BF16_LEAVES
  _leaf_sums(harness.mesh(shape), shapes, dtype, mode)


def test_more_leaves_than_one_pair_takes_run_as_several_pairs(monkeypatch):
  """A bucket of more leaves than ``MAX_LEAVES_PER_CALL`` (a kernel's code grows with
  them) runs as several kernel pairs, each leaf summed exactly once."""
  monkeypatch.setattr(pallas_backend, "MAX_LEAVES_PER_CALL", 2)
  mesh = harness.mesh((4,))
  leaves = [harness.small_integers((4, 8, 128), np.float32, seed=i) for i in range(3)]
  ours = lambda *ls: pallas_backend.all_reduce_leaves(ls, ("x",), (4,))
  with harness.interpret_mode("eager"):
    jaxpr = jax.make_jaxpr(harness.sharded(ours, mesh, check_vma=False))(*leaves)
    got = jax.block_until_ready(harness.sharded(ours, mesh, check_vma=False)(*leaves))
  assert str(jaxpr).count("pallas_call[") == 4
  for g, leaf in zip(got, leaves):
    np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(leaf.sum(0), leaf.shape))


@pytest.mark.parametrize(
  "dtypes, message",
  [
    ((jnp.float32, jnp.bfloat16), "share a dtype"),
    ((jnp.int8,), "16- and 32-bit"),
  ],
)
def test_leaves_the_kernels_cannot_sum_are_refused(dtypes, message):
  mesh = harness.mesh((4,))
  leaves = [np.zeros((4, 16, 128), d) for d in dtypes]
  ours = lambda *ls: pallas_backend.all_reduce_leaves(ls, ("x",), (4,))
  with harness.interpret_mode("eager"), pytest.raises(ValueError, match=message):
    harness.sharded(ours, mesh, check_vma=False)(*leaves)


def test_the_gradient_summation_sums_leaves_where_they_lie():
  """On "pallas", a bucket of convolution and dense kernels (and an empty leaf) is summed
  by the leaf kernels: no concatenate packs it and no slice unpacks it, and the means
  equal lax.pmean's."""
  mesh = harness.mesh((2, 4))
  axes = mesh.axis_names
  tree = {
    "conv": harness.small_integers((8, 3, 3, 8, 16), np.float32, 1),
    "dense": harness.small_integers((8, 40, 128), np.float32, 2),
    "empty": np.zeros((8, 0, 16), np.float32),  # its sum is itself
  }
  fn = lambda t: (
    tc.all_reduce_gradients(t, axes, implementation="pallas"),
    jax.tree.map(lambda g: lax.pmean(g, axes), t),
  )
  with harness.interpret_mode("on_wait"):
    jaxpr = jax.make_jaxpr(harness.sharded(fn, mesh))(tree)
    (ours, ref) = jax.block_until_ready(harness.sharded(fn, mesh)(tree))
  names = collections.Counter(re.findall(r"\b(concatenate|slice|pallas_call)\[", str(jaxpr)))
  assert names["concatenate"] == names["slice"] == 0, names
  assert names["pallas_call"] == 2, names
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


@pytest.mark.aot
def test_a_step_summing_leaves_computes_what_the_lax_step_computes():
  """Compiled for v5e:2x2: an MLP-like step whose gradients (six weights of 16 MiB, and
  six bias vectors, which go whole) are summed by the leaf kernels has exactly the compute
  ops of the same step summed by ``lax.psum`` (by opcode and shape; XLA may place a result
  in another memory), and no copy, concatenate or slice: nothing is packed, unpacked or
  relaid."""
  import aot_skip

  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from jax.sharding import PartitionSpec as P

  from torus_collectives.testing.aot import topology_mesh
  from torus_collectives.testing.hlo_schedule import entry_ops

  mesh = topology_mesh("v5e:2x2")
  torus = (mesh.shape["x"], mesh.shape["y"])
  shapes = [(4096, 1024)] * 4 + [(2048, 2048), (8192, 256)]

  def program(summed):
    def step(params, x):
      loss = lambda ps: sum(jnp.tanh(x[:, : w.shape[0]] @ w + b).sum() for w, b in ps)
      grads = jax.grad(loss)(params)
      leaves, tree = jax.tree.flatten(grads)
      new = [p - 0.1 * g for p, g in zip(jax.tree.leaves(params), summed(leaves))]
      return jax.tree.unflatten(tree, new)

    spec = (P(), P(("x", "y")))
    fn = jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)
    weights = [
      (jax.ShapeDtypeStruct(s, jnp.float32), jax.ShapeDtypeStruct(s[-1:], jnp.float32))
      for s in shapes
    ]
    x = jax.ShapeDtypeStruct((mesh.size * 64, 8192), jnp.float32)
    return entry_ops(jax.jit(fn, donate_argnums=0).lower(weights, x).compile().as_text())

  def compute(ops):
    # A result's shape without its memory space; the leaf kernels' mesh coordinates (an
    # s32 vector) are theirs, not the step's.
    shape = lambda op: re.sub(r"S\(\d\)", "", op.result)
    return collections.Counter(
      (op.opcode, shape(op))
      for op in ops
      if op.kind == "compute" and not op.result.startswith("s32")
    )

  ours = program(lambda g: pallas_backend.all_reduce_leaves(g, ("x", "y"), torus))
  lax_ = program(lambda g: [lax.psum(v, ("x", "y")) for v in g])
  assert compute(ours) == compute(lax_)
  relaid = [op.name for op in ours if op.opcode in ("copy", "concatenate", "slice")]
  assert not relaid, relaid
  assert sum(op.kind == "pallas" for op in ours) == 2


# ResNet-50's weight shapes (HWIO convolution kernels, the dense kernel) and a few more.
LAYOUT_SHAPES = [
  (7, 7, 3, 64), (1, 1, 64, 64), (3, 3, 64, 64), (1, 1, 64, 256), (1, 1, 256, 64),
  (1, 1, 256, 128), (3, 3, 128, 128), (1, 1, 128, 512), (1, 1, 512, 128), (1, 1, 512, 256),
  (3, 3, 256, 256), (1, 1, 256, 1024), (1, 1, 1024, 256), (1, 1, 1024, 512),
  (3, 3, 512, 512), (1, 1, 512, 2048), (1, 1, 2048, 512), (2048, 1000), (256, 40), (40, 256),
]  # fmt: skip


@pytest.mark.aot
def test_transposed_views_match_the_compilers_layouts():
  """``kernel_view`` swaps the two minor dimensions of exactly the arrays that XLA's TPU
  compiler lays out minor dimension first (read off a compiled program's parameters for
  v5e), so the swap is a bitcast and the kernels' row-major operands cost no copy."""
  import aot_skip

  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from torus_collectives.testing.aot import topology_mesh

  mesh = topology_mesh("v5e:2x2")
  args = [
    jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P())) for s in LAYOUT_SHAPES
  ]
  text = jax.jit(lambda xs: [x * 2 for x in xs]).lower(args).compile().as_text()
  entry = text[text.index("ENTRY") :]
  for shape in LAYOUT_SHAPES:
    dims = ",".join(map(str, shape))
    (layout,) = set(re.findall(rf"f32\[{dims}\]\{{([0-9,]+)[:}}][^ ]* parameter", entry))
    minor_first = layout.split(",")[0] == str(len(shape) - 2)
    transposed = leaf_grid.kernel_view(shape, 4) == "transposed"
    if shape[-2] % 8 or (transposed and shape[-1] % 8):
      continue  # packed whatever the layout
    assert transposed == minor_first, (shape, layout)
