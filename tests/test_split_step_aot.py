"""The threaded gradient summation's compiled schedule, ahead of time per TPU generation.

A four-layer convolutional network's data-parallel step
(``tc.experimental.value_and_summed_grad`` with the split Pallas all-reduce, buckets of
two kernels) is compiled for v5e, v6e and a 3-D v5p mesh (needs libtpu). The
kernels' gradients come in the order w4, w3, w2, w1, so the buckets are [w4, w3] and
[w2, w1], the last cut at the last backward convolution, which produces w1's: [w4, w3],
[w2], [w1]. In the scheduled program (``testing.hlo_schedule``):

* each bucket runs 2N streams, each a chain of one call per hop (of the reduce-scatter's
  phases, then the all-gather's) and a done (``split_leaf_kernels``: the leaves where they
  lie, no packing);
* the chains of every bucket but the last start before a backward convolution and finish
  after one (the last holds the first layer's kernel alone, produced by the last backward
  convolution: nothing is left to overlap it);
* every step and done takes its leaves from the previous call in place: no copy of a
  buffer that DMAs are writing (``split_schedule_problems``);
* for v5e, the step computes at most 2 % more than ``jax.grad`` then ``lax.pmean``, and
  has no copy, concatenation or slice.

The same invariants hold in the ResNet example's train step with ``config.grad_overlap``
(the tiny ResNet in four buckets, small images), where the update threaded behind the
summation puts compute between the calls of the last bucket: on v5e, the generation the
step is estimated for; the small network above covers three generations and v5p's 3-D
mesh (six streams a bucket). ``python -m bench.overlap_report`` shows the ResNet-50 step's
schedule. And the zero that pins an operand after the calls survives compilation as no
constant.
"""

import itertools

import aot_skip
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc

pytestmark = [pytest.mark.aot, pytest.mark.timeout(600, method="thread")]

CHANNELS, LAYERS = 128, 4
KERNEL_BYTES = 3 * 3 * CHANNELS * CHANNELS * 4
TOPOLOGIES = {  # name: (topology, mesh shape or None for the square 2-D mesh)
  "v5e": ("v5e:2x2", None),
  "v6e": ("v6e:2x2", None),
  "v5p-3d": ("v5p:2x2x2", (2, 2, 2)),
}


def _loss(params, x):
  h = x
  for w in params:
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=dims))
  return jnp.mean(h**2)


def _check_compute_against_the_plain_step(text, mesh, params, x):
  """The threaded step (compiled program ``text``) computes at most 2 % more than
  ``jax.grad`` then ``lax.pmean`` (its scheduled ops other than collectives and Pallas
  calls, by the compiler's estimate; here it is less: XLA fuses the pinned convolutions
  differently), and has no copy, concatenation or slice: the leaves go to the calls as
  they are. With the bucket packed into a flat buffer instead, this fails."""
  from torus_collectives.testing import hlo_schedule

  axes = mesh.axis_names
  plain = lambda params, x: jax.lax.pmean(jax.grad(_loss)(params, x), axes)
  fn = jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P()))
  texts = {"threaded": text, "plain": fn.lower(params, x).compile().as_text()}
  compute = {
    name: sum(op.cycles or 0 for op in hlo_schedule.entry_ops(t) if op.kind == "compute")
    for name, t in texts.items()
  }
  categories = {name: hlo_schedule.compute_by_category(t) for name, t in texts.items()}
  assert compute["threaded"] <= 1.02 * compute["plain"], (compute, categories)
  assert not {"copy", "concatenate", "slice"} & set(categories["threaded"]), categories


@pytest.mark.parametrize("generation", list(TOPOLOGIES))
def test_every_bucket_but_the_last_overlaps_a_backward_convolution(generation):
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from torus_collectives.testing import aot, hlo_schedule

  topology, shape = TOPOLOGIES[generation]
  mesh = aot.topology_mesh(topology, shape)
  axes = mesh.axis_names
  live_axes = [a for a in axes if mesh.shape[a] > 1]

  def step(params, x):
    summed = tc.experimental.value_and_summed_grad(
      _loss, axes, bucket_bytes=2 * KERNEL_BYTES, implementation="pallas"
    )
    return summed(params, x)[1]

  replicated = NamedSharding(mesh, P())
  params = [jax.ShapeDtypeStruct((3, 3, CHANNELS, CHANNELS), jnp.float32, sharding=replicated)]
  params *= LAYERS
  x = jax.ShapeDtypeStruct(
    (8 * mesh.devices.size, 32, 32, CHANNELS), jnp.float32, sharding=NamedSharding(mesh, P(axes))
  )
  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P()))
  text = fn.lower(params, x).compile().as_text()
  ops = hlo_schedule.entry_ops(text)
  if generation == "v5e":
    _check_compute_against_the_plain_step(text, mesh, params, x)

  chains = hlo_schedule.split_chains(ops)
  streams = 2 * len(live_axes)
  calls = sum(2 * (mesh.shape[a] - 1) for a in live_axes) + 1  # a call per hop, a done
  buckets = 3
  assert [len(c) for c in chains] == [calls] * (buckets * streams), chains
  assert hlo_schedule.split_schedule_problems(ops) == []
  backward = [i for i, op in enumerate(ops) if hlo_schedule.is_backward_convolution(op)]
  in_start_order = sorted(chains, key=lambda c: c[0])
  for chain in in_start_order[: (buckets - 1) * streams]:  # every bucket's streams but the last's
    assert any(chain[0] < i < chain[-1] for i in backward), (chain, backward)
  last = in_start_order[(buckets - 1) * streams :]
  assert not any(chain[0] < i < chain[-1] for chain in last for i in backward), (last, backward)


