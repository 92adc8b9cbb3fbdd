"""Checks every config field before anything is built, naming the field and its valid range.

``validate_config(config)`` needs nothing but the config, so the entry point runs it before
jax starts; with ``num_devices`` it also checks what needs jax or the devices (the model
and gradient implementation names, that the implementation carries a block-scaled gradient
transport, batch divisibility, the torus shape, the BN group). It
collects every problem and raises one
``ValueError`` listing them all, so a user fixes a command line in one go. Checks that need
the data (the batch against the dataset size, the warmup against the run length) are made
where the data is listed, still before anything compiles.

Fields hold plain Python values (ml_collections keeps each field's type on override); bool
is not accepted where a number is meant.
"""

import math
from collections.abc import Callable

import ml_collections

DTYPES = ("float32", "bfloat16", "float16")  # compute dtypes of the model
# Gradient transport dtypes besides '' (none): a cast, which only the plain all-reduce
# takes, or a block-scaled format (torus_collectives/quantization.py), which only the
# implementations with block-scaled transport carry.
CAST_TRANSPORT_DTYPES = ("bfloat16",)
BLOCK_SCALED_TRANSPORT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
# The implementations that return the quantization residual of error feedback ("auto" runs
# block-scaled transport on "shard_map"; "pallas" returns none).
ERROR_FEEDBACK_IMPLEMENTATIONS = ("auto", "shard_map")
# The most axes of a torus mesh (``torus_collectives.registry.MAX_TORUS_AXES``, not imported
# here so that validating needs no jax).
MAX_MESH_AXES = 3


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
  return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def _int_at_least(low: int) -> tuple[Callable, str]:
  return (lambda v: _is_int(v) and v >= low), f"an integer >= {low}"


def _real_in(low: float, high: float, *, open_low=False, open_high=False) -> tuple[Callable, str]:
  def ok(v):
    return (
      _is_real(v) and (low < v if open_low else low <= v) and (v < high if open_high else v <= high)
    )

  brackets = ("(" if open_low else "[") + f"{low}, {high}" + (")" if open_high else "]")
  return ok, f"a finite number in {brackets}"


def _one_of(choices) -> tuple[Callable, str]:
  return (lambda v: v in choices), f"one of {', '.join(map(repr, choices))}"


def _fraction_pair(v) -> bool:
  return (
    isinstance(v, tuple | list) and len(v) == 2 and all(map(_is_real, v)) and 0 < v[0] <= v[1] <= 1
  )


def _torus_shape(v) -> bool:
  return (
    isinstance(v, tuple | list)
    and len(v) <= MAX_MESH_AXES
    and all(_is_int(n) and n >= 1 for n in v)
  )


_BOOL = ((lambda v: isinstance(v, bool)), "True or False")
_NONEMPTY_STR = ((lambda v: isinstance(v, str) and v != ""), "a non-empty string")
_POSITIVE = _real_in(0, math.inf, open_low=True, open_high=True)
_NON_NEGATIVE = _real_in(0, math.inf, open_high=True)

