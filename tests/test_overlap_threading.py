"""Gradient summation threaded through the backward pass
(``torus_collectives.experimental.overlap``: its plan, its executor, its public function).

* In TPU interpret mode through the split-call extension (``testing.split_interpret``), race
  detector on: ``value_and_summed_grad(implementation="pallas")`` of a three-layer network
  with small-integer weights and inputs (every gradient an exact integer) equals
  ``jax.value_and_grad`` followed by ``lax.psum`` (``mean=False``, DMAs eager), and with
  the update threaded, the update of ``lax.pmean`` (``mean=True``, DMAs on wait), exactly,
  with buckets small enough that several are in flight at once.
* In the traced program, each bucket's start comes after the equation producing its last
  leaf and before at least one later backward matmul, and its done after that matmul.
* The operand that waits for the last call is one computation produced, not an input
  only laid out for the matmul; the equations are evaluated leaves first; the advance
  points are the leaves computed from new pinned work (a matmul), not from elementwise
  work or a reduction alone, and each
  collective's calls spread evenly over the points left after its start.
* Other implementations ("xla", "auto") are ``value_and_grad`` then
  ``all_reduce_gradients``, unchanged.
"""

import functools
import itertools
import math
import re
import types

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import inlining
from torus_collectives.experimental import overlap
from torus_collectives.experimental.overlap import executor, plan
from torus_collectives.testing.split_interpret import async_interpret_mode

pytestmark = pytest.mark.timeout(300, method="thread")

AXES = ("x", "y")
BUCKET_BYTES = 2048  # a few buckets for these layers
# The programs that run: both directions of both axes at the fewest calls a chain (the
# interpreted calls are most of their time); those only traced take 2x4.
RUN_MESH = (2, 2)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  shapes = {"w1": (16, 32), "w2": (32, 32), "w3": (32, 8), "b": (8,)}
  return {k: rng.integers(-2, 3, shape).astype(np.float32) for k, shape in shapes.items()}


def _loss(params, x):
  h = x @ params["w1"]
  h = h @ params["w2"]
  return jnp.sum(h @ params["w3"] + params["b"])


def _sgd(params):
  """An optimizer step exact on integers: ``p + neg(2 g)`` per leaf (of each leaf's own
  gradient, so its work can run while later buckets are in flight) and the sum of every
  gradient (which waits for all of them)."""

  def update(grads):
    stepped = jax.tree.map(lambda p, g: p + lax.neg(2.0 * g), params, grads)
    return stepped, sum(jnp.sum(g) for g in jax.tree.leaves(grads))

  return update


def _step(mean, implementation="pallas", reference=False, update=None):
  """The threaded step, or (``reference``) ``value_and_grad`` then ``lax.psum``/``pmean``:
  separate programs, since a lax collective in the program of the split calls may run
  concurrently with one of them on the CPU and deadlock against the interpreter.
  ``update``: a function of the parameters giving ``value_and_summed_grad``'s ``update``
  (``_sgd``); the step then returns its result in place of the gradient."""

  def body(x, params):
    then = (lambda grads: grads) if update is None else update(params)
    if reference:
      value, grads = jax.value_and_grad(_loss)(params, x)
      return value[None], then((lax.pmean if mean else lax.psum)(grads, AXES))
    value, result = overlap.value_and_summed_grad(
      _loss,
      AXES,
      mean=mean,
      bucket_bytes=BUCKET_BYTES,
      implementation=implementation,
      update=None if update is None else update(params),
    )(params, x)
    return value[None], result

  mesh = harness.mesh(RUN_MESH, AXES)
  specs = (P(AXES), P())
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P()), out_specs=specs, check_vma=False)
  )


def _check_against_the_reference(mean, values):
  value, grads = values
  ref_value, ref_grads = _step(mean, reference=True)(*_inputs())
  np.testing.assert_array_equal(value, ref_value)
  for name in ref_grads:
    np.testing.assert_array_equal(grads[name], ref_grads[name])
  return grads


def _inputs():
  x = np.random.default_rng(1).integers(-2, 3, (8 * 4, 16)).astype(np.float32)
  return x, _params()


