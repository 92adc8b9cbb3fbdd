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
   first).
3. The equations are evaluated in program order. As soon as the equation that produces a
   bucket's last leaf has run, the bucket is packed into one flat buffer and its split
   all-reduce is started (its first call issued).
4. Around every *heavy* equation (``HEAVY``: a convolution or a matmul) while collectives
   are in flight, the equation's operands pass through an optimization barrier with each
   in-flight buffer (so it runs after the last call issued), its results through another
   (so the next call waits for it), and then every in-flight collective issues its next
   call. So each window between two calls of a collective holds one backward
   convolution's work: XLA cannot move it out, because the barriers are data
   dependencies (the async note's remedy; ``async_torus.pin``). Equations that
   communicate (lax collectives such as the batch norms' sums, the package's primitives,
   Pallas kernels) are pinned the same way without advancing, and each bucket starts
   after the last of them so far, so their order relative to the split calls is the
   program's on every device (lax collectives keep program order among themselves, the
   Pallas calls too, but not relative to each other on a runtime that runs independent
   ops concurrently: the CPU interpreter); the value and aux come out of a barrier with
   the final sums.
5. After the last equation, every collective still in flight issues the calls it has
   left; the sums are unpacked, scaled (``mean``) and cast back to the leaves' dtypes.

The result is that of ``jax.value_and_grad(fun)`` followed by
``all_reduce_gradients(grads, axis_name, mean=mean, bucket_bytes=bucket_bytes,
implementation=implementation)``: the same buckets, summed by the same ring algorithm in
float32 adds (the blocking kernels and the split streams cut the buffer into chunks
differently, so float sums may round differently; integers are exact in both).

Assumptions and limits:

* ``implementation`` must have split collectives (``registry.CollectiveBackend
  .split_all_reduce``: today "pallas"). Any other implementation is run as
  ``value_and_grad`` followed by ``all_reduce_gradients``, unchanged (XLA's collectives are
  scheduled by XLA: ``torus_collectives.xla_settings``).
* Only the default transport (the leaves' own dtype); ``transport_dtype`` and error
  feedback go through ``all_reduce_gradients``.
* The pins cost fusion: XLA cannot fuse a pinned convolution with its producers and
  consumers, and by the compiler's estimate a ResNet-50 step on v5e:16x16 computes for
  30.7 ms instead of 20.8 ms, more than the exposed communication saved
  (``bench.overlap_report --grad-overlap on``). Pinning only the gradient leaves (which are
  materialized anyway) costs little, but leaves XLA free to hoist the backward compute
  before the calls, so it was not adopted. Until a pin that costs no fusion exists,
  threading is a schedule to measure, not a speed-up.
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
  all_reduce_gradients,
)

# The equations whose work a window between two collective calls holds: the backward
# pass's convolutions and matmuls (everything else is cheap beside them).
HEAVY = frozenset({"conv_general_dilated", "dot_general"})


def value_and_summed_grad(
  fun: Callable,
  axis_name: AxisName,
  *,
  mean: bool = True,
  bucket_bytes: int | None = None,
  implementation: str = "pallas",
  has_aux: bool = False,
) -> Callable:
  """``jax.value_and_grad(fun, has_aux=has_aux)`` whose gradient comes back summed
  (``mean=False``) or averaged over ``axis_name``, each bucket's summation overlapping the
  rest of the backward pass (module doc). Call the returned function inside the
  ``shard_map`` over ``axis_name``; it differentiates with respect to the first argument.
  """
  grad_fn = jax.value_and_grad(fun, has_aux=has_aux)

  def run(params, *args):
    registry.check_name(implementation)
    if implementation == "auto" or registry.runs_lax(implementation):
      split_all_reduce = None
    else:
      split_all_reduce = registry.collective_backend(implementation).split_all_reduce
    if split_all_reduce is None:
      value, grads = grad_fn(params, *args)
      return value, all_reduce_gradients(
        grads, axis_name, mean=mean, bucket_bytes=bucket_bytes, implementation=implementation
      )
    names = axes.names(axis_name)
    sizes = tuple(lax.axis_size(a) for a in names)
    closed, (value_shapes, grad_shapes) = jax.make_jaxpr(grad_fn, return_shape=True)(params, *args)
    grad_leaves, grad_tree = jax.tree.flatten(grad_shapes)
    threaded = _Threaded(split_all_reduce, names, sizes, bucket_bytes or DEFAULT_BUCKET_BYTES)
    value_leaves, summed = threaded.run(closed, jax.tree.leaves((params, *args)), grad_leaves)
    scale = 1.0 / math.prod(sizes) if mean else 1.0
    grads = [
      (s.astype(jnp.float32) * scale).astype(leaf.dtype) for s, leaf in zip(summed, grad_leaves)
    ]
    value = jax.tree.unflatten(jax.tree.structure(value_shapes), value_leaves)
    return value, jax.tree.unflatten(grad_tree, grads)

  return run