# field -> (predicate, description of the valid range)
RULES = {
  "simulated_cpu_devices": _int_at_least(0),
  "mesh_shape": (
    _torus_shape,
    "empty (the most square 2-D torus) or one, two or three positive integers multiplying to "
    "the device count",
  ),
  "dataset": (
    lambda v: (
      isinstance(v, str)
      and (v in ("digits", "imagenet2012") or (v.startswith("folder:") and len(v) > 7))
    ),
    "'digits', 'imagenet2012' or 'folder:<root>'",
  ),
  "data_dir": ((lambda v: isinstance(v, str)), "a string (a directory; empty: the default)"),
  "train_split": _NONEMPTY_STR,
  "eval_split": _NONEMPTY_STR,
  "image_size": _int_at_least(1),
  "crop_area_range": (_fraction_pair, "a pair (low, high) with 0 < low <= high <= 1"),
  "random_flip": _BOOL,
  "eval_crop_fraction": _real_in(0, 1, open_low=True),
  "cache": _BOOL,
  "shuffle_buffer": _int_at_least(0),
  "prefetch_to_device": _int_at_least(1),
  "model": _NONEMPTY_STR,  # the runtime check names the architectures
  "dtype": _one_of(DTYPES),
  "bn_momentum": _real_in(0, 1),
  "bn_span_examples": _int_at_least(1),
  "bn_group_size": (
    lambda v: _is_int(v) and v >= 0,
    "an integer >= 0 (0: derived from bn_span_examples) dividing the device count",
  ),
  "global_batch_size": (
    lambda v: _is_int(v) and v >= 1,
    "a positive multiple of the device count",
  ),
  "eval_batch_size": (lambda v: _is_int(v) and v >= 1, "a positive multiple of the device count"),
  "num_epochs": _POSITIVE,
  "num_train_steps": (
    _is_int,
    "an integer: > 0 sets the number of steps, <= 0 uses num_epochs",
  ),
  "warmup_epochs": _NON_NEGATIVE,
  "base_learning_rate": _POSITIVE,
  "end_learning_rate": _NON_NEGATIVE,
  "lr_decay_power": _NON_NEGATIVE,
  "weight_decay": _NON_NEGATIVE,
  "momentum": _real_in(0, 1, open_high=True),
  "lars_trust_coefficient": _POSITIVE,
  "lars_eps": _NON_NEGATIVE,
  "label_smoothing": _real_in(0, 1, open_high=True),
  "grad_implementation": _NONEMPTY_STR,
  "grad_bucket_bytes": _int_at_least(1),  # the runtime check names the implementations
  "grad_transport_dtype": (
    lambda v: v in ("", *CAST_TRANSPORT_DTYPES, *BLOCK_SCALED_TRANSPORT_DTYPES),
    "'' (gradients travel in their own dtype), "
    + ", ".join(map(repr, CAST_TRANSPORT_DTYPES))
    + " or a block-scaled format, "
    + ", ".join(map(repr, BLOCK_SCALED_TRANSPORT_DTYPES)),
  ),
  "grad_error_feedback": _BOOL,
  "grad_overlap": _BOOL,
  "tune": _BOOL,
  "weight_update_sharding": _BOOL,
  "defer_weight_gather": _BOOL,
  "xla_overlap_settings": _BOOL,
  "seed": (lambda v: _is_int(v) and 0 <= v < 2**30, "an integer in [0, 2**30)"),
  "log_every_steps": _int_at_least(1),
  "eval_every_epochs": _POSITIVE,
  "checkpoint_every_steps": _int_at_least(1),
  "heartbeat_timeout_seconds": _int_at_least(2),
  "stop_timeout_seconds": _POSITIVE,
}


def _cross_field_problems(config) -> list[str]:
  """Fields valid alone but not together (checked once every field is valid alone)."""
  return gradient_sync_problems(config)


