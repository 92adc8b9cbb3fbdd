"""Gradient summation threaded through the backward pass: ``value_and_summed_grad``.

``all_reduce_gradients`` receives a finished gradient, so each bucket's collective can at
best be scheduled by XLA; a Pallas kernel call holds the TensorCore from its first DMA to
its last, and XLA places all of them after the backward pass (the whole transfer is
exposed). Here the backward pass itself is re-run equation by equation with the
collectives woven in, using the split kernels (``kernels.split_collectives``: a start,
per-hop steps and a done per ring phase, each a separate Pallas call that returns while
its DMAs are on the link):

1. ``jax.value_and_grad(fun)`` is traced to a jaxpr, and its calls (jit, custom_vjp, ...)
   are inlined (``inlining``), so every convolution and matmul of the backward pass is one
   equation of one flat program.
2. The gradient leaves are grouped into buckets exactly as ``all_reduce_gradients`` groups
   them (``packing.buckets_by_size``, in the order the program computes them: last layers
   first), except that the last bucket is cut at the last convolution or matmul
   (``_cut``): what only it produces (the first layer's kernel gradient) travels alone,
   since nothing is left to overlap it, and the rest of that bucket starts before it.
3. The equations are evaluated in program order. As soon as the equation that produces a
   bucket's last leaf has run, the bucket is packed into one flat buffer and its split
   all-reduce is started (its first call issued).
4. While collectives are in flight, the calls are tied to the backward pass by
   optimization barriers with the in-flight buffers (the async note's remedy;
   ``async_torus.pin``), which are data dependencies XLA cannot reorder:

   * *operand side*: each *pinned* equation (``PINNED``: a convolution or a matmul,
     ``HEAVY``, or a reduction such as a batch norm's sums) reads one operand less a zero
     that comes out of the barrier (``_after_last_call``), so it runs after the last call
     issued. Not the operand itself through the barrier: that would stop XLA fusing the
     operand's elementwise producers (the batch norm's scale, the ReLU mask, a pad) into
     the convolution, where the subtraction fuses with them. Nor a constant zero: XLA
     forwards a constant through a barrier before it schedules, and the pin is gone; the
     zero is ``min(axis index, 0)`` (``_opaque_zero``), which it cannot fold. The operand
     is one that computation produced, not an input only laid out for the convolution
     (the images, a flipped weight): those XLA lays out once for the forward and backward
     passes together.
   * *result side*: the *advance points* (``_advance_points``) are the equations that
     compute a gradient leaf from a pinned equation evaluated since the previous point (a
     weight gradient's convolution, a batch norm's scale and offset gradients): about
     three a layer. So every window holds work that cannot run before its first call:
     counting a leaf computed only from elementwise work as a point left windows that XLA
     had emptied by running that work earlier (the compiled figures are in the
     documentation's design log). At each, the leaf passes a barrier with
     the collectives in flight, so the next call waits for the window's work (the backward
     pass reads the leaf as computed: a batch norm's sums feed its input gradient, which
     the barrier would cut off from them), and each in-flight collective issues its next
     call if it is due: a collective with ``C`` calls left when it starts, ``T`` points
     before the end, issues ``j * C // T`` by its ``j``-th point. So its calls spread
     evenly over the windows left, one a window at most (two calls in one window would
     leave the first one's hop nothing to overlap), and the last is issued at the last
     point.

   Equations that communicate (lax collectives such as the batch norms' sums, the
   package's primitives, Pallas kernels) are pinned on both sides without advancing,
   and each bucket starts after the last of them so far, so their order relative to the
   split calls is the program's on every device (lax collectives keep program order
   among themselves, the Pallas calls too, but not relative to each other on a runtime
   that runs independent ops concurrently: the CPU interpreter); the value and aux come
   out of a barrier with the result.
5. After the last equation, the sums are unpacked, scaled (``mean``) and cast back to the
   leaves' dtypes. Without ``update``, the collectives still in flight first issue the
   calls they have left, one call of each in turn (so that their hops overlap one
   another's). With ``update`` (the optimizer's step), the unpacking and ``update`` are
   traced as one program, the *tail*, and evaluated unit by unit while those calls are
   issued (``_Tail``): whatever reads only finished buckets' sums runs between the calls
   of the buckets still in flight (its reads of parameters and optimizer state pinned
   after them), a large leaf's norms and its update in separate windows (``_units``), and
   each collective's calls spaced over the tail's work that can run before it is done, at
   the largest spacing that still gives every call a window (``_call_spacing``). The last
   buckets (the first layers' gradients, which start near the end of the backward pass)
   so overlap the update of every other layer instead of nothing. An ``update`` that
   reads every leaf at once (a global norm clip) has nothing ready early and runs after
   the last call, as without.

The same machinery threads weight-update sharding through a whole step
(``weight_update.threaded``): a ``Summation`` says how a bucket is packed and which split
collective sums it (here the all-reduce; there ``sharded_update``'s rows and a
reduce-scatter), and a ``Gathering`` makes program inputs (the parameters) arrive by split
all-gathers, two in flight at a time, each paced over the heavy equations before its
first read and finished at that read.

The result is that of ``jax.value_and_grad(fun)`` followed by
``all_reduce_gradients(grads, axis_name, mean=mean, bucket_bytes=bucket_bytes,
implementation=implementation)`` (and ``update`` of that): the same buckets, summed by
the same ring algorithm in float32 adds (the blocking kernels and the split streams cut
the buffer into chunks differently, so float sums may round differently; integers are
exact in both).

Assumptions and limits:

* ``implementation`` must have split collectives (``registry.CollectiveBackend
  .split_all_reduce``: today "pallas"). Any other implementation is run as
  ``value_and_grad`` followed by ``all_reduce_gradients``, unchanged (XLA's collectives are
  scheduled by XLA: ``torus_collectives.xla_settings``).
* "auto" runs what a whole-step tuning (``tuning.step_tuning.tune_step``) measured for
  this gradient tree (``registry.tuned_step``, keyed as ``all_reduce_gradients`` keys it): threaded
  where the measured implementation has split collectives, with the measured bucket size
  unless the caller gave one, since a ``make_step`` built on this function timed the
  threaded form; otherwise ``all_reduce_gradients(implementation="auto")``.
* Only the default transport (the leaves' own dtype); ``transport_dtype`` and error
  feedback go through ``all_reduce_gradients``.
* The pins and the packing still cost compute: by the compiler's estimate for ResNet-50
  on v5e:16x16 the threaded step computes more than the blocking one, and more than the
  transfer it hides, so it is not faster than XLA's default step (``bench.overlap_report
  --grad-overlap on``, against ``--implementation xla``; compiler estimates and the cost
  model, with the figures by op category in the documentation's design log). The costs:
  the batch norms' backward reductions run apart from the convolutions that the blocking
  step fuses them into, slices of the summed parts that the update writes out,
  concatenations of leaves cut from two stream parts, the cut of each packed bucket into
  its streams' parts, and elementwise work.
* The tail's windows are its units, one or more a window; a leaf's update pass is never
  split. ResNet-50's is a few large kernel updates beside many small scales; spaced
  evenly in bytes (``_call_spacing``), every call of the last buckets gets a window with
  work as traced (compiled, XLA can still leave one empty: one on v4 in
  ``tests/test_split_step_aot.py``), and a short window still exposes part of a long hop.
* The windows are counted, not timed: a hop longer than its window is partly exposed.
  Every bucket has the same number of calls whatever its size (two phases of ``n - 1``
  hops per axis), so one started with fewer points left than calls issues the rest
  back to back at the end, unless the tail's work takes them.
* Heavy equations inside a loop (``scan``, ``while``) or a ``cond`` are one equation here:
  a scanned model's backward pass gives one window, not one per layer.
* Every device must issue the calls in one order: one program under ``shard_map`` does;
  the pins chain all in-flight collectives, so even a runtime that runs independent ops
  concurrently (the CPU interpreter) keeps that order.
* Nothing here has run on a TPU: the threading is verified in TPU interpret mode (exact on
  integers against ``lax.psum`` of ``jax.grad``) and its schedule on ahead-of-time compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import _jax_internals as jax_internals
from torus_collectives import axes, inlining, packing, registry
from torus_collectives._vma import ensure_varying, mark_invariant
from torus_collectives.collectives import AxisName
from torus_collectives.gradients import (
  DEFAULT_BUCKET_BYTES,
  GRADIENT_SCOPE,
  WEIGHT_GATHER_SCOPE,
  all_reduce_gradients,
  summation_request,
)

# The equations whose work a window between two collective calls holds: the backward
# pass's convolutions and matmuls (everything else is cheap beside them).
HEAVY = frozenset({"conv_general_dilated", "dot_general"})
# Run after the last call issued (module doc, step 4): the heavy equations, and the
# reductions (a batch norm's sums in the backward pass), each of which reads a whole
# activation, work enough to cover a hop, and which XLA would otherwise run as early as
# it may. The advance points are the leaves computed from them.
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
PINNED = HEAVY | REDUCTIONS
# Equations that move no data of their own (XLA makes them bitcasts or fuses them).
LAYOUT = frozenset(
  "reshape squeeze expand_dims broadcast_in_dim convert_element_type transpose copy copy_p".split()
)
# Weight gathers in flight at once in the forward pass: the one the next layers read and
# the one after it. More would share the links with the gather needed next, so that it
# arrives later (a choice by that reasoning; the alternatives are not compared here).
GATHERS_IN_FLIGHT = 2
# What lays an input out for a convolution without computing on it (``_computed``).
LAID_OUT = LAYOUT | {"rev"}


@dataclasses.dataclass(frozen=True)
class Summation:
  """How the threaded backward pass sums one bucket of gradient leaves: ``pack`` (the
  leaves -> one flat buffer), ``start`` (the buffer -> its split collective, no call
  issued yet) and ``width`` (a leaf -> the length of its piece of the result, the pieces
  lying side by side in bucket order, padding after them)."""

  pack: Callable[[list[jax.Array]], jax.Array]
  start: Callable[[jax.Array], Any]
  width: Callable[[Any], int]


def all_reduced(split_all_reduce, names, sizes) -> Summation:
  """The all-reduce of ``value_and_summed_grad``: the leaves flattened side by side."""
  return Summation(
    pack=lambda leaves: ensure_varying(
      packing.pack([jnp.asarray(leaf).reshape(-1) for leaf in leaves]), names
    ),
    start=lambda flat: split_all_reduce(flat, names, sizes),
    width=lambda leaf: math.prod(leaf.shape),
  )


@dataclasses.dataclass(frozen=True)
class Gathering:
  """Program inputs that arrive by split all-gathers threaded through the forward pass
  (weight-update sharding's parameters, ``weight_update.threaded``).

  ``indices``: the flat arguments gathered (their values passed to ``run`` only stand in
  for their types); ``like``: their shapes and dtypes; ``calls``: the calls each split
  all-gather issues (its windows: ``_start_gathers``); ``pack``: leaf numbers (into
  ``like``) -> the flat buffer of this device's shards of them; ``start``: the buffer ->
  its split all-gather; ``unpack``: the leaf numbers and the finished collective's parts
  -> the whole leaves."""

  indices: tuple[int, ...]
  like: tuple[Any, ...]
  calls: int
  pack: Callable[[list[int]], jax.Array]
  start: Callable[[jax.Array], Any]
  unpack: Callable[[list[int], list[jax.Array]], list[jax.Array]]


def value_and_summed_grad(
  fun: Callable,
  axis_name: AxisName,
  *,
  mean: bool = True,
  bucket_bytes: int | None = None,
  implementation: str = "auto",
  has_aux: bool = False,
  update: Callable | None = None,
) -> Callable:
  """``jax.value_and_grad(fun, has_aux=has_aux)`` whose gradient comes back summed
  (``mean=False``) or averaged over ``axis_name``, each bucket's summation overlapping the
  rest of the backward pass (module doc). Call the returned function inside the
  ``shard_map`` over ``axis_name``; it differentiates with respect to the first argument.

  ``implementation``: ``"auto"`` (the default, as for every op) threads the summation only
  where a whole-step tuning (``tuning.step_tuning.tune_step``) measured a threaded
  implementation faster on this topology, and is otherwise ``value_and_grad`` then
  ``all_reduce_gradients(implementation="auto")``. An implementation with split kernels
  (``"pallas"``) always threads; one without (``"xla"``, ``"shard_map"``,
  ``"lax_torus"``) is ``value_and_grad`` then ``all_reduce_gradients`` with it. An unknown
  name raises ``ValueError`` listing the known ones.

  ``mean``: average (the default) or sum. ``bucket_bytes``: the largest bucket a summation
  call carries (``all_reduce_gradients``'s). ``has_aux``: as ``jax.value_and_grad``'s.

  ``update``: a function of the summed gradient (the optimizer's step, say:
  ``lambda g: tx.update(g, opt_state, params)``); the returned function then gives
  ``(value, update(grads))``, and the work of every leaf whose bucket is complete runs
  between the calls of the buckets still in flight (module doc, step 5).
  """
  grad_fn = jax.value_and_grad(fun, has_aux=has_aux)
  then = (lambda grads: grads) if update is None else update

  def run(params, *args):
    registry.check_name(implementation)
    if implementation != "auto" and _split_all_reduce(implementation) is None:
      value, grads = grad_fn(params, *args)
      return value, then(
        all_reduce_gradients(
          grads, axis_name, mean=mean, bucket_bytes=bucket_bytes, implementation=implementation
        )
      )
    names = axes.names(axis_name)
    sizes = tuple(lax.axis_size(a) for a in names)
    closed, (value_shapes, grad_shapes) = jax.make_jaxpr(grad_fn, return_shape=True)(params, *args)
    grad_leaves, grad_tree = jax.tree.flatten(grad_shapes)
    chosen, chosen_bucket = implementation, bucket_bytes
    if implementation == "auto":  # threaded where a whole-step tuning measured it so
      step = registry.tuned_step(summation_request(grad_leaves, sizes))
      chosen, tuned_bucket = step or ("auto", None)
      chosen_bucket = tuned_bucket if bucket_bytes is None else bucket_bytes
    split_all_reduce = _split_all_reduce(chosen)
    if split_all_reduce is None:
      value, grads = grad_fn(params, *args)
      return value, then(
        all_reduce_gradients(
          grads, axis_name, mean=mean, bucket_bytes=chosen_bucket, implementation=chosen
        )
      )
    scale = 1.0 / math.prod(sizes) if mean else 1.0

    def gradient_then(summed):  # the summed leaves, flat -> then(the gradient tree)
      grads = [
        (mark_invariant(s.reshape(leaf.shape), names).astype(jnp.float32) * scale).astype(
          leaf.dtype
        )
        for s, leaf in zip(summed, grad_leaves)
      ]
      return then(jax.tree.unflatten(grad_tree, grads))

    summation = all_reduced(split_all_reduce, names, sizes)
    threaded = _Threaded(summation, names, sizes, chosen_bucket or DEFAULT_BUCKET_BYTES)
    flat_args = jax.tree.leaves((params, *args))
    value_leaves, result = threaded.run(closed, flat_args, grad_leaves, gradient_then, update)
    return jax.tree.unflatten(jax.tree.structure(value_shapes), value_leaves), result

  return run


def _split_all_reduce(implementation: str):
  """The split all-reduce of a concrete ``implementation``, or None where it has none
  (then the summation is ``all_reduce_gradients`` after the backward pass)."""
  if implementation == "auto" or registry.runs_lax(implementation):
    return None
  return registry.collective_backend(implementation).split_all_reduce


class _Threaded:
  """The re-evaluation of one traced ``value_and_grad`` with summation woven in."""

  def __init__(
    self, summation: Summation, names, sizes, bucket_bytes: int, gathering: Gathering | None = None
  ):
    self.summation, self.names, self.sizes = summation, names, sizes
    self.bucket_bytes = bucket_bytes
    self.gathering = gathering
    self.in_flight: list[tuple[list[int], Any]] = []  # (leaf indices, SplitCollective)
    # The gathers not finished yet: (leaf numbers into ``gathering.like``, SplitCollective).
    self.gathers: list[tuple[list[int], Any]] = []
    self.pending: list[tuple[list[int], int]] = []  # gathers not started: (bucket, first read)
    self.gathers_started = 0
    self.heavy: list[int] = []  # the positions of the heavy equations (set by ``run``)
    self.scopes: dict[int, tuple[str, int]] = {}  # id(split) -> (its scope, its start order)
    self.last_communicated: list[jax.Array] = []  # results of the last such equation
    self.points: list[int] = []  # the advance points (``_advance_points``)
    self.pacing: dict[int, tuple[int, list[int]]] = {}  # split -> (calls left, its points)
    self.zero: jax.Array | None = None  # what pinned zeros come from (``_opaque_zero``)

  @contextlib.contextmanager
  def _scope(self, split):
    """The named scopes of a bucket's calls: the summation's (or the weight gather's),
    then ``bucket_<k>`` (``k`` its start order among them), by which
    ``bench.hlo_schedule`` tells one bucket's calls apart."""
    scope, k = self.scopes[id(split)]
    with jax.named_scope(scope), jax.named_scope(f"bucket_{k}"):
      yield

  def _flying(self) -> list:
    """Every collective started so far whose result a barrier still ties to (module doc,
    step 4): the summations (finished ones too), and the gathers not yet finished."""
    return [split for _, split in self.in_flight] + [split for _, split in self.gathers]

  def run(self, closed, flat_args, grad_leaves, gradient_then, update) -> tuple[list, Any]:
    """(the value's leaves, ``gradient_then(the summed gradient leaves)``) of the traced
    program; ``update`` given, ``gradient_then``'s work is threaded too (``_Tail``)."""
    counter = itertools.count()
    constants: dict[int, Any] = {}
    in_keys = [next(counter) for _ in flat_args]
    eqns, outs = inlining.inline(closed.jaxpr, closed.consts, in_keys, counter, constants)
    self.zero = _opaque_zero(self.names)
    self.heavy = [i for i, item in enumerate(eqns) if item.eqn.primitive.name in HEAVY]
    gathered = self._start_gathers(eqns, in_keys)  # input key -> (leaf number, bucket)
    env: dict[Any, Any] = {
      **constants,
      **{k: v for k, v in zip(in_keys, flat_args) if k not in gathered},
    }
    split_at = len(outs) - len(grad_leaves)
    value_atoms, grad_atoms = outs[:split_at], outs[split_at:]
    produced_at = {key: position for position, item in enumerate(eqns) for key in item.outs}
    producer = {key: item for item in eqns for key in item.outs}
    where = [produced_at.get(a, -1) if isinstance(a, int) else -1 for a in grad_atoms]
    order = sorted(range(len(grad_atoms)), key=lambda i: (where[i], i))
    buckets = packing.buckets_by_size(grad_leaves, self.bucket_bytes, order)
    if buckets and self.heavy:  # what exists only after the last heavy equation travels alone
      buckets[-1:] = _cut(buckets[-1], where, self.heavy[-1])
    # The position of the equation after which each bucket's last leaf exists (-1: before any).
    ready_after = [max(where[i] for i in bucket) for bucket in buckets]

    def gradient(i):
      return _read(env, grad_atoms[i])

    leaf_keys = {a for a in grad_atoms if isinstance(a, int)}
    first_start = min(ready_after, default=len(eqns))
    self.points = _advance_points(eqns, leaf_keys, first_start)
    points = set(self.points)
    self._start_ready(buckets, ready_after, -1, gradient)
    for position, item in enumerate(eqns):
      self._finish_gathers_read(position, item, gathered, env)
      operands = [_read(env, atom) for atom in item.ins]
      name = item.eqn.primitive.name
      flying = bool(self._flying())
      communicates = flying and _communicates(name)
      if communicates:
        operands = self._pin(operands)
      elif flying and name in PINNED:
        operands = self._after_last_call(item, operands, producer)
      results = _evaluate(item.eqn, operands)
      if communicates:
        results = self._pin(results)
      if position in points or (self.gathers and name in HEAVY):
        self._pin(results)  # for the next call's sake: the window's consumers read them unpinned
        self._advance_due(position)
      if _communicates(name):
        self.last_communicated = [r for r in results if isinstance(r, jax.Array)]
      env.update(zip(item.outs, results))
      self._start_ready(buckets, ready_after, position, gradient)
    while self.gathers:  # inputs never read: their gathers still complete
      first_leaf = self.gathers[0][0][0]
      self._finish_gather(gathered, in_keys[self.gathering.indices[first_leaf]], env, len(eqns))
    result = self._result(grad_leaves, gradient_then, update is not None)
    # The value and aux come out of a barrier with the result, so that what the caller
    # computes from them (its metrics' collectives, say) runs after the last call.
    leaves, tree = jax.tree.flatten(result)
    value, leaves = lax.optimization_barrier(([_read(env, a) for a in value_atoms], leaves))
    return value, jax.tree.unflatten(tree, leaves)

  def _result(self, grad_leaves, gradient_then, threaded: bool):
    """``gradient_then`` of the summed leaves: after every call (``_finish_in_turn``), or
    (``threaded``) evaluated while the buckets still in flight issue theirs (``_Tail``)."""
    widths = [
      [self.summation.width(grad_leaves[i]) for i in bucket] for bucket, _ in self.in_flight
    ]

    def tail(*parts):  # the buckets' sums' parts, in start order -> gradient_then(leaves)
      summed: dict[int, jax.Array] = {}
      for (bucket, _), bucket_parts, sizes in zip(self.in_flight, parts, widths):
        summed.update(zip(bucket, packing.unpack_parts(bucket_parts, sizes)))
      return gradient_then([summed[i] for i in range(len(grad_leaves))])

    if threaded:
      return _Tail(self, tail).run()
    self._finish_in_turn()
    parts = []
    for _, split in self.in_flight:
      with self._scope(split):
        parts.append(split.finish_parts())
    return tail(*parts)

  def _start_ready(self, buckets, ready_after, position, gradient) -> None:
    """Starts the split all-reduce of every bucket whose last leaf ``position`` produced."""
    for bucket, ready in zip(buckets, ready_after):
      if ready != position:
        continue
      with jax.named_scope(GRADIENT_SCOPE):
        flat = self.summation.pack([gradient(i) for i in bucket])
        # After every communicating equation so far (they run in program order among
        # themselves; the split calls, in program order among themselves, follow them).
        flat, _ = lax.optimization_barrier((flat, self.last_communicated))
        split = self.summation.start(flat)
      self.scopes[id(split)] = (GRADIENT_SCOPE, len(self.in_flight))
      self.in_flight.append((bucket, split))
      if split.calls_left:
        with self._scope(split):
          split.advance()
      self.pacing[id(split)] = (split.calls_left, [p for p in self.points if p > position])

  def _pin(self, values):
    """``values`` (their traced arrays; literals pass) through a barrier with each
    collective ``_flying``, in start order."""
    return _pin_to(self._flying(), values)

  def _start_gathers(self, eqns, in_keys) -> dict[int, tuple[int, list[int]]]:
    """Buckets the gathered inputs in the order the program first reads the leaves (the
    forward pass's: first layers first) and starts the split all-gathers of the first
    ``GATHERS_IN_FLIGHT`` (``_start_next_gather``); each later one starts when the one
    ``GATHERS_IN_FLIGHT`` before it is finished, at its first read (``_finish_gather``).
    Returns each gathered input's key -> (leaf number, bucket)."""
    if self.gathering is None:
      return {}
    keys = [in_keys[i] for i in self.gathering.indices]
    first_read = {}
    for position, item in enumerate(eqns):
      for atom in item.ins:
        if isinstance(atom, int):
          first_read.setdefault(atom, position)
    never = len(eqns)
    reads = [first_read.get(k, never) for k in keys]
    order = sorted(range(len(keys)), key=lambda i: (reads[i], i))
    heavy = self.heavy
    # What is read by the first heavy equations, before a gather's calls could have a
    # window each, is gathered first, whole (one dtype per bucket): its calls are issued
    # back to back at its first read, so it is the exposed part; every later bucket has
    # as many heavy equations before its first read as it has calls.
    boundary = heavy[min(self.gathering.calls, len(heavy)) - 1] + 1 if heavy else 0
    early = [i for i in order if reads[i] < boundary]
    late = [i for i in order if reads[i] >= boundary]
    buckets = _buckets_of(early, self.gathering.like, math.inf)
    buckets += _buckets_of(late, self.gathering.like, self.bucket_bytes)
    self.pending = [(bucket, min(reads[i] for i in bucket)) for bucket in buckets]
    for _ in range(GATHERS_IN_FLIGHT):
      self._start_next_gather(-1)
    return {keys[i]: (i, bucket) for bucket in buckets for i in bucket}

  def _start_next_gather(self, position: int) -> None:
    """Starts the next bucket's split all-gather before the equation at ``position``,
    after every gather started so far (a barrier: one order on every device), and issues
    its first call; its others are paced over the heavy equations from ``position`` to
    its first read (``_advance_due``), the rest issued at that read."""
    if not self.pending:
      return
    bucket, needed = self.pending.pop(0)
    with jax.named_scope(WEIGHT_GATHER_SCOPE):
      (flat,) = self._pin([self.gathering.pack(bucket)])
      split = self.gathering.start(flat)
    self.scopes[id(split)] = (WEIGHT_GATHER_SCOPE, self.gathers_started)
    self.gathers_started += 1
    self.gathers.append((bucket, split))
    with self._scope(split):
      split.advance()
    points = [h for h in self.heavy if position <= h < needed]
    self.pacing[id(split)] = (split.calls_left, points)

  def _finish_gathers_read(self, position, item, gathered, env) -> None:
    """Finishes the gather of every gathered input that ``item`` (at ``position``) reads
    first."""
    for atom in item.ins:
      if isinstance(atom, int) and atom in gathered and atom not in env:
        self._finish_gather(gathered, atom, env, position)

  def _finish_gather(self, gathered, key, env, position: int) -> None:
    """Issues the calls left of the gather holding input ``key``; its leaves enter ``env``."""
    _, bucket = gathered[key]
    while not any(b is bucket for b, _ in self.gathers):  # read before its turn
      self._start_next_gather(position)
    k = next(k for k, (b, _) in enumerate(self.gathers) if b is bucket)
    _, split = self.gathers.pop(k)
    with self._scope(split):
      leaves = self.gathering.unpack(bucket, split.finish_parts())
    keys = {i: k for k, (i, _) in gathered.items()}
    env.update((keys[i], leaf) for i, leaf in zip(bucket, leaves))
    self._start_next_gather(position)

  def _after_last_call(self, item, operands, producer):
    """The pinned equation ``item``'s operands, one of them less a zero that comes out of
    a barrier with the collectives in flight: the equation then cannot run before the
    last call issued, yet XLA still fuses the operand's producers (the batch norm's
    scale, the ReLU mask, a pad) and the subtraction into the convolution, as a barrier
    on the operand itself would not let it. ``x - 0`` is ``x`` exactly for every float
    (``-0`` and NaN included) and integer.

    The operand is the smallest one that computation produced (``_computed``), not an
    input moved into place by layout equations: a program input (the images) or a
    weight cast and flipped for a transposed convolution is laid out for the convolution
    once and shared with the forward pass, and less a zero it would be copied again
    (seen for the images in a v5e compile). Failing that, the smallest
    operand."""
    traced = [i for i, v in enumerate(operands) if isinstance(v, jax.Array)]
    if not traced:
      return operands
    computed = [i for i in traced if _computed(item.ins[i], producer)]
    i = min(computed or traced, key=lambda k: _nbytes(operands[k]))
    operands = list(operands)
    operands[i] = _plus_zero(operands[i], self._pin([self.zero])[0])
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
    collective that is due. A collective started with ``C`` calls left before ``T``
    points has issued ``j * C // T`` of them by its ``j``-th point: its calls spread
    evenly over the windows left, one call a window at most (two calls in one window
    would leave the first one's hop nothing to overlap)."""
    for split in self._flying():
      calls, points = self.pacing[id(split)]
      passed = sum(1 for p in points if p <= position)
      if split.calls_left and calls - split.calls_left < passed * calls // max(len(points), 1):
        with self._scope(split):
          split.advance()


def _opaque_zero(axis_names) -> jax.Array:
  """An int32 zero that XLA cannot prove is one: ``min(axis index, 0)``, typed invariant
  over ``axis_names`` (it is 0 on every device). A constant zero through a barrier does
  not pin what reads it: XLA forwards constants through an ``optimization_barrier`` before
  it schedules (checked on a v5e compile: the reader got the constant and the barrier no
  longer ordered it, ``tests/test_split_step_aot.py``)."""
  return mark_invariant(jnp.minimum(lax.axis_index(axis_names), 0), tuple(axis_names))


def _plus_zero(value, zero):
  """``value`` less ``zero`` (an int32 zero, ``_opaque_zero``, out of a barrier; or with it
  for booleans): ``value`` exactly, for every float (``-0`` and NaN included) and integer,
  but computed from ``zero``, so XLA cannot run its reader before that barrier's calls."""
  if value.dtype == jnp.bool_:
    return value | zero.astype(jnp.bool_)
  return value - zero.astype(value.dtype)


def _buckets_of(indices: list[int], leaves, bucket_bytes) -> list[list[int]]:
  """``packing.buckets_by_size`` of the ``leaves`` at ``indices``, filled in that order."""
  chosen = [leaves[i] for i in indices]
  buckets = packing.buckets_by_size(chosen, bucket_bytes, range(len(indices)))
  return [[indices[j] for j in bucket] for bucket in buckets]


def _cut(bucket: list[int], positions, boundary: int) -> list[list[int]]:
  """``bucket`` cut in two: its leaves whose ``positions`` lie before ``boundary``, then
  the others (either part left out when empty). The summation's last bucket is cut at
  the last heavy equation, so that the part with nothing to overlap (the first layer's
  gradients, produced by the last backward convolution) is only what must be: a full
  bucket there would be exposed whole."""
  before = [i for i in bucket if positions[i] < boundary]
  after = [i for i in bucket if positions[i] >= boundary]
  return [part for part in (before, after) if part]


def _advance_points(eqns, leaf_keys, first_start: int) -> list[int]:
  """The positions after ``first_start`` of the equations that compute a gradient leaf
  from a ``PINNED`` equation evaluated since the previous such position (directly, or
  through what derives from it): where the calls may advance, so that each window
  between two of them holds work that runs after its first call."""
  window: set[int] = set()
  points = []
  for position, item in enumerate(eqns):
    if position <= first_start:
      continue
    if item.eqn.primitive.name in PINNED or any(
      isinstance(a, int) and a in window for a in item.ins
    ):
      window.update(item.outs)
      if any(k in leaf_keys for k in item.outs):
        points.append(position)
        window.clear()
  return points


def _computed(key, producer) -> bool:
  """Whether ``key`` is computed by an equation other than a layout change (``LAID_OUT``),
  through any such changes: not a program input or constant moved into place."""
  item = producer.get(key) if isinstance(key, int) else None
  while item is not None and item.eqn.primitive.name in LAID_OUT:
    key = item.ins[0]
    item = producer.get(key) if isinstance(key, int) else None
  return item is not None


class _Tail:
  """The work after the backward pass (``tail``: a function of the buckets' sums, in start
  order), traced and evaluated while the buckets still in flight issue their calls
  (module doc, step 5).

  The tail is evaluated unit by unit (``_units``), in the order it returns its outputs: a
  unit is an output (a parameter's new value, with the optimizer state leaves its update
  computes whole) or the reductions in an output's cone (a trust ratio's norms), so that a
  large leaf's update gives two windows. A unit's *cone*, the equations it needs that have
  not run yet, is evaluated in one window, once every bucket sum it reads exists. So a
  leaf's update chain stays in one window and fuses. The cone's reads of the tail's inputs
  from outside the window (the parameters and the optimizer state) are pinned after the
  collectives' last call (``_read``); the buckets' sums, out of their done calls, and what
  earlier windows computed, are ordered already. Each collective in flight issues its next
  call once the work evaluated since its last one reaches its spacing (``_call_spacing``),
  after a barrier with the window's outputs; a new window opens whenever one does. A
  collective with no calls left is finished, and the units that read its sum become ready;
  when a pass finds no unit ready, the collective with the fewest calls left issues one.
  """

  def __init__(self, threaded: _Threaded, tail: Callable):
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
    self.units = _units(self.eqns, outputs, producer)
    self.cones = {
      unit: sorted({i for key in unit for i in _cone(key, self.eqns, producer)})
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
    self.work = _unit_work(self.eqns, self.units, self.cones, producer)
    calls_left = [split.calls_left for _, split in threaded.in_flight]
    work = [self.work[unit] for unit in self.units]
    self.spacing = _call_spacing(work, needs, calls_left)
    self.since = [0.0] * len(calls_left)  # of it, since each collective's last call
    self.window: dict[Any, Any] = {}  # keys computed or pinned in the current window
    self.zero: jax.Array | None = None  # the window's pinned zero (``_opaque_zero``)
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
    """Evaluates the cone of ``unit`` (``_units``: one output, or the reductions of one)
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
    communicates = bool(flying) and _communicates(item.eqn.primitive.name)
    if communicates:  # in one order with the split calls on every device
      operands = _pin_to(flying, operands)
    results = _evaluate(item.eqn, operands)
    if communicates:
      results = _pin_to(flying, results)
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
      (self.window[atom],) = _pin_to(flying, [value])
      return self.window[atom]
    if self.zero is None:
      (self.zero,) = _pin_to(flying, [self.threaded.zero])
    self.window[atom] = _plus_zero(value, self.zero)
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
      _pin_to(splits, self.window_outputs)
    self.window.clear()
    self.zero = None
    self.window_outputs = []
    for c, split in zip(due, splits):
      self.since[c] = 0.0
      with self.threaded._scope(split):
        split.advance()
    self._collect_finished()


def _units(eqns, outputs, producer) -> list[tuple[int, ...]]:
  """What the tail evaluates one at a time, in the order it returns its ``outputs``: each
  output, after the reductions in its cone that no earlier unit holds (together, one unit:
  XLA fuses the reductions of one leaf, a trust ratio's two norms, into one pass). A
  reduction's scalar result cannot fuse into the elementwise work that reads it, so the
  window can close between them at no cost, and a large leaf's update (one norm pass, one
  update pass) gives two windows, not one. An output that earlier units compute whole (a
  momentum, computed for its parameter's update) joins the last of them, in the same
  window, where XLA computes both in one pass."""
  units: list[tuple[int, ...]] = []
  claimed: set[int] = set()
  unit_of: dict[int, int] = {}  # equation -> the unit that computes it
  for key in outputs:
    cone = _cone(key, eqns, producer)
    if all(i in unit_of for i in cone):
      last = max(unit_of[i] for i in cone)
      units[last] += (key,)
      continue
    reductions = [
      i
      for i in cone
      if i not in claimed and eqns[i].eqn.primitive.name in REDUCTIONS and eqns[i].outs[0] != key
    ]
    claimed.update(reductions)
    if reductions:
      units.append(tuple(eqns[i].outs[0] for i in reductions))
      for i in {j for r in reductions for j in _cone(eqns[r].outs[0], eqns, producer)}:
        unit_of.setdefault(i, len(units) - 1)
    units.append((key,))
    for i in cone:
      unit_of.setdefault(i, len(units) - 1)
  return units


def _unit_work(eqns, units, cones, producer) -> dict[tuple[int, ...], float]:
  """Each unit's work, for spacing the calls: the bytes its keys hold, a reduction's those
  of the array it reduces, where its cone holds an equation no earlier unit's does (the
  momentum an update's cone computed holds none: it is done by then), else 0."""
  avals = {k: v.aval for item in eqns for k, v in zip(item.outs, item.eqn.outvars)}

  def nbytes(key):
    item = eqns[producer[key]]
    if item.eqn.primitive.name in REDUCTIONS:
      aval = item.eqn.invars[0].aval
    else:
      aval = avals[key]
    return math.prod(aval.shape) * aval.dtype.itemsize

  seen: set[int] = set()
  work = {}
  for unit in units:
    fresh = set(cones[unit]) - seen
    seen |= fresh
    work[unit] = float(sum(nbytes(key) for key in unit)) if fresh else 0.0
  return work


def _cone(key, eqns, producer) -> list[int]:
  """The positions of the equations ``key`` is computed from, in program order."""
  found, stack = set(), [key]
  while stack:
    i = producer.get(stack.pop())
    if i is None or i in found:
      continue
    found.add(i)
    stack.extend(a for a in eqns[i].ins if isinstance(a, int))
  return sorted(found)


def _call_spacing(unit_work, unit_needs, calls_left) -> list[float]:
  """The tail's work (``_unit_work``) that each collective in flight lets pass between
  two of its calls.

  The collectives are taken to finish in the order of their calls left (fewest first).
  What can cover collective ``c``'s calls is the units that need none of the sums of
  ``c`` and of the collectives finishing after it (``unit_needs``: the collectives'
  indices each unit reads), evaluated in their order. Their work is lumpy (a convolution
  kernel's update beside a batch norm scale's), so the spacing is fitted to it
  (``_fitted_spacing``): the largest that still closes a window for each of ``c``'s
  calls, so that none is left to issue back to back after that work. 1 (a call after
  every unit with work) where nothing can cover them; infinite for a collective with no
  calls left."""
  order = sorted(range(len(calls_left)), key=lambda i: calls_left[i])
  spacing = [math.inf] * len(calls_left)
  for rank, c in enumerate(order):
    if not calls_left[c]:
      continue
    later = set(order[rank:])
    free = [w for w, needs in zip(unit_work, unit_needs) if w and not needs & later]
    spacing[c] = _fitted_spacing(free, calls_left[c])
  return spacing


def _fitted_spacing(work: list[float], windows: int) -> float:
  """The largest spacing at which ``work`` (positive, in order) closes at least
  ``windows`` windows, a window closing once the work in it reaches the spacing; the
  smallest of ``work`` where even that closes fewer (one window a unit), 1 where there is
  none. Found by bisection: fewer windows close the larger the spacing."""
  if not work:
    return 1.0
  low, high = min(work), sum(work)
  if _windows_closed(work, low) < windows:
    return low
  if _windows_closed(work, high) >= windows:
    return high
  for _ in range(60):  # low closes enough windows, high too few
    middle = (low + high) / 2
    low, high = (middle, high) if _windows_closed(work, middle) >= windows else (low, middle)
  return low


def _windows_closed(work: list[float], spacing: float) -> int:
  """How many windows ``work`` (in order) closes at ``spacing``: a window closes once the
  work in it reaches the spacing (what is left after the last is no window)."""
  count, since = 0, 0.0
  for w in work:
    since += w
    if since >= spacing:
      count, since = count + 1, 0.0
  return count


def _pin_to(splits, values) -> list:
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


def _communicates(name: str) -> bool:
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
