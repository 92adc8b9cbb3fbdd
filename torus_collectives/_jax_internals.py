"""The private jax APIs the package relies on, in one place.

The version pin in ``pyproject.toml`` (jax 0.12.x) is for these: revisit this file when
moving to another jax series. They are imported from ``jax._src`` rather than
``jax.extend``, because importing ``jax.extend`` loads jax's Pallas core, which the
package's core must not (Pallas loads only with the kernels).

* ``Primitive``, ``Literal``, ``Jaxpr``, ``Tracer``: defining the collectives' primitives
  and reading traced jaxprs (``primitives``, ``_vma``, ``weight_update.sharded_eval``).
* ``get_axis_env``: the named axes bound where a collective is called (``collectives``).
* ``pvary``: the transpose of an invariant collective (``primitives``).
* ``production_order``: where in the traced program each gradient leaf was computed, so
  that buckets follow the backward pass (``gradients``).
* ``backends_initialized``: whether it is too late to pass flags to libtpu
  (``xla_settings``).
* ``check_vma``, ``auto_pcast``, ``pallas_tpu_interpret_mode``: flags of the enclosing
  ``shard_map`` and interpret-mode context (``_vma``, ``collectives``, ``target``).
* ``equation_context``: an equation's source information (its name stack, so compiled
  ``op_name``s keep ``transpose(jvp(...))``) around a re-evaluation of it (``overlap``).
* ``bool_state``: a jax config option of the package's own, keyed into jit's cache
  (``registry.bitwise_as_lax``).
* ``all_gather_start``: the async all-gather, which XLA's TPU compiler emits as a genuine
  all-gather where it may compile ``lax.all_gather`` over two mesh axes as an all-reduce
  (``weight_update.xla_collectives``).
* ``interpreter_callbacks_on_host_arrays``: TPU interpret mode's callbacks handed the host
  arrays XLA passes them, not jax Arrays placed on the CPU device one operand at a time
  (``testing.split_interpret``, ``check.verify`` and the tests' interpret-mode harness).
* ``coordination_client``: the key-value store of ``jax.distributed``'s coordination
  service, which jax does not expose publicly (``resnet.faults``'s liveness heartbeat;
  orbax and ``jax.experimental.multihost_utils`` read it the same way).
"""

import contextlib
import functools
import threading
import weakref

import numpy as np
from jax._src import callback as _callback
from jax._src import config as _config
from jax._src import distributed as _distributed
from jax._src import mesh as _mesh
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util, tree_util, xla_bridge
from jax._src.core import Jaxpr, Literal, Primitive, Tracer, get_axis_env, pvary
from jax._src.lax.parallel import all_gather_start

bool_state = _config.bool_state


def production_order(leaves) -> list[int] | None:
  """For each leaf, the position in the enclosing trace of the equation that computed it,
  or None if some leaf is not a value traced into that program (then no order is known)."""
  frames = {id(getattr(getattr(leaf, "_trace", None), "frame", None)) for leaf in leaves}
  if len(frames) != 1 or not leaves:
    return None
  frame = getattr(getattr(leaves[0], "_trace", None), "frame", None)
  eqns = getattr(frame, "tracing_eqns", None)
  if eqns is None:
    return None
  position = {}
  for i, eqn in enumerate(eqns):
    eqn = eqn() if isinstance(eqn, weakref.ReferenceType) else eqn
    if eqn is not None:
      position[id(eqn)] = i
  order = [position.get(id(getattr(leaf, "parent", None))) for leaf in leaves]
  return None if any(i is None for i in order) else order


def backends_initialized() -> bool:
  """Whether jax has started a backend (libtpu reads its flags only before that)."""
  return bool(xla_bridge._backends)


def check_vma() -> bool:
  """Whether the enclosing ``shard_map`` checks varying-axes types."""
  return bool(_config._check_vma.value)


