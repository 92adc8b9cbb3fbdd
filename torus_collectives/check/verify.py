"""Stage 1 inside a worker: run one correctness case and compare it with ``jax.lax``.

Each case compiles one program, inside ``jax.shard_map`` over every axis of its torus,
that returns the implementation's result, lax's result and the magnitudes the bound is
stated in; it runs twice on the same program:

* on **small integers** (values in [-4, 4]: every partial sum of up to 64 of them is
  exact in bfloat16 and float32, so every summation order gives the same bits): the
  result must equal lax's exactly, except where the op rounds by design (pmean's
  division, batch norm, block-scaled transport, the optimizer's arithmetic), which are
  held to their bound as for floats;
* on **random floats** (standard normal, rounded once to the dtype): per element,
  ``|result - lax| <= c * magnitude + r * |lax|``, with ``c`` the package's own bound:
  ``registry.auto_rounding_bound`` for sums (``2 gamma(p - 1)``, ``2 gamma(p) / p`` for
  means) with ``magnitude`` the sum over devices of ``|x|``; ``quantization.error_bound``
  for block-scaled int8 transport, with ``magnitude`` the sum over devices of each
  device's largest ``|x|`` (a block's largest magnitude is at most that, so this bound is
  looser than the stated one, never tighter), plus the float32 sum's own rounding;
  ``r`` one rounding of the output to its dtype where the op casts back (``0`` else).
  Batch norm is held to a relative tolerance of ``BATCH_NORM_RTOL`` against float32
  statistics summed by lax, and the sharded optimizer step to the pmean bound on its
  gradient times the learning rate.

A case *passes* when both runs are within bound; it *fails* with the count of elements
out of bound ("wrong", as nccl-tests counts them) and the worst error against its bound.
An exception is the case's error. In TPU interpret mode the race detector is on, DMAs
complete on wait, scratch memory is NaN, and a race fails the case; the split calls run
through the package's extension of that mode (``testing.split_interpret``), which keeps
their semaphores and in-flight buffers from one call to the next.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import _jax_internals as jax_internals
from torus_collectives import quantization, registry
from torus_collectives.check.cases import AXIS_NAMES, SPLIT, Case
from torus_collectives.topology import make_torus_mesh

# Batch norm: relative tolerance of y and the mean against lax-summed float32 statistics
# (float32: 5x the package's own batch-norm tests' 2e-5; bfloat16: two roundings).
BATCH_NORM_RTOL = {"float32": 1e-4, "bfloat16": 2.0**-7}
LEARNING_RATE = 0.5


@functools.cache
def mesh(torus: tuple[int, ...]):
  return make_torus_mesh(torus, AXIS_NAMES[: len(torus)])


@contextlib.contextmanager
def interpret_mode():
  """TPU interpret mode for the kernels traced and run inside (race detector on)."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  from jax.experimental.pallas import tpu as pltpu

  params = pltpu.InterpretParams(
    dma_execution_mode="on_wait", detect_races=True, uninitialized_memory="nan"
  )
  try:
    with (
      pltpu.force_tpu_interpret_mode(params),
      jax_internals.interpreter_callbacks_on_host_arrays(),
    ):
      yield
    races = interpret_pallas_call.races
    if races is not None and races.races_found:
      raise AssertionError("the TPU interpreter detected a data race")
  finally:
    pltpu.reset_tpu_interpret_mode_state()


