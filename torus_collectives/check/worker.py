"""The worker process: runs a batch of cases and reports each as it ends.

``python -m torus_collectives.check.worker SPEC.json``, started by ``runner``; it is the
only kind of process of the check that initialises a jax backend (on a TPU, one process
at a time holds the chips). The spec: ``{"kind": "probe" | "correctness" | "measure" |
"step", "cases": [...], "interpret": bool, "plugins": [module, ...], "rounds": int,
"xla_settings": bool}``; with ``xla_settings`` the package's libtpu flags
(``torus_collectives.xla_settings``) are set before any backend starts.

Protocol, on stdout, one JSON object per line after the marker ``@@check`` (other output,
from jax or a plugin, is ignored; logs go to stderr):

1. ``{"event": "ready", "process": ...}`` once the plugins are imported and the devices
   are up (for "probe", with what it found: platform, device kind and count, the chips'
   torus shape, versions);
2. per case, ``{"event": "start", "id": ...}`` before it runs and ``{"event": "result",
   "id": ..., ...}`` after, flushed at once: the parent times each case from its start,
   and a case that raises is reported with its error while the batch goes on;
3. ``{"event": "done"}``.

A case that never ends is ended by the parent, which kills this process (its whole
process group) and starts a fresh worker for the cases after it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import time
import traceback

MARKER = "@@check "


def emit(**event) -> None:
  sys.stdout.write(MARKER + json.dumps(event) + "\n")
  sys.stdout.flush()


def _version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def probe() -> dict:
  """The devices jax sees here, and the versions that matter."""
  import jax
  import numpy as np

  devices = jax.devices()
  physical = None
  if hasattr(devices[0], "coords"):
    coords = np.array([d.coords for d in devices])
    cores = np.array([getattr(d, "core_on_chip", 0) for d in devices])
    extent = coords.max(0) - coords.min(0) + 1
    extent[-1] *= int(cores.max()) + 1
    physical = [int(n) for n in extent if n > 1] or [1]
  return {
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "device_count": jax.device_count(),
    "process_count": jax.process_count(),
    "physical": physical,
    "versions": {
      "jax": jax.__version__,
      "jaxlib": _version("jaxlib"),
      "libtpu": _version("libtpu") or _version("libtpu-nightly"),
      "torus-collectives": _version("torus-collectives"),
      "numpy": np.__version__,
      "python": sys.version.split()[0],
    },
  }


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  with open(argv[0]) as f:
    spec = json.load(f)
  if spec.get("xla_settings"):
    from torus_collectives import xla_settings

    xla_settings.apply()
  for module in spec.get("plugins", []):
    importlib.import_module(module)
  import jax

  from torus_collectives.check import cases, measure, step, verify
  from torus_collectives.tuning import tables

  jax.devices()  # the backend up before the first case's clock starts
  if spec["kind"] == "probe":
    emit(event="ready", process=tables.PROCESS, **probe())
    emit(event="done")
    return 0
  emit(event="ready", process=tables.PROCESS)
  for item in spec["cases"]:
    case_id = item if isinstance(item, str) else item["id"]
    emit(event="start", id=case_id)
    start = time.perf_counter()
    try:
      if spec["kind"] == "correctness":
        result = verify.run(cases.Case.from_id(case_id), spec.get("interpret", False))
      elif spec["kind"] == "step":
        result = step.time_item(item, spec["rounds"])
        result["status"] = "measured"
      else:
        result = measure.time_case(cases.Measure.from_dict(item), spec["rounds"])
        result["status"] = "measured"
    except Exception as e:  # noqa: BLE001 (every failure is the case's result)
      lines = traceback.format_exception(e)
      result = {"status": "error", "detail": f"{type(e).__name__}: {e}"[:2000]}
      result["traceback"] = "".join(lines)[-4000:]
    result["seconds"] = round(time.perf_counter() - start, 3)
    emit(event="result", id=case_id, **result)
  emit(event="done")
  return 0


if __name__ == "__main__":
  sys.exit(main())
