"""One process of the two-process test: ``python multiprocess_worker.py PORT PROCESS_ID``.

Each process owns 4 simulated CPU devices; together they form a 2x4 torus over which the
torus collectives (shard_map implementation) must equal lax's results on the same data.
"""

import sys

import multiprocess_setup  # first: it sets the device count before jax loads

# isort: split
import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def main(port: int, process_id: int) -> None:
  multiprocess_setup.join(port, process_id)
  import torus_collectives as tc

  mesh = tc.make_torus_mesh((2, 4))
  spec = P(("x", "y"))
  # Global input: device d's block holds small integers seeded by d, so results are exact.
  global_x = np.stack([np.random.default_rng(d).integers(-4, 5, (16, 3)) for d in range(8)])
  global_x = global_x.astype(np.float32).reshape(8 * 16, 3)
  sharding = NamedSharding(mesh, spec)
  local = global_x.reshape(2, 64, 3)[jax.process_index()]
  x = jax.make_array_from_process_local_data(sharding, local, global_x.shape)

  def body(v):
    ours = (
      tc.all_reduce(v, ("x", "y"), implementation="shard_map"),
      tc.reduce_scatter(v, ("x", "y"), tiled=True, implementation="shard_map"),
      tc.all_gather(v, ("y", "x"), tiled=True, implementation="shard_map"),
    )
    ref = (
      lax.psum(v, ("x", "y")),
      lax.psum_scatter(v, ("x", "y"), tiled=True),
      lax.all_gather(v, ("y", "x"), tiled=True),
    )
    return ours, ref

  ours, ref = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)
  for o, r in zip(ours, ref):
    for a, b in zip(o.addressable_shards, r.addressable_shards):
      np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
  print(f"process {process_id}: {len(jax.devices())} devices, all collectives equal lax")
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
