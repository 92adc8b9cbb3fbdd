"""Block-scaled (int8, fp8) transport: the ``shard_map`` implementation against the numpy
model of the same schedule and quantization (``quantization.simulate``), bitwise; its
error against a float64 sum within ``quantization.error_bound``; non-finite blocks; error
feedback; the bytes on the wire; and every refusal, before any device work."""

from __future__ import annotations

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import torus_collectives as tc
from torus_collectives import quantization
from torus_collectives.backends import shard_map as backend
from torus_collectives.tiling import ceil_div

INT8 = tc.BlockScaled("int8")
TORI = {"1d": (8,), "2d": (2, 4), "3d": (2, 2, 2)}


def _grid(flat: np.ndarray, p: int, width: int, torus) -> np.ndarray:
  """One device's flat buffer (a multiple of p long) as the backend's chunk grid."""
  m = flat.shape[0] // p
  grid = np.zeros((p, width), np.float32)
  grid[:, :m] = flat.reshape(p, m)
  return grid.reshape(tuple(torus) + (width,))


def _chunk_width(collective, torus, n, transport) -> tuple[int, int]:
  """(m, width): the chunk of ``n`` elements per device and its padded width, as the
  backend lays the grid out."""
  p = math.prod(torus)
  m = {"all_gather": n, "reduce_scatter": n // p}.get(collective, ceil_div(n, p))
  width = backend._padded_width(m, tuple(torus), transport)
  if collective == "all_reduce" and transport:  # whole chunks, the padding at the end
    return width, width
  return m, width


def _model(collective, torus, x, transport):
  """``quantization.simulate`` on the per-device inputs ``x`` ([p, n]), laid out as the
  backend lays them out; returns what each device ends with ([p, n_out])."""
  p, n = x.shape
  m, width = _chunk_width(collective, torus, n, transport)
  if collective == "all_gather":
    buffers = np.zeros((p, p, width), np.float32)
    for d in range(p):
      buffers[d, d, :n] = x[d]
  else:
    flats = np.zeros((p, p * m), np.float32)
    flats[:, :n] = x
    buffers = np.stack([_grid(f, p, width, torus) for f in flats]).reshape(p, p, width)
  shape = tuple(torus) + tuple(torus) + (width,)
  out = quantization.simulate(collective, torus, buffers.reshape(shape), transport)
  out = out.reshape(p, p, width)[:, :, :m]
  if collective == "reduce_scatter":
    return np.stack([out[d, d] for d in range(p)])
  return out.reshape(p, p * m)[:, : (n if collective == "all_reduce" else p * n)]


def _run(collective, torus, x, transport):
  """The backend on ``x`` ([p, n], one row per device) inside ``shard_map``."""
  mesh = harness.mesh(torus)
  names = tuple(mesh.axis_names)
  fn = lambda v: getattr(backend, collective)(v, names, tuple(torus), transport=transport)
  return np.asarray(harness.per_device(fn, mesh, x, check_vma=False))


CASES = [
  # (collective, torus, elements per device, formats per axis)
  ("all_reduce", "1d", 3000, (INT8,)),
  ("all_reduce", "2d", 5000, (INT8, INT8)),
  ("all_reduce", "2d", 5000, (None, INT8)),
  ("all_reduce", "3d", 1000, (INT8, INT8, INT8)),
  ("all_reduce", "2d", 7, (INT8, INT8)),
  ("all_reduce", "2d", 2000, (tc.BlockScaled("float8_e4m3fn", 32),) * 2),
  ("all_reduce", "1d", 2000, (tc.BlockScaled("float8_e5m2", 64),)),
  ("reduce_scatter", "2d", 8 * 700, (INT8, INT8)),
  ("reduce_scatter", "3d", 8 * 33, (INT8, INT8, INT8)),
  ("all_gather", "2d", 300, (INT8, INT8)),
  ("all_gather", "3d", 130, (INT8, None, tc.BlockScaled("float8_e4m3fn", 32))),
]


@pytest.mark.parametrize("collective,rank,n,transport", CASES)
def test_equals_the_numpy_model_bitwise_and_keeps_the_bound(collective, rank, n, transport):
  """Bitwise the model (float32 adds and divisions are IEEE on CPU), and within the
  stated bound of the float64 sum, per element: ``|error| <= c * sum_i a_i``."""
  torus = TORI[rank]
  p = math.prod(torus)
  x = harness.random_floats((p, n), seed=n)
  ours = _run(collective, torus, x, transport)
  np.testing.assert_array_equal(ours, _model(collective, torus, x, transport))
  if collective == "all_reduce":
    assert all(np.array_equal(ours[0], ours[d]) for d in range(p)), "identical on every device"
  _assert_within_bound(collective, torus, x, ours, transport)


def _block_absmax_sum(x: np.ndarray, collective, torus, transport) -> np.ndarray:
  """``sum_i a_i`` per element of the result: a_i is device i's largest magnitude over
  the element's block (the backend's layout, blocks of the chunk grid)."""
  p, n = x.shape
  block = quantization.block_multiple(transport)
  m, width = _chunk_width(collective, torus, n, transport)
  if collective == "all_gather":
    grids = np.zeros((p, p, width))
    for d in range(p):
      grids[d, d, :n] = np.abs(x[d])
  else:
    grids = np.zeros((p, p, width))
    flats = np.zeros((p, p * m))
    flats[:, :n] = np.abs(x)
    grids[:, :, :m] = flats.reshape(p, p, m)
  blocks = grids.reshape(p, p, width // block, block).max(-1).sum(0)  # [chunk, block]
  per_element = np.repeat(blocks, block, axis=-1)[:, :m]
  if collective == "reduce_scatter":
    return per_element
  return per_element.reshape(-1)[: (n if collective == "all_reduce" else p * n)]


def _assert_within_bound(collective, torus, x, ours, transport) -> None:
  exact64 = x.astype(np.float64)
  p = x.shape[0]
  if collective == "all_reduce":
    exact = np.broadcast_to(exact64.sum(0), ours.shape)
  elif collective == "reduce_scatter":
    exact = exact64.sum(0).reshape(p, -1)
  else:
    exact = np.broadcast_to(exact64.reshape(-1), ours.shape)
  scale = _block_absmax_sum(x, collective, torus, transport)
  bound = quantization.error_bound(collective, torus, transport) * scale
  error = np.abs(ours - exact)
  assert np.all(error <= bound), f"worst excess {np.max(error - bound)}"
  assert np.max(error) > 0, "quantization changed nothing: the test cannot tell"


@pytest.mark.parametrize("draw", ["normal", "student_t", "zeros"])
@pytest.mark.parametrize("rank", ["1d", "2d"])
def test_public_all_reduce_within_the_bound(draw, rank):
  """``tc.psum(..., transport_dtype=jnp.int8)`` (through the primitive, "auto") equals the
  backend bitwise and keeps the bound on heavy tails; all-zero inputs stay exactly zero."""
  torus = TORI[rank]
  p = math.prod(torus)
  rng = np.random.default_rng(7)
  shape = (p, 2, 999)
  if draw == "normal":
    x = rng.standard_normal(shape).astype(np.float32)
  elif draw == "student_t":
    x = rng.standard_t(3, shape).astype(np.float32)
  else:
    x = np.zeros(shape, np.float32)
  mesh = harness.mesh(torus)
  names = tuple(mesh.axis_names)
  ours = np.asarray(
    harness.per_device(lambda v: tc.psum(v, names, transport_dtype=jnp.int8), mesh, x)
  )
  flat = x.reshape(p, -1)
  transport = (INT8,) * len(torus)
  np.testing.assert_array_equal(ours.reshape(p, -1), _run("all_reduce", torus, flat, transport))
  if draw == "zeros":
    assert not np.any(ours)
  else:
    _assert_within_bound("all_reduce", torus, flat, ours.reshape(p, -1), transport)


def test_non_finite_blocks_arrive_as_nan_and_nothing_else_does():
  """A block holding inf or NaN on one device is NaN in the result (never a finite
  value); every other block keeps its finite, bounded value."""
  torus, p, n = (2, 4), 8, 8 * 512
  x = np.array(harness.random_floats((p, n)))
  x[3, 5] = np.inf
  x[6, 1000] = np.nan
  x[1, 2000] = -np.inf
  ours = _run("all_reduce", torus, x, (INT8, INT8))
  np.testing.assert_array_equal(ours, _model("all_reduce", torus, x, (INT8, INT8)))
  poisoned = np.zeros(n, bool)
  for element in (5, 1000, 2000):
    start = element // INT8.block_size * INT8.block_size
    poisoned[start : start + INT8.block_size] = True
  assert np.all(np.isnan(ours[:, poisoned]))
  assert np.all(np.isfinite(ours[:, ~poisoned]))


def test_ragged_and_tiny_sizes():
  """Sizes that fill no block, or leave one partly empty, pad with zeros that change
  nothing: one element, a prime count, one element short of a whole grid."""
  for n in (1, 13, 8 * 256 - 1):
    x = harness.random_floats((8, n), seed=n)
    ours = _run("all_reduce", (2, 4), x, (INT8, INT8))
    np.testing.assert_array_equal(ours, _model("all_reduce", (2, 4), x, (INT8, INT8)))


def test_error_feedback_keeps_the_running_sum_unbiased():
  """The same gradients summed for T steps: with the residual carried over, the T results
  add up to T times the exact sum up to one step's error (the last residual); without it
  the error of the running sum grows T times."""
  mesh = harness.mesh((2, 4))
  names = ("x", "y")
  grads = {"w": harness.random_floats((8, 64, 33), seed=3)}
  exact = grads["w"].astype(np.float64).sum(0)

  def steps(g, with_feedback, T=16):
    """T steps in one traced loop body: (running sum of the results, residual)."""

    def step(_, carry):
      total, residual = carry
      if with_feedback:
        summed, residual = tc.all_reduce_gradients(
          g, names, mean=False, transport_dtype=jnp.int8, residual=residual
        )
      else:
        summed = tc.all_reduce_gradients(g, names, mean=False, transport_dtype=jnp.int8)
      return jax.tree.map(jnp.add, total, summed), residual

    # Per device: varying over the mesh axes, as the residual the call returns.
    residual = jax.tree.map(
      lambda v: lax.pcast(jnp.zeros(v.shape, jnp.float32), names, to="varying"), g
    )
    total, _ = lax.fori_loop(0, T, step, (jax.tree.map(jnp.zeros_like, g), residual))
    return total

  T = 16
  with_ef = np.asarray(harness.per_device(lambda g: steps(g, True), mesh, grads)["w"][0])
  without = np.asarray(harness.per_device(lambda g: steps(g, False), mesh, grads)["w"][0])
  one_step = quantization.error_bound("all_reduce", (2, 4), (INT8, INT8))
  scale = np.abs(grads["w"]).max() * 8
  assert np.max(np.abs(with_ef - T * exact)) <= 2 * one_step * scale
  assert np.max(np.abs(without - T * exact)) > 4 * np.max(np.abs(with_ef - T * exact))


def test_residuals_sum_to_the_error_of_the_step():
  mesh = harness.mesh((2, 2, 2))
  names = ("x", "y", "z")
  g = harness.random_floats((8, 1000), seed=5)

  def fn(v):
    return tc.all_reduce_gradients(
      v, names, mean=False, transport_dtype=jnp.int8, residual=jnp.zeros(v.shape, jnp.float32)
    )

  summed, residual = harness.per_device(fn, mesh, g)
  exact = g.astype(np.float64).sum(0)
  error = exact - np.asarray(summed[0], np.float64)
  assert np.max(np.abs(error)) > 1e-3
  np.testing.assert_allclose(np.asarray(residual, np.float64).sum(0), error, atol=1e-5)


def _ppermute_bytes(fn, x) -> int:
  """Bytes that the ``ppermute``s of ``fn``'s jaxpr send per device, in every sub-jaxpr."""
  total = 0

  def visit(jaxpr):
    nonlocal total
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "ppermute":
        total += sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.invars)
      for value in eqn.params.values():
        if type(value).__name__ == "ClosedJaxpr":
          visit(value.jaxpr)
        elif type(value).__name__ == "Jaxpr":
          visit(value)

  visit(jax.make_jaxpr(fn)(x).jaxpr)
  return total


def test_wire_bytes_are_at_most_053_of_bfloat16s():
  """Counted from the traced program: every byte the int8 all-reduce's ``ppermute``s send,
  scales included, against the bfloat16 all-reduce's, on a size with no padding (the
  backend itself: through the public op the ``ppermute``s sit inside the primitive)."""
  mesh = harness.mesh((2, 4))
  names = ("x", "y")
  n = 8 * 4 * 1024
  x = jnp.zeros((8, n), jnp.float32)

  def traced(transport, dtype):
    body = lambda v: backend.all_reduce(v[0].astype(dtype), names, (2, 4), transport=transport)[
      None
    ]
    return jax.shard_map(
      body, mesh=mesh, in_specs=jax.P(names), out_specs=jax.P(names), check_vma=False
    )

  int8 = _ppermute_bytes(traced((INT8, INT8), jnp.float32), x)
  bf16 = _ppermute_bytes(traced(None, jnp.bfloat16), x)
  assert int8 / bf16 == pytest.approx(INT8.wire_bytes_per_element / 2)
  assert int8 / bf16 <= 0.53
  assert bf16 == 2 * (8 - 1) / 8 * n * 2  # the bound: 2 (p - 1) / p * S


@pytest.mark.parametrize("implementation", ["xla", "lax_torus"])
def test_implementations_without_it_refuse_naming_those_with_it(implementation):
  mesh = harness.mesh((2, 4))
  fn = lambda v: tc.psum(v, ("x", "y"), implementation=implementation, transport_dtype=jnp.int8)
  with pytest.raises(ValueError, match="no block-scaled.*shard_map.*pallas"):
    harness.per_device(fn, mesh, np.zeros((8, 16), np.float32))


@pytest.mark.parametrize(
  "transport", [jnp.float8_e4m3fn, tc.BlockScaled("int8", 64), {"y": jnp.int8}], ids=str
)
def test_pallas_refuses_the_formats_its_kernels_do_not_run(transport):
  """The Pallas kernels run int8 blocks of 128 on every axis (tests/test_quantized_kernels.py);
  anything else is refused at trace time, naming the implementation that runs it."""
  mesh = harness.mesh((2, 4))
  fn = lambda v: tc.psum(v, ("x", "y"), implementation="pallas", transport_dtype=transport)
  with pytest.raises(ValueError, match='pallas.*int8.*128.*"shard_map"'):
    harness.per_device(fn, mesh, np.zeros((8, 16), np.float32))


def test_pallas_has_no_error_feedback():
  mesh = harness.mesh((2, 4))
  fn = lambda v: tc.all_reduce_gradients(
    v, ("x", "y"), implementation="pallas", transport_dtype=jnp.int8, residual=jnp.zeros_like(v)
  )
  with pytest.raises(ValueError, match='no quantization residual.*"shard_map"'):
    harness.per_device(fn, mesh, np.zeros((8, 16), np.float32))


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda v: tc.psum(v.astype(jnp.int32), ("x", "y"), transport_dtype=jnp.int8), "floating"),
    (lambda v: tc.psum(v, ("x", "y"), transport_dtype=jnp.bfloat16), "cast the input"),
    (lambda v: tc.psum(v, ("x", "y"), transport_dtype={"z": jnp.int8}), "does not run over"),
    (lambda v: tc.psum(v, ("x", "y"), transport_dtype=tc.BlockScaled("int8", 0)), "block_size"),
    (
      lambda v: tc.all_reduce_gradients(v, ("x", "y"), residual=jnp.zeros_like(v)),
      "block-scaled transport_dtype",
    ),
  ],
)
def test_bad_transport_arguments_are_refused(call, match):
  with pytest.raises(ValueError, match=match):
    harness.per_device(call, harness.mesh((2, 4)), np.zeros((8, 16), np.float32))


