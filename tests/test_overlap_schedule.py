"""The scheduled-program reader and timeline of ``testing.hlo_schedule``, on programs whose
answer is computed by hand, and the order in which gradient buckets are issued."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import xla_settings
from torus_collectives.testing import hlo_schedule

CLOCK = 1e9  # 1 cycle = 1 ns


def _fusion(name, cycles, operands=""):
  return (
    f"  %{name} = f32[1024]{{0}} fusion({operands}), kind=kLoop, calls=%c, "
    f'metadata={{op_name="jit(step)/transpose(jvp(Net))/conv_general_dilated"}}, '
    f'backend_config={{"estimated_cycles":"{cycles}"}}'
  )


def _program(*lines) -> str:
  body = "\n".join(lines)
  return f"HloModule m\n\nENTRY %main (p: f32[1024]) -> f32[1024] {{\n{body}\n}}\n"


def _price(op, nbytes):
  return 2e-6 if nbytes else 0.0  # every collective: 2 us


BLOCKING = _program(
  "  %p = f32[1024]{0} parameter(0)",
  _fusion("fusion.1", 3000, "%p"),
  "  %all-reduce = f32[1024]{0} all-reduce(%fusion.1), channel_id=1, "
  "replica_groups=mesh['x'=2,'y'=2] {'x','y'}, to_apply=%add",
)
ASYNC = _program(
  "  %p = f32[1024]{0} parameter(0)",
  "  %async-collective-start = (f32[1024]{0}, u32[]{:S(2)}) fusion(%p), kind=kCustom, calls=%ar",
  "  %get-tuple-element.1 = u32[]{:S(2)} get-tuple-element(%async-collective-start), index=1",
  _fusion("fusion.1", 1500, "%p, %get-tuple-element.1"),
  _fusion("fusion.2", 1000, "%fusion.1"),
  "  %async-collective-done = f32[1024]{0} fusion(%fusion.2), kind=kCustom, calls=%ar_done",
)


def test_a_blocking_all_reduce_after_backward_is_all_exposed():
  timeline = hlo_schedule.timeline(hlo_schedule.entry_ops(BLOCKING), CLOCK, _price)
  (row,) = timeline.rows
  assert (row.kind, row.nbytes, row.after_last_convolution) == ("sync", 4096, True)
  assert row.exposed_s == row.modelled_s == 2e-6
  assert timeline.compute_s == pytest.approx(3e-6)
  assert timeline.step_s == pytest.approx(5e-6)  # 3 us of compute, then 2 us blocked
  assert timeline.summary() == (
    "exposed gradient communication: 0.002 ms of 0.002 ms (100.0 %); step compute 0.003 ms"
  )


def test_an_async_pair_around_longer_compute_is_hidden():
  timeline = hlo_schedule.timeline(hlo_schedule.entry_ops(ASYNC), CLOCK, _price)
  (row,) = timeline.rows
  assert row.kind == "async"
  assert row.covered_s == pytest.approx(2.5e-6)  # 1500 + 1000 cycles between start and done
  assert row.exposed_s == 0.0
  assert timeline.step_s == pytest.approx(2.5e-6)  # the transfer adds nothing
  assert "(0.0 %)" in timeline.summary()


def test_an_async_pair_around_shorter_compute_exposes_the_rest():
  slow = lambda op, nbytes: 4e-6
  timeline = hlo_schedule.timeline(hlo_schedule.entry_ops(ASYNC), CLOCK, slow)
  assert timeline.rows[0].exposed_s == pytest.approx(1.5e-6)  # 4 us transfer - 2.5 us compute
  assert timeline.step_s == pytest.approx(4e-6)


def test_instruction_parsing():
  op = hlo_schedule.parse_instruction(
    "  %copy-start.5 = (bf16[8,32]{1,0}, bf16[8,32]{1,0}, u32[]{:S(2)}) copy-start(%param.1), "
    'backend_config={"estimated_cycles":"42"}'
  )
  assert (op.name, op.opcode, op.operands, op.cycles) == (
    "copy-start.5",
    "copy-start",
    ("param.1",),
    42,
  )
  assert op.result_bytes == 2 * 8 * 32 * 2 + 4


def test_compute_by_category_names_each_fusion_by_its_heaviest_op():
  """A fusion counts as its heaviest op (a convolution over a reduction over a slice...),
  a fusion of elementwise ops as elementwise, any other op as its opcode; collectives are
  not compute."""

  def computation(name, *ops):
    lines = [f"  %{op.split('(')[0]}.{i} = f32[8]{{0}} {op}" for i, op in enumerate(ops)]
    return f"%{name} (p: f32[8]) -> f32[8] {{\n" + "\n".join(lines) + "\n}\n"

  fused = (
    computation("conv", "convolution(%p, %p)", "reduce(%p, %c)", "multiply(%p, %p)")
    + computation("norm", "multiply(%p, %p)", "reduce(%p, %c)")
    + computation("cut", "slice(%p)", "add(%p, %p)")
    + computation("scale", "multiply(%p, %p)", "add(%p, %p)")
  )
  text = BLOCKING.replace("HloModule m\n\n", "HloModule m\n\n" + fused)
  text = text.replace(
    _fusion("fusion.1", 3000, "%p"),
    "\n".join(
      [
        _fusion("fusion.1", 3000, "%p").replace("calls=%c", "calls=%conv"),
        _fusion("fusion.2", 200, "%p").replace("calls=%c", "calls=%norm"),
        _fusion("fusion.3", 50, "%p").replace("calls=%c", "calls=%cut"),
        _fusion("fusion.4", 70, "%p").replace("calls=%c", "calls=%scale"),
        _fusion("fusion.5", 30, "%p").replace("calls=%c", "calls=%scale"),
        '  %copy.1 = f32[1024]{0} copy(%p), backend_config={"estimated_cycles":"9"}',
      ]
    ),
  )
  assert hlo_schedule.compute_by_category(text) == {
    "convolution": 3000,
    "reduction": 200,
    "elementwise": 100,
    "slice": 50,
    "copy": 9,
  }


def test_libtpu_flags_keep_the_users_values():
  merged = xla_settings.libtpu_init_args("--xla_enable_async_all_reduce=false --other=1")
  flags = merged.split()
  assert "--xla_enable_async_all_reduce=false" in flags and "--other=1" in flags
  assert f"--xla_jf_crs_combiner_threshold_in_bytes={xla_settings.COMBINE_BELOW_BYTES}" in flags
  assert len(flags) == len(xla_settings.OVERLAP_FLAGS) + 1


def test_settings_refuse_once_a_backend_runs():
  jax.devices()
  with pytest.raises(RuntimeError, match="before jax starts a backend"):
    xla_settings.apply({})


def _collective_operand_shapes(jaxpr, primitives) -> list[tuple[int, ...]]:
  """The operand shapes of every ``primitives`` equation, in program order, nested
  jaxprs included."""
  shapes = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in primitives:
        shapes.append(tuple(eqn.invars[0].aval.shape))
      for value in eqn.params.values():
        if hasattr(value, "eqns"):
          walk(value)
        elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
          walk(value.jaxpr)

  walk(jaxpr.jaxpr)
  return shapes


SHAPES = {"a": (3, 4), "b": (4, 5), "c": (5, 6)}


def _grads(params, x):
  return jax.grad(lambda p: jnp.sum(x @ p["a"] @ p["b"] @ p["c"]))(params)


@pytest.mark.parametrize("implementation", ["xla", "shard_map"])
def test_buckets_follow_the_backward_pass(implementation):
  """The last layer's gradient is produced first by the backward pass, so its bucket's
  collective comes first in the program; the tree's own order would put "a" first."""
  mesh = tc.make_torus_mesh((2, 4))
  params = {k: jnp.ones(s) for k, s in SHAPES.items()}

  def step(params, x):
    grads = _grads(params, x)
    return tc.all_reduce_gradients(grads, ("x", "y"), bucket_bytes=1, implementation=implementation)

  f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("x", "y"))), out_specs=P())
  jaxpr = jax.make_jaxpr(f)(params, jnp.ones((8, 3)))
  shapes = _collective_operand_shapes(jaxpr, ("psum", "psum_invariant", "torus_all_reduce"))
  flat = {(5, 6): "c", (30,): "c", (4, 5): "b", (20,): "b", (3, 4): "a", (12,): "a"}
  assert list(dict.fromkeys(flat[s] for s in shapes)) == ["c", "b", "a"]


