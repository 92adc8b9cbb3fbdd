"""Several runs' training curves in one figure, e.g. one config with two gradient transport
dtypes:

  python -m resnet.compare_runs RUN_DIR... --out PNG [--labels A B ...]

Each run directory is a ``--workdir`` of ``python -m resnet``; its ``metrics.jsonl``
(``reporting.MetricWriter``, one row per step across resumes) is what is read, so a run's
TensorBoard events are not needed. The figure has the training loss (left) and the
evaluation top-1 (right) against the step, one colour per run; each run's last evaluation
is printed, for the record that goes with the figure.
"""

import argparse
import pathlib
from collections.abc import Sequence

from resnet import reporting


def final_eval(run_dir: str | pathlib.Path) -> dict[str, float]:
  """The last row of ``run_dir``'s metrics that holds an evaluation (its step and metrics);
  raises ValueError when the run has not evaluated (a run cut short, or the wrong folder)."""
  rows = [r for r in reporting.read_metrics(run_dir) if "eval_top1" in r]
  if not rows:
    raise ValueError(f"{run_dir} has no evaluation in metrics.jsonl")
  return rows[-1]


def plot_runs(
  run_dirs: Sequence[str | pathlib.Path],
  out: str | pathlib.Path,
  labels: Sequence[str] | None = None,
) -> pathlib.Path:
  """Saves the training loss and evaluation top-1 of every run in ``run_dirs`` against the
  step to the PNG ``out`` and returns its path; ``labels`` name the runs in the legend
  (default: each directory's name)."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  labels = list(labels) if labels else [pathlib.Path(d).name for d in run_dirs]
  if len(labels) != len(run_dirs):
    raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
  fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
  for run_dir, label in zip(run_dirs, labels):
    records = reporting.read_metrics(run_dir)
    top1 = final_eval(run_dir)["eval_top1"]
    loss_ax.plot(*reporting.series(records, "train_loss"), label=label, alpha=0.8)
    acc_ax.plot(
      *reporting.series(records, "eval_top1"), marker="o", label=f"{label} (final {top1:.2%})"
    )
  loss_ax.set(xlabel="step", ylabel="training loss (label-smoothed)", yscale="log")
  acc_ax.set(xlabel="step", ylabel="evaluation top-1", ylim=(0, 1))
  for ax in (loss_ax, acc_ax):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description="Plots runs' loss and top-1 in one PNG.")
  parser.add_argument("run_dirs", nargs="+", help="workdirs of python -m resnet")
  parser.add_argument("--out", required=True, help="the PNG to write")
  parser.add_argument("--labels", nargs="+", help="one legend label per run (default: names)")
  args = parser.parse_args(argv)
  for run_dir in args.run_dirs:
    row = final_eval(run_dir)
    print(f"{run_dir}: eval top-1 {row['eval_top1']:.4f} at step {row['step']}")
  print(plot_runs(args.run_dirs, args.out, args.labels))


if __name__ == "__main__":
  main()
