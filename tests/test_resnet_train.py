"""End-to-end training of a tiny ResNet on the digits: loop, evaluation, checkpoints,
plot, SIGTERM, bitwise resume, and two processes matching one."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from resnet import data_sources, input_pipeline, train
from resnet.configs import default

TOTAL_STEPS = 4
REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(
  model='resnet_tiny',
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


def tiny_config(data_dir, **overrides):
  config = default.get_config()
  config.update(dict(TINY, data_dir=str(data_dir), **overrides))
  return config


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp('data')
  data_sources.write_digits(root / 'digits')
  return root


@pytest.fixture(scope='module')
def full_run(data_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('full')
  return workdir, train.train_and_evaluate(tiny_config(data_dir), str(workdir))


def _final_state(workdir, step=TOTAL_STEPS):
  with ocp.CheckpointManager(pathlib.Path(workdir) / 'checkpoints') as manager:
    return manager.restore(step)


def _losses(workdir):
  lines = (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()
  return {r['step']: r['train_loss'] for r in map(json.loads, lines)}


def test_end_to_end_writes_checkpoints_metrics_and_plot(full_run):
  workdir, summary = full_run
  assert summary['step'] == TOTAL_STEPS
  assert 0.0 <= summary['eval_top1'] <= summary['eval_top5'] <= 1.0
  assert summary['skipped_images'] == 0
  with ocp.CheckpointManager(workdir / 'checkpoints') as manager:
    assert manager.all_steps() == [2, 4]
  assert (workdir / 'curves.png').stat().st_size > 0
  assert list(workdir.glob('events.out.tfevents.*'))
  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, TOTAL_STEPS + 1))
  assert all(np.isfinite(list(losses.values())))


def test_sigterm_checkpoints_and_resume_is_bitwise_equal(full_run, data_dir, tmp_path, monkeypatch):
  interrupt_after = 1
  real_prefetch = input_pipeline.device_prefetch

  def prefetch_then_sigterm(batches, sharding, **kwargs):
    for i, item in enumerate(real_prefetch(batches, sharding, **kwargs)):
      if 'host_keys' not in kwargs and i == interrupt_after:  # the training stream
        signal.raise_signal(signal.SIGTERM)
      yield item

  monkeypatch.setattr(input_pipeline, 'device_prefetch', prefetch_then_sigterm)
  stopped = train.train_and_evaluate(tiny_config(data_dir), str(tmp_path))
  assert stopped['step'] == interrupt_after + 1
  with ocp.CheckpointManager(tmp_path / 'checkpoints') as manager:
    assert manager.all_steps() == [interrupt_after + 1]
  monkeypatch.setattr(input_pipeline, 'device_prefetch', real_prefetch)
  resumed = train.train_and_evaluate(tiny_config(data_dir), str(tmp_path))
  assert resumed['step'] == TOTAL_STEPS

  expected, actual = _final_state(full_run[0]), _final_state(tmp_path)
  jax.tree.map(np.testing.assert_array_equal, expected, actual)
  # Each step logged once: the second run continued where the first stopped.
  steps = [
    json.loads(line)['step'] for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()
  ]
  assert steps == list(range(1, TOTAL_STEPS + 1))
  assert _losses(tmp_path) == _losses(full_run[0])


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_match_one(full_run, data_dir, tmp_path):
  port = _free_port()
  flags = [f'--config.{k}={v}' for k, v in TINY.items()]
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    XLA_FLAGS='',
    PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]),
  )
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        '-m',
        'resnet',
        f'--config={REPO}/resnet/configs/default.py',
        f'--workdir={tmp_path}',
        f'--config.data_dir={data_dir}',
        '--config.simulated_cpu_devices=4',
        f'--coordinator_address=127.0.0.1:{port}',
        '--num_processes=2',
        f'--process_id={i}',
        *flags,
      ],
      env=env,
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  try:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  one, two = _losses(full_run[0]), _losses(tmp_path)
  assert one.keys() == two.keys()
  np.testing.assert_allclose([two[k] for k in one], list(one.values()), rtol=1e-5)


def test_non_finite_metrics_stop_and_keep_the_last_good_checkpoint(full_run, data_dir, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(full_run[0], workdir)
  # Resuming at step 4 of 6 with a NaN learning rate poisons step 5's metrics.
  config = tiny_config(data_dir, num_train_steps=TOTAL_STEPS + 2, base_learning_rate=float('nan'))
  with pytest.raises(FloatingPointError, match=r'last good checkpoint \(step 4\) is kept'):
    train.train_and_evaluate(config, str(workdir))
  with ocp.CheckpointManager(workdir / 'checkpoints') as manager:
    assert manager.all_steps() == [2, 4]
