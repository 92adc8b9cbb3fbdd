"""The private jax APIs the package relies on, in one place.

The version pin in ``pyproject.toml`` (jax 0.12.x) is for these: revisit this file when
moving to another jax series. They are imported from ``jax._src`` rather than
``jax.extend``, because importing ``jax.extend`` loads jax's Pallas core, which the
package's core must not (Pallas loads only with the kernels).

* ``Primitive``, ``Literal``, ``Jaxpr``, ``Tracer``: defining the collectives' primitives
  and reading traced jaxprs (``primitives``, ``_vma``, ``shard_interpreter``).
* ``get_axis_env``: the named axes bound where a collective is called (``collectives``).
* ``pvary``: the transpose of an invariant collective (``primitives``).
* ``check_vma``, ``auto_pcast``, ``pallas_tpu_interpret_mode``: flags of the enclosing
  ``shard_map`` and interpret-mode context (``_vma``, ``collectives``, ``platform``).
"""

from jax._src import config as _config
from jax._src.core import Jaxpr, Literal, Primitive, Tracer, get_axis_env, pvary


def check_vma() -> bool:
  """Whether the enclosing ``shard_map`` checks varying-axes types."""
  return bool(_config._check_vma.value)


def auto_pcast() -> bool:
  return bool(_config.auto_pcast.value)


def pallas_tpu_interpret_mode() -> bool:
  """Whether a ``pltpu.force_tpu_interpret_mode`` context is active."""
  return _config.pallas_tpu_interpret_mode_context_manager.value is not None


__all__ = [
  "Jaxpr",
  "Literal",
  "Primitive",
  "Tracer",
  "auto_pcast",
  "check_vma",
  "get_axis_env",
  "pallas_tpu_interpret_mode",
  "pvary",
]
