"""Gradient summation threaded through the backward pass: ``value_and_summed_grad``
(experimental: it may change or go without a deprecation period).

Three modules: ``plan`` computes every decision from the traced program (a frozen, printable
``plan.Plan``: the buckets, the cut, where each starts, what is pinned, the advance points),
``executor`` runs a plan, and this module is the public function.

``all_reduce_gradients`` receives a finished gradient, so each bucket's collective can at
best be scheduled by XLA; a Pallas kernel call holds the TensorCore from its first DMA to
its last, and XLA places all of them after the backward pass (the whole transfer is
exposed). Here the backward pass itself is re-run equation by equation with the collectives
woven in, using split kernels: Pallas calls that return while their DMAs are on the link
(``kernels.split_leaf_kernels``: one call per hop of each stream over the bucket's leaves
where they lie, and a done):

1. ``jax.value_and_grad(fun)`` is traced to a jaxpr, and its calls (jit, custom_vjp, ...)
   are inlined (``inlining``), so every convolution and matmul of the backward pass is one
   equation of one flat program.
2. The gradient leaves are grouped into buckets exactly as ``all_reduce_gradients`` groups
   them (``packing.buckets_by_size``, in the order the program computes them: last layers
   first), except that the last bucket is cut at the last convolution or matmul
   (``plan.cut_last_bucket``): what only it produces (the first layer's kernel gradient)
   travels alone, since nothing is left to overlap it, and the rest of that bucket starts
   before it.
3. The equations are evaluated leaves first (``plan.leaves_first``): for each gradient leaf
   in the order the program computes them, what it needs that has not run yet, so that the
   work only a later leaf needs (a layer's input-gradient convolution) is evaluated after
   the earlier leaf, in the next window (step 4). As soon as the equation that produces a
   bucket's last leaf has run, its split all-reduce is started on the leaves (its first
   call issued): nothing is concatenated, reshaped or copied, and the sums come back in
   the leaves' own buffers (``registry.CollectiveBackend.split_all_reduce_leaves``).
4. While collectives are in flight, the calls are tied to the backward pass by optimization
   barriers with the in-flight buffers (the async note's remedy;
   ``SplitLeafAllReduce.pin``), which are data dependencies XLA cannot reorder:

   * *operand side*: each *pinned* equation (``plan.PINNED``: a convolution or a matmul;
     not the reductions, such as a batch norm's sums, which XLA fuses into the convolution
     whose output they read, and which a pin of their own would cut out of it) reads one
     operand less a zero that comes out of the barrier
     (``executor.Executor._after_last_call``), so it runs after the last call issued. Not
     the operand itself through the barrier: that would stop XLA fusing the operand's
     elementwise producers (the batch norm's scale, the ReLU mask, a pad) into the
     convolution, where the subtraction fuses with them. Nor a constant zero: XLA forwards
     a constant through a barrier before it schedules, and the pin is gone; the zero is
     ``min(axis index, 0)`` (``executor.opaque_zero``), which it cannot fold. The operand
     is one that computation produced, not an input only laid out for the convolution (the
     images, a flipped weight): those XLA lays out once for the forward and backward passes
     together.
   * *result side*: the *advance points* (``plan.advance_points``) are the equations that
     compute a gradient leaf from a pinned equation evaluated since the previous point (a
     weight gradient's convolution, a batch norm's scale gradient after the input-gradient
     convolution it is computed from): about two a layer, nearly every window holding one
     convolution. So every window holds work that cannot run before its first call:
     counting a leaf computed only from elementwise work as a point left windows that XLA
     had emptied by running that work earlier (the compiled figures are in the
     documentation's design log). At each, the leaf passes a barrier with the collectives
     in flight, so the next call waits for the window's work (the backward pass reads the
     leaf as computed: a batch norm's sums feed its input gradient, which the barrier would
     cut off from them), and each in-flight collective issues its next call if it is due
     (``plan.call_points``): each of its hops gets a run of consecutive windows, one at
     least, the windows beyond one a hop going to the hops with the most bytes per window,
     and the call that waits for a hop is issued at the last point of its run. So a hop
     that moves sixteen times another's bytes (a 2-D torus's first phase against its
     second) gets more time to hide in, no two calls of a collective share a window (the
     first one's hop would have nothing to overlap), and the last is issued at the last
     point; with fewer windows than calls, one a window and the rest at the end.

   Equations that communicate (lax collectives such as the batch norms' sums, the package's
   primitives, Pallas kernels) are pinned on both sides without advancing, and each bucket
   starts after the last of them so far, so their order relative to the split calls is the
   program's on every device (lax collectives keep program order among themselves, the
   Pallas calls too, but not relative to each other on a runtime that runs independent ops
   concurrently: the CPU interpreter); the value and aux come out of a barrier with the
   result.
5. After the last equation, the sums are scaled (``mean``) and cast back to the
   leaves' dtypes. Without ``update``, the collectives still in flight first issue the calls
   they have left, one call of each in turn (so that their hops overlap one another's). With
   ``update`` (the optimizer's step), the scaling and ``update`` are traced as one
   program, the *tail*, and evaluated unit by unit while those calls are issued
   (``executor.Tail``): whatever reads only finished buckets' sums runs between the calls of
   the buckets still in flight (its reads of parameters and optimizer state pinned after
   them), a large leaf's norms and its update in separate windows (``plan.units``), and each
   collective's calls spaced over the tail's work that can run before it is done, at the
   largest spacing that still gives every call a window (``plan.call_spacing``). The last
   buckets (the first layers' gradients, which start near the end of the backward pass) so
   overlap the update of every other layer instead of nothing. An ``update`` that reads
   every leaf at once (a global norm clip) has nothing ready early and runs after the last
   call, as without.

The result is that of ``jax.value_and_grad(fun)`` followed by ``all_reduce_gradients(grads,
axis_name, mean=mean, bucket_bytes=bucket_bytes, implementation=implementation)`` (and
``update`` of that): the same buckets, summed by the same ring algorithm in float32 adds
(the blocking kernels and the split streams cut the buffer into chunks differently, so float
sums may round differently; integers are exact in both).

Assumptions and limits:

* ``implementation`` must have a split all-reduce of leaves (``registry.CollectiveBackend
  .split_all_reduce_leaves``: today "pallas"). Any other implementation is run as
  ``value_and_grad`` followed by ``all_reduce_gradients``, unchanged (XLA's collectives are
  scheduled by XLA: ``torus_collectives.xla_settings``).
* "auto" runs what a whole-step tuning (``tuning.step_tuning.tune_step``) measured for this
  gradient tree (``registry.tuned_step``, keyed as ``all_reduce_gradients`` keys it):
  threaded where the measured implementation has split collectives, with the measured bucket
  size unless the caller gave one, since a ``make_step`` built on this function timed the
  threaded form; otherwise ``all_reduce_gradients(implementation="auto")``.
* Only the default transport (the leaves' own dtype); ``transport_dtype`` and error feedback
  go through ``all_reduce_gradients``.
* The leaves go to the calls where they lie, the small ones the kernels cannot cut (a
  batch norm's scale and offset gradients, the stem's kernel) whole; only scalars and
  larger leaves of no whole tile are packed (``pallas_backend.kernel_leaves``). What the
  threading still adds to the compute is that each such vector gradient is a small fusion
  of its own, where XLA's step computes it inside a larger one. The pins do not cut a
  batch norm's sums out of their convolution (only convolutions and matmuls are pinned,
  leaves first); by the compiler's estimate for ResNet-50 the threaded step computes about
  what XLA's default step does and hides most of the transfer (``bench.overlap_report
  --grad-overlap on``, against ``--implementation xla``; compiler estimates and the cost
  model, with the figures by op category in the documentation's design log). Each call
  also waits at its link's barrier for the neighbour to enter it, a latency the model does
  not price.
* The tail's windows are its units, one or more a window; a leaf's update pass is never
  split. ResNet-50's is a few large kernel updates beside many small scales; spaced evenly
  in bytes (``plan.call_spacing``), every call of the last buckets gets a window with work
  as traced (compiled, XLA can still leave some empty: ``tests/test_split_step_aot.py``
  holds the ResNet example's step for v5e to compute in at least half the last bucket's
  windows), and a short window still exposes part of a long hop.
* The windows are counted, not timed: a hop longer than its window is partly exposed. Every
  bucket has the same number of calls whatever its size (two phases of ``n - 1`` hops per
  axis), so one started with fewer points left than calls issues the rest back to back at
  the end, unless the tail's work takes them.
* Heavy equations inside a loop (``scan``, ``while``) or a ``cond`` are one equation here: a
  scanned model's backward pass gives one window, not one per layer.
* Every device must issue the calls in one order: one program under ``shard_map`` does; the
  pins chain all in-flight collectives, so even a runtime that runs independent ops
  concurrently (the CPU interpreter) keeps that order.
* Nothing here has run on a TPU: the threading is verified in TPU interpret mode (exact on
  integers against ``lax.psum`` of ``jax.grad``) and its schedule on ahead-of-time compiles.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import axes, registry
from torus_collectives._vma import mark_invariant
from torus_collectives.collectives import AxisName
from torus_collectives.experimental.overlap.executor import Executor
from torus_collectives.gradients import (
  DEFAULT_BUCKET_BYTES,
  all_reduce_gradients,
  summation_request,
)

__all__ = ["value_and_summed_grad"]


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
    if implementation != "auto" and _summation(implementation, (), ()) is None:
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
    start_summation = _summation(chosen, names, sizes)
    if start_summation is None:
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

    threaded = Executor(start_summation, names, sizes, chosen_bucket or DEFAULT_BUCKET_BYTES)
    flat_args = jax.tree.leaves((params, *args))
    value_leaves, result = threaded.run(closed, flat_args, grad_leaves, gradient_then, update)
    return jax.tree.unflatten(jax.tree.structure(value_shapes), value_leaves), result

  return run


def _summation(implementation: str, names, sizes):
  """How a concrete ``implementation`` starts a bucket's summation threaded: its split
  all-reduce of the leaves where they lie; None where it has none (then the summation is
  ``all_reduce_gradients`` after the backward pass)."""
  if implementation == "auto" or registry.runs_lax(implementation):
    return None
  backend = registry.collective_backend(implementation)
  if backend.split_all_reduce_leaves is None:
    return None
  return functools.partial(backend.split_all_reduce_leaves, axes=names, torus=sizes)
