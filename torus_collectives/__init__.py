"""torus-collectives: the 2-D torus collectives of "Image Classification at Supercomputer
Scale" (Ying et al., 2018), generalised to 3-D tori, as drop-in replacements for ``jax.lax``
collectives.

The public API. Layers below it, each importing only the ones after it: ``registry``
(which implementation runs), then the portable ``shard_map_backend`` and the Pallas
``kernels`` (imported lazily, only when chosen), then ``schedule``, ``layout``,
``configs`` and the vma helpers they share.

The core needs only jax and numpy. ``sharded_update``, ``ShardedUpdate``, ``lars`` and
``scale_by_trust_ratio`` take optax transformations: they load on first use (from
``weight_update`` and ``trust_ratio``), and without optax say to install the ``optax`` extra.
"""

import importlib

from torus_collectives import schedule
from torus_collectives.batch_norm import batch_norm
from torus_collectives.collectives import (
  all_gather,
  all_reduce,
  pmean,
  psum,
  psum_scatter,
  reduce_scatter,
)
from torus_collectives.configs import BlockSizes, KernelConfig
from torus_collectives.gradients import all_reduce_gradients
from torus_collectives.groups import group_sum, resolve_tile
from torus_collectives.registry import (
  IMPLEMENTATIONS,
  Implementation,
  auto_implementation,
  auto_rounding_bound,
  bitwise_as_lax,
)
from torus_collectives.shard_interpreter import UnshardableTransformError
from torus_collectives.topology import make_torus_mesh

__all__ = [
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
]

# Names that need optax: module each lives in, imported on first access.
_NEEDS_OPTAX = {
  "sharded_update": "torus_collectives.weight_update",
  "ShardedUpdate": "torus_collectives.weight_update",
  "lars": "torus_collectives.trust_ratio",
  "scale_by_trust_ratio": "torus_collectives.trust_ratio",
}


def __getattr__(name: str):
  if name in _NEEDS_OPTAX:
    value = getattr(importlib.import_module(_NEEDS_OPTAX[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'torus_collectives' has no attribute {name!r}")