# Each interpreted run takes half a minute, so the two paths (the calls left issued in
# turn after the backward pass; the update threaded between them) split the DMA modes and
# the two reductions between them.
@pytest.mark.interpret
def test_threaded_summation_matches_lax():
  """Eager DMAs, the sum (``mean=False``)."""
  with async_interpret_mode("eager", deadlock_timeout_s=60.0):
    values = jax.block_until_ready(_step(False)(*_inputs()))
  grads = _check_against_the_reference(False, values)
  # integers: the sums are exact whatever the order
  assert all(np.all(g == np.round(g)) for g in grads.values())


def _program_order(jaxpr, out, also=()):
  """``(what, bucket)`` of the pallas calls (``bucket``: the index in their ``bucket_<k>``
  scope) and ``dot_general`` equations and those named in ``also`` (``bucket`` None), in
  program order."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      bucket = re.search(r"bucket_([0-9]+)", str(eqn.source_info.name_stack))
      out.append(("call", int(bucket.group(1))))
      continue  # not into the kernel's body
    if eqn.primitive.name in ("dot_general", *also):
      out.append((eqn.primitive.name, None))
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", None)
      if sub is not None:
        _program_order(getattr(sub, "jaxpr", sub), out, also)
  return out


@pytest.mark.interpret
def test_each_bucket_overlaps_a_backward_matmul():
  x, params = _inputs()
  mesh = harness.mesh((2, 4), AXES)
  step = overlap.value_and_summed_grad(
    _loss, AXES, bucket_bytes=BUCKET_BYTES, implementation="pallas"
  )
  fn = jax.shard_map(
    lambda x, p: step(p, x)[1], mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(), check_vma=False
  )
  with async_interpret_mode("eager", deadlock_timeout_s=60.0):
    jaxpr = jax.make_jaxpr(fn)(x, params).jaxpr
  order = _program_order(jaxpr, [])
  buckets = sorted({b for what, b in order if what == "call"})
  assert buckets == [0, 1, 2], order  # w3 and b, w2, w1
  # Each bucket: 4 streams (2 rotations x 2 directions), one call per hop and a done
  # each: 2 x (1 + 3) hops on 2x4, 9 calls.
  calls = {b: [i for i, (what, c) in enumerate(order) if c == b] for b in buckets}
  assert all(len(c) == 4 * 9 for c in calls.values())
  starts, dones = [calls[b][0] for b in buckets], [calls[b][-1] for b in buckets]
  last_matmul = max(i for i, (what, _) in enumerate(order) if what == "dot_general")
  # Every bucket but the last one produced has a backward matmul inside its window...
  for start, done in zip(starts[:-1], dones[:-1]):
    assert ("dot_general", None) in order[start:done], (start, done, order)
  # ... two of them in flight at once (the second starts before the first is done) ...
  assert starts[1] < dones[0], order
  # ... and the last (the first layer's gradient) has nothing left to overlap.
  assert starts[-1] > last_matmul


@pytest.mark.interpret
def test_the_last_bucket_is_cut_at_the_last_matmul():
  """One bucket would hold every leaf; the last matmul's gradient (``w1``) travels alone,
  and the rest (``w3``, ``b``, ``w2``) starts before that matmul, which its window holds."""
  x, params = _inputs()
  mesh = harness.mesh((2, 4), AXES)
  step = overlap.value_and_summed_grad(_loss, AXES, bucket_bytes=1 << 20, implementation="pallas")
  fn = jax.shard_map(
    lambda x, p: step(p, x)[1], mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(), check_vma=False
  )
  with async_interpret_mode("eager", deadlock_timeout_s=60.0):
    jaxpr = jax.make_jaxpr(fn)(x, params).jaxpr
  order = _program_order(jaxpr, [])
  calls = {b: [i for i, (what, c) in enumerate(order) if c == b] for _, b in order if b is not None}
  assert sorted(calls) == [0, 1], order
  last_matmul = max(i for i, (what, _) in enumerate(order) if what == "dot_general")
  assert calls[0][0] < last_matmul < calls[0][-1]
  assert calls[1][0] > last_matmul
  assert plan.cut_last_bucket([3, 4, 5], {3: 1, 4: 7, 5: 9}, 8) == [[3, 4], [5]]
  assert plan.cut_last_bucket([3, 4], {3: 1, 4: 7}, 8) == [[3, 4]]


@pytest.mark.interpret
def test_threaded_update_matches_lax():
  """``update`` threaded with the buckets in flight gives what it gives on the summed
  gradient, exactly (every value one over 4 of an integer): DMAs on wait, the mean."""
  with async_interpret_mode("on_wait", deadlock_timeout_s=60.0):
    value, (stepped, total) = jax.block_until_ready(_step(True, update=_sgd)(*_inputs()))
  ref_value, (ref_stepped, ref_total) = _step(True, reference=True, update=_sgd)(*_inputs())
  np.testing.assert_array_equal(value, ref_value)
  np.testing.assert_array_equal(total, ref_total)
  for name in ref_stepped:
    np.testing.assert_array_equal(stepped[name], ref_stepped[name])


@pytest.mark.interpret
def test_update_of_finished_buckets_runs_between_the_last_buckets_calls():
  """The update's work on the leaves whose buckets are done (its ``neg`` equations: the
  backward pass has none) is traced between the calls of the last bucket, which the
  backward pass left with nothing to overlap; the negation of the last bucket's own
  leaf's step (``w1``) comes after its last call."""
  x, params = _inputs()
  mesh = harness.mesh((2, 4), AXES)

  def body(x, p):
    step = overlap.value_and_summed_grad(
      _loss, AXES, bucket_bytes=BUCKET_BYTES, update=_sgd(p), implementation="pallas"
    )
    return step(p, x)[1]

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(), check_vma=False)
  with async_interpret_mode("eager", deadlock_timeout_s=60.0):
    jaxpr = jax.make_jaxpr(fn)(x, params).jaxpr
  order = _program_order(jaxpr, [], also=("neg",))
  last = [i for i, (what, b) in enumerate(order) if what == "call" and b == 2]
  negs = [i for i, (what, _) in enumerate(order) if what == "neg"]
  assert len(negs) == 4, order
  assert sum(last[0] < i < last[-1] for i in negs) == 3, (last, negs)  # w3, b, w2
  assert max(negs) > last[-1]  # w1's


