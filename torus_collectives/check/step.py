"""Stage 2, the train step: the ResNet example's step in images/s, per variant, against XLA.

Needs the checkout's ``resnet/`` package (the wheel does not install it); without it the
stage reports the step as skipped. What is timed is ``resnet.train.build_train_step`` (the
forward and backward pass, the gradient mean over every device, LARS, the batch-norm
statistics) on random images, jitted without donation, so every call reuses one state
and one batch; the global batch is the per-replica batch times the devices, split over
them. The model and images: on TPU the imagenet config's (ResNet-50, 224 px, bfloat16)
at per-replica batches of 8 and 32; off TPU a stand-in small enough to compile in
seconds (``--quick``: ``resnet_tiny`` at 16 px; otherwise ResNet-18 at 32 px; float32),
at 2 per replica. Off TPU the figures time this host's cores, not an interconnect.

The variants (``VARIANTS``), each a change of the config:

* ``xla``: ``grad_implementation="xla"``, the baseline;
* ``pallas``: the package's blocking Pallas kernels (TPU only: elsewhere they would run
  in interpret mode, which times the interpreter);
* ``threaded``: ``grad_overlap`` with the Pallas split kernels threaded through the
  backward pass (TPU only, for the same reason);
* ``int8``: ``grad_transport_dtype="int8"``, on ``"pallas"`` on TPU and ``"shard_map"``
  elsewhere;
* ``weight_update_sharding``: reduce-scatter, LARS on each device's shard, all-gather
  (``tc.sharded_update`` on ``"xla"``; the weights gathered within the step);
* ``xla_settings``: ``"xla"`` under the package's libtpu flags
  (``torus_collectives.xla_settings``). libtpu reads them once per process, so this
  variant runs in a worker of its own and is not interleaved with the baseline: its ratio
  is the ratio of the two medians, without an interval. TPU only (the flags are libtpu's).

Each work item is one variant at one batch, in a worker (``runner``), so a variant that
fails or hangs is reported and the others still run. An item times the variant and the
baseline interleaved (``tuning.timing.Interleaved``: compiled and warmed first, then
rounds of a fresh random order); the baseline's step is built once per worker and batch.
A row's ``ratio`` is the median over rounds of ``t_variant / t_xla``, with the bootstrap
interval of ``measure.interval``; ``images_per_s`` is the global batch over the median
seconds of a call.

On TPU, from a checkout, each row carries ``bench.overlap_report``'s prediction for the
same compiled program: the compiler's cycle estimates at the clock calibrated on a bf16
matmul, with every gradient collective priced by ``cost_model`` for the chip's
generation; ``measured_over_predicted`` is measured images/s over predicted images/s
(below 1: slower than the model says). Off TPU there is none: the model prices TPU links.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
from collections.abc import Sequence

from torus_collectives import cost_model
from torus_collectives.check.measure import interval, sig

BASELINE = "xla"
VARIANTS = ("xla", "pallas", "threaded", "int8", "weight_update_sharding", "xla_settings")
TPU_BATCHES = (8, 32)
OTHER_BATCHES = (2,)
NO_PREDICTION = "no prediction: the model prices TPU links"


def available() -> bool:
  """Whether the checkout's ``resnet`` package can be imported here."""
  return importlib.util.find_spec("resnet") is not None


def item_id(variant: str, batch: int) -> str:
  return f"{variant}:{batch}"


def plan(
  platform: str, quick: bool, variants: Sequence[str] = VARIANTS
) -> tuple[list[dict], list[dict]]:
  """(work items, skipped rows) of ``variants`` for a machine of ``platform``. An item:
  ``{"id", "variant", "batch", "quick", "own_process"}``; a skipped row: ``{"variant",
  "batch", "status": "skipped", "reason"}``."""
  unknown = sorted(set(variants) - set(VARIANTS))
  if unknown:
    raise ValueError(f"unknown train-step variants {unknown}; the variants: {VARIANTS}")
  tpu = platform == "tpu"
  items, skipped = [], []
  for batch in TPU_BATCHES if tpu else OTHER_BATCHES:
    for variant in (v for v in VARIANTS if v in variants):
      reason = None
      if not tpu and variant in ("pallas", "threaded"):
        reason = (
          "the Pallas kernels run natively on TPU only; elsewhere they run in interpret "
          "mode, which would time the interpreter"
        )
      elif not tpu and variant == "xla_settings":
        reason = "the package's XLA settings are libtpu flags: TPU only"
      if reason:
        skipped.append({"variant": variant, "batch": batch, "status": "skipped", "reason": reason})
        continue
      items.append(
        {
          "id": item_id(variant, batch),
          "variant": variant,
          "batch": batch,
          "quick": quick,
          "own_process": variant == "xla_settings",
        }
      )
  return items, skipped