def test_differentiating_a_quantized_collective_is_refused():
  mesh = harness.mesh((2, 4))
  fn = lambda v: jax.grad(lambda u: tc.psum(u, ("x", "y"), transport_dtype=jnp.int8).sum())(v)
  with pytest.raises(NotImplementedError, match="not differentiable"):
    harness.per_device(fn, mesh, np.zeros((8, 16), np.float32), check_vma=False)


def test_sharded_update_quantizes_the_gradients_not_the_weights():
  """int8 reduce-scatter of the gradients: SGD's new weights are within the bound of the
  exact mean gradient's step, and on every device identical (the gather is exact)."""
  mesh = harness.mesh((2, 4))
  names = ("x", "y")
  params = {"w": jnp.asarray(harness.random_floats((40, 30), seed=1))}
  grads = harness.random_floats((8, 40, 30), seed=2)
  lr = 0.5
  sharded = tc.sharded_update(optax.sgd(lr), names, transport_dtype=jnp.int8)

  def step(g):
    g = {"w": g}
    state = sharded.init(params)
    new, _ = sharded.apply_gradients(g, state, params)
    return new["w"]

  new = np.asarray(harness.per_device(step, mesh, grads, check_vma=False))
  assert all(np.array_equal(new[0], new[d]) for d in range(8))
  exact = np.asarray(params["w"], np.float64) - lr * grads.astype(np.float64).mean(0)
  bound = quantization.error_bound("reduce_scatter", (2, 4), (INT8, INT8))
  per_element = lr * 8 * np.abs(grads).max() / 8 * bound + 1e-6
  assert 0 < np.max(np.abs(new[0] - exact)) <= per_element


