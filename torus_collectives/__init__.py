"""torus-collectives: the 2-D torus collectives of "Image Classification at Supercomputer
Scale" (Ying et al., 2018), generalised to 3-D tori, as drop-in replacements for ``jax.lax``
collectives.

This module is the public API. The layout, top to bottom (each layer imports only those
below it):

* the ops: ``collectives`` (psum, pmean, psum_scatter, all_gather), ``gradients``
  (``all_reduce_gradients``), ``overlap`` (``value_and_summed_grad``: the summation
  threaded through the backward pass, on ``inlining``), ``norm`` (batch norm),
  ``weight_update`` (``sharded_update``);
* ``registry``: the backends as data and the one ``resolve`` that picks one per call;
  ``tuning``, what "auto" measured and the tuner that measures it;
* the implementations: ``backends`` (portable) and ``kernels`` (Pallas, loaded only when
  chosen), on ``primitives`` (their JAX transformation rules);
* the shared facts: ``schedule`` (the algorithm as data), ``layout``, ``packing`` (pytrees
  as flat buffers), ``axes`` (axis names, size-one axes), ``groups`` (replica groups as
  tiles), ``topology``, ``configs``, ``target`` (the device being traced for),
  ``cost_model`` (its alpha-beta prices), ``sizes`` (byte counts as text),
  ``xla_settings``, and the private-jax and vma helpers.

A subpackage groups modules that serve one feature and are read together (batch norm's
op, reference passes, tunable and flax module; the tuner with its tables and timing; the
weight-update sharding with its interpreter); the modules every feature shares stay flat,
so a newcomer finds the algorithm one level down.

The core needs only jax and numpy. ``sharded_update``, ``ShardedUpdate``, ``lars`` and
``scale_by_trust_ratio`` take optax transformations: they load on first use (from
``weight_update``), and without optax say to install the ``optax`` extra.
"""

import importlib

from torus_collectives import schedule
from torus_collectives.collectives import (
  all_gather,
  all_reduce,
  group_sum,
  pmean,
  psum,
  psum_scatter,
  reduce_scatter,
)
from torus_collectives.configs import KernelConfig
from torus_collectives.gradients import all_reduce_gradients
from torus_collectives.groups import resolve_tile
from torus_collectives.norm.batch_norm import batch_norm
from torus_collectives.norm.block_sizes import BlockSizes
from torus_collectives.overlap import value_and_summed_grad
from torus_collectives.quantization import BlockScaled
from torus_collectives.registry import (
  IMPLEMENTATIONS,
  Implementation,
  auto_implementation,
  auto_rounding_bound,
  bitwise_as_lax,
)
from torus_collectives.topology import make_torus_mesh
from torus_collectives.weight_update.interpreter import UnshardableTransformError

__all__ = [
  "BlockScaled",
  "IMPLEMENTATIONS",
  "ShardedUpdate",
  "UnshardableTransformError",
  "BlockSizes",
  "Implementation",
  "KernelConfig",
  "all_gather",
  "all_reduce",
  "all_reduce_gradients",
  "auto_implementation",
  "auto_rounding_bound",
  "batch_norm",
  "bitwise_as_lax",
  "group_sum",
  "lars",
  "make_torus_mesh",
  "pmean",
  "psum",
  "psum_scatter",
  "reduce_scatter",
  "resolve_tile",
  "scale_by_trust_ratio",
  "schedule",
  "sharded_update",
  "value_and_summed_grad",
]

# Names that need optax: module each lives in, imported on first access.
_NEEDS_OPTAX = {
  "sharded_update": "torus_collectives.weight_update.sharded_update",
  "ShardedUpdate": "torus_collectives.weight_update.sharded_update",
  "lars": "torus_collectives.weight_update.trust_ratio",
  "scale_by_trust_ratio": "torus_collectives.weight_update.trust_ratio",
}


def __getattr__(name: str):
  if name in _NEEDS_OPTAX:
    value = getattr(importlib.import_module(_NEEDS_OPTAX[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'torus_collectives' has no attribute {name!r}")
