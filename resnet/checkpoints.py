"""Orbax checkpoints that are verified before they are trusted.

Right after a step is saved, process 0 records the size and SHA-256 of every file orbax
wrote for it in ``<step>/digests.json`` (written to a temporary name and renamed, so it is
whole or absent). On restore, steps are tried newest first: a step whose files do not match
their record, that has no record (the run ended between the save and the record), or that
fails to load is reported with its step and path, moved to
``<workdir>/rejected_checkpoints/``, and the next older one is tried. Two steps are kept,
so one bad checkpoint costs at most one checkpoint interval.

Assumptions: every process sees the same checkpoint directory (a shared filesystem, as
orbax's multi-process saving already requires) and it is a local path. Saves are
synchronous, so a step's record follows its files by the hashing time only; at the
configured intervals that pause is small next to training.
"""

import datetime
import hashlib
import json
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

DIGESTS = "digests.json"
KEEP = 2


def file_digests(step_dir: pathlib.Path) -> dict[str, list]:
  """``{relative path: [size, sha256 hex]}`` of every file under ``step_dir``."""
  digests = {}
  for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != DIGESTS):
    with path.open("rb") as f:
      digests[str(path.relative_to(step_dir))] = [
        path.stat().st_size,
        hashlib.file_digest(f, "sha256").hexdigest(),
      ]
  return digests


def record_digests(step_dir: pathlib.Path) -> None:
  tmp = step_dir / f"{DIGESTS}.tmp"
  tmp.write_text(json.dumps(file_digests(step_dir)))
  tmp.rename(step_dir / DIGESTS)


def verification_problem(step_dir: pathlib.Path) -> str | None:
  """Why ``step_dir`` does not match its record, or None when every file does."""
  try:
    recorded = json.loads((step_dir / DIGESTS).read_text())
  except FileNotFoundError:
    return f"no {DIGESTS} (the run ended before the save was recorded)"
  except (OSError, ValueError) as e:
    return f"unreadable {DIGESTS} ({e})"
  actual = file_digests(step_dir)
  for name, (size, digest) in recorded.items():
    if name not in actual:
      return f"{name} is missing"
    if actual[name][0] != size:
      return f"{name} has {actual[name][0]} bytes, {size} were written"
    if actual[name][1] != digest:
      return f"{name} does not match its SHA-256 ({size} bytes)"
  return None


class VerifiedCheckpoints:
  """``<workdir>/checkpoints`` through orbax, with digests recorded and checked.

  Attributes:
    latest: the newest step saved with its digests recorded, or restored after
      verification, in this run; None before either.
  """

  def __init__(self, workdir: pathlib.Path):
    self.directory = workdir / "checkpoints"
    self._rejected_dir = workdir / "rejected_checkpoints"
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=KEEP, enable_async_checkpointing=False),
    )
    self.latest: int | None = None

  def describe_latest(self) -> str:
    """Where a rerun resumes, for messages."""
    if self.latest is None:
      return "step 0 (no checkpoint saved or verified in this run)"
    return f"step {self.latest} in {self.directory}"

  def save(self, step: int, state: Any) -> None:
    self._manager.save(step, args=ocp.args.StandardSave(state))
    if jax.process_index() == 0:
      record_digests(self.directory / str(step))
    self.latest = step

  def restore_newest_intact(self, abstract_state: Any) -> Any | None:
    """The newest checkpoint that verifies and loads into ``abstract_state``'s shardings,
    or None when there is none; every process restores the same step."""
    state, rejected = None, []
    for step in sorted(self._manager.all_steps(), reverse=True):
      step_dir = self.directory / str(step)
      problem = verification_problem(step_dir)
      if problem is None:
        try:
          state = self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except Exception as e:  # noqa: BLE001  # any failure to load makes it unusable
          problem = f"failed to load: {type(e).__name__}: {e}"
      if problem is None:
        self.latest = step
        break
      logging.error(
        "Checkpoint step %d at %s is unusable: %s. Skipping it.", step, step_dir, problem
      )
      rejected.append(step)
    if jax.process_count() > 1:
      chosen = multihost_utils.process_allgather(
        np.int64(-1 if self.latest is None else self.latest)
      )
      if len(set(chosen.tolist())) > 1:
        raise RuntimeError(
          f"Processes chose different checkpoints to resume from ({chosen.tolist()} by process): "
          f"they do not see the same files in {self.directory}."
        )
    if rejected:
      self._reject(rejected)
    return state

  def _reject(self, steps: list[int]) -> None:
    """Moves the unusable steps aside, so that they are kept for inspection and the run
    can save those step numbers again."""
    if jax.process_index() == 0:
      self._rejected_dir.mkdir(exist_ok=True)
      stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
      for step in steps:
        target = self._rejected_dir / f"{step}-{stamp}"
        (self.directory / str(step)).rename(target)
        logging.error("Moved the unusable checkpoint step %d to %s.", step, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("resnet: unusable checkpoints moved")
    self._manager.reload()

  def close(self) -> None:
    self._manager.close()
