"""What a training run does about faults it cannot prevent: stop signals and dead peers.

Stop signals. SIGTERM (a preemption notice) or SIGINT sets a stop code on the process that
receives it. The code rides along with every training step as a per-device input and the
step all-reduces it (max), so every process learns of a stop at the same step, however
late the notice reached each host; they then save the same checkpoint and exit. The first
signal also puts the default handler back, so a second one ends the process at once
(without saving), and starts a deadline: if the stop has not been saved within
``stop_timeout`` seconds (a peer hung in a collective, a stalled filesystem), the process
says so and exits with status 1.

Dead peers. In a multi-process run each process bumps its own counter in the coordination
service's key-value store every second. A peer whose counter has not moved for ``timeout``
seconds is reported by its process id, with the step a rerun resumes from, and this process
exits with status 1: the training loop is likely blocked in a collective with it forever.
``peer_timeout`` gives the ``timeout`` for a coordination service's heartbeat timeout: a
quarter of it. The service has declared a killed process dead as soon as half its
heartbeat timeout after the kill, and then the runtime aborts this process first without
naming anyone; at a quarter the watchdog acts well before that. The one case left to the
runtime is the loss of process 0: the coordination service lives there, and the other
processes abort within a second with "Terminating process because the JAX distributed
service detected fatal errors". A peer that finished normally (``close(finished=True)``)
is not reported.

Both report with ``os._exit``: the main thread may be blocked in a collective that
never returns, so neither an exception nor a clean shutdown can reach it.
"""

import os
import signal
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from torus_collectives import _jax_internals as jax_internals

_KEY = "resnet/liveness"


def _fail(message: str) -> None:
  logging.error("%s", message)
  logging.flush()
  os._exit(1)


class StopRequest:
  """SIGTERM/SIGINT as a stop code that every process agrees on through the train step.

  Args:
    timeout: seconds from the first signal to a saved stop before the process gives up.
    describe_resume: what a rerun resumes from, for the timeout message.
  """

  def __init__(self, timeout: float, describe_resume: Callable[[], str]):
    self.code = 0  # the first signal's number, 0 before any
    self._timeout = timeout
    self._describe_resume = describe_resume
    self._timer: threading.Timer | None = None
    self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    signal.signal(signum, self._previous[signum])  # a second one is not caught
    if self.code:
      return
    self.code = signum
    logging.warning(
      "%s received: all processes will save the same step and exit (within %.0f s). Send "
      "it again to exit at once without saving.",
      name,
      self._timeout,
    )
    self._timer = threading.Timer(self._timeout, self._expire, args=(name,))
    self._timer.daemon = True
    self._timer.start()

  def _expire(self, name: str) -> None:
    _fail(
      f"{name} was received {self._timeout:.0f} s ago and the stop is not saved yet (a peer "
      f"may be hung, or saving is stalled). Exiting without saving; a rerun of the same "
      f"command resumes from {self._describe_resume()}."
    )

  def device_flags(self, sharding: jax.sharding.NamedSharding) -> jax.Array:
    """This process's stop code on each of its devices, as one global int32 array with a
    row per device: a batch entry the train step reduces over the mesh."""
    local = np.full(len(sharding.addressable_devices), self.code, np.int32)
    return jax.make_array_from_process_local_data(sharding, local)

  def saved(self) -> None:
    """The stop is saved: the deadline no longer applies."""
    if self._timer is not None:
      self._timer.cancel()

  def close(self) -> None:
    self.saved()
    for s, handler in self._previous.items():
      if signal.getsignal(s) == self._handle:
        signal.signal(s, handler)


def peer_timeout(heartbeat_timeout_seconds: float) -> float:
  """Seconds of silence after which ``PeerWatchdog`` names a peer, for the coordination
  service's ``heartbeat_timeout_seconds``: a quarter of it (module docstring)."""
  return heartbeat_timeout_seconds / 4


class PeerWatchdog:
  """Reports a peer process that stopped responding and ends this one (multi-process only).

  Args:
    timeout: seconds of silence after which a peer counts as dead.
    describe_resume: what a rerun resumes from, for the message.
  """

  def __init__(self, timeout: float, describe_resume: Callable[[], str]):
    self._timeout = timeout
    self._describe_resume = describe_resume
    self._stopped = threading.Event()
    self._thread = None
    if jax.process_count() > 1:
      # jax has no public accessor for the coordination service client.
      self._client = jax_internals.coordination_client()
      self._thread = threading.Thread(target=self._run, name="peer-watchdog", daemon=True)
      self._thread.start()

  def _counter(self, process: int) -> int | None:
    try:
      return int(self._client.key_value_try_get(f"{_KEY}/beat/{process}"))
    except Exception:  # noqa: BLE001  # NOT_FOUND before the peer's first beat
      return None

  def _finished(self, process: int) -> bool:
    try:
      return self._client.key_value_try_get(f"{_KEY}/finished/{process}") == "1"
    except Exception:  # noqa: BLE001  # NOT_FOUND while it runs
      return False

  def _run(self) -> None:
    me = jax.process_index()
    peers = [p for p in range(jax.process_count()) if p != me]
    seen = {p: (None, time.monotonic()) for p in peers}  # last counter, when it last moved
    answered = time.monotonic()  # the coordination service's last answer
    while not self._stopped.wait(1.0):
      now = time.monotonic()
      try:
        self._client.key_value_increment(f"{_KEY}/beat/{me}", 1)
        answered = now
      except Exception:  # noqa: BLE001  # unreachable: only its duration matters
        if now - answered > self._timeout:
          _fail(
            f"The coordination service on process 0 has not answered for "
            f"{now - answered:.0f} s. Process {me} exits; restart all processes with the same "
            f"command; they resume from {self._describe_resume()}."
          )
        continue
      for p in peers:
        counter = self._counter(p)
        if counter != seen[p][0]:
          seen[p] = (counter, now)
        elif now - seen[p][1] > self._timeout and not self._finished(p):
          _fail(
            f"Process {p} has not responded for {now - seen[p][1]:.0f} s: it died or hangs "
            f"(its own log says why). Process {me} exits instead of waiting in a collective "
            f"forever. Restart all processes with the same command; they resume from "
            f"{self._describe_resume()}."
          )

  def close(self, *, finished: bool) -> None:
    """Stops beating; ``finished`` tells the peers this process ended normally."""
    if self._thread is None:
      return
    if finished:
      self._client.key_value_set(f"{_KEY}/finished/{jax.process_index()}", "1")
    self._stopped.set()
    self._thread.join()