def _inputs(case: Case, shape, floats: bool, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if floats:
    values = rng.standard_normal(shape).astype(np.float32)
  else:
    values = rng.integers(-4, 5, size=shape).astype(np.float32)
  return np.asarray(jnp.asarray(values, case.dtype))


def _unit(dtype) -> float:
  return registry.unit_roundoff(dtype)


def _sum_check(case: Case, axes):
  """psum, pmean, psum_scatter, all_gather, psum_int8 on a ``[n]`` buffer per device."""
  p = case.devices
  op = case.op
  n = case.elements // p if op == "all_gather" else case.elements

  def body(x):
    a = jnp.abs(x).astype(jnp.float32)
    if op == "psum":
      return tc.psum(x, axes, implementation=case.impl), lax.psum(x, axes), lax.psum(a, axes)
    if op == "pmean":
      return tc.pmean(x, axes, implementation=case.impl), lax.pmean(x, axes), lax.psum(a, axes)
    if op == "psum_scatter":
      got = tc.psum_scatter(x, axes, tiled=True, implementation=case.impl)
      return got, lax.psum_scatter(x, axes, tiled=True), lax.psum_scatter(a, axes, tiled=True)
    if op == "all_gather":
      got = tc.all_gather(x, axes, tiled=True, implementation=case.impl)
      return got, lax.all_gather(x, axes, tiled=True), jnp.zeros(p * n, jnp.float32)
    # psum_int8: the stated bound is per block; each device's largest |x| bounds its blocks.
    got = tc.psum(x, axes, implementation=case.impl, transport_dtype=jnp.int8)
    want = lax.psum(x.astype(jnp.float32), axes)
    peak = jnp.broadcast_to(lax.psum(jnp.max(a), axes), a.shape)
    return got, want, (peak, lax.psum(a, axes))

  if op == "psum_int8":
    transport = (quantization.BlockScaled(),) * len(case.torus)
    c_q = quantization.error_bound("all_reduce", case.torus, transport)
    c_sum = registry.auto_rounding_bound("psum", jnp.float32, p)

    def bound(want, mags):
      peak, total = mags
      return c_q * peak + c_sum * total + _unit(case.dtype) * np.abs(want)

  else:
    c = registry.auto_rounding_bound(op, case.dtype, p)

    def bound(want, mags):
      return c * mags

  exact = op in ("psum", "psum_scatter", "all_gather")
  return body, (n,), bound, exact


# A gradient check's kernel is a [rows, 128] matrix (rows a multiple of 16, a tile of
# every dtype) where the case has room for one: the shape the Pallas gradient summation
# sums where it lies (``kernels.leaf_kernels``); smaller cases keep a flat kernel.
_KERNEL_TILE = 16 * 128


def _gradients_check(case: Case, axes):
  p = case.devices
  first = max(1, case.elements * 2 // 3)
  if first >= _KERNEL_TILE:
    first -= first % _KERNEL_TILE
  second = max(1, case.elements - first)
  c = registry.auto_rounding_bound("pmean", case.dtype, p)
  kernel_shape = (first // 128, 128) if first % _KERNEL_TILE == 0 else (first,)

  def body(x):
    tree = {"kernel": x[:first].reshape(kernel_shape), "bias": x[first : first + second]}
    got = tc.all_reduce_gradients(tree, axes, implementation=case.impl)
    want = lax.pmean(tree, axes)
    mags = lax.psum(jax.tree.map(lambda v: jnp.abs(v).astype(jnp.float32), tree), axes)
    flat = lambda t: jnp.concatenate([t["kernel"].reshape(-1), t["bias"]])
    return flat(got), flat(want), flat(mags)

  return body, (first + second,), lambda want, mags: c * mags, False


def _batch_norm_check(case: Case, axes):
  channels = 8
  rows = max(1, case.elements // (4 * channels))
  rtol = BATCH_NORM_RTOL[case.dtype]

  def body(x):
    x = x.reshape(rows, 2, 2, channels)
    scale = jnp.linspace(0.5, 1.5, channels, dtype=jnp.float32)
    bias = jnp.linspace(-1.0, 1.0, channels, dtype=jnp.float32)
    y, mean, _ = tc.batch_norm(x, scale, bias, axis_name=axes, implementation=case.impl)
    x32 = x.astype(jnp.float32).reshape(-1, channels)
    count = lax.psum(x32.shape[0], axes)
    mu = lax.psum(x32.sum(0), axes) / count
    var = lax.psum(((x32 - mu) ** 2).sum(0), axes) / count
    want = (x32 - mu) * lax.rsqrt(var + 1e-5) * scale + bias
    got = jnp.concatenate([y.astype(jnp.float32).reshape(-1), mean])
    want = jnp.concatenate([want.reshape(-1), mu])
    return got, want, 1.0 + jnp.abs(want)

  return body, (rows * 4 * channels,), lambda want, mags: rtol * mags, False


def _sharded_update_check(case: Case, axes):
  import optax

  p = case.devices
  first = max(1, case.elements // 2 + 3)
  c = registry.auto_rounding_bound("pmean", case.dtype, p)

  def body(g):
    grads = {"w": g[:first], "b": g[first : first + 5]}
    params = jax.tree.map(lambda v: jnp.ones_like(v), grads)
    update = tc.sharded_update(optax.sgd(LEARNING_RATE), axes, implementation=case.impl)
    state = update.init(params)
    new, _ = update.apply_gradients(grads, state, params)
    want = jax.tree.map(lambda w, m: w - LEARNING_RATE * m, params, lax.pmean(grads, axes))
    mags = lax.psum(jax.tree.map(jnp.abs, grads), axes)
    flat = lambda t: jnp.concatenate([t["w"], t["b"]])
    return flat(new), flat(want), flat(mags)

  def bound(want, mags):
    return LEARNING_RATE * c * mags + 2 * _unit(case.dtype) * np.abs(want)

  return body, (first + 5,), bound, False


def _split_check(case: Case, axes):
  """The split all-reduce of leaves, issued call by call, against ``lax.psum``: a 1-D
  input, which the leaf chain takes packed into one ``[rows, 128]`` leaf."""
  c = registry.auto_rounding_bound("all_reduce", case.dtype, case.devices)

  def body(x):
    functions = registry.collective_backend(case.impl)
    split = getattr(functions, case.op)([x], axes, case.torus)
    a = jnp.abs(x).astype(jnp.float32)
    return split.finish_parts()[0], lax.psum(x, axes), lax.psum(a, axes)

  return body, (case.elements,), lambda want, mags: c * mags, True


CHECKS = {
  "psum": _sum_check,
  "pmean": _sum_check,
  "psum_scatter": _sum_check,
  "all_gather": _sum_check,
  "psum_int8": _sum_check,
  "all_reduce_gradients": _gradients_check,
  "batch_norm": _batch_norm_check,
  "sharded_update": _sharded_update_check,
  "split_all_reduce_leaves": _split_check,
}


def _program(case: Case, body, shape):
  m = mesh(case.torus)
  axes = tuple(m.axis_names)
  spec = P(axes)

  def local(x):
    outs = body(x[0])
    return jax.tree.map(lambda v: jnp.asarray(v)[None], outs)

  kernels = registry.BACKENDS[case.impl].pallas_kernels
  fn = jax.jit(jax.shard_map(local, mesh=m, in_specs=spec, out_specs=spec, check_vma=not kernels))
  sharding = jax.sharding.NamedSharding(m, spec)
  return fn, sharding, (case.devices, *shape)


def _compare(got, want, allowed, exact: bool) -> tuple[int, float]:
  """(elements out of bound, worst error over its bound) of one run."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if got.shape != want.shape:
    raise AssertionError(f"result shape {got.shape}, lax's {want.shape}")
  error = np.abs(got - want)
  error = np.where(np.isnan(got) != np.isnan(want), np.inf, np.nan_to_num(error, nan=0.0))
  allowed = np.zeros_like(want) if exact else np.broadcast_to(np.asarray(allowed), want.shape)
  wrong = int(np.sum(error > allowed))
  worst = float(np.max(error - allowed, initial=-np.inf))
  return wrong, worst


def run(case: Case, interpret: bool) -> dict:
  """Runs ``case``; returns ``{"status": "pass"|"fail", "wrong", "worst", "detail"}``."""
  axes = AXIS_NAMES[: len(case.torus)]
  body, shape, bound, exact_on_integers = CHECKS[case.op](case, axes)
  kernels = registry.BACKENDS[case.impl].pallas_kernels and interpret
  context = interpret_mode if kernels else contextlib.nullcontext
  if kernels and case.op in SPLIT:  # semaphores and buffers live from call to call
    from torus_collectives.testing.split_interpret import async_interpret_mode

    context = async_interpret_mode
  fn, sharding, global_shape = _program(case, body, shape)
  results = {}
  with context():
    for floats in (False, True):
      if floats and case.dtype == "int32":
        continue
      x = jax.device_put(_inputs(case, global_shape, floats), sharding)
      got, want, mags = jax.block_until_ready(fn(x))
      mags = jax.tree.map(lambda v: np.asarray(v, np.float64), mags)
      allowed = bound(np.asarray(want, np.float64), mags)
      exact = exact_on_integers and not floats
      results["floats" if floats else "integers"] = _compare(got, want, allowed, exact)
  wrong = sum(w for w, _ in results.values())
  detail = "; ".join(
    f"{k}: {w} wrong" + (f", worst error {e:.3g} over its bound" if w else "")
    for k, (w, e) in results.items()
  )
  return {"status": "pass" if wrong == 0 else "fail", "wrong": wrong, "detail": detail}
