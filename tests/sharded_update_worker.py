"""One process of the two-process sharded_update test: ``python sharded_update_worker.py
PORT PROCESS_ID OUT.npz``.

Each process owns 4 simulated CPU devices; together they form a 2x4 torus and run the same
sharded LARS steps as the one-process test, which compares process 0's parameters (written
to ``OUT.npz``) with its own on 8 devices.
"""

import sys

import multiprocess_setup  # first: it sets the device count before jax loads

# isort: split
import jax
import numpy as np


def main(port: int, process_id: int, out_file: str) -> None:
  multiprocess_setup.join(port, process_id)
  import sharded_update_cases as cases

  mesh = cases.tc.make_torus_mesh((2, 4))
  params, _ = cases.run(mesh, "lars", cases.STEPS, sharded=True, implementation="shard_map")
  if process_id == 0:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    local = {jax.tree_util.keystr(k): np.asarray(v.addressable_shards[0].data) for k, v in flat}
    np.savez(out_file, **local)
  print(f"process {process_id}: {jax.device_count()} devices, sharded LARS ran {cases.STEPS} steps")
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
