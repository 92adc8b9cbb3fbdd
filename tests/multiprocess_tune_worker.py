"""One process of the two-process tuning test: ``python multiprocess_tune_worker.py PORT ID``.

Both processes tune the same cases on a 2x4 torus (4 simulated CPU devices each), with a
fake timer whose verdicts disagree between the processes, into table files that disagree
too: each holds an earlier run (from another process) that agrees with its own timer, so
each file plus its own run would confirm a different choice. Each prints its table's
choices and a hash of the compiled "auto" program; the test checks that they agree.
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import multiprocess_setup  # first: it sets the device count before jax loads

# isort: split
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MiB = 2**20
# Seconds per call as each process would measure them: they disagree on every case.
VERDICTS = {
  0: {"xla": 1.0, "shard_map": 2.0, "lax_torus": 0.5},  # process 0: lax_torus wins
  1: {"xla": 1.0, "shard_map": 0.5, "lax_torus": 2.0},  # process 1: shard_map wins
}


def main(port: int, process_id: int) -> None:
  multiprocess_setup.join(port, process_id)
  import torus_collectives as tc
  from torus_collectives.tuning import tables, tuner

  def timer(name, call):
    jax.block_until_ready(call())  # every process runs every collective
    return VERDICTS[process_id][name]

  earlier = tables.Run.of(
    {n: [VERDICTS[process_id][n]] * tables.MIN_ROUNDS for n in ("shard_map", "lax_torus")},
    process=f"earlier-{process_id}",
  )
  path = Path(tempfile.mkdtemp()) / "table.json"
  entries = [
    tables.Entry.from_runs("2x4", op, "float32", tables.size_bucket(MiB), [earlier])
    for op in ("all_reduce", "reduce_scatter")
  ]
  tables.Table(jax.devices()[0].device_kind, "earlier", tables.now(), entries).save(path)

  mesh = tc.make_torus_mesh((2, 4))
  table = tuner.tune(
    mesh,
    sizes=[MiB],
    dtypes=["float32"],
    ops=["all_reduce", "reduce_scatter"],
    rounds=tables.MIN_ROUNDS,
    timer=timer,
    output=str(path),
    progress=None,
  )
  written = tables.Table.from_json(path.read_text())
  assert {e.op: e.choice for e in written.entries} == {e.op: e.choice for e in table.entries}
  choices = {f"{e.op}": e.choice for e in table.entries}

  spec = P(("x", "y"))
  body = lambda v: (tc.all_reduce(v, ("x", "y")), tc.reduce_scatter(v, ("x", "y"), tiled=True))
  x = jax.ShapeDtypeStruct((8 * MiB // 4,), jnp.float32, sharding=NamedSharding(mesh, spec))
  lowered = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).lower(x)
  text = lowered.as_text()
  result = {
    "process": process_id,
    "choices": choices,
    "program": hashlib.sha256(text.encode()).hexdigest(),
    "per_axis_reduce_scatter": "stablehlo.reduce_scatter" in text,  # what lax_torus runs
  }
  print("RESULT " + json.dumps(result))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
