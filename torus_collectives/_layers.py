"""The package's layers, top to bottom: a module imports only modules of its own layer or
of the layers below it. ``tests/test_layers.py`` reads ``LAYERS`` from this file's source
(without importing it) and checks every import of every module against it, the imports
inside functions included; the package docstring describes the same layers in prose.

A name ending in ``.*`` stands for every module of that subpackage; any other name is one
module, a subpackage's ``__init__`` under the subpackage's own name. Importing a module
also runs the ``__init__`` of each subpackage above it, so those sit in the lowest layer
of their modules (the bottom one, importing nothing, but for ``tuning``'s). An old path
kept for one release may load its new path from any layer, in a function that first warns
(``_deprecation.warn_moved``) and then loads it.
"""

LAYERS = (
  # The public API, the hardware check that calls it as a user does, the old paths that
  # lead to the new ones, and the support of the tests and benchmarks (``testing``: it
  # compiles and interprets the ops, and the hardware check reads schedules with it; no op
  # imports it).
  (
    "api",
    (
      "torus_collectives",
      "torus_collectives.check",
      "torus_collectives.check.*",
      "torus_collectives.nn",
      "torus_collectives.configs",
      "torus_collectives.layout",
      "torus_collectives.overlap",
      "torus_collectives.weight_update.interpreter",
      "torus_collectives.testing",
      "torus_collectives.testing.*",
      "torus_collectives.timing",
      "torus_collectives.tune",
    ),
  ),
  # The tuner: it times the ops, so it sits above them.
  (
    "tuner",
    (
      "torus_collectives.tuning.__main__",
      "torus_collectives.tuning.step_tuning",
      "torus_collectives.tuning.timing",
      "torus_collectives.tuning.tuner",
    ),
  ),
  # The ops a user calls, and the modules that serve one of them alone.
  (
    "ops",
    (
      "torus_collectives.collectives",
      "torus_collectives.gradients",
      "torus_collectives.experimental",
      "torus_collectives.experimental.overlap",
      "torus_collectives.experimental.overlap.*",
      "torus_collectives.norm.batch_norm",
      "torus_collectives.norm.linen",
      "torus_collectives.weight_update.sharded_eval",
      "torus_collectives.weight_update.sharded_update",
      "torus_collectives.weight_update.trust_ratio",
      "torus_collectives.weight_update.xla_collectives",
    ),
  ),
  # The collectives as JAX primitives: their lowering runs the backend the registry names.
  ("primitives", ("torus_collectives.primitives",)),
  # The backends as data, and the one rule that picks one per call.
  ("registry", ("torus_collectives.registry",)),
  # What "auto" measured: the tables' format, their rule, where they are found.
  # (``tuning``'s ``__init__`` presents the tables, and imports nothing else.)
  ("tables", ("torus_collectives.tuning", "torus_collectives.tuning.tables")),
  # The implementations the registry loads on first use.
  (
    "implementations",
    (
      "torus_collectives.backends.*",
      "torus_collectives.kernels.*",
      "torus_collectives.norm.passes",
    ),
  ),
  # The facts every layer shares, and the subpackages' (empty) ``__init__``.
  (
    "shared",
    (
      "torus_collectives._deprecation",
      "torus_collectives._jax_internals",
      "torus_collectives._layers",
      "torus_collectives._optional",
      "torus_collectives._vma",
      "torus_collectives.axes",
      "torus_collectives.kernel_config",
      "torus_collectives.cost_model",
      "torus_collectives.groups",
      "torus_collectives.inlining",
      "torus_collectives.tiling",
      "torus_collectives.norm.block_sizes",
      "torus_collectives.packing",
      "torus_collectives.quantization",
      "torus_collectives.schedule",
      "torus_collectives.sizes",
      "torus_collectives.target",
      "torus_collectives.topology",
      "torus_collectives.xla_settings",
      "torus_collectives.backends",
      "torus_collectives.kernels",
      "torus_collectives.norm",
      "torus_collectives.weight_update",
    ),
  ),
)
