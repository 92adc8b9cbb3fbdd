"""Experimental parts of torus-collectives: they may change, or go, without a deprecation
period, and none is chosen by "auto" on a user's behalf unless a measurement says so.

* ``value_and_summed_grad`` (``experimental.overlap``): ``jax.value_and_grad`` whose
  gradient is summed over the mesh while the backward pass still runs, by split Pallas
  calls threaded through it. Verified in TPU interpret mode and in ahead-of-time compiles;
  by the compiler's estimate its pins and packing cost more compute than the transfer it
  hides, so it is not faster than XLA's default step (``docs/kernels.md``).
"""

from torus_collectives.experimental.overlap import value_and_summed_grad

__all__ = ["value_and_summed_grad"]
