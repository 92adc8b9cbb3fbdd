"""The XLA/libtpu settings under which gradient collectives overlap the backward pass.

By default XLA's TPU all-reduce combiner merges every gradient all-reduce of a step into
one synchronous collective, placed after the last backward convolution: the whole
gradient sum is on the critical path. With the flags below (read by libtpu when it
loads; MaxText documents them), compiled ahead of time for v5e:4x4, the ``lax.pmean``
of a ResNet-50 step's gradients (batch 32 per replica) is no longer merged: 66 of its
all-reduces, holding most of the gradient's bytes, become ``async-collective-start``/
``-done`` pairs with compute scheduled between them, and 197 small ones stay synchronous
(compiler output; how much time that hides is what ``bench.overlap_report`` estimates):

* ``--xla_jf_crs_combiner_threshold_in_bytes=0``: do not merge all-reduces;
* ``--xla_tpu_enable_async_collective_fusion`` (with ``_fuse_all_reduce`` and
  ``_multiple_steps``): run collectives asynchronously, their steps fused into the
  compute fusions between start and done;
* ``--xla_tpu_overlap_compute_collective_tc``: let the TensorCore compute meanwhile;
* ``--xla_enable_async_all_reduce``: all-reduces as start/done pairs.

libtpu reads ``LIBTPU_INIT_ARGS`` once, when jax first starts a backend: call ``apply()``
before any jax computation (``python -m resnet`` does, on TPU configs). An unknown flag
aborts libtpu's start, so the flags are only those this package was compiled against
(libtpu of the ``tpu`` extra). Whether the overlap pays is what
``python -m bench.overlap_report`` estimates; nothing here has run on a TPU.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from torus_collectives import _jax_internals as jax_internals

ENV_VAR = "LIBTPU_INIT_ARGS"
OVERLAP_FLAGS = (
  "--xla_jf_crs_combiner_threshold_in_bytes=0",
  "--xla_tpu_enable_async_collective_fusion=true",
  "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
  "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
  "--xla_tpu_overlap_compute_collective_tc=true",
  "--xla_enable_async_all_reduce=true",
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