# The tiny ResNet's 0.5 MB gradient in buckets of 160 KiB: four of them.
RESNET_BUCKET_BYTES = 160 * 1024


def test_resnet_threaded_step_keeps_every_bucket_on_compute():
  """The ResNet example's train step with ``config.grad_overlap`` (the update threaded
  too), for v5e, with the tiny ResNet (64x64 images, 2 a replica): every bucket
  but the last starts before a backward convolution and finishes after one; the last
  (the first layer's kernel, which the last backward convolution produces) has compute,
  the update of the other layers, in at least half the windows between its calls (the
  spacing is in bytes, so the last window can end up empty; without the update threaded
  every one is: its calls are issued back to back); no buffer in flight is copied."""
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from bench import overlap_report
  from torus_collectives.testing import hlo_schedule

  topology, shape = TOPOLOGIES["v5e"]
  mesh, lowered = overlap_report.lower_train_step(
    topology,
    "resnet_tiny",
    2,
    "pallas",
    False,
    bucket_bytes=RESNET_BUCKET_BYTES,
    overlap=True,
    mesh_shape=shape,
    image_size=64,
  )
  ops = hlo_schedule.entry_ops(lowered.compile().as_text())
  assert hlo_schedule.split_schedule_problems(ops) == []
  chains = sorted(hlo_schedule.split_chains(ops), key=lambda c: c[0])
  streams = 2 * sum(1 for a in mesh.axis_names if mesh.shape[a] > 1)
  buckets = [chains[i : i + streams] for i in range(0, len(chains), streams)]
  assert len(buckets) >= 3 and all(len(b) == streams for b in buckets), [len(c) for c in chains]
  backward = [i for i, op in enumerate(ops) if hlo_schedule.is_backward_convolution(op)]
  for bucket in buckets[:-1]:
    for chain in bucket:
      assert any(chain[0] < i < chain[-1] for i in backward), (chain, backward[-1])
  for chain in buckets[-1]:
    windows = [
      sum(op.cycles or 0 for op in ops[before + 1 : call] if not hlo_schedule.split_call(op))
      for before, call in itertools.pairwise(chain)
    ]
    assert sum(1 for cycles in windows if cycles) >= len(windows) / 2, (chain, windows)
  # What the links carry from each bucket's first call on (priced 1 ns a declared byte):
  # from the first, every hop of the step on its link; later, less, against less compute.
  loads = hlo_schedule.link_loads(ops, 1e9, lambda op, nbytes: nbytes * 1e-9)
  assert [load.first for load in loads] == [ops[chain[0]].name for chain in chains]
  per_link: dict = {}
  for op in ops:
    if hlo_schedule.split_call(op):
      link = hlo_schedule.split_link(op)
      per_link[link] = per_link.get(link, 0) + op.remote_bytes * 1e-9
  assert loads[0].need_s == pytest.approx(max(per_link.values()))
  for earlier, later in itertools.pairwise(loads):
    assert earlier.need_s >= later.need_s and earlier.compute_s >= later.compute_s > 0


def test_a_pinned_zero_is_not_folded_into_a_constant():
  """The threading's operand pins (``executor.plus_zero``) subtract a zero that comes out
  of a barrier with the calls in flight. XLA forwards a constant through an
  ``optimization_barrier`` before it schedules, which would leave the reader unpinned; the
  opaque zero (``executor.opaque_zero``) is no constant, so in the v5e program the
  subtraction reads it, not a constant, and runs after the barrier's matmul."""
  pytest.importorskip("libtpu", reason=aot_skip.REASON)
  from torus_collectives.experimental.overlap import executor
  from torus_collectives.testing import aot, hlo_schedule

  mesh = aot.topology_mesh("v5e:2x2")
  axes = mesh.axis_names

  def body(a, x):
    product = a @ a
    product, zero = jax.lax.optimization_barrier((product, executor.opaque_zero(axes)))
    return product @ a, executor.plus_zero(x, zero)

  square = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))
  text = fn.lower(square, square).compile().as_text()
  ops = hlo_schedule.entry_ops(text)
  entry = text[text.index("ENTRY") :]
  definitions = dict(
    line.strip().lstrip("%").split(" = ", 1) for line in entry.splitlines() if " = " in line
  )
  subtract = [i for i, op in enumerate(ops) if op.op_name.endswith("/sub")]
  matmuls = [i for i, op in enumerate(ops) if op.op_name.endswith("/dot_general")]
  assert len(subtract) == 1 and len(matmuls) == 2, [op.name for op in ops]
  reader = definitions[ops[subtract[0]].name]
  operands = reader.split("fusion(")[1].split(")")[0].split(", ")
  defined = [definitions.get(o.lstrip("%"), "") for o in operands]
  assert not [d for d in defined if " constant(" in d], reader
  assert subtract[0] > matmuls[0]