@pytest.mark.parametrize("implementation", ["xla", "shard_map"])
def test_sharded_update_reduce_scatters_in_backward_order(implementation):
  """Weight-update sharding's reduce-scatters follow the backward pass too (last layer
  first), though its layout is read from the parameters, which are the step's inputs."""
  optax = pytest.importorskip("optax")
  mesh = tc.make_torus_mesh((2, 4))
  tx = tc.sharded_update(optax.sgd(0.1), ("x", "y"), bucket_bytes=1, implementation=implementation)
  params = {k: jnp.ones(s) for k, s in SHAPES.items()}

  def step(params, x):
    return tx.apply_gradients(_grads(params, x), tx.init(params), params)[0]

  f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("x", "y"))), out_specs=P())
  jaxpr = jax.make_jaxpr(f)(params, jnp.ones((8, 3)))
  shapes = _collective_operand_shapes(jaxpr, ("reduce_scatter", "torus_reduce_scatter"))
  # Each leaf padded to [8, ceil(size / 8)] and flattened: c 30 -> 32, b 20 -> 24, a 12 -> 16.
  assert shapes == [(32,), (24,), (16,)]


def test_first_use_order_is_the_forward_pass_order():
  params = {"a": jnp.ones((2, 2)), "b": jnp.ones((2, 2)), "unused": jnp.ones(3)}
  order = tc.packing.first_use_order(lambda p, x: x @ p["b"] @ p["a"], params, jnp.ones((1, 2)))
  assert order == [1, 0, 2]
  leaves = jax.tree.leaves(params)
  assert tc.packing.buckets_by_size(leaves, 16, order) == [[1], [0], [2]]
  assert tc.packing.buckets_by_size(leaves, 32, order) == [[1, 0], [2]]
  with pytest.raises(ValueError, match="every leaf index"):
    tc.packing.buckets_by_size(leaves, 16, [0, 1])


