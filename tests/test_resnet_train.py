"""End-to-end training of a tiny ResNet on the digits: loop, evaluation, checkpoints, plot,
bitwise resume after SIGTERM and after a corrupt checkpoint, a resume onto a 2x2x2 mesh, the NaN
stop, and two processes: matching one, stopping together on SIGTERM to either, and naming a
killed peer.

Every subprocess wait has a timeout, so a regression that hangs fails instead."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import two_processes

from resnet import checkpoints, data_sources, input_pipeline, train, validation
from resnet.configs import default

pytestmark = pytest.mark.slow  # every test here trains

TOTAL_STEPS = 8
REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(
  model="resnet_tiny",
  image_size=16,
  global_batch_size=32,
  eval_batch_size=64,
  num_train_steps=TOTAL_STEPS,
  warmup_epochs=0.05,
  log_every_steps=1,
  checkpoint_every_steps=2,
  eval_every_epochs=0.1,
  shuffle_buffer=0,
)
# One run of two processes takes about a minute on an idle 2-core machine; a loaded one
# can take several times that.
PROCESS_TIMEOUT_S = 420
DEAD_PEER_LIMIT_S = 60


def tiny_config(data_dir, **overrides):
  config = default.get_config()
  config.update(dict(TINY, data_dir=str(data_dir), **overrides))
  return config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """The digits plus one undecodable evaluation image."""
  root = tmp_path_factory.mktemp("data")
  data_sources.write_digits(root / "digits")
  (root / "digits" / "test" / "0" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"junk" * 50)
  return root


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("full")
  return workdir, train.train_and_evaluate(tiny_config(data_dir), str(workdir))


def _final_state(workdir, step=TOTAL_STEPS):
  """The saved state on one device, whichever devices (and processes) saved it."""
  path = pathlib.Path(workdir) / "checkpoints" / str(step) / "default"
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.StandardCheckpointer() as checkpointer:
    target = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
      checkpointer.metadata(path).item_metadata,
    )
    return checkpointer.restore(path, target)


def _rows(workdir):
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def _steps(workdir):
  return [r["step"] for r in _rows(workdir)]


def _losses(workdir):
  return {r["step"]: r["train_loss"] for r in _rows(workdir)}


def test_end_to_end_writes_checkpoints_metrics_and_plot(full_run):
  workdir, summary = full_run
  assert summary["step"] == TOTAL_STEPS
  assert 0.0 <= summary["eval_top1"] <= summary["eval_top5"] <= 1.0
  assert summary["skipped_images"] == 0
  assert summary["eval_skipped_images"] == 1  # the corrupt evaluation image, counted
  with ocp.CheckpointManager(workdir / "checkpoints") as manager:
    assert manager.all_steps() == [TOTAL_STEPS - 2, TOTAL_STEPS]
  for step in (TOTAL_STEPS - 2, TOTAL_STEPS):
    assert checkpoints.verification_problem(workdir / "checkpoints" / str(step)) is None
  assert (workdir / "curves.png").stat().st_size > 0
  assert list(workdir.glob("events.out.tfevents.*"))
  assert _steps(workdir) == list(range(1, TOTAL_STEPS + 1))
  assert all(np.isfinite(list(_losses(workdir).values())))


def test_a_2x2x2_mesh_resumes_and_trains_on_every_axis(full_run, data_dir, tmp_path):
  """The training path on a 3-axis torus: the 2x4 run's step-6 checkpoint resumes into the
  2x2x2 mesh's shardings, and as the batch is split over all three axes (the same rows on
  the same devices), step 7's loss is the 2x4 run's."""
  resume_from = TOTAL_STEPS - 2
  shutil.copytree(
    full_run[0] / "checkpoints" / str(resume_from), tmp_path / "checkpoints" / str(resume_from)
  )
  config = tiny_config(data_dir, mesh_shape=(2, 2, 2))
  validation.validate_config(config, num_devices=jax.device_count())
  mesh = train.create_mesh(config)
  assert dict(mesh.shape) == {"x": 2, "y": 2, "z": 2}
  data = train._open_data(config, mesh)
  assert data.sharding.spec == jax.sharding.PartitionSpec(("x", "y", "z"))
  program = train._build_program(config, mesh, data)
  store = checkpoints.VerifiedCheckpoints(tmp_path)
  try:
    state = train.restore_or_create_state(
      store, program.init_fn, program.key, program.state_sharding
    )
  finally:
    store.close()
  assert int(state.step) == resume_from
  batch, _ = next(train._train_batches(config, data, start_step=resume_from))
  state, metrics = program.train_step(state, batch)
  assert int(state.step) == resume_from + 1
  expected = _losses(full_run[0])[resume_from + 1]
  np.testing.assert_allclose(float(metrics["train_loss"]), expected, rtol=1e-5)


def test_sigterm_checkpoints_and_resume_is_bitwise_equal(full_run, data_dir, tmp_path, monkeypatch):
  interrupt_before = 2  # the step whose batch is being fetched when SIGTERM arrives
  real_prefetch = input_pipeline.device_prefetch

  def prefetch_then_sigterm(batches, sharding, **kwargs):
    for i, item in enumerate(real_prefetch(batches, sharding, **kwargs)):
      if "host_keys" not in kwargs and i + 1 == interrupt_before:  # the training stream
        signal.raise_signal(signal.SIGTERM)
      yield item

  monkeypatch.setattr(input_pipeline, "device_prefetch", prefetch_then_sigterm)
  stopped = train.train_and_evaluate(tiny_config(data_dir), str(tmp_path))
  # Step 2 carries the stop to every process; it is read after step 3 is dispatched.
  assert stopped["step"] == interrupt_before + 1
  with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
    assert manager.all_steps() == [2, interrupt_before + 1]
  monkeypatch.setattr(input_pipeline, "device_prefetch", real_prefetch)
  resumed = train.train_and_evaluate(tiny_config(data_dir), str(tmp_path))
  assert resumed["step"] == TOTAL_STEPS

  jax.tree.map(np.testing.assert_array_equal, _final_state(full_run[0]), _final_state(tmp_path))
  assert _steps(tmp_path) == list(range(1, TOTAL_STEPS + 1))
  assert _losses(tmp_path) == _losses(full_run[0])


def test_a_deferred_weight_gather_checkpoints_whole_weights_and_resumes(data_dir, tmp_path):
  """Weight-update sharding with the gather deferred to the next step: the running state
  holds weight shards, but every checkpoint holds the whole weights (each leaf the model's
  shape), and a run of the same config resumes from it."""
  config = tiny_config(data_dir, weight_update_sharding=True, defer_weight_gather=True)
  config.num_train_steps = 3
  first = train.train_and_evaluate(config, str(tmp_path))
  assert first["step"] == 3
  model = train.create_model(config, 10, train.create_mesh(config))
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)["params"]
  )
  saved = _final_state(tmp_path, step=3)["params"]
  assert jax.tree.map(jnp.shape, saved) == jax.tree.map(jnp.shape, shapes)
  config.num_train_steps = 4
  resumed = train.train_and_evaluate(config, str(tmp_path))
  assert resumed["step"] == 4 and _steps(tmp_path) == [1, 2, 3, 4]
  assert all(np.isfinite(list(_losses(tmp_path).values())))


def _largest_file(step_dir):
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != checkpoints.DIGESTS]
  return max(files, key=lambda p: p.stat().st_size)


def _flip_4kib(step_dir):
  path = _largest_file(step_dir)
  data = bytearray(path.read_bytes())
  start = max(0, len(data) // 2 - 2048)
  data[start : start + 4096] = bytes(b ^ 0xFF for b in data[start : start + 4096])
  path.write_bytes(bytes(data))


def _truncate(step_dir):
  path = _largest_file(step_dir)
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero_metadata(step_dir):
  for path in step_dir.rglob("*METADATA"):
    path.write_bytes(bytes(path.stat().st_size))


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_resumed(
  full_run, data_dir, tmp_path, caplog
):
  workdir = tmp_path / "run"
  shutil.copytree(full_run[0], workdir)
  newest = workdir / "checkpoints" / str(TOTAL_STEPS)
  expected = _final_state(full_run[0])
  corruptions = {"4 KiB flipped": _flip_4kib, "truncated": _truncate, "zeroed": _zero_metadata}
  # Each round resumes once more in the same workdir: three resumes in all.
  for resumes, (kind, corrupt) in enumerate(corruptions.items(), 1):
    corrupt(newest)
    caplog.clear()
    summary = train.train_and_evaluate(tiny_config(data_dir), str(workdir))
    assert summary["step"] == TOTAL_STEPS, kind
    assert f"Checkpoint step {TOTAL_STEPS} at {newest} is unusable" in caplog.text, kind
    assert f"Resumed from the verified step {TOTAL_STEPS - 2} " in caplog.text, kind
    assert len(list((workdir / "rejected_checkpoints").iterdir())) == resumes, kind
    jax.tree.map(np.testing.assert_array_equal, expected, _final_state(workdir))
    assert _steps(workdir) == list(range(1, TOTAL_STEPS + 1)), kind


def test_non_finite_metrics_stop_without_saving_and_name_the_newest_checkpoint(
  full_run, data_dir, tmp_path, monkeypatch
):
  workdir = tmp_path / "run"
  shutil.copytree(full_run[0], workdir)
  # A NaN learning rate poisons the first step after the resume.
  monkeypatch.setattr(train, "create_learning_rate_fn", lambda *_: lambda step: jnp.nan)
  config = tiny_config(data_dir, num_train_steps=TOTAL_STEPS + 2)
  message = (
    rf"Non-finite training metrics at step {TOTAL_STEPS + 1}: .*\. Stopped without saving; "
    rf"the newest checkpoint is step {TOTAL_STEPS} in {re.escape(str(workdir))}/checkpoints\.$"
  )
  with pytest.raises(FloatingPointError, match=message):
    train.train_and_evaluate(config, str(workdir))
  with ocp.CheckpointManager(workdir / "checkpoints") as manager:
    assert manager.all_steps() == [TOTAL_STEPS - 2, TOTAL_STEPS]


def _start_two(workdir, data_dir, *flags):
  """Two ``python -m resnet`` processes of 4 CPU devices each; logs beside the workdir."""
  port = two_processes.free_port()
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="",
    PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
  )
  procs = []
  for i in range(2):
    log = pathlib.Path(f"{workdir}.process{i}.log")
    with log.open("w") as out:
      proc = subprocess.Popen(
        [
          sys.executable,
          "-m",
          "resnet",
          f"--config={REPO}/resnet/configs/default.py",
          f"--workdir={workdir}",
          f"--config.data_dir={data_dir}",
          "--config.simulated_cpu_devices=4",
          f"--coordinator_address=127.0.0.1:{port}",
          "--num_processes=2",
          f"--process_id={i}",
          *[f"--config.{k}={v}" for k, v in TINY.items()],
          *flags,
        ],
        env=env,
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
      )
    proc.log = log
    procs.append(proc)
  return procs


def _finish(procs, timeout=PROCESS_TIMEOUT_S):
  """Each process's output once all exit; kills them all after ``timeout`` seconds."""
  deadline = time.monotonic() + timeout
  try:
    for p in procs:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  finally:
    for p in procs:
      p.kill()
  return [p.log.read_text() for p in procs]


