"""Runs batches of cases in worker processes, with a watchdog per case.

One broken kernel must not take the check down or freeze it, and on a TPU a kernel that
deadlocks can only be stopped by ending its process. So every case runs in a worker
(``worker``), and starting jax and compiling in a fresh process is slow, so a worker runs
as many cases as it can:

1. a worker starts with every remaining case of the batch; it has ``startup_s`` to come up
   (import jax, open the devices, import the plugins);
2. each case has ``timeout_s`` from its ``start`` event (compiling included) to its
   ``result``. A case that raises is a result like any other, and the worker goes on;
3. a case past its timeout is recorded as a **hang**; a worker that exits in the middle
   of a case (a crash, an abort in the runtime) leaves that case recorded as a
   **crash**, with the end of the worker's stderr. Either way the worker's process group
   is killed and a fresh worker takes the cases after it;
4. a worker that never comes up, or exits before its first case, ends the batch: every
   case left is recorded as an error with the worker's stderr (a fresh worker would fail
   alike).

``on_result(id, result)`` is called as each case ends, for progress lines.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torus_collectives.check.worker import MARKER

STARTUP_S = 300.0


def _reader(stream, out: queue.Queue) -> None:
  for line in stream:
    if line.startswith(MARKER):
      try:
        out.put(json.loads(line[len(MARKER) :]))
      except json.JSONDecodeError:
        continue
  out.put(None)  # end of stream: the worker exited


def _tail(path: str, limit: int = 3000) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-limit:]
  except OSError:
    return ""


def _kill(proc: subprocess.Popen) -> None:
  """Ends the worker and anything it started (its own process group)."""
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait()


def worker_env(extra_paths: Sequence[str] = ()) -> dict[str, str]:
  """The environment of a worker: this one, with the caller's working directory (where
  ``--plugin`` modules are found, as ``python -m`` finds them) on ``PYTHONPATH``."""
  env = dict(os.environ)
  paths = [*extra_paths, os.getcwd(), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
  env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
  return env


class Worker:
  """One worker process on a spec file, read through a queue of its events."""

  def __init__(self, spec: dict, workdir: str):
    fd, self.spec_path = tempfile.mkstemp(suffix=".json", dir=workdir)
    with os.fdopen(fd, "w") as f:
      json.dump(spec, f)
    self.stderr_path = self.spec_path.replace(".json", ".stderr")
    self._stderr = open(self.stderr_path, "w")
    self.proc = subprocess.Popen(
      [sys.executable, "-m", "torus_collectives.check.worker", self.spec_path],
      stdout=subprocess.PIPE,
      stderr=self._stderr,
      stdin=subprocess.DEVNULL,
      text=True,
      env=worker_env(),
      start_new_session=True,
    )
    self.events: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(self.proc.stdout, self.events), daemon=True).start()

  def next_event(self, timeout: float) -> dict | None | str:
    """The next event; None when the worker has exited; "timeout" after ``timeout`` s."""
    try:
      return self.events.get(timeout=max(timeout, 0.0))
    except queue.Empty:
      return "timeout"

  def stop(self) -> str:
    """Kills the worker; returns the end of its stderr."""
    _kill(self.proc)
    self._stderr.close()
    return _tail(self.stderr_path)


def probe(plugins: Sequence[str], startup_s: float = STARTUP_S) -> dict:
  """What a worker finds: the devices and versions (``worker.probe``)."""
  with tempfile.TemporaryDirectory(prefix="torus-check-") as workdir:
    w = Worker({"kind": "probe", "cases": [], "plugins": list(plugins)}, workdir)
    event = w.next_event(startup_s)
    stderr = w.stop()
  if not isinstance(event, dict) or event.get("event") != "ready":
    raise RuntimeError(f"the probe worker did not start:\n{stderr}")
  return event


def _failure(status: str, detail: str, stderr: str, seconds: float | None = None) -> dict:
  result = {"status": status, "detail": detail, "stderr": stderr[-1500:]}
  return result if seconds is None else result | {"seconds": round(seconds, 3)}


def _drive(w: Worker, record, processes: list, timeout_s: float, startup_s: float) -> int | None:
  """Reads ``w``'s events until it is done, or stopped; returns the cases it ended
  (a hang or a crash counts), None if it ended none and failed (``record`` then holds
  every remaining case as an error)."""
  current, since, ready, ran = None, time.monotonic(), False, 0
  while True:
    limit = timeout_s if ready else startup_s
    event = w.next_event(since + limit - time.monotonic())
    kind = event.get("event") if isinstance(event, dict) else event
    if kind == "ready":
      ready, since = True, time.monotonic()
      processes.append(event["process"])
    elif kind == "start":
      current, since = event["id"], time.monotonic()
    elif kind == "result":
      record(event["id"], {k: v for k, v in event.items() if k not in ("event", "id")})
      current, since, ran = None, time.monotonic(), ran + 1
    elif kind == "done":
      w.stop()
      return ran
    elif current is not None:  # a timeout or an exit in the middle of a case
      stderr = w.stop()
      if kind == "timeout":
        detail = f"no result within {timeout_s:g} s: the worker was killed"
        record(current, _failure("hang", detail, stderr, timeout_s))
      else:
        detail = f"the worker exited (code {w.proc.returncode}) during the case"
        record(current, _failure("crash", detail, stderr))
      return ran + 1
    else:  # never came up, or exited or stalled between cases
      stderr = w.stop()
      if ran:
        return ran
      why = "did not start" if kind == "timeout" else "exited before its first case"
      record(None, _failure("error", f"the worker {why}: {stderr}", stderr))
      return None


def run_batch(
  kind: str,
  items: Sequence[Any],
  *,
  timeout_s: float,
  interpret: bool = False,
  plugins: Sequence[str] = (),
  rounds: int = 0,
  startup_s: float = STARTUP_S,
  on_result: Callable[[str, dict], None] | None = None,
  on_worker: Callable[[str], None] | None = None,
  xla_settings: bool = False,
) -> tuple[dict[str, dict], list[str]]:
  """Runs ``items`` (case ids, or measurement dicts with an ``id``) in workers; returns
  ``({id: result}, [process id of every worker that came up])``. With ``xla_settings``
  the workers set the package's libtpu flags before their backend starts."""
  ids = [i if isinstance(i, str) else i["id"] for i in items]
  by_id = dict(zip(ids, items))
  results: dict[str, dict] = {}
  processes: list[str] = []
  remaining = list(ids)

  def record(case_id: str | None, result: dict) -> None:
    for i in [case_id] if case_id is not None else list(remaining):  # None: all left
      results[i] = result
      remaining.remove(i)
      if on_result:
        on_result(i, result)

  with tempfile.TemporaryDirectory(prefix="torus-check-") as workdir:
    while remaining:
      spec = {
        "kind": kind,
        "cases": [by_id[i] for i in remaining],
        "interpret": interpret,
        "plugins": list(plugins),
        "rounds": rounds,
        "xla_settings": xla_settings,
      }
      if on_worker:
        on_worker(f"worker started for {len(remaining)} case(s)")
      ran = _drive(Worker(spec, workdir), record, processes, timeout_s, startup_s)
      if ran is None:  # it never came up, or died before its first case
        break
  return results, processes