def config_for(variant: str, batch: int, platform: str, num_devices: int, quick: bool):
  """The example's config for ``variant`` at a per-replica ``batch`` (see the module)."""
  from resnet.configs import default, imagenet

  tpu = platform == "tpu"
  if tpu:
    config = imagenet.get_config(global_batch=batch * num_devices)
  else:
    config = default.get_config()
    config.model = "resnet_tiny" if quick else "resnet18"
    config.image_size = 16 if quick else 32
    config.dtype = "float32"
    config.global_batch_size = batch * num_devices
  config.mesh_shape = ()
  config.grad_implementation = BASELINE
  config.weight_update_sharding = False
  config.defer_weight_gather = False
  config.grad_overlap = False
  config.grad_transport_dtype = ""
  config.grad_error_feedback = False
  config.xla_overlap_settings = False
  config.tune = False
  if variant == "pallas":
    config.grad_implementation = "pallas"
  elif variant == "threaded":
    config.grad_implementation, config.grad_overlap = "pallas", True
  elif variant == "int8":
    config.grad_implementation = "pallas" if tpu else "shard_map"
    config.grad_transport_dtype = "int8"
  elif variant == "weight_update_sharding":
    config.weight_update_sharding = True
  elif variant == "xla_settings":
    config.xla_overlap_settings = True
  elif variant != BASELINE:
    raise ValueError(f"unknown train-step variant {variant!r}")
  return config


