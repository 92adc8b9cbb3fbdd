"""The start every worker of the multi-process tests shares: 4 simulated CPU devices per
process, gloo CPU collectives, and JAX's multi-controller runtime on 127.0.0.1.

Import it before jax: XLA reads the device count when jax is first imported.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax


def join(port: int, process_id: int, num_processes: int = 2) -> None:
  """Joins the cluster whose coordinator listens on ``port`` (process 0 hosts it)."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=120,
  )