def test_auto_never_quantizes_by_itself():
  """Without a transport_dtype, "auto" is lax's psum bitwise (no table here)."""
  mesh = harness.mesh((2, 4))
  x = harness.random_floats((8, 1000))
  ours = harness.per_device(lambda v: tc.psum(v, ("x", "y")), mesh, x)
  ref = harness.per_device(lambda v: lax.psum(v, ("x", "y")), mesh, x)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


def test_the_bound_counts_hops_per_axis():
  """k, the quantizations a value goes through: sum_a (n_a - 1) for a reduce-scatter,
  one more for an all-reduce's gather; only the quantized axes count."""
  assert quantization.quantizations("reduce_scatter", (256,), (INT8,)) == 255
  assert quantization.quantizations("all_reduce", (16, 16), (INT8, INT8)) == 31
  assert quantization.quantizations("all_reduce", (4, 16, 16), (INT8, None, None)) == 4
  assert quantization.quantizations("all_gather", (2, 4), (INT8, INT8)) == 1
  assert quantization.quantizations("all_reduce", (1, 8), (INT8, None)) == 0
  d = INT8.delta
  assert quantization.error_bound("all_reduce", (8,), (INT8,)) == pytest.approx(
    (1 + d) ** 8 * (1 + 2.0**-24) ** 8 - 1
  )


