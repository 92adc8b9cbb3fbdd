"""Gradient summation threaded through the backward pass (``torus_collectives.overlap``).

* In TPU interpret mode through the split-call extension (``async_interpret``), race
  detector on, both DMA execution modes: ``value_and_summed_grad(implementation="pallas")``
  of a three-layer network with small-integer weights and inputs (every gradient an exact
  integer) equals ``jax.value_and_grad`` followed by ``lax.psum`` (``mean=False``) and
  ``lax.pmean`` (``mean=True``), exactly, with buckets small enough that several are in
  flight at once.
* In the traced program, each bucket's start comes after the equation producing its last
  leaf and before at least one later backward matmul, and its done after that matmul.
* Other implementations ("xla", "auto") are ``value_and_grad`` then
  ``all_reduce_gradients``, unchanged.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from async_interpret import async_interpret_mode
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import overlap

pytestmark = pytest.mark.timeout(300, method="thread")

AXES = ("x", "y")
BUCKET_BYTES = 2048  # a few buckets for these layers


def _params(seed=0):
  rng = np.random.default_rng(seed)
  shapes = {"w1": (16, 32), "w2": (32, 32), "w3": (32, 8), "b": (8,)}
  return {k: rng.integers(-2, 3, shape).astype(np.float32) for k, shape in shapes.items()}


def _loss(params, x):
  h = x @ params["w1"]
  h = h @ params["w2"]
  return jnp.sum(h @ params["w3"] + params["b"])


def _step(mean, implementation="pallas"):
  def body(x, params):
    value, grads = overlap.value_and_summed_grad(
      _loss, AXES, mean=mean, bucket_bytes=BUCKET_BYTES, implementation=implementation
    )(params, x)
    ref_value, ref_grads = jax.value_and_grad(_loss)(params, x)
    reduce = lax.pmean if mean else lax.psum
    return value[None], grads, ref_value[None], reduce(ref_grads, AXES)

  mesh = harness.mesh((2, 4), AXES)
  specs = (P(AXES), P(), P(AXES), P())
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P()), out_specs=specs, check_vma=False)
  )


def _inputs():
  x = np.random.default_rng(1).integers(-2, 3, (8 * 4, 16)).astype(np.float32)
  return x, _params()


@pytest.mark.interpret
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("mode", harness.DMA_MODES)
def test_threaded_summation_matches_lax(mode, mean):
  x, params = _inputs()
  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    value, grads, ref_value, ref_grads = jax.block_until_ready(_step(mean)(x, params))
  np.testing.assert_array_equal(value, ref_value)
  for name in params:
    np.testing.assert_array_equal(grads[name], ref_grads[name])
  if not mean:  # integers: the sums are exact whatever the order
    assert all(np.all(g == np.round(g)) for g in grads.values())


def _program_order(jaxpr, out):
  """Names of the pallas calls and ``dot_general`` equations, in program order."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      out.append(eqn.params["name"])
    elif eqn.primitive.name == "dot_general":
      out.append("dot_general")
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", None)
      if sub is not None:
        _program_order(getattr(sub, "jaxpr", sub), out)
  return out


@pytest.mark.interpret
def test_each_bucket_overlaps_a_backward_matmul():
  x, params = _inputs()
  mesh = harness.mesh((2, 4), AXES)
  step = overlap.value_and_summed_grad(_loss, AXES, bucket_bytes=BUCKET_BYTES)
  fn = jax.shard_map(
    lambda x, p: step(p, x)[1], mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(), check_vma=False
  )
  with async_interpret_mode("eager", deadlock_timeout_s=60.0):
    jaxpr = jax.make_jaxpr(fn)(x, params).jaxpr
  order = _program_order(jaxpr, [])
  starts = [i for i, name in enumerate(order) if name == "async_reduce_scatter_start_x"]
  dones = [i for i, name in enumerate(order) if name == "async_all_gather_done_x"]
  assert len(starts) == len(dones) == 3, order  # w3 and b, w2, w1
  last_matmul = max(i for i, name in enumerate(order) if name == "dot_general")
  # Every bucket but the last one produced has a backward matmul inside its window...
  for start, done in zip(starts[:-1], dones[:-1]):
    assert "dot_general" in order[start:done], (start, done, order)
  # ... two of them in flight at once (the second starts before the first is done) ...
  assert starts[1] < dones[0], order
  # ... and the last (the first layer's gradient) has nothing left to overlap.
  assert starts[-1] > last_matmul


@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_other_implementations_are_value_and_grad_then_all_reduce_gradients(implementation):
  x, params = _inputs()
  value, grads, ref_value, ref_grads = _step(True, implementation)(x, params)
  np.testing.assert_array_equal(value, ref_value)
  for name in params:
    np.testing.assert_array_equal(grads[name], ref_grads[name])


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


def test_exported_from_the_package():
  assert tc.value_and_summed_grad is overlap.value_and_summed_grad
