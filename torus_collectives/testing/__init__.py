"""Verifying the package's programs without a TPU: support for its tests and benchmarks.

Not part of the ops' API: nothing a user calls lives here, no op imports it, and its
modules may change with the tests that use them. The modules (``README.md`` beside this
file says who uses each, and what each needs):

* ``hlo_schedule``: reads a compiled program's scheduled HLO (``compiled.as_text()``):
  its ENTRY ops in schedule order, the split calls' chains and the schedule problems that
  would expose them, and a modelled timeline of one step;
* ``aot``: ahead-of-time compiles of the torus all-reduce for real TPU topologies on a
  CPU host (needs libtpu, the ``tpu`` extra, when it compiles; importing it does not),
  and what the compiled program's HLO and cost analyses say about it;
* ``split_interpret``: an extension of jax's TPU interpret mode that runs split (start /
  step / done) Pallas calls on CPU, pinned to one jax version (``SUPPORTED_JAX_VERSION``).

This ``__init__`` imports none of them, so importing ``torus_collectives.testing`` needs
nothing beyond the package's own dependencies.
"""