@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_other_implementations_are_value_and_grad_then_all_reduce_gradients(implementation):
  _check_against_the_reference(True, _step(True, implementation)(*_inputs()))


def test_refuses_unknown_implementation_and_integer_gradients():
  with pytest.raises(ValueError, match="unknown implementation"):
    _step(True, "nope")(*_inputs())
  mesh = harness.mesh((2, 4), AXES)

  def body(x):
    return overlap.value_and_summed_grad(lambda p: jnp.sum(p * 1.0), AXES, implementation="pallas")(
      x
    )[0][None]

  fn = jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES), check_vma=False)
  with pytest.raises(TypeError, match="integer|float"):
    fn(jnp.zeros((8, 128), jnp.int32))


def test_exported_from_experimental_and_the_old_paths_warn():
  assert tc.experimental.value_and_summed_grad is overlap.value_and_summed_grad
  assert "value_and_summed_grad" not in tc.__all__
  with pytest.warns(DeprecationWarning, match="torus_collectives.experimental"):
    assert tc.value_and_summed_grad is overlap.value_and_summed_grad


def _inlined(fun, *args, outs=False):
  closed = jax.make_jaxpr(fun)(*args)
  counter = itertools.count()
  in_keys = [next(counter) for _ in jax.tree.leaves(args)]
  eqns, out_keys = inlining.inline(closed.jaxpr, closed.consts, in_keys, counter, {})
  producer = {key: item for item in eqns for key in item.outs}
  return (eqns, producer, out_keys) if outs else (eqns, producer)


