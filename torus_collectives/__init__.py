"""torus-collectives: the 2-D torus collectives of "Image Classification at Supercomputer
Scale" (Ying et al., 2018), generalised to 3-D tori, as drop-in replacements for ``jax.lax``
collectives.

This module is the public API: the ops a user calls and the types they take. The layers,
top to bottom (each module imports only those of its own layer and below;
``torus_collectives._layers.LAYERS`` lists every module's, and a test holds each import to
it):

* *api*: this module, the hardware check (``check``), the old paths kept for one release
  (``nn``, ``timing``, ``tune``, ``overlap``, ``layout``, ``configs``),
  and ``testing``, the tests' and benchmarks' support (not part of the ops' API);
* *tuner*: ``tuning.tuner`` and ``tuning.step_tuning`` (with ``tuning.timing``), which time
  the ops;
* *ops*: ``collectives`` (psum, pmean, psum_scatter, all_gather), ``gradients``
  (``all_reduce_gradients``), ``experimental.overlap`` (``value_and_summed_grad``: the
  summation threaded through the backward pass, on ``inlining``), ``norm.batch_norm`` and
  ``norm.linen`` (batch norm), ``weight_update`` (``sharded_update``, the sharded
  evaluation of an update ``sharded_eval``, ``lars``);
* *primitives*: the collectives as JAX primitives, their transformation rules, a lowering
  that runs the backend the registry names;
* *registry*: the backends as data and the one ``resolve`` that picks one per call;
* *tables*: ``tuning.tables``, what "auto" measured (the format, the rule, the lookup);
* *implementations*: ``backends`` (portable), ``kernels`` (Pallas) and ``norm.passes``
  (batch norm's jnp passes), each loaded by the registry only when chosen;
* *shared*: ``schedule`` (the algorithm as data), ``tiling``, ``packing`` (pytrees as flat
  buffers), ``axes`` (axis names, size-one axes), ``groups`` (replica groups as tiles),
  ``topology``, ``kernel_config``, ``norm.block_sizes``, ``quantization`` (the block-scaled
  format), ``target`` (the device being traced for), ``cost_model`` (its alpha-beta
  prices), ``sizes`` (byte counts as text), ``xla_settings``, the private-jax and vma
  helpers, and the subpackages' ``__init__``, which import nothing.

A subpackage groups modules that serve one feature and are read together (batch norm's
op, reference passes, tunable and flax module; the tuner with its tables and timing; the
weight-update sharding with its sharded evaluation); the modules every feature shares stay flat,
so a newcomer finds the algorithm one level down.

The core needs only jax and numpy. ``sharded_update`` and ``ShardedUpdate`` take optax
transformations: they load on first use (from ``weight_update``), and without optax say to
install the ``optax`` extra, as do ``weight_update.trust_ratio``'s ``lars`` and
``scale_by_trust_ratio``.
"""

import importlib

from torus_collectives import _deprecation
from torus_collectives import experimental as experimental
from torus_collectives.collectives import (
  all_gather,
  all_reduce,
  group_sum,
  pmean,
  psum,
  psum_scatter,
  reduce_scatter,
)
from torus_collectives.gradients import all_reduce_gradients
from torus_collectives.groups import resolve_tile
from torus_collectives.kernel_config import KernelConfig
from torus_collectives.norm.batch_norm import batch_norm
from torus_collectives.norm.block_sizes import BlockSizes
from torus_collectives.quantization import BlockScaled
from torus_collectives.registry import Implementation, bitwise_as_lax
from torus_collectives.topology import make_torus_mesh
from torus_collectives.weight_update.sharded_eval import UnshardableTransformError

__all__ = [
  "BlockScaled",
  "BlockSizes",
  "Implementation",
  "KernelConfig",
  "ShardedUpdate",
  "UnshardableTransformError",
  "all_gather",
  "all_reduce",
  "all_reduce_gradients",
  "batch_norm",
  "bitwise_as_lax",
  "group_sum",
  "make_torus_mesh",
  "pmean",
  "psum",
  "psum_scatter",
  "reduce_scatter",
  "resolve_tile",
  "sharded_update",
]

# Names that need optax: the module each lives in, imported on first access.
_NEEDS_OPTAX = {
  "sharded_update": "torus_collectives.weight_update.sharded_update",
  "ShardedUpdate": "torus_collectives.weight_update.sharded_update",
}

# Old names of this module, each with the module it lives in: they answer, with a
# DeprecationWarning that names the new path, until the release ``_deprecation`` names.
_MOVED = {
  "IMPLEMENTATIONS": "torus_collectives.registry",
  "auto_implementation": "torus_collectives.registry",
  "auto_rounding_bound": "torus_collectives.registry",
  "lars": "torus_collectives.weight_update.trust_ratio",
  "scale_by_trust_ratio": "torus_collectives.weight_update.trust_ratio",
  "value_and_summed_grad": "torus_collectives.experimental",
}


def _moved(name: str):
  _deprecation.warn_moved(f"torus_collectives.{name}", f"{_MOVED[name]}.{name}", stacklevel=4)
  return getattr(importlib.import_module(_MOVED[name]), name)


def __getattr__(name: str):
  if name in _MOVED:
    return _moved(name)
  if name in _NEEDS_OPTAX:
    value = getattr(importlib.import_module(_NEEDS_OPTAX[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'torus_collectives' has no attribute {name!r}")
