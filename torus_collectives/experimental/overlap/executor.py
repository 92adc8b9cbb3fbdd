"""The threaded summation's executor: re-evaluates a traced ``value_and_grad``
equation by equation, as its ``plan.Plan`` says, with each bucket's split collective
started, its calls issued and its results pinned (the package's docstring, steps 3 to 5).

``Executor`` runs the backward pass; ``Tail`` runs the work after it (the scaling of the
sums and the optimizer's update) while the last buckets' calls are issued. The pins:
``opaque_zero`` and ``plus_zero`` order an equation after the calls through one operand,
so XLA still fuses its producers; ``pin_to`` passes values through a barrier with the
collectives in flight.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import _jax_internals as jax_internals
from torus_collectives import inlining
from torus_collectives._vma import mark_invariant
from torus_collectives.experimental.overlap.plan import (
  Plan,
  call_points,
  call_spacing,
  cone,
  is_computed,
  make_plan,
  unit_work,
  units,
)
from torus_collectives.gradients import GRADIENT_SCOPE


class Executor:
  """The re-evaluation of one traced ``value_and_grad`` with summation woven in."""

  def __init__(self, start_summation, names, sizes, bucket_bytes: int):
    # A bucket's leaves -> their split all-reduce, no call issued yet, whose
    # ``finish_parts`` are the leaves' sums where they lie (``registry.CollectiveBackend
    # .split_all_reduce_leaves``).
    self.start_summation = start_summation
    self.names, self.sizes = names, sizes
    self.bucket_bytes = bucket_bytes
    self.in_flight: list[tuple[list[int], Any]] = []  # (leaf indices, its collective)
    self.plan: Plan | None = None  # the decisions (set by ``run``: ``plan.make_plan``)
    self.scopes: dict[int, tuple[str, int]] = {}  # id(split) -> (its scope, its start order)
    self.last_communicated: list[jax.Array] = []  # results of the last such equation
    self.pacing: dict[int, tuple[int, list]] = {}  # split -> (calls left, each one's point)
    self.zero: jax.Array | None = None  # what pinned zeros come from (``opaque_zero``)

  @contextlib.contextmanager
  def _scope(self, split):
    """The named scopes of a bucket's calls: the summation's, then ``bucket_<k>`` (``k``
    its start order among them), by which ``testing.hlo_schedule`` tells one bucket's
    calls apart."""
    scope, k = self.scopes[id(split)]
    with jax.named_scope(scope), jax.named_scope(f"bucket_{k}"):
      yield

  def _flying(self) -> list:
    """Every collective started so far, finished ones too: a barrier still ties their
    results to what follows (the package docstring, step 4)."""
    return [split for _, split in self.in_flight]

  def run(self, closed, flat_args, grad_leaves, gradient_then, update) -> tuple[list, Any]:
    """(the value's leaves, ``gradient_then(the summed gradient leaves)``) of the traced
    program; ``update`` given, ``gradient_then``'s work is threaded too (``Tail``)."""
    counter = itertools.count()
    constants: dict[int, Any] = {}
    in_keys = [next(counter) for _ in flat_args]
    eqns, outs = inlining.inline(closed.jaxpr, closed.consts, in_keys, counter, constants)
    self.zero = opaque_zero(self.names)
    self.plan = plan = make_plan(eqns, outs, grad_leaves, self.bucket_bytes)
    eqns = [eqns[i] for i in plan.order]
    env: dict[Any, Any] = {**constants, **dict(zip(in_keys, flat_args))}
    split_at = len(outs) - len(grad_leaves)
    value_atoms, grad_atoms = outs[:split_at], outs[split_at:]
    producer = {key: item for item in eqns for key in item.outs}

    def gradient(i):
      return _read(env, grad_atoms[i])

    points, pinned = set(plan.points), set(plan.pinned)
    self._start_ready(-1, gradient)
    for position, item in enumerate(eqns):
      operands = [_read(env, atom) for atom in item.ins]
      name = item.eqn.primitive.name
      communicating = bool(self._flying()) and communicates(name)
      if communicating:
        operands = self._pin(operands)
      elif position in pinned:
        operands = self._after_last_call(item, operands, producer)
      results = _evaluate(item.eqn, operands)
      if communicating:
        results = self._pin(results)
      if position in points:
        self._pin(results)  # for the next call's sake: the window's consumers read them unpinned
        self._advance_due(position)
      if communicates(name):
        self.last_communicated = [r for r in results if isinstance(r, jax.Array)]
      env.update(zip(item.outs, results))
      self._start_ready(position, gradient)
    result = self._result(grad_leaves, gradient_then, update is not None)
    # The value and aux come out of a barrier with the result, so that what the caller
    # computes from them (its metrics' collectives, say) runs after the last call.
    leaves, tree = jax.tree.flatten(result)
    value, leaves = lax.optimization_barrier(([_read(env, a) for a in value_atoms], leaves))
    return value, jax.tree.unflatten(tree, leaves)

  def _result(self, grad_leaves, gradient_then, threaded: bool):
    """``gradient_then`` of the summed leaves: after every call (``_finish_in_turn``), or
    (``threaded``) evaluated while the buckets still in flight issue theirs (``Tail``)."""

    def tail(*parts):  # the buckets' sums' parts, in start order -> gradient_then(leaves)
      summed: dict[int, jax.Array] = {}
      for (bucket, _), bucket_parts in zip(self.in_flight, parts):
        summed.update(zip(bucket, bucket_parts))
      return gradient_then([summed[i] for i in range(len(grad_leaves))])

    if threaded:
      return Tail(self, tail).run()
    self._finish_in_turn()
    parts = []
    for _, split in self.in_flight:
      with self._scope(split):
        parts.append(split.finish_parts())
    return tail(*parts)

  def _start_ready(self, position, gradient) -> None:
    """Starts the split all-reduce of every bucket whose last leaf ``position`` produced."""
    for b, (bucket, ready) in enumerate(zip(self.plan.buckets, self.plan.ready_after)):
      if ready != position:
        continue
      bucket = list(bucket)
      with jax.named_scope(GRADIENT_SCOPE):
        leaves = [gradient(i) for i in bucket]
        # After every communicating equation so far (they run in program order among
        # themselves; the split calls, in program order among themselves, follow them).
        leaves, _ = lax.optimization_barrier((leaves, self.last_communicated))
        split = self.start_summation(leaves)
      self.scopes[id(split)] = (GRADIENT_SCOPE, len(self.in_flight))
      self.in_flight.append((bucket, split))
      if split.calls_left:
        with self._scope(split):
          split.advance()
      # The bytes of the hops the calls left wait for (uniform where the split says not).
      hops = getattr(split, "hop_bytes", None) or [1] * split.calls_left
      points = call_points(hops[len(hops) - split.calls_left :], self.plan.windows(b))
      self.pacing[id(split)] = (split.calls_left, points)

  def _pin(self, values):
    """``values`` (their traced arrays; literals pass) through a barrier with each
    collective ``_flying``, in start order."""
    return pin_to(self._flying(), values)

  def _after_last_call(self, item, operands, producer):
    """The pinned equation ``item``'s operands, one of them less a zero that comes out of
    a barrier with the collectives in flight: the equation then cannot run before the
    last call issued, yet XLA still fuses the operand's producers (the batch norm's
    scale, the ReLU mask, a pad) and the subtraction into the convolution, as a barrier
    on the operand itself would not let it. ``x - 0`` is ``x`` exactly for every float
    (``-0`` and NaN included) and integer.

    The operand is the smallest one that computation produced (``is_computed``), not an
    input moved into place by layout equations: a program input (the images) or a
    weight cast and flipped for a transposed convolution is laid out for the convolution
    once and shared with the forward pass, and less a zero it would be copied again
    (seen for the images in a v5e compile). Failing that, the smallest
    operand."""
    traced = [i for i, v in enumerate(operands) if isinstance(v, jax.Array)]
    if not traced:
      return operands
    computed = [i for i in traced if is_computed(item.ins[i], producer)]
    i = min(computed or traced, key=lambda k: _nbytes(operands[k]))
    operands = list(operands)
    operands[i] = plus_zero(operands[i], self._pin([self.zero])[0])
    return operands

  def _finish_in_turn(self) -> None:
    """The calls left after the last point, one of each collective in turn: their hops
    overlap one another's rather than queueing bucket after bucket."""
    while any(split.calls_left for _, split in self.in_flight):
      for _, split in self.in_flight:
        if split.calls_left:
          with self._scope(split):
            split.advance()

  def _advance_due(self, position: int) -> None:
    """At the advance point ``position``, issues the next call of each in-flight
    collective that is due (``plan.call_points``), one a window at most."""
    for split in self._flying():
      calls, points = self.pacing[id(split)]
      issued = calls - split.calls_left
      if split.calls_left and points[issued] is not None and points[issued] <= position:
        with self._scope(split):
          split.advance()


def opaque_zero(axis_names) -> jax.Array:
  """An int32 zero that XLA cannot prove is one: ``min(axis index, 0)``, typed invariant
  over ``axis_names`` (it is 0 on every device). A constant zero through a barrier does
  not pin what reads it: XLA forwards constants through an ``optimization_barrier`` before
  it schedules (checked on a v5e compile: the reader got the constant and the barrier no
  longer ordered it, ``tests/test_split_step_aot.py``)."""
  return mark_invariant(jnp.minimum(lax.axis_index(axis_names), 0), tuple(axis_names))


def plus_zero(value, zero):
  """``value`` less ``zero`` (an int32 zero, ``opaque_zero``, out of a barrier; or with it
  for booleans): ``value`` exactly, for every float (``-0`` and NaN included) and integer,
  but computed from ``zero``, so XLA cannot run its reader before that barrier's calls."""
  if value.dtype == jnp.bool_:
    return value | zero.astype(jnp.bool_)
  return value - zero.astype(value.dtype)


class Tail:
  """The work after the backward pass (``tail``: a function of the buckets' sums, in start
  order), traced and evaluated while the buckets still in flight issue their calls
  (the package docstring, step 5).

  The tail is evaluated unit by unit (``units``), in the order it returns its outputs: a
  unit is an output (a parameter's new value, with the optimizer state leaves its update
  computes whole) or the reductions in an output's cone (a trust ratio's norms), so that a
  large leaf's update gives two windows. A unit's *cone*, the equations it needs that have
  not run yet, is evaluated in one window, once every bucket sum it reads exists. So a
  leaf's update chain stays in one window and fuses. The cone's reads of the tail's inputs
  from outside the window (the parameters and the optimizer state) are pinned after the
  collectives' last call (``_read``); the buckets' sums, out of their done calls, and what
  earlier windows computed, are ordered already. Each collective in flight issues its next
  call once the work evaluated since its last one reaches its spacing (``call_spacing``),
  after a barrier with the window's outputs; a new window opens whenever one does. A
  collective with no calls left is finished, and the units that read its sum become ready;
  when a pass finds no unit ready, the collective with the fewest calls left issues one.
  """

  def __init__(self, threaded: Executor, tail: Callable):
    self.threaded = threaded
    parts = [split.parts_like for _, split in threaded.in_flight]
    closed, self.shapes = jax.make_jaxpr(tail, return_shape=True)(*parts)
    counter = itertools.count()
    constants: dict[int, Any] = {}
    # One key per stream part; in_keys[c]: collective c's.
    self.in_keys = [[next(counter) for _ in bucket_parts] for bucket_parts in parts]
    flat_keys = [k for keys in self.in_keys for k in keys]
    self.sums = set(flat_keys)
    self.eqns, self.outs = inlining.inline(
      closed.jaxpr, closed.consts, flat_keys, counter, constants
    )
    self.env: dict[Any, Any] = dict(constants)
    producer = {key: i for i, item in enumerate(self.eqns) for key in item.outs}
    outputs = list(dict.fromkeys(a for a in self.outs if isinstance(a, int) and a in producer))
    self.units = units(self.eqns, outputs, producer)
    self.cones = {
      unit: sorted({i for key in unit for i in cone(key, self.eqns, producer)})
      for unit in self.units
    }
    self.done: set[int] = set()  # the equations evaluated
    self.producer = producer
    which = {key: c for c, keys in enumerate(self.in_keys) for key in keys}
    needs = [
      {
        which[a]
        for i in self.cones[unit]
        for a in self.eqns[i].ins
        if isinstance(a, int) and a in which
      }
      for unit in self.units
    ]
    self.work = unit_work(self.eqns, self.units, self.cones, producer)
    calls_left = [split.calls_left for _, split in threaded.in_flight]
    work = [self.work[unit] for unit in self.units]
    self.spacing = call_spacing(work, needs, calls_left)
    self.since = [0.0] * len(calls_left)  # of it, since each collective's last call
    self.window: dict[Any, Any] = {}  # keys computed or pinned in the current window
    self.zero: jax.Array | None = None  # the window's pinned zero (``opaque_zero``)
    self.window_outputs: list[jax.Array] = []

  def run(self):
    """The tail's result, every collective finished."""
    self._collect_finished()
    pending = self.units
    while pending:
      waiting = [unit for unit in pending if not self._evaluate_cone(unit)]
      if len(waiting) == len(pending):  # nothing was ready: a sum they read is in flight
        self._next_window([self._next_to_finish()])
      pending = waiting
    while any(split.calls_left for _, split in self.threaded.in_flight):
      self._next_window()
    leaves = [_read(self.env, a) for a in self.outs]
    return jax.tree.unflatten(jax.tree.structure(self.shapes), leaves)

  def _evaluate_cone(self, unit) -> bool:
    """Evaluates the cone of ``unit`` (``units``: one output, or the reductions of one)
    if every operand it reads from outside exists (False if not), closing the window when
    it is due."""
    cone = [i for i in self.cones[unit] if i not in self.done]
    inside = {k for i in cone for k in self.eqns[i].outs}
    reads = {a for i in cone for a in self.eqns[i].ins if isinstance(a, int)} - inside
    if any(a not in self.env for a in reads):
      return False
    for i in cone:
      self._evaluate(self.eqns[i])
      self.done.add(i)
    self.window_outputs += [self.env[key] for key in unit]
    self.since = [since + self.work[unit] for since in self.since]
    due = [c for c, (_, split) in enumerate(self.threaded.in_flight) if self._due(c, split)]
    if due:
      self._next_window(due)
    return True

  def _due(self, c: int, split) -> bool:
    """Whether collective ``c`` issues its next call: the work evaluated since its last
    one has reached its spacing."""
    return bool(split.calls_left) and self.since[c] >= self.spacing[c]

  def _evaluate(self, item) -> None:
    flying = [split for _, split in self.threaded.in_flight if split.calls_left]
    operands = [self._read(a, flying) for a in item.ins]
    communicating = bool(flying) and communicates(item.eqn.primitive.name)
    if communicating:  # in one order with the split calls on every device
      operands = pin_to(flying, operands)
    results = _evaluate(item.eqn, operands)
    if communicating:
      results = pin_to(flying, results)
    self.env.update(zip(item.outs, results))
    self.window.update(zip(item.outs, results))

  def _read(self, atom, flying):
    """An operand: as computed in this window, else, for a tail input (a parameter, an
    optimizer state leaf), after the calls of the collectives ``flying`` issued so far, as
    ``_after_last_call`` does it: less a zero that comes out of a barrier with them (one a
    window), which XLA fuses into the reader. A bucket's sum, which comes out of its done
    call, and what an earlier window computed, which comes out of its window, are read as
    they are: less the zero, they were written out again wherever two fusions read them (a
    leaf's norms and its update, seen in a v5e compile of ResNet-50). Values that admit no
    arithmetic (PRNG keys) pass the barrier themselves; with nothing in flight, every value
    is read as it is."""
    if not isinstance(atom, int):
      return atom.value
    if atom in self.window or not flying or atom in self.producer or atom in self.sums:
      return self.env[atom]
    value = self.env[atom]
    if not isinstance(value, jax.Array) or jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
      (self.window[atom],) = pin_to(flying, [value])
      return self.window[atom]
    if self.zero is None:
      (self.zero,) = pin_to(flying, [self.threaded.zero])
    self.window[atom] = plus_zero(value, self.zero)
    return self.window[atom]

  def _collect_finished(self) -> None:
    """The sum of every collective with no calls left, as the tail's input."""
    for (_, split), keys in zip(self.threaded.in_flight, self.in_keys):
      if keys[0] not in self.env and not split.calls_left:
        with self.threaded._scope(split):
          self.env.update(zip(keys, split.finish_parts()))

  def _next_to_finish(self) -> int:
    """The collective in flight with the fewest calls left: the one to advance when no
    output is ready (the others keep their calls for the work its sum releases)."""
    left = [(s.calls_left, c) for c, (_, s) in enumerate(self.threaded.in_flight) if s.calls_left]
    return min(left)[1]

  def _next_window(self, due=None) -> None:
    """The collectives ``due`` (indices; default: every one in flight) issue their next
    call, after the window's outputs (one barrier); a new window opens."""
    in_flight = self.threaded.in_flight
    every = range(len(in_flight)) if due is None else due
    due = [c for c in every if in_flight[c][1].calls_left]
    splits = [in_flight[c][1] for c in due]
    if self.window_outputs:  # the next calls wait for the window's work
      pin_to(splits, self.window_outputs)
    self.window.clear()
    self.zero = None
    self.window_outputs = []
    for c, split in zip(due, splits):
      self.since[c] = 0.0
      with self.threaded._scope(split):
        split.advance()
    self._collect_finished()


def pin_to(splits, values) -> list:
  """``values`` (their traced arrays; literals pass) through a barrier with each of
  ``splits`` in turn."""
  traced = [i for i, v in enumerate(values) if isinstance(v, jax.Array)]
  pinned = [values[i] for i in traced]
  for split in splits:
    pinned = split.pin(pinned)
  values = list(values)
  for i, v in zip(traced, pinned):
    values[i] = v
  return values


def _nbytes(value) -> int:
  return math.prod(jnp.shape(value)) * jnp.result_type(value).itemsize


def communicates(name: str) -> bool:
  """A lax collective, a torus primitive or a Pallas kernel: ops that wait for other
  devices, so every device must run them in the same order relative to the split calls."""
  return name in inlining.COLLECTIVES or name.startswith("torus_") or name == "pallas_call"


def _read(env, atom):
  return atom.value if isinstance(atom, inlining.Literal) else env[atom]


def _evaluate(eqn, operands) -> list:
  params = eqn.primitive.get_bind_params(eqn.params)
  with jax_internals.equation_context(eqn):
    out = inlining.bind(eqn.primitive, operands, params)
  return list(out) if eqn.primitive.multiple_results else [out]