class _Threaded:
  """The re-evaluation of one traced ``value_and_grad`` with summation woven in."""

  def __init__(self, split_all_reduce, names, sizes, bucket_bytes: int):
    self.split_all_reduce, self.names, self.sizes = split_all_reduce, names, sizes
    self.bucket_bytes = bucket_bytes
    self.in_flight: list[tuple[list[int], Any]] = []  # (leaf indices, SplitCollective)
    self.last_communicated: list[jax.Array] = []  # results of the last such equation

  @contextlib.contextmanager
  def _scope(self, split):
    """The named scopes of a bucket's calls: the summation's, then ``bucket_<k>`` (``k``
    its start order), by which ``bench.hlo_schedule`` tells one bucket's calls apart."""
    k = next(i for i, (_, s) in enumerate(self.in_flight) if s is split)
    with jax.named_scope(GRADIENT_SCOPE), jax.named_scope(f"bucket_{k}"):
      yield

  def run(self, closed, flat_args, grad_leaves) -> tuple[list, list[jax.Array]]:
    """(the value's leaves, the summed gradient leaves, flat) of the traced program."""
    counter = itertools.count()
    constants: dict[int, Any] = {}
    in_keys = [next(counter) for _ in flat_args]
    eqns, outs = inlining.inline(closed.jaxpr, closed.consts, in_keys, counter, constants)
    env: dict[Any, Any] = {**constants, **dict(zip(in_keys, flat_args))}
    split_at = len(outs) - len(grad_leaves)
    value_atoms, grad_atoms = outs[:split_at], outs[split_at:]
    produced_at = {key: position for position, item in enumerate(eqns) for key in item.outs}
    where = [produced_at.get(a, -1) if isinstance(a, int) else -1 for a in grad_atoms]
    order = sorted(range(len(grad_atoms)), key=lambda i: (where[i], i))
    buckets = packing.buckets_by_size(grad_leaves, self.bucket_bytes, order)
    # The position of the equation after which each bucket's last leaf exists (-1: before any).
    ready_after = [max(where[i] for i in bucket) for bucket in buckets]

    def gradient(i):
      return _read(env, grad_atoms[i])

    self._start_ready(buckets, ready_after, -1, gradient)
    for position, item in enumerate(eqns):
      operands = [_read(env, atom) for atom in item.ins]
      name = item.eqn.primitive.name
      pinned = self.in_flight and (name in HEAVY or _communicates(name))
      if pinned:
        operands = self._pin(operands)
      results = _evaluate(item.eqn, operands)
      if pinned:
        results = self._pin(results)
        if name in HEAVY:
          self._advance()
      if _communicates(name):
        self.last_communicated = [r for r in results if isinstance(r, jax.Array)]
      env.update(zip(item.outs, results))
      self._start_ready(buckets, ready_after, position, gradient)
    summed: dict[int, jax.Array] = {}
    for bucket, split in self.in_flight:
      with self._scope(split):
        sizes = [math.prod(grad_leaves[i].shape) for i in bucket]
        parts = packing.unpack(split.finish(), sizes)
      summed.update(zip(bucket, parts))
    reduced = [
      mark_invariant(summed[i].reshape(leaf.shape), self.names)
      for i, leaf in enumerate(grad_leaves)
    ]
    # The value and aux come out of a barrier with the sums, so that what the caller
    # computes from them (its metrics' collectives, say) runs after the last call.
    value, reduced = lax.optimization_barrier(([_read(env, a) for a in value_atoms], reduced))
    return value, reduced

  def _start_ready(self, buckets, ready_after, position, gradient) -> None:
    """Starts the split all-reduce of every bucket whose last leaf ``position`` produced."""
    for bucket, ready in zip(buckets, ready_after):
      if ready != position:
        continue
      with jax.named_scope(GRADIENT_SCOPE):
        leaves = [jnp.asarray(gradient(i)).reshape(-1) for i in bucket]
        flat = ensure_varying(packing.pack(leaves), self.names)
        # After every communicating equation so far (they run in program order among
        # themselves; the split calls, in program order among themselves, follow them).
        flat, _ = lax.optimization_barrier((flat, self.last_communicated))
        split = self.split_all_reduce(flat, self.names, self.sizes)
      self.in_flight.append((bucket, split))
      if split.calls_left:
        with self._scope(split):
          split.advance()

  def _pin(self, values):
    """``values`` (their traced arrays; literals pass) through a barrier with each
    collective started so far (finished ones too: with their result), in start order."""
    traced = [i for i, v in enumerate(values) if isinstance(v, jax.Array)]
    pinned = [values[i] for i in traced]
    for _, split in self.in_flight:
      pinned = split.pin(pinned)
    values = list(values)
    for i, v in zip(traced, pinned):
      values[i] = v
    return values

  def _advance(self) -> None:
    for _, split in self.in_flight:
      if split.calls_left:
        with self._scope(split):
          split.advance()


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