def test_the_plan_of_a_three_layer_mlp():
  """``plan.make_plan`` on ``value_and_grad`` of a 3-layer tanh MLP (weights of 4 KiB,
  buckets of 8 KiB): the equations are evaluated in an order of them all; the gradients
  come w3, w2, w1; the buckets are [w3, w2] and [w1] (w1 alone: the last matmul makes
  it), each starting after the equation that produced its last leaf; every matmul once a
  bucket is in flight is pinned, and no reduction; the points are the weight-gradient
  matmuls after the first start, and a bucket's windows are the points after its start.
  The plan prints one line a bucket."""

  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.sum(x)

  ws = [jnp.ones((32, 32))] * 3
  eqns, producer, outs = _inlined(jax.value_and_grad(loss), ws, jnp.ones((8, 32)), outs=True)
  like = [jax.ShapeDtypeStruct((32, 32), jnp.float32)] * 3
  made = plan.make_plan(eqns, outs, like, bucket_bytes=8 * 1024)
  assert sorted(made.order) == list(range(len(eqns)))
  evaluated = [eqns[i] for i in made.order]
  position = {key: i for i, item in enumerate(evaluated) for key in item.outs}
  made_at = [position[key] for key in outs[1:]]  # w1, w2, w3's gradients
  assert made_at[2] < made_at[1] < made_at[0]
  assert made.buckets == ((2, 1), (0,))
  assert made.ready_after == (made_at[1], made_at[0])
  assert made_at[1] < made.heavy[-1] < made_at[0]  # only w1's exists after the last matmul
  assert made.pinned == tuple(
    i
    for i, item in enumerate(evaluated)
    if i > made_at[1] and item.eqn.primitive.name == "dot_general"
  )
  assert made.points == (made_at[0],)
  assert made.windows(0) == (made_at[0],) and made.windows(1) == ()
  text = str(made)
  assert (
    "2 buckets" in text and f"bucket 0: leaves [2, 1], starts after equation {made_at[1]}" in text
  )


def test_leaves_first_moves_what_only_a_later_leaf_needs_after_the_earlier_leaf():
  """``plan.leaves_first``: a program that computes ``t = b @ b`` (needed only by the second
  leaf) before the first leaf ``a @ a`` is evaluated first leaf, then ``t``, then the
  second leaf. In program order the second leaf is no advance point: the matmul it comes
  from ran before the first leaf's point. Leaves first, both are, a matmul in each
  window."""

  def fun(a, b):
    t = b @ b
    return a @ a, jnp.tanh(t)

  eqns, _, outs = _inlined(fun, jnp.ones((8, 8)), jnp.ones((8, 8)), outs=True)
  names = [item.eqn.primitive.name for item in eqns]
  assert names == ["dot_general", "dot_general", "tanh"]
  order = plan.leaves_first(eqns, outs)
  assert order == [1, 0, 2]
  leaf_keys = set(outs)
  assert plan.advance_points(eqns, leaf_keys, -1) == [1]
  assert plan.advance_points([eqns[i] for i in order], leaf_keys, -1) == [0, 2]
  # what no leaf needs comes right after the last thing it reads
  assert plan.leaves_first(eqns, outs[:1]) == [0, 2, 1]
  assert plan.leaves_first(eqns, outs[1:]) == [1, 0, 2]


def test_leaves_first_keeps_effects_in_program_order():
  """Two ordered callbacks, the first feeding the second leaf and the second the first
  leaf: leaves first would run the second callback first, but an equation with effects
  also reads the one before it, so they keep their program order."""

  def fun(a, b):
    like = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    u = io_callback(lambda v: v, like, b, ordered=True)
    v = io_callback(lambda v: v, like, a, ordered=True)
    return v @ v, jnp.tanh(u)

  eqns, _, outs = _inlined(fun, jnp.ones((8, 8)), jnp.ones((8, 8)), outs=True)
  names = [item.eqn.primitive.name for item in eqns]
  assert names == ["io_callback", "io_callback", "dot_general", "tanh"], names
  assert plan.leaves_first(eqns, outs) == [0, 1, 2, 3]