def test_the_report_counts_the_data_parallel_collectives():
  """By named scope, plus what XLA made itself (no op_name) over the whole mesh."""
  overlap_report = pytest.importorskip("bench.overlap_report")
  line = (
    "  %all-reduce.3 = f32[1024]{0} all-reduce(%p), channel_id=1, "
    "replica_groups=mesh['x'=2,'y'=2] {AXES}, to_apply=%add{META}"
  )

  def op(axes, op_name):
    meta = f', metadata={{op_name="{op_name}"}}' if op_name else ""
    return hlo_schedule.parse_instruction(line.replace("{AXES}", axes).replace("{META}", meta))

  mesh_axes = ("x", "y")
  assert overlap_report.is_data_parallel(
    op("{'x','y'}", "jit(f)/gradient_summation/psum"), mesh_axes
  )
  assert overlap_report.is_data_parallel(op("{'x'}", "jit(f)/weight_gather/all_gather"), mesh_axes)
  assert overlap_report.is_data_parallel(op("{'x','y'}", ""), mesh_axes)  # combined by XLA
  assert not overlap_report.is_data_parallel(op("{'x'}", ""), mesh_axes)
  assert not overlap_report.is_data_parallel(op("{'x','y'}", "jit(f)/BatchNorm_0/pmean"), mesh_axes)


def _leaf_call(name, pattern, operands, remote_bytes, bucket="bucket_0"):
  """A call of a leaf chain (``kernels.split_leaf_kernels``) declaring its hop's bytes."""
  return (
    f"  %{name} = (f32[8,128]{{1,0}}, s32[]{{:S(2)}}, s32[]{{:S(2)}}) custom-call({operands}), "
    f'custom_call_target="tpu_custom_call", metadata={{op_name="jit(step)/gradient_summation/'
    f'{bucket}/async_leaf_{pattern}/pallas_call"}}, backend_config={{"cost_estimate":'
    f'{{"flops":"0","remote_bytes_transferred":"{remote_bytes}"}}}}'
  )