def test_int8_on_the_slow_axis_only():
  """Multislice: ``{"dcn": jnp.int8}`` quantizes only the hops between slices (the outer
  axis); the gradient summation equals the backend with that per-axis transport bitwise,
  and its bound counts the DCN hops alone."""
  mesh = harness.mesh((2, 2, 2), ("dcn", "x", "y"))
  names = ("dcn", "x", "y")
  g = harness.random_floats((8, 3000), seed=11)
  fn = lambda v: tc.all_reduce_gradients(v, names, mean=False, transport_dtype={"dcn": jnp.int8})
  ours = np.asarray(harness.per_device(fn, mesh, g))
  transport = (INT8, None, None)
  backend_fn = lambda v: backend.all_reduce(v, names, (2, 2, 2), transport=transport)
  np.testing.assert_array_equal(
    ours, np.asarray(harness.per_device(backend_fn, mesh, g, check_vma=False))
  )
  np.testing.assert_array_equal(ours, _model("all_reduce", (2, 2, 2), g, transport))
  assert quantization.quantizations("all_reduce", (2, 2, 2), transport) == 2
  _assert_within_bound("all_reduce", (2, 2, 2), g, ours, transport)


def test_sharded_update_error_feedback_keeps_the_running_sum_unbiased():
  """SGD with learning rate 1 from zero weights on the same gradients for T steps: the
  weights are minus the sum of the T averaged gradients. With error feedback in the state
  they are within one step's error of T times the exact mean; without it the error grows
  T times. The state holds the residual whole per device."""
  mesh = harness.mesh((2, 4))
  names = ("x", "y")
  params = {"w": jnp.zeros((48, 20), jnp.float32), "b": jnp.zeros((7,), jnp.float32)}
  grads = {
    "w": harness.random_floats((8, 48, 20), seed=8),
    "b": harness.random_floats((8, 7), seed=9),
  }
  T = 12

  def run(g, error_feedback):
    sharded = tc.sharded_update(
      optax.sgd(1.0), names, transport_dtype=jnp.int8, error_feedback=error_feedback
    )

    def step(_, carry):
      weights, state = carry
      return sharded.apply_gradients(g, state, weights)

    return lax.fori_loop(0, T, step, (params, sharded.init(params)))

  with_ef, state = harness.per_device(lambda g: run(g, True), mesh, grads, check_vma=False)
  without, _ = harness.per_device(lambda g: run(g, False), mesh, grads, check_vma=False)
  assert state.residual["w"].shape == (8, 1, 48, 20)
  one_step = quantization.error_bound("reduce_scatter", (2, 4), (INT8, INT8))
  for name in params:
    exact = -T * grads[name].astype(np.float64).mean(0)
    scale = np.abs(grads[name]).max()  # the mean's share of sum_i a_i: 8 a / 8
    ef_error = np.max(np.abs(np.asarray(with_ef[name][0]) - exact))
    assert ef_error <= 2 * one_step * scale + 1e-5
    assert np.max(np.abs(np.asarray(without[name][0]) - exact)) > 3 * ef_error


def test_sharded_update_error_feedback_needs_block_scaled_transport():
  with pytest.raises(ValueError, match="error_feedback=True needs a block-scaled"):
    tc.sharded_update(optax.sgd(1.0), "x", error_feedback=True)


def test_tiny_and_subnormal_blocks_follow_the_model():
  """Blocks whose scale would be subnormal travel as zeros, and subnormal inputs count as
  zero, in the implementation (XLA flushes them) and the model alike."""
  x = np.array(harness.random_floats((8, 8 * 256), seed=4))
  x[:, :128] *= np.float32(1e-37)  # scale below the smallest normal float32: zeros
  x[:, 128:256] *= np.float32(1e-30)
  x[2, 130] = np.float32(3e-39)  # a subnormal inside a block of normal scale
  ours = _run("all_reduce", (2, 4), x, (INT8, INT8))
  np.testing.assert_array_equal(ours, _model("all_reduce", (2, 4), x, (INT8, INT8)))
  assert not np.any(ours[:, :128]) and np.any(ours[:, 128:256])
