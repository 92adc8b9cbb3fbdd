"""faults.StopRequest on its own, in a subprocess (it installs signal handlers and may end
the process): a second signal is not caught, and a stop not saved in time ends the run
with a message. The multi-process behaviour is in test_resnet_train.py."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(body: str) -> subprocess.CompletedProcess:
  script = textwrap.dedent(
    """
    import signal, time
    from resnet import faults
    stop = faults.StopRequest(timeout=1.0, describe_resume=lambda: 'step 4 in /ckpt')
    signal.raise_signal(signal.SIGTERM)
    assert stop.code == signal.SIGTERM
    """
  )
  return subprocess.run(
    [sys.executable, "-c", script + textwrap.dedent(body)],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )


def test_a_second_signal_ends_the_process_at_once():
  result = _run("signal.raise_signal(signal.SIGTERM)\ntime.sleep(30)\n")
  assert result.returncode == -signal.SIGTERM, result.stderr
  assert "Send it again to exit at once without saving" in result.stderr


def test_a_stop_not_saved_in_time_exits_with_a_message():
  result = _run("time.sleep(30)\n")
  assert result.returncode == 1, result.stderr
  assert "the stop is not saved yet" in result.stderr
  assert "resumes from step 4 in /ckpt" in result.stderr


def test_a_saved_stop_cancels_the_deadline():
  result = _run('stop.saved()\ntime.sleep(2)\nstop.close()\nprint("clean exit")\n')
  assert result.returncode == 0, result.stderr
  assert "clean exit" in result.stdout
