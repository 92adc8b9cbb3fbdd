"""The XLA/libtpu settings under which gradient collectives overlap the backward pass.

What XLA's TPU compiler does (libtpu 0.0.50, compiled ahead of time for v5e; compiler
output, read with ``testing.hlo_schedule``):

* **Default flags.** Its all-reduce combiner merges every gradient all-reduce of a step
  into one synchronous collective, placed after the last backward convolution: the whole
  gradient sum is on the critical path.
* **With the flags below.** An all-reduce whose operand is a single array computed by a
  fusion (a layer's weight gradient) becomes an ``async-collective-start``/``-done`` pair,
  and XLA moves the next layers' weight-gradient fusions into the window between them. A
  packed buffer (a concatenate) or a combined (tuple) all-reduce stays synchronous and is
  scheduled after the backward pass, so on XLA ``all_reduce_gradients`` hands the
  compiler single leaves, never packed buckets. (``sharded_update`` hands it buckets: its
  genuine reduce-scatters and all-gathers, ``weight_update.xla_collectives``, cost one
  latency a bucket, where single leaves paid one a leaf.) The combiner still merges
  leaves below ``COMBINE_BELOW_BYTES`` (batch-norm scales and biases), which would
  otherwise each pay a collective's latency, synchronously. In ResNet-50 the 9 MiB
  float32 kernels of the last stage stay synchronous too, for reasons the compiler does
  not print.
  ``tests/test_overlap_compiled.py`` checks the first two facts on a small MLP.
* **Reduce-scatters and all-gathers.** It compiles a flat ``lax.psum_scatter`` over mesh
  axes as an all-reduce and a slice, and often ``lax.all_gather`` over two axes as an
  all-reduce (over v5e:16x16 for every shape tried), so each moves an all-reduce's bytes.
  The async forms (a reduce-scatter of whole tiles through ``lax.psum_scatter_start``, the
  async all-gather) are genuine, which is how ``sharded_update`` sends its buckets on lax
  (``weight_update.xla_collectives``).

Whether the flags pay is a question of topology, and ``python -m bench.overlap_report``
answers it (compiler estimates and the cost model; docs/benchmarks.md has the table): each
collective they keep apart pays the torus's latency, which grows with its diameter. For a
ResNet-50 step at batch 32 per replica they shorten the weight-update-sharding step on
v5e:4x4 and lengthen every step on v5e:16x16, so nothing applies them by default.

The flags:

* ``--xla_jf_crs_combiner_threshold_in_bytes``: merge only all-reduces below
  ``COMBINE_BELOW_BYTES``;
* ``--xla_tpu_enable_async_collective_fusion`` (with ``_fuse_all_reduce``,
  ``_fuse_all_gather``, ``_fuse_reduce_scatter`` and ``_multiple_steps``): run collectives
  asynchronously, their steps fused into the compute fusions between start and done;
* ``--xla_tpu_overlap_compute_collective_tc``: let the TensorCore compute meanwhile;
* ``--xla_enable_async_all_reduce``, ``--xla_enable_async_all_gather``: start/done pairs.

libtpu reads ``LIBTPU_INIT_ARGS`` once, when jax first starts a backend: call ``apply()``
before any jax computation (``python -m resnet`` does, with ``config.xla_overlap_settings``).
An unknown flag aborts libtpu's start, so the flags are only those this package was
compiled against (libtpu of the ``tpu`` extra). Nothing here has run on a TPU.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from torus_collectives import _jax_internals as jax_internals

ENV_VAR = "LIBTPU_INIT_ARGS"
COMBINE_BELOW_BYTES = 2**20
OVERLAP_FLAGS = (
  f"--xla_jf_crs_combiner_threshold_in_bytes={COMBINE_BELOW_BYTES}",
  "--xla_tpu_enable_async_collective_fusion=true",
  "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
  "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
  "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=true",
  "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
  "--xla_tpu_overlap_compute_collective_tc=true",
  "--xla_enable_async_all_reduce=true",
  "--xla_enable_async_all_gather=true",
)


def libtpu_init_args(existing: str = "") -> str:
  """``existing`` libtpu flags with the overlap flags added; a flag the user already set
  (by name) keeps the user's value."""
  flags = existing.split()
  named = {flag.split("=", 1)[0] for flag in flags}
  flags += [flag for flag in OVERLAP_FLAGS if flag.split("=", 1)[0] not in named]
  return " ".join(flags)


def apply(environ: MutableMapping[str, str] = os.environ) -> str:
  """Adds the overlap flags to ``LIBTPU_INIT_ARGS`` (returns the new value). Raises if
  jax has already started a backend, since libtpu would never read them."""
  if jax_internals.backends_initialized():
    raise RuntimeError(
      "torus_collectives.xla_settings.apply() must run before jax starts a backend "
      "(before the first jax.devices() or computation): call it at the top of the program"
    )
  environ[ENV_VAR] = libtpu_init_args(environ.get(ENV_VAR, ""))
  return environ[ENV_VAR]