def test_the_operand_that_waits_for_the_call_is_one_computation_produced():
  """``_computed``: for ``max(cumsum(x) * s, 0) @ transpose(w)`` the matmul's left
  operand is computed (so the zero from the barrier is subtracted there, fused with its
  producers), the right one is the input ``w`` moved by a layout change only (less a
  zero it would be laid out anew), as is a flipped, cast input."""

  def fun(x, s, w):
    return jnp.maximum(jnp.cumsum(x, axis=1) * s, 0.0) @ w.T, x @ jnp.flip(
      w.astype(jnp.bfloat16).T, 0
    )

  eqns, producer = _inlined(fun, jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((2, 8)))
  first, second = [item for item in eqns if item.eqn.primitive.name == "dot_general"]
  assert plan.is_computed(first.ins[0], producer)
  assert not plan.is_computed(first.ins[1], producer)
  assert not plan.is_computed(second.ins[0], producer)  # a program input
  assert not plan.is_computed(second.ins[1], producer)


class _PinningSplit:
  """A stand-in for a split collective in flight: ``pin`` passes values through a barrier
  with its buffer, as ``SplitLeafAllReduce.pin`` does with its first leaf, and counts the
  barriers."""

  def __init__(self):
    self.buffer, self.pins = jnp.zeros((4,)), 0

  def pin(self, values):
    self.pins += 1
    self.buffer, values = lax.optimization_barrier((self.buffer, values))
    return values


def test_tail_operands_wait_for_the_calls_through_a_pinned_zero():
  """``_Tail._read`` of a tail input from outside the window (a parameter, an optimizer
  state): the value itself, less the opaque zero (``_opaque_zero``, here a traced int32
  argument) out of a barrier with the collectives in flight (one barrier a window, so XLA
  fuses the subtraction into the reader); booleans ``or`` it; a PRNG key, which admits no
  arithmetic, passes the barrier itself; with nothing in flight, the value as is. A
  bucket's sum and what an earlier window computed are read as they are."""
  tail = object.__new__(executor.Tail)
  tail.window, tail.zero = {}, None
  tail.sums, tail.producer = {4}, {5: 0}  # key 4: a bucket's sum; 5: computed by the tail
  split = _PinningSplit()

  def reads(a, b, flags, key, zero):
    tail.env, tail.threaded = {0: a, 1: b, 2: flags, 3: key}, types.SimpleNamespace(zero=zero)
    tail.env.update({4: a, 5: b})
    tail.zero = None
    read = [tail._read(k, [split]) for k in range(6)]
    # a sum comes out of its done call, a tail value out of an earlier window: as they are
    assert read[4] is a and read[5] is b
    return read[:4] + [tail._read(1, [])]

  args = (
    jnp.arange(6.0).reshape(2, 3) - 2.5,
    jnp.asarray([-0.0, jnp.nan, 7.0]),
    jnp.asarray([True, False]),
    jax.random.key(0),
    jnp.int32(0),
  )
  jaxpr = jax.make_jaxpr(reads)(*args)
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  # the window's one zero, for every dtype; the key itself
  assert len(barriers) == split.pins == 2
  passed = [v.aval for e in barriers for v in e.invars[1:]]
  assert sorted((a.shape, str(a.dtype)) for a in passed) == [
    ((), "int32"),
    ((), "key<fry>"),
  ], passed
  assert [e.primitive.name for e in jaxpr.eqns].count("sub") == 2
  assert [e.primitive.name for e in jaxpr.eqns].count("or") == 1
  a, b, flags, key, b_as_is = jax.jit(reads)(*args)
  np.testing.assert_array_equal(a, args[0])
  np.testing.assert_array_equal(b, args[1])  # NaN stays NaN
  assert np.signbit(b[0])  # -0 stays -0
  np.testing.assert_array_equal(flags, args[2])
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(args[3]))
  np.testing.assert_array_equal(b_as_is, args[1])