def _split_call(name, call, operands, bucket="bucket_0", ccw=False):
  """A leaf chain's all-gather call along "x" in a bucket's scope, sending to the next
  device (``ccw``: the previous one) the 4096 bytes its cost estimate declares (a done
  sends none)."""
  pattern = f"all_gather{'_ccw' if ccw else ''}_{call}_x"
  return _leaf_call(name, pattern, operands, 0 if call == "done" else 4096, bucket)


def _split_program(done_operand="%get-tuple-element.2", conv_cycles=(1500, 1000)):
  return _program(
    "  %p = f32[8,128]{1,0} parameter(0)",
    "  %c = s32[1]{0} parameter(1)",
    "  %k = s32[1]{0} parameter(2)",
    _split_call("start", "start", "%c, %k, %p"),
    "  %get-tuple-element.1 = f32[8,128]{1,0} get-tuple-element(%start), index=0",
    _fusion("fusion.1", conv_cycles[0], "%p"),
    _split_call("step", "step", "%c, %k, %get-tuple-element.1"),
    "  %get-tuple-element.2 = f32[8,128]{1,0} get-tuple-element(%step), index=0",
    _fusion("fusion.2", conv_cycles[1], "%fusion.1"),
    "  %copy.1 = f32[8,128]{1,0} copy(%get-tuple-element.2)",
    _split_call("done", "done", f"%c, %k, {done_operand}"),
  )


def test_a_split_chain_is_priced_hop_by_hop():
  """Each call but the done starts a 2 us hop; the next call waits for what the compute
  since did not cover: 1.5 us of compute leave 0.5 us of the first hop, 1 us leave 1 us
  of the second. One row for the chain."""
  ops = hlo_schedule.entry_ops(_split_program())
  assert [hlo_schedule.split_call(op) for op in ops if hlo_schedule.split_call(op)] == [
    ("all_gather", "start", "x"),
    ("all_gather", "step", "x"),
    ("all_gather", "done", "x"),
  ]
  assert hlo_schedule.split_chains(ops) == [[3, 6, 10]]
  timeline = hlo_schedule.timeline(ops, CLOCK, _price)
  (row,) = timeline.rows
  assert (row.name, row.kind, row.nbytes) == ("start", "split", 4096 + 4 + 4)
  assert row.modelled_s == pytest.approx(4e-6)
  assert row.covered_s == pytest.approx(2.5e-6)
  assert row.exposed_s == pytest.approx(1.5e-6)
  assert (row.hops, row.waits) == (2, 2)
  assert timeline.step_s == pytest.approx(4e-6)
  assert hlo_schedule.split_schedule_problems(ops) == []
  covered = hlo_schedule.timeline(
    hlo_schedule.entry_ops(_split_program(conv_cycles=(2000, 500))), CLOCK, _price
  )
  assert (covered.rows[0].hops, covered.rows[0].waits) == (2, 1)  # the first hop is covered


def _two_buckets(ccw, between, after):
  """Two buckets' one-hop chains along "x" (bucket 1's the other way round with ``ccw``):
  bucket 0 starts, then ``between``, bucket 1 starts, then ``after``, then both dones."""
  return hlo_schedule.entry_ops(
    _program(
      "  %p = f32[8,128]{1,0} parameter(0)",
      "  %c = s32[1]{0} parameter(1)",
      "  %k = s32[1]{0} parameter(2)",
      _split_call("start.0", "start", "%c, %k, %p"),
      *between,
      _split_call("start.1", "start", "%c, %k, %p", bucket="bucket_1", ccw=ccw),
      *after,
      _split_call("done.0", "done", "%c, %k, %start.0"),
      _split_call("done.1", "done", "%c, %k, %start.1", bucket="bucket_1", ccw=ccw),
    )
  )


