"""torus-collectives: the 2-D torus collectives of "Image Classification at Supercomputer
Scale" (Ying et al., 2018) as drop-in replacements for ``jax.lax`` collectives."""

from torus_collectives import schedule
from torus_collectives.backends import IMPLEMENTATIONS, auto_implementation
from torus_collectives.batch_norm import batch_norm
from torus_collectives.collectives import all_gather, all_reduce, reduce_scatter
from torus_collectives.gradients import all_reduce_gradients
from torus_collectives.groups import group_sum, resolve_tile
from torus_collectives.topology import make_torus_mesh

__all__ = [
  "IMPLEMENTATIONS",
  "all_gather",
  "all_reduce",
  "all_reduce_gradients",
  "auto_implementation",
  "batch_norm",
  "group_sum",
  "make_torus_mesh",
  "reduce_scatter",
  "resolve_tile",
  "schedule",
]
