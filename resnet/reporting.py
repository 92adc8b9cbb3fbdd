"""Training metrics out of the loop: TensorBoard scalars, a JSON-lines log, a PNG plot.

Scalars go through the low-level ``tf.summary.write`` tagged for TensorBoard's scalars
plugin, so writing them needs only TensorFlow, not the tensorboard package. Only process 0
writes. ``metrics.jsonl`` is appended across restarts, so the final plot covers a resumed
run from its first step; a run resumed at step k first drops the rows after k (the steps
it repeats), so the file holds one row per step after any number of resumes. TensorBoard
sorts out repeated steps itself (it discards the superseded events).
"""

import json
import pathlib

import jax
import tensorflow as tf

_SCALAR = tf.compat.v1.SummaryMetadata(
  plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
)


class MetricWriter:
  """Writes scalars to TensorBoard and to ``<workdir>/metrics.jsonl``."""

  def __init__(self, workdir: str | pathlib.Path, start_step: int = 0):
    self._enabled = jax.process_index() == 0
    self._path = pathlib.Path(workdir) / "metrics.jsonl"
    self._tb = tf.summary.create_file_writer(str(workdir)) if self._enabled else None
    if self._enabled and self._path.exists():
      kept = [r for r in read_metrics(workdir) if r["step"] <= start_step]
      tmp = self._path.with_suffix(".tmp")
      tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
      tmp.rename(self._path)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self._enabled:
      return
    with self._tb.as_default():
      for name, value in scalars.items():
        tf.summary.write(name, tf.constant(value, tf.float32), step=step, metadata=_SCALAR)
    self._tb.flush()
    with self._path.open("a") as f:
      f.write(json.dumps({"step": step, **scalars}) + "\n")


def read_metrics(workdir: str | pathlib.Path) -> list[dict[str, float]]:
  """The rows of ``metrics.jsonl``, without a last line cut short by a killed run."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  rows = []
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      rows.append(json.loads(line))
    except ValueError:
      continue
  return rows


def series(records: list[dict[str, float]], name: str) -> tuple[tuple, tuple]:
  """(steps, values) of the metric ``name`` in ``records``, only the rows that have it
  (evaluations happen on some steps only); two empty tuples when none has it."""
  points = [(r["step"], r[name]) for r in records if name in r]
  return tuple(zip(*points)) if points else ((), ())


def plot_curves(workdir: str | pathlib.Path) -> pathlib.Path | None:
  """Saves ``curves.png``: training loss, and train/eval top-1 against the step."""
  if jax.process_index() != 0:
    return None
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  records = read_metrics(workdir)
  fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
  loss_ax.plot(*series(records, "train_loss"))
  loss_ax.set(xlabel="step", ylabel="training loss (label-smoothed)", yscale="log")
  for name in ("train_accuracy", "eval_top1", "eval_top5"):
    acc_ax.plot(*series(records, name), marker=".", label=name)
  acc_ax.set(xlabel="step", ylabel="accuracy", ylim=(0, 1))
  acc_ax.legend()
  fig.tight_layout()
  path = pathlib.Path(workdir) / "curves.png"
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
