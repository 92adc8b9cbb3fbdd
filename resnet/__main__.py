"""Entry point: ``python -m resnet --config=resnet/configs/default.py --workdir=DIR``.

Override any config field with ``--config.<field>=<value>``. For several processes (a TPU
pod slice, a GPU cluster, or several CPU processes on one host) pass
``--coordinator_address``, ``--num_processes`` and ``--process_id`` (or set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); each process runs the same
command. jax is imported only after the flags are parsed and the config is checked,
because the simulated CPU device count must be in XLA_FLAGS before jax starts. The
coordination service's heartbeat timeout is ``--config.heartbeat_timeout_seconds``.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from resnet import validation

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs and plots go here.")
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  os.environ.get("JAX_COORDINATOR_ADDRESS"),
  "host:port of process 0, for multi-process runs.",
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", int(os.environ.get("JAX_NUM_PROCESSES", 1)), "Number of processes."
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", int(os.environ.get("JAX_PROCESS_ID", 0)), "This process, 0-based."
)
flags.mark_flags_as_required(["config", "workdir"])


def _validate(config, **devices) -> None:
  """A config error ends the run with its message (status 2), not a traceback."""
  try:
    validation.validate_config(config, **devices)
  except ValueError as e:
    print(e, file=sys.stderr)
    sys.exit(2)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  _validate(config)
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  on_cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu"
  if on_cpu and config.simulated_cpu_devices:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform"
      f"_device_count={config.simulated_cpu_devices}"
    ).strip()
  if config.xla_overlap_settings:  # libtpu reads its flags once, when jax starts it
    from torus_collectives import xla_settings

    xla_settings.apply()
  import jax

  if _NUM_PROCESSES.value > 1:
    if on_cpu:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
      heartbeat_timeout_seconds=config.heartbeat_timeout_seconds,
    )
  _validate(config, num_devices=jax.device_count())
  from resnet import train

  train.train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
