"""Weight-update sharding threaded through the step (``ShardedUpdate.value_and_apply``).

* In TPU interpret mode through the split-call extension (``async_interpret``), race
  detector on, both DMA execution modes (on 2x4 and a ring of 2): ``value_and_apply``
  with "pallas" (parameter gathers threaded through the forward pass, gradient
  reduce-scatters through the backward pass, SGD with momentum on the shards) of a
  three-layer network with small-integer weights and inputs equals the blocking parts on
  lax in a program of its own (``gather_params``, ``value_and_grad`` of per-replica
  parameters, ``apply_gradients(gather=False)``): the first step exactly (every value an
  integer or a sum of eighths of one), the second within float32 rounding.
* In the traced program (a ring of 2), what the first matmuls read is gathered first and
  the next bucket's gather has a forward matmul inside its window and ends before its
  reader; every reduce-scatter but the last has a backward matmul inside its window.
* Without split collectives ("xla"), and with block-scaled transport, it is the blocking
  parts; mis-shaped shards are refused before any device work.
"""

import functools
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from async_interpret import async_interpret_mode
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives.weight_update import trust_ratio

pytestmark = pytest.mark.timeout(300, method="thread")

MESHES = {"2x4": ((2, 4), ("x", "y")), "2": ((2,), ("x",))}
AXES = MESHES["2x4"][1]
BUCKET_BYTES = 2048  # a few buckets for these layers
SHAPES = {"w1": (16, 32), "w2": (32, 32), "w3": (32, 8), "b": (8,)}


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.integers(-2, 3, shape).astype(np.float32) for k, shape in SHAPES.items()}


def _loss(params, x):
  h = x @ params["w1"]
  h = h @ params["w2"]
  return jnp.sum(h @ params["w3"] + params["b"])


LIKE = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
# Exact on these integers: a step of 1/4 of a momentum that sums eighths.
TX = optax.sgd(0.25, momentum=0.5)


def _steps(
  implementation, steps=2, reference=False, transport_dtype=None, mesh="2x4", loss=_loss, inner=TX
):
  """``steps`` training steps of ``loss`` with ``inner`` sharded from ``_params()``; per
  step, the loss (each device's), the new shards and the new state (each device's shard,
  stacked). ``reference``: the blocking parts (``gather_params``, ``value_and_grad`` of
  per-replica parameters, ``apply_gradients(gather=False)``), which the threaded step
  must equal."""
  shape, axes = MESHES[mesh]
  tx = tc.sharded_update(
    inner,
    axes,
    bucket_bytes=BUCKET_BYTES,
    implementation=implementation,
    transport_dtype=transport_dtype,
  )

  def body(x, params):
    shards, state = tx.shard_params(params), tx.init(params)
    out = []
    for _ in range(steps):
      if reference:
        whole = tx.gather_params(shards, LIKE)
        value, grads = jax.value_and_grad(loss)(whole, x)
        shards, state = tx.apply_gradients(grads, state, whole, gather=False)
      else:
        value, (shards, state) = tx.value_and_apply(loss, LIKE)(shards, state, x)
      out.append((value[None], shards, state))
    return out

  return jax.jit(
    jax.shard_map(
      body,
      mesh=harness.mesh(shape, axes),
      in_specs=(P(axes), P()),
      out_specs=P(axes),
      check_vma=False,
    )
  )


def _inputs():
  x = np.random.default_rng(1).integers(-2, 3, (8 * 4, 16)).astype(np.float32)
  return x, _params()


def _assert_equal(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g, w)


@pytest.mark.interpret
@pytest.mark.parametrize("mode, steps, mesh", [("eager", 2, "2x4"), ("on_wait", 1, "2")])
def test_threaded_sharded_step_matches_the_blocking_parts_on_lax(mode, steps, mesh):
  """The first step exactly (every value an integer or a sum of eighths of one); the
  second (eager mode: the state carried from the first), whose products of stepped
  weights need more than float32's 24 bits, to the rounding of a different summation
  order (the ring's against lax's): rtol 1e-6. On 2x4 a gather has 6 calls, more than the
  forward pass's matmuls, so the parameters travel in one bucket; on a ring of 2 (2
  calls) in two, both in flight at once."""
  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    got = jax.block_until_ready(_steps("pallas", steps, mesh=mesh)(*_inputs()))
  want = _steps("xla", steps, reference=True, mesh=mesh)(*_inputs())
  _assert_equal(got[0], want[0])
  loss, shards, _ = got[0]
  assert np.all(loss == np.round(loss))
  assert all(np.all(s * 64 == np.round(s * 64)) for s in jax.tree.leaves(shards))
  for g, w in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:]), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6)
  if steps == 2:
    assert not np.allclose(got[1][0], loss)  # the second step trained on the first's weights


def _centred_loss(params, x):
  """``_loss`` with each layer's output centred by its sum over the mesh, as a distributed
  batch norm does: collectives of the model's own between the split calls."""
  h = x @ params["w1"]
  h = h - lax.psum(jnp.sum(h, 0), AXES)
  h = h @ params["w2"]
  h = h - lax.psum(jnp.sum(h, 0), AXES)
  return jnp.sum(h @ params["w3"] + params["b"])