def build(config, mesh, num_classes: int):
  """``(call, jitted step, state, batch)``: ``call()`` runs one step on a fixed state and
  batch (not donated) and returns its metrics."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from resnet import train

  built = train.build_train_step(
    config, mesh, num_classes=num_classes, steps_per_epoch=100, total_steps=10_000
  )
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), built.running_spec)
  state = jax.device_put(built.sync.layout.to_running(built.init_fn(built.key)), shardings)
  size, examples = config.image_size, config.global_batch_size
  key_image, key_label = jax.random.split(jax.random.key(1))
  split = NamedSharding(mesh, P(mesh.axis_names))
  batch = jax.device_put(
    {
      "image": jax.random.normal(key_image, (examples, size, size, 3), jnp.dtype(config.dtype)),
      "label": jax.random.randint(key_label, (examples,), 0, num_classes),
    },
    split,
  )
  step = jax.jit(built.train_step)
  return (lambda: step(state, batch)[1]), step, state, batch


def _generation(device_kind: str) -> str | None:
  return cost_model.generation_of(device_kind)


_CLOCKS: dict[str, float] = {}  # generation -> calibrated clock (Hz), per worker


def predict(step, state, batch, mesh, global_batch: int) -> tuple[dict | None, str]:
  """``bench.overlap_report``'s prediction for the compiled ``step`` (TPU, checkout only):
  ``({"images_per_s", "step_ms"}, note)``, or ``(None, why not)``."""
  device_kind = mesh.devices.flat[0].device_kind
  if mesh.devices.flat[0].platform != "tpu":
    return None, NO_PREDICTION
  try:
    from bench import overlap_report
    from torus_collectives.testing import hlo_schedule
  except ImportError as e:
    return None, f"no prediction: bench.overlap_report does not import here ({e})"
  generation = _generation(device_kind)
  if generation not in hlo_schedule.PEAK_FLOPS:
    return None, f"no prediction: no peak FLOP/s for {device_kind!r} to calibrate the clock"
  try:
    text = step.lower(state, batch).compile().as_text()
    if generation not in _CLOCKS:  # three matmuls to compile: once per worker
      _CLOCKS[generation] = overlap_report.calibrated_clock(mesh, generation)
    clock = _CLOCKS[generation]
    timeline = overlap_report.step_timeline(text, mesh, generation, clock)
  except Exception as e:  # noqa: BLE001 (the measurement stands without its prediction)
    return None, f"no prediction: {type(e).__name__}: {e}"[:500]
  return (
    {"images_per_s": global_batch / timeline.step_s, "step_ms": 1e3 * timeline.step_s},
    f"bench.overlap_report on {generation}, clock {clock / 1e6:.0f} MHz",
  )


_BASELINES: dict[int, tuple] = {}  # per-replica batch -> the baseline's build, per worker


def time_item(item: dict, rounds: int) -> dict:
  """Times ``item``'s variant and, unless it runs in a process of its own, the baseline,
  interleaved, in this process; returns the seconds of every round, the per-round ratios,
  the global batch and the prediction (or why there is none)."""
  import jax
  import numpy as np

  from resnet import train
  from torus_collectives.tuning import timing

  platform = jax.devices()[0].platform
  variant, batch = item["variant"], item["batch"]
  config = config_for(variant, batch, platform, jax.device_count(), item["quick"])
  mesh = train.create_mesh(config)
  num_classes = 1000 if platform == "tpu" else 10
  calls = {}
  if variant == BASELINE or not item["own_process"]:
    if batch not in _BASELINES:
      base = config_for(BASELINE, batch, platform, jax.device_count(), item["quick"])
      _BASELINES[batch] = build(base, mesh, num_classes)
    calls[BASELINE] = _BASELINES[batch][0]
  if variant == BASELINE:
    call, step, state, inputs = _BASELINES[batch]
  else:
    call, step, state, inputs = build(config, mesh, num_classes)
  calls[variant] = call
  runs = timing.Interleaved(calls).run(rounds)
  loss = float(np.asarray(jax.device_get(call()["train_loss"])))
  if not math.isfinite(loss):
    raise FloatingPointError(f"the step's loss is {loss}")
  prediction, note = predict(step, state, inputs, mesh, config.global_batch_size)
  out = {
    "times": runs.times[variant],
    "global_batch": config.global_batch_size,
    "model": config.model,
    "image_size": config.image_size,
    "dtype": config.dtype,
    "grad_implementation": config.grad_implementation,
    "prediction": prediction,
    "prediction_note": note,
  }
  if variant != BASELINE and BASELINE in calls:
    out["ratios"] = runs.round_ratios(variant, BASELINE)
  return out


def row(item: dict, result: dict, baseline_median: float | None) -> dict:
  """The report's row of ``item`` from its worker's ``result``; ``baseline_median``: the
  baseline's median seconds at this batch (for a variant timed in its own process)."""
  out = {"variant": item["variant"], "batch": item["batch"], "status": result["status"]}
  if result["status"] != "measured":
    return out | {"reason": result.get("detail", "")[:500]}
  t = statistics.median(result["times"])
  out |= {
    "global_batch": result["global_batch"],
    "grad_implementation": result["grad_implementation"],
    "images_per_s": sig(result["global_batch"] / t),
    "step_ms": sig(t * 1e3),
    "rounds": len(result["times"]),
    "seconds": result.get("seconds"),
  }
  if result.get("ratios"):
    low, high = interval(result["ratios"])
    out |= {
      "ratio": sig(statistics.median(result["ratios"])),
      "ci_low": sig(low),
      "ci_high": sig(high),
    }
  elif item["variant"] != BASELINE and baseline_median:
    out["ratio"] = sig(t / baseline_median)  # separate processes: no interval
    out["ratio_note"] = "not interleaved: its own process"
  prediction = result.get("prediction")
  if prediction:
    predicted = prediction["images_per_s"]
    out |= {
      "predicted_images_per_s": sig(predicted),
      "measured_over_predicted": sig(result["global_batch"] / t / predicted),
    }
  out["prediction_note"] = result.get("prediction_note", "")
  return out


def rows(items: Sequence[dict], results: dict[str, dict], skipped: Sequence[dict]) -> list[dict]:
  """Every row, measured, failed or skipped, in the order of ``VARIANTS`` per batch."""
  medians = {}
  for item in items:
    r = results.get(item["id"], {})
    if item["variant"] == BASELINE and r.get("status") == "measured":
      medians[item["batch"]] = statistics.median(r["times"])
  out = [
    row(
      i, results.get(i["id"], {"status": "error", "detail": "no result"}), medians.get(i["batch"])
    )
    for i in items
  ]
  out += [dict(s) for s in skipped]
  order = {v: n for n, v in enumerate(VARIANTS)}
  return sorted(out, key=lambda r: (r["batch"], order[r["variant"]]))