@pytest.mark.parametrize("ccw, exposed", [(False, 3e-6), (True, 1e-6)], ids=["shared", "apart"])
def test_hops_in_flight_on_one_link_share_it(ccw, exposed):
  """Two buckets' 2 us hops, started together around 1 us of compute. On the same link
  each runs at half speed: 1.5 us of each are left after the compute, and the first done
  waits 3 us for both to finish (the second then waits for nothing). On opposite
  directions each has its link alone: the first done waits 1 us."""
  ops = _two_buckets(ccw, [], [_fusion("fusion.1", 1000, "%p")])
  assert [hlo_schedule.split_link(op) for op in ops if hlo_schedule.split_call(op)] == [
    ("x", 1), ("x", -1 if ccw else 1), ("x", 1), ("x", -1 if ccw else 1)
  ]  # fmt: skip
  timeline = hlo_schedule.timeline(ops, CLOCK, _price)
  first, second = timeline.rows
  assert first.exposed_s == pytest.approx(exposed)
  assert second.exposed_s == pytest.approx(0.0)
  assert (first.waits, second.waits) == (1, 0)
  assert first.modelled_s == second.modelled_s == pytest.approx(2e-6)
  assert timeline.step_s == pytest.approx(1e-6 + exposed)
  with pytest.raises(ValueError, match="not a split collective"):
    hlo_schedule.split_link(dataclasses.replace(ops[-1], op_name="jit(f)/x"))


@pytest.mark.parametrize("ccw, first_need", [(False, 4e-6), (True, 2e-6)], ids=["shared", "apart"])
def test_link_loads_count_every_later_hop_on_the_busiest_link(ccw, first_need):
  """Bucket 0 starts, 1 us of compute, bucket 1 starts, 0.5 us more: from bucket 0's first
  call the links must carry both buckets' 2 us hops, 4 us on one link when both use it,
  2 us on each when they go opposite ways, against 1.5 us of compute; from bucket 1's, its
  own hop against 0.5 us."""
  ops = _two_buckets(
    ccw, [_fusion("fusion.1", 1000, "%p")], [_fusion("fusion.2", 500, "%fusion.1")]
  )
  first, second = hlo_schedule.link_loads(ops, CLOCK, _price)
  assert (first.first, second.first) == ("start.0", "start.1")
  assert first.need_s == pytest.approx(first_need)
  assert first.compute_s == pytest.approx(1.5e-6)
  assert first.share == pytest.approx(first_need / 1.5e-6)
  assert (second.need_s, second.compute_s) == pytest.approx((2e-6, 0.5e-6))
  assert hlo_schedule.link_loads(hlo_schedule.entry_ops(BLOCKING), CLOCK, _price) == []


def test_split_schedule_problems_name_a_copied_buffer_and_an_empty_window():
  copied = hlo_schedule.entry_ops(_split_program(done_operand="%copy.1"))
  assert hlo_schedule.split_schedule_problems(copied) == [
    "done takes copy.1, not a split call's output"
  ]
  # The same chain with both convolutions of the forward pass: nothing of the backward
  # pass inside its window (and one backward convolution after it).
  text = _split_program().replace("transpose(jvp(Net))", "jvp(Net)")
  text = text.replace(
    _split_call("done", "done", "%c, %k, %get-tuple-element.2"),
    _split_call("done", "done", "%c, %k, %get-tuple-element.2")
    + "\n"
    + _fusion("fusion.3", 10, "%p"),
  )
  assert hlo_schedule.split_schedule_problems(hlo_schedule.entry_ops(text)) == [
    "start: no backward convolution between its first and last call"
  ]