def gradient_sync_problems(config) -> list[str]:
  """The combinations of the gradient fields that the example refuses, each named with how
  to fix it; ``grad_sync.strategy_from_config`` refuses them too, so none is ever built."""
  problems = []
  if config.defer_weight_gather and not config.weight_update_sharding:
    problems.append(
      "config.defer_weight_gather=True needs config.weight_update_sharding=True (only the "
      "sharded optimizer leaves the new weights as shards to gather later)."
    )
  if config.grad_transport_dtype in CAST_TRANSPORT_DTYPES and config.weight_update_sharding:
    problems.append(
      f"config.grad_transport_dtype={config.grad_transport_dtype!r} needs "
      "config.weight_update_sharding=False: the sharded optimizer's reduce-scatter takes "
      f"only a block-scaled transport ({', '.join(map(repr, BLOCK_SCALED_TRANSPORT_DTYPES))})."
    )
  if (
    config.grad_error_feedback and config.grad_transport_dtype not in BLOCK_SCALED_TRANSPORT_DTYPES
  ):
    problems.append(
      f"config.grad_error_feedback=True needs a block-scaled config.grad_transport_dtype "
      f"({', '.join(map(repr, BLOCK_SCALED_TRANSPORT_DTYPES))}), not "
      f"{config.grad_transport_dtype!r}: only quantization leaves a residual to feed back. "
      "Set config.grad_transport_dtype='int8' or config.grad_error_feedback=False."
    )
  if (
    config.grad_error_feedback and config.grad_implementation not in ERROR_FEEDBACK_IMPLEMENTATIONS
  ):
    problems.append(
      f"config.grad_error_feedback=True needs config.grad_implementation in "
      f"{list(ERROR_FEEDBACK_IMPLEMENTATIONS)}, not {config.grad_implementation!r}, which "
      "returns no quantization residual. Set config.grad_implementation='shard_map' or "
      "config.grad_error_feedback=False."
    )
  if config.grad_overlap and config.weight_update_sharding:
    problems.append(
      "config.grad_overlap=True with config.weight_update_sharding=True is not offered: "
      "the package has no threaded sharded step (it never beat the blocking one and "
      "stalled in TPU interpret mode). Set config.grad_overlap=False or "
      "config.weight_update_sharding=False."
    )
  if config.grad_overlap and config.grad_transport_dtype:
    problems.append(
      f"config.grad_overlap=True sums the gradients in their own dtype, not "
      f"config.grad_transport_dtype={config.grad_transport_dtype!r}. Set "
      "config.grad_transport_dtype='' or config.grad_overlap=False."
    )
  return problems


def _runtime_problems(config, num_devices: int) -> list[str]:
  """What needs jax up (imported here, so the entry point can validate before it starts)."""
  from resnet import models
  from torus_collectives import registry

  problems = []
  if config.model not in models.ARCHITECTURES:
    problems.append(f"config.model={config.model!r} must be one of {sorted(models.ARCHITECTURES)}.")
  if config.grad_implementation not in registry.IMPLEMENTATIONS:
    problems.append(
      f"config.grad_implementation={config.grad_implementation!r} must be one of "
      f"{list(registry.IMPLEMENTATIONS)}."
    )
  block_scaled = ["auto", *(n for n, b in registry.BACKENDS.items() if b.block_scaled_transport)]
  if (
    config.grad_transport_dtype in BLOCK_SCALED_TRANSPORT_DTYPES
    and config.grad_implementation in registry.IMPLEMENTATIONS
    and config.grad_implementation not in block_scaled
  ):
    problems.append(
      f"config.grad_transport_dtype={config.grad_transport_dtype!r} is block-scaled: "
      f"config.grad_implementation must be one of {block_scaled}, not "
      f"{config.grad_implementation!r}, whose collectives cannot requantize the partial sums "
      "at each hop."
    )
  for name in ("global_batch_size", "eval_batch_size"):
    if config[name] % num_devices:
      problems.append(
        f"config.{name}={config[name]} must be a positive multiple of the {num_devices} devices."
      )
  if config.bn_group_size and num_devices % config.bn_group_size:
    problems.append(
      f"config.bn_group_size={config.bn_group_size} must be 0 or divide the {num_devices} devices."
    )
  if config.mesh_shape and math.prod(config.mesh_shape) != num_devices:
    problems.append(
      f"config.mesh_shape={tuple(config.mesh_shape)} must multiply to the {num_devices} "
      "devices (or be empty)."
    )
  return problems


def validate_config(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> None:
  """Raises ``ValueError`` naming every invalid field and its valid range.

  Args:
    config: a config in the shape of ``resnet/configs/default.py``.
    num_devices: the global device count; None skips the checks that need jax.
  """
  problems = []
  for name, (ok, valid) in RULES.items():
    if name not in config:
      problems.append(f"config.{name} is missing; it must be {valid}.")
    elif not ok(config[name]):
      problems.append(f"config.{name}={config[name]!r} is invalid; it must be {valid}.")
  if not problems:
    problems += _cross_field_problems(config)
  if num_devices is not None and not problems:  # the runtime checks assume sane types
    problems += _runtime_problems(config, num_devices)
  if problems:
    raise ValueError("Invalid config:\n  " + "\n  ".join(problems))
