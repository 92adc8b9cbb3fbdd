"""The split 2-D torus all-reduce kernel on a 4x4 torus (16 simulated devices), against lax.

On 2xN meshes the +x and -x neighbours coincide; a 4x4 torus is the smallest on which all
four links of a device lead to different devices and every ring phase has several steps, so
the per-phase capacity handshake is exercised for real. The suite's process has 8 devices,
so this file re-runs itself in a subprocess with 16. DMAs run in "eager" mode here; the 8-device
file runs the same multi-block all-reduce in "on_wait" mode.
"""

import os
import sys

import pytest
from device_count_subprocess import run_as_script

MARKER = "4x4 all-reduce matches lax"


@pytest.mark.interpret
@pytest.mark.slow
def test_all_reduce_on_a_4x4_torus():
  run_as_script(__file__, 16, MARKER)


def _main() -> None:
  sys.path.insert(0, os.getcwd())
  import harness
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  from torus_collectives import configs as torus_config
  from torus_collectives.kernels import pallas_backend as kernels

  axes = ("x", "y")
  mesh = harness.mesh((4, 4))
  spec = P(axes)
  # 16 devices x 4 streams x 2 blocks of 16 rows, minus an odd amount (padding).
  n = 16 * 4 * 2 * 16 * 128 - 333
  x = jnp.asarray(np.random.default_rng(0).integers(-8, 8, size=(16, n)), jnp.int32)

  def per_device(fn):
    return jax.jit(
      jax.shard_map(
        lambda v: fn(v[0])[None], mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
      )
    )

  want = per_device(lambda v: lax.psum(v, axes))(x)
  config = torus_config.KernelConfig(block_rows=16)
  fn = per_device(lambda v: kernels.all_reduce(v, axes, (4, 4), config=config))
  got = harness.interpreted("eager", fn, x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  print(MARKER)


if __name__ == "__main__":
  _main()
