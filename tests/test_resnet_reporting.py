"""metrics.jsonl: one row per step however often a run is resumed."""

from resnet import reporting


def _write(workdir, steps, run, start_step=0):
  writer = reporting.MetricWriter(workdir, start_step)
  for step in steps:
    writer.write(step, {"run": run})


def test_metrics_have_one_row_per_step_after_two_resumes(tmp_path):
  _write(tmp_path, range(1, 6), run=0)  # killed after step 5; the checkpoint was step 2
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 6, "ru')  # killed while writing
  _write(tmp_path, range(3, 8), run=1, start_step=2)  # killed after 7; checkpoint at 6
  _write(tmp_path, range(7, 9), run=2, start_step=6)
  rows = reporting.read_metrics(tmp_path)
  assert [r["step"] for r in rows] == list(range(1, 9))
  assert [r["run"] for r in rows] == [0, 0, 1, 1, 1, 1, 2, 2]