def test_a_weight_gathers_chain_must_overlap_a_forward_convolution():
  """A chain in the weight gather's scope (threaded through the forward pass) is checked
  against every convolution, not the backward pass's; its bucket_0 is not the gradient
  summation's bucket_0."""
  text = _split_program().replace("/gradient_summation/", "/weight_gather/")
  ops = hlo_schedule.entry_ops(text.replace("transpose(jvp(Net))", "jvp(Net)"))
  problems = hlo_schedule.split_schedule_problems
  assert problems(ops) == []  # forward convolutions inside its window
  convolutions = [op for op in ops if hlo_schedule.is_convolution(op)]
  rest = [op for op in ops if not hlo_schedule.is_convolution(op)]
  assert problems(rest + convolutions) == []  # the first layer's: nothing before its read
  assert problems(convolutions + rest) == ["start: no convolution between its first and last call"]
  both = _program(
    "  %p = f32[8,128]{1,0} parameter(0)",
    "  %c = s32[1]{0} parameter(1)",
    "  %k = s32[1]{0} parameter(2)",
    _split_call("start", "start", "%c, %k, %p"),
    _split_call("start.1", "start", "%c, %k, %p").replace(
      "/gradient_summation/", "/weight_gather/"
    ),
  )
  assert len(hlo_schedule.split_chains(hlo_schedule.entry_ops(both))) == 2


def test_the_reports_update_after_applies_the_update_to_the_summed_gradient():
  """``--threaded-update off``: the threaded summation called without ``update``, and the
  update applied to what it returns."""
  overlap_report = pytest.importorskip("bench.overlap_report")
  calls = []

  def value_and_averaged_grad(loss_fn, axes, update=None):
    calls.append(update)
    return lambda params: (loss_fn(params), params * 2.0)

  wrapped = overlap_report.update_after(value_and_averaged_grad)
  value, stepped = wrapped(lambda p: p.sum(), ("x",), update=lambda g: g + 1.0)(jnp.ones(3))
  assert calls == [None]
  assert float(value) == 3.0
  assert stepped.tolist() == [3.0, 3.0, 3.0]
  assert wrapped(lambda p: p.sum(), ("x",))(jnp.ones(2))[1].tolist() == [2.0, 2.0]


def _leaf_program(last_leaf="%get-tuple-element.2"):
  return _program(
    "  %p = f32[8,128]{1,0} parameter(0)",
    "  %c = s32[2]{0} parameter(1)",
    "  %k = s32[1]{0} parameter(2)",
    _leaf_call("start", "reduce_scatter_start_x", "%c, %k, %p", 1000),
    "  %get-tuple-element.1 = f32[8,128]{1,0} get-tuple-element(%start), index=0",
    _fusion("fusion.1", 1500, "%p"),
    _leaf_call("step", "all_gather_step_y", "%c, %k, %get-tuple-element.1", 3000),
    "  %get-tuple-element.2 = f32[8,128]{1,0} get-tuple-element(%step), index=0",
    _fusion("fusion.2", 1000, "%fusion.1"),
    "  %copy.1 = f32[8,128]{1,0} copy(%get-tuple-element.2)",
    _leaf_call("done", "all_gather_done_y", f"%c, %k, {last_leaf}", 0),
  )


def test_a_leaf_chain_goes_from_phase_to_phase_priced_by_its_declared_bytes():
  """A leaf chain's calls change kind and axis within the chain (a reduce-scatter hop on
  x, an all-gather hop on y), which is no problem; each hop is priced with the bytes its
  call declares (``remote_bytes_transferred``), not its buffer's; a leaf that reaches the
  next call through a copy is named."""
  ops = hlo_schedule.entry_ops(_leaf_program())
  calls = [op for op in ops if hlo_schedule.split_call(op)]
  assert [hlo_schedule.split_call(op) for op in calls] == [
    ("reduce_scatter", "start", "x"),
    ("all_gather", "step", "y"),
    ("all_gather", "done", "y"),
  ]
  assert hlo_schedule.split_chains(ops) == [[3, 6, 10]]
  assert hlo_schedule.split_schedule_problems(ops) == []
  priced = []
  hlo_schedule.timeline(ops, CLOCK, lambda op, nbytes: priced.append(nbytes) or 2e-6)
  assert priced == [1000, 3000]
  copied = hlo_schedule.entry_ops(_leaf_program(last_leaf="%copy.1"))
  assert hlo_schedule.split_schedule_problems(copied) == [
    "done takes copy.1, not a split call's output"
  ]