def auto_pcast() -> bool:
  return bool(_config.auto_pcast.value)


def coordination_client():
  """The client of the coordination service started by ``jax.distributed.initialize``
  (``key_value_set``, ``key_value_try_get``, ``key_value_increment``, ...), or None when
  it was not called."""
  return _distributed.global_state.client


def equation_context(eqn):
  """The context ``jax.core.eval_jaxpr`` binds ``eqn`` in: its traceback and name stack
  under the current one, and the equation's own context."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  traceback = eqn.source_info.traceback
  stack = contextlib.ExitStack()
  stack.enter_context(source_info_util.user_context(traceback, name_stack=name_stack))
  stack.enter_context(eqn.ctx.manager)
  return stack


def pallas_tpu_interpret_mode() -> bool:
  """Whether a ``pltpu.force_tpu_interpret_mode`` context is active."""
  return _config.pallas_tpu_interpret_mode_context_manager.value is not None


# The modules whose io_callbacks ``interpreter_callbacks_on_host_arrays`` hands host arrays:
# jax's TPU interpreter (its DMAs, loads, stores, semaphores and device threads) and the
# package's split-call extension of it.
INTERPRETER_MODULES = (
  "jax._src.pallas.mosaic.interpret",
  "torus_collectives.testing.split_interpret",
)
_host_arrays_lock = threading.Lock()
_host_arrays_depth = 0
_placing_io_callback_impl = _callback.io_callback_impl


def _defining_module(flat_callback) -> str:
  fn = getattr(flat_callback, "callback_func", None)
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "__module__", None) or ""


def _io_callback_impl(*args, callback, **params):
  """jax's ``io_callback_impl`` without its ``device_put`` of the operands, for the
  interpreter's callbacks; any other callback goes through jax's own."""
  if not _defining_module(callback).startswith(INTERPRETER_MODULES):
    return _placing_io_callback_impl(*args, callback=callback, **params)
  cpu_device, *_ = xla_bridge.local_devices(backend="cpu")
  with (
    _config.default_device(cpu_device),
    _sharding_impls._internal_use_concrete_mesh(_mesh.empty_concrete_mesh),
    _mesh.use_abstract_mesh(_mesh.empty_abstract_mesh),
  ):
    return tree_util.tree_map(np.asarray, callback(*args))


@contextlib.contextmanager
def interpreter_callbacks_on_host_arrays():
  """Inside the block, the io_callbacks of the functions of ``INTERPRETER_MODULES``
  receive the host numpy arrays XLA passes a callback, where jax would first place each
  operand on the CPU device as a jax Array (one ``device_put`` an operand).

  TPU interpret mode makes one callback for every load, store, DMA and semaphore operation
  of a kernel, and reads its scalar operands (device ids, buffer ids, indices) back with
  ``int()``: the placements and the reads back took most of the time of the
  interpret-mode tests profiled. Its callbacks take
  either kind of array, and copy (``np.array``) whatever they keep past the call, as a
  callback must, since the host arrays are XLA's buffers; so the values computed are the
  same. Other io_callbacks, a user's own, are untouched. Blocks nest, and may be entered
  from several threads."""
  global _host_arrays_depth
  with _host_arrays_lock:
    _host_arrays_depth += 1
    _callback.io_callback_impl = _io_callback_impl
  try:
    yield
  finally:
    with _host_arrays_lock:
      _host_arrays_depth -= 1
      if _host_arrays_depth == 0:
        _callback.io_callback_impl = _placing_io_callback_impl


__all__ = [
  "Jaxpr",
  "Literal",
  "Primitive",
  "Tracer",
  "all_gather_start",
  "auto_pcast",
  "bool_state",
  "backends_initialized",
  "check_vma",
  "coordination_client",
  "equation_context",
  "get_axis_env",
  "interpreter_callbacks_on_host_arrays",
  "pallas_tpu_interpret_mode",
  "production_order",
  "pvary",
]
