"""torus-collectives: the 2-D torus collectives of "Image Classification at Supercomputer
Scale" (Ying et al., 2018), generalised to 3-D tori, as drop-in replacements for ``jax.lax``
collectives.

The public API. Layers below it, each importing only the ones after it: ``registry``
(which implementation runs), then the portable ``shard_map_backend`` and the Pallas
``kernels`` (imported lazily, only when chosen), then ``schedule``, ``layout``,
``configs`` and the vma helpers they share.
"""

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
from torus_collectives.sharded_update import lars, scale_by_trust_ratio, sharded_update
from torus_collectives.topology import make_torus_mesh

__all__ = [
  "IMPLEMENTATIONS",
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