@pytest.mark.parametrize(
  "hop_bytes, points, expected",
  [
    ([1] * 4, 8, [2, 4, 6, 8]),  # even hops: every other window, the last at the last point
    ([1] * 3, 3, [1, 2, 3]),
    ([1] * 6, 4, [1, 2, 3, 4, None, None]),  # more calls than windows: the rest at the end
    ([1] * 2, 0, [None, None]),  # no window left: everything at the end
    ([16, 16, 1, 1], 10, [4, 8, 9, 10]),  # the large hops get the spare windows
    ([1, 16, 1], 5, [1, 4, 5]),
  ],
)
def test_each_hop_gets_a_run_of_windows_by_its_bytes(hop_bytes, points, expected):
  """``plan.call_points``: the call that waits for a hop is issued at the last point of the
  hop's run of windows, one window at least, the spare ones to the hops with the most
  bytes per window."""
  assert plan.call_points(hop_bytes, list(range(1, points + 1))) == expected


def test_no_hop_gets_fewer_windows_than_a_smaller_one():
  rng = np.random.default_rng(0)
  for _ in range(50):
    hop_bytes = list(rng.integers(1, 100, size=int(rng.integers(1, 20))))
    windows = list(range(10, 10 + len(hop_bytes) + int(rng.integers(0, 40))))
    points = plan.call_points(hop_bytes, windows)
    assert points[-1] == windows[-1] and points == sorted(set(points))  # one call a window
    runs = np.diff([windows.index(p) for p in points], prepend=-1)
    for i, j in itertools.permutations(range(len(hop_bytes)), 2):
      if hop_bytes[i] > hop_bytes[j]:
        assert runs[i] >= runs[j], (hop_bytes, runs)


def test_advance_points_are_leaves_computed_from_new_work():
  """In the three-layer network's backward pass: each weight's gradient (a matmul, then
  its transpose) is a point, and the offset's (a sum of the output's gradient, which no
  matmul computed) is not; none comes at or before the position given (the first
  bucket's start)."""
  x, params = _inputs()
  closed = jax.make_jaxpr(jax.grad(_loss))(params, x)
  counter = itertools.count()
  in_keys = [next(counter) for _ in jax.tree.leaves((params, x))]
  eqns, outs = inlining.inline(closed.jaxpr, closed.consts, in_keys, counter, {})
  leaf_keys = {a for a in outs if isinstance(a, int)}
  points = plan.advance_points(eqns, leaf_keys, -1)
  producer = {key: item for item in eqns for key in item.outs}

  def work(item):  # the equation a layout change (the weight gradient's transpose) reads
    while item.eqn.primitive.name in plan.MOVES_NO_DATA:
      item = producer[item.ins[0]]
    return item.eqn.primitive.name

  names = [work(eqns[p]) for p in points]
  assert names == ["dot_general"] * 3, names
  assert all(any(k in leaf_keys for k in eqns[p].outs) for p in points)
  assert plan.advance_points(eqns, leaf_keys, max(points)) == []


def test_a_leaf_computed_only_elementwise_is_no_point():
  """A gradient that comes from elementwise work alone (``cos(s) * v`` for the loss term
  ``sum(sin(s) * v)``) opens no window: XLA may run that work before the call the window
  follows. The matmul weight's gradient is a point; the elementwise one is not."""

  def loss(params, x, v):
    return jnp.sum(x @ params["w"]) + jnp.sum(jnp.sin(params["s"]) * v)

  params = {"w": jnp.ones((16, 8)), "s": jnp.ones((8,))}
  x, v = jnp.ones((4, 16)), jnp.ones((8,))
  closed = jax.make_jaxpr(jax.grad(loss))(params, x, v)
  counter = itertools.count()
  in_keys = [next(counter) for _ in jax.tree.leaves((params, x, v))]
  eqns, outs = inlining.inline(closed.jaxpr, closed.consts, in_keys, counter, {})
  grad_s, grad_w = outs  # the leaves in key order: "s", then "w"
  produced_at = {key: position for position, item in enumerate(eqns) for key in item.outs}
  points = plan.advance_points(eqns, {grad_s, grad_w}, -1)
  assert points == [produced_at[grad_w]], (points, produced_at[grad_s], produced_at[grad_w])