def _wait_for_training(procs, workdir, timeout=PROCESS_TIMEOUT_S):
  """Returns once step 1 is logged, i.e. both processes are past compilation."""
  deadline = time.monotonic() + timeout
  metrics = pathlib.Path(workdir) / "metrics.jsonl"
  while not (metrics.exists() and metrics.read_text().strip()):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      outputs = _finish(procs, timeout=1)
      pytest.fail("training never started:\n" + "\n".join(o[-3000:] for o in outputs))
    time.sleep(0.2)


def _assert_succeeded(procs, outputs):
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i}:\n{out[-3000:]}"


@pytest.fixture(scope="module")
def two_process_run(data_dir, tmp_path_factory):
  """An uninterrupted run of 2 processes x 4 devices."""
  workdir = tmp_path_factory.mktemp("two") / "run"
  procs = _start_two(workdir, data_dir)
  _assert_succeeded(procs, _finish(procs))
  return workdir


@pytest.mark.multiprocess
def test_two_processes_match_one(full_run, two_process_run):
  """The same batches and the same arithmetic on 2 processes x 4 devices as on 1 x 8; only
  the order in which the cross-device sums add (gloo's ring against XLA's in-process
  all-reduce) differs. So the first step's loss, before any update, is the same to float32
  rounding (rtol 1e-6), and every later step's within rtol 1e-4: the rounding of two
  summation orders grows through the updates at this learning rate and batch (seen: 1e-7
  after one update, 1.1e-5 after five), while another batch's loss differs by about
  1e-2 (this run's steps differ from each other by that much)."""
  one, two = _losses(full_run[0]), _losses(two_process_run)
  assert one.keys() == two.keys()
  first = min(one)
  np.testing.assert_allclose(two[first], one[first], rtol=1e-6)
  np.testing.assert_allclose([two[k] for k in one], list(one.values()), rtol=1e-4)


