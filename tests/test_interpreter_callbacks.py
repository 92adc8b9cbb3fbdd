"""``_jax_internals.interpreter_callbacks_on_host_arrays``: inside the block, TPU interpret
mode's io_callbacks receive host numpy arrays and compute what they compute on jax
Arrays; any other io_callback still receives jax Arrays; leaving the last block restores
jax's own callback path, also when the block raises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import callback as jax_callback
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torus_collectives import _jax_internals as jax_internals

pytestmark = pytest.mark.interpret


def _kinds_seen_by_a_user_callback():
  seen = []

  def record(x):
    seen.append(type(x))
    return x

  jax.jit(lambda x: io_callback(record, jax.ShapeDtypeStruct((3,), jnp.int32), x))(
    jnp.arange(3, dtype=jnp.int32)
  ).block_until_ready()
  return seen


def test_a_users_callback_still_receives_jax_arrays():
  with jax_internals.interpreter_callbacks_on_host_arrays():
    seen = _kinds_seen_by_a_user_callback()
  assert seen and all(issubclass(kind, jax.Array) for kind in seen), seen


def test_interpreter_callbacks_receive_host_arrays_and_compute_the_same(monkeypatch):
  """A kernel that DMAs its input into VMEM and doubles it gives the same, exact result
  both ways; inside the block the interpreter's callbacks saw numpy arrays only."""

  def kernel(x_hbm, o_ref, scratch, sem):
    copy = pltpu.make_async_copy(x_hbm, scratch, sem)
    copy.start()
    copy.wait()
    o_ref[...] = 2 * scratch[...]

  def double(x):
    return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
    )(x)

  x = jnp.arange(8 * 128, dtype=jnp.int32).reshape(8, 128)
  params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
  kinds = {"placed": set(), "host": set()}
  run = "placed"
  receive = jax_callback._FlatCallback.__call__

  def recording(self, *flat_args):  # what the interpreter's functions receive
    if jax_internals._defining_module(self).startswith(jax_internals.INTERPRETER_MODULES):
      kinds[run].update(type(a) for a in flat_args)
    return receive(self, *flat_args)

  monkeypatch.setattr(jax_callback._FlatCallback, "__call__", recording)
  with pltpu.force_tpu_interpret_mode(params):
    placed = np.asarray(jax.jit(double)(x))
    pltpu.reset_tpu_interpret_mode_state()
    run = "host"
    with jax_internals.interpreter_callbacks_on_host_arrays():
      host = np.asarray(jax.jit(double)(x))
    pltpu.reset_tpu_interpret_mode_state()
  np.testing.assert_array_equal(placed, 2 * np.asarray(x))
  np.testing.assert_array_equal(host, placed)
  assert kinds["placed"] and all(issubclass(k, jax.Array) for k in kinds["placed"]), kinds
  assert kinds["host"] and all(issubclass(k, np.ndarray) for k in kinds["host"]), kinds
  assert jax_callback.io_callback_impl is jax_internals._placing_io_callback_impl


def test_blocks_nest_and_the_last_one_out_restores_jax_even_on_error():
  placing = jax_internals._placing_io_callback_impl
  with pytest.raises(RuntimeError, match="inner"):
    with jax_internals.interpreter_callbacks_on_host_arrays():
      with jax_internals.interpreter_callbacks_on_host_arrays():
        assert jax_callback.io_callback_impl is jax_internals._io_callback_impl
      assert jax_callback.io_callback_impl is jax_internals._io_callback_impl
      raise RuntimeError("inner")
  assert jax_callback.io_callback_impl is placing