@pytest.mark.interpret
@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_model_collectives_and_a_norm_taking_optimizer_run_in_one_order(mode):
  """The model's own psums in the forward and backward passes, and LARS's per-leaf norms
  (completed on the shards by one psum) in the tail, run between split calls that are
  still in flight; every device must meet them in one order (a stray order deadlocks the
  interpreter, as it would a TPU). The result equals the blocking parts on lax: the
  values are integers until LARS's trust ratios, whose square roots and quotients both
  sides take of the same sums (rtol 1e-6: the ring and lax sum in different orders)."""
  inner = trust_ratio.lars(0.125, weight_decay=0.0, trust_coefficient=1.0, eps=0.0, momentum=0.5)
  run = functools.partial(_steps, steps=1, loss=_centred_loss, inner=inner)
  with async_interpret_mode(mode, deadlock_timeout_s=60.0):
    got = jax.block_until_ready(run("pallas")(*_inputs()))
  want = run("xla", reference=True)(*_inputs())
  loss = got[0][0]
  np.testing.assert_array_equal(loss, want[0][0])
  assert np.all(loss == np.round(loss)) and not np.all(loss == 0)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6)


def _program_order(jaxpr, out):
  """``(what, scope, bucket)`` of the pallas calls (``scope``: "weight_gather" or
  "gradient_summation", ``bucket`` the index in its ``bucket_<k>`` scope) and of the
  ``dot_general`` equations (``scope``, ``bucket`` None), in program order."""
  for eqn in jaxpr.eqns:
    stack = str(eqn.source_info.name_stack)
    if eqn.primitive.name == "pallas_call":
      scope = "weight_gather" if "weight_gather" in stack else "gradient_summation"
      out.append(("call", scope, int(re.search(r"bucket_([0-9]+)", stack).group(1))))
      continue
    if eqn.primitive.name == "dot_general":
      out.append(("dot", None, None))
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", None)
      if sub is not None:
        _program_order(getattr(sub, "jaxpr", sub), out)
  return out


@pytest.mark.interpret
def test_gathers_overlap_the_forward_pass_and_reduce_scatters_the_backward_pass():
  """On a ring of 2 (every split collective 2 calls): what the first 2 matmuls read (w1,
  w2) is gathered first, exposed; w3 and b next, in flight over the first matmuls."""
  x, params = _inputs()
  shape, axes = MESHES["2"]
  tx = tc.sharded_update(TX, axes, bucket_bytes=BUCKET_BYTES, implementation="pallas")

  def body(x, params):
    shards, state = tx.shard_params(params), tx.init(params)
    return tx.value_and_apply(_loss, LIKE)(shards, state, x)[1]

  mesh = harness.mesh(shape, axes)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(axes), check_vma=False)
  with async_interpret_mode("eager", deadlock_timeout_s=60.0):
    jaxpr = jax.make_jaxpr(fn)(x, params).jaxpr
  order = _program_order(jaxpr, [])
  dots = [i for i, (what, _, _) in enumerate(order) if what == "dot"]
  forward, backward = dots[:3], dots[3:]

  def calls(scope):
    found = {}
    for i, (what, s, b) in enumerate(order):
      if what == "call" and s == scope:
        found.setdefault(b, []).append(i)
    return [found[b] for b in sorted(found)]

  gathers, scatters = calls("weight_gather"), calls("gradient_summation")
  # Gathers: [w1, w2], [w3, b]; reduce-scatters in backward order: [w3, b], [w2], [w1].
  assert len(gathers) == 2 and len(scatters) == 3, order
  assert all(len(c) == 2 for c in gathers + scatters)  # a start and a done
  early, late = gathers
  assert early[-1] < forward[0]  # exposed: read by the first matmul
  assert late[0] < forward[0] < late[-1] < forward[2]  # over the first matmuls, before w3's
  # Every reduce-scatter but the last (the first layer's) has a backward matmul in its window.
  for c in scatters[:-1]:
    assert any(c[0] < d < c[-1] for d in backward), (c, backward)


def test_without_split_collectives_it_is_the_blocking_parts():
  _assert_equal(_steps("xla")(*_inputs()), _steps("xla", reference=True)(*_inputs()))


def test_block_scaled_transport_runs_the_blocking_parts():
  got = _steps("shard_map", steps=1, transport_dtype=jnp.int8)(*_inputs())
  want = _steps("shard_map", steps=1, reference=True, transport_dtype=jnp.int8)(*_inputs())
  _assert_equal(got, want)


def test_refuses_shards_that_do_not_belong_to_like():
  tx = tc.sharded_update(TX, AXES, implementation="xla")
  mesh = harness.mesh((2, 4), AXES)

  def body(x, params):
    shards = jax.tree.map(lambda s: s[:-1], tx.shard_params(params))
    return tx.value_and_apply(_loss, LIKE)(shards, tx.init(params), x)[0][None]

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(AXES), check_vma=False)
  with pytest.raises(ValueError, match="does not belong to a leaf"):
    fn(*_inputs())