@pytest.mark.multiprocess
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(
  two_process_run, data_dir, tmp_path
):
  workdir = tmp_path / "run"
  procs = _start_two(workdir, data_dir)
  _wait_for_training(procs, workdir)
  procs[1].send_signal(signal.SIGTERM)
  outputs = _finish(procs)
  _assert_succeeded(procs, outputs)
  saved = [re.findall(r"saved step (\d+) to", out) for out in outputs]
  assert saved[0] == saved[1] and len(saved[0]) == 1, saved
  assert 1 < int(saved[0][0]) < TOTAL_STEPS
  assert "received by another process" in outputs[0]
  assert "received by this process" in outputs[1]

  procs = _start_two(workdir, data_dir)
  _assert_succeeded(procs, _finish(procs))
  jax.tree.map(np.testing.assert_array_equal, _final_state(two_process_run), _final_state(workdir))
  assert _steps(workdir) == list(range(1, TOTAL_STEPS + 1))


@pytest.mark.multiprocess
def test_sigkill_of_one_of_two_processes_is_named_by_the_survivor(data_dir, tmp_path):
  workdir = tmp_path / "run"
  procs = _start_two(workdir, data_dir, "--config.num_train_steps=1000")
  _wait_for_training(procs, workdir)
  procs[1].kill()
  killed_at = time.monotonic()
  try:
    procs[0].wait(timeout=DEAD_PEER_LIMIT_S)
  except subprocess.TimeoutExpired:
    pass
  detected_after = time.monotonic() - killed_at
  survivor = _finish(procs, timeout=1)[0]
  assert procs[0].returncode not in (0, None) and detected_after < DEAD_PEER_LIMIT_S, (
    f"{detected_after:.0f} s:\n{survivor[-3000:]}"
  )
  assert re.search(r"Process 1 has not responded for \d+ s", survivor), survivor[-3000:]
  assert "they resume from step " in survivor