def test_the_tail_is_cut_into_reductions_then_updates_with_their_riders():
  """``_units`` of a trust-ratio update of two leaves (each: two norms, then the momentum
  and the parameter from them), returning the parameters then the momenta: each leaf's
  norms are one unit, then its parameter with its momentum, which the parameter's update
  computes whole and so rides in its unit; the work of a norms unit is the bytes its
  reductions read, of an update unit the bytes it returns."""

  def update(grads, params, momenta):
    new_params, new_momenta = [], []
    for g, p, m in zip(grads, params, momenta):
      trust = jnp.linalg.norm(p) / jnp.linalg.norm(g + 1e-4 * p)
      m = 0.9 * m + trust * g
      new_params.append(p - 0.1 * m)
      new_momenta.append(m)
    return new_params, new_momenta

  leaves = [jnp.ones((3, 4)), jnp.ones((5,))]
  closed = jax.make_jaxpr(update)(leaves, leaves, leaves)
  counter = itertools.count()
  in_keys = [next(counter) for _ in range(6)]
  eqns, outs = inlining.inline(closed.jaxpr, closed.consts, in_keys, counter, {})
  producer = {key: i for i, item in enumerate(eqns) for key in item.outs}
  units = plan.units(eqns, outs, producer)
  p0, p1, m0, m1 = outs
  kinds = [[eqns[producer[k]].eqn.primitive.name for k in unit] for unit in units]
  assert kinds[0] == kinds[2] == ["reduce_sum", "reduce_sum"], kinds
  assert [units[1], units[3]] == [(p0, m0), (p1, m1)], units
  cones = {u: sorted({i for k in u for i in plan.cone(k, eqns, producer)}) for u in units}
  work = plan.unit_work(eqns, units, cones, producer)
  assert [work[u] for u in units] == [2 * 48.0, 2 * 48.0, 2 * 20.0, 2 * 20.0]


def test_tail_calls_are_spaced_over_the_work_that_can_cover_them():
  """Collective 0 (1 call left) finishes first: every unit needs its sum or the other's,
  so nothing covers its call (spacing 1: a call after every unit with work). Collective 1
  is covered by the work that needs only collective 0's sum, in order 300, 100, 20 (the
  50 and the 7 read collective 1's, the 0 is work another unit did): for 2 calls the
  largest spacing that still closes 2 windows (300 | 100 + 20), for 3 one a unit, for
  more calls than such work the smallest unit (one window each; the rest are issued
  after it). No calls left: never due."""
  work, needs = [300, 100, 50, 20, 0, 7], [{0}, {0}, {0, 1}, {0}, {0}, {1}]
  spacing = plan.call_spacing(work, needs, [1, 2])
  assert spacing == [1.0, pytest.approx(120.0)]
  assert plan.call_spacing(work, needs, [1, 3]) == [1.0, pytest.approx(20.0)]
  assert plan.call_spacing(work, needs, [1, 9]) == [1.0, 20]
  assert plan.call_spacing(work, needs, [0, 2]) == [math.inf, pytest.approx(120.0)]


def test_a_fitted_spacing_closes_a_window_for_every_call():
  """``_fitted_spacing``: lumpy work in order, cut greedily (a window closes once its work
  reaches the spacing) into at least as many windows as calls, with the largest spacing
  that does. The cut, by hand: at 3, 5 | 1+1+1 | 5 | 1+1+1 (4 windows); at 2, 5 | 1+1 |
  1+5 | 1+1 and a 1 left over (4); at 8, 5+1+1+1 | 5+1+1+1 (2)."""
  work = [5, 1, 1, 1, 5, 1, 1, 1]
  closed = functools.partial(plan.windows_closed, work)
  assert [closed(3), closed(2), closed(8), closed(1), closed(17)] == [4, 4, 2, 8, 0]
  for calls, expected in [(1, 16), (2, 8), (4, 3), (5, 1), (8, 1), (12, 1)]:
    spacing = plan.fitted_spacing(work, calls)
    assert spacing == pytest.approx(expected), calls
    assert closed(spacing) >= min(calls, len(work))
    assert calls > len(work) or closed(spacing * 1.01) < calls
  assert plan.fitted_spacing([], 3) == 1.0
