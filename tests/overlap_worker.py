"""Compiles a small data-parallel MLP train step ahead of time for v5e:2x2 and prints its
overlap timeline (``bench.overlap_report.step_timeline``) as JSON.

A subprocess of ``test_overlap_compiled``, since libtpu reads its flags once per process:

  python overlap_worker.py {package,default} PROGRAM.hlo

Six 2048x2048 float32 layers (16 MiB of gradient each, one bucket each) on a batch of
4096 rows per device: each layer's weight gradient is a matmul the compiler can run while
the previous layer's gradient is being summed.
"""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from bench import overlap_report
from torus_collectives import xla_settings
from torus_collectives.testing import hlo_schedule
from torus_collectives.testing.aot import topology_mesh

settings, hlo_path = sys.argv[1:3]
if settings == "package":
  xla_settings.apply()  # importing jax starts no backend; topology_mesh below does

LAYERS, WIDTH, ROWS = 6, 2048, 4096
mesh = topology_mesh("v5e:2x2")
axes = mesh.axis_names


def step(params, x):
  def loss(params):
    h = x
    for w in params:
      h = jnp.tanh(h @ w)
    return jnp.sum(h)

  grads = jax.grad(loss)(lax.pcast(params, axes, to="varying"))
  return tc.all_reduce_gradients(grads, axes, bucket_bytes=1, implementation="xla")


replicated = NamedSharding(mesh, P())
params = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=replicated)] * LAYERS
x = jax.ShapeDtypeStruct(
  (ROWS * mesh.devices.size, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P(axes))
)
program = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P()))
compiled = program.lower(params, x).compile()
text = compiled.as_text()
with open(hlo_path, "w") as f:
  f.write(text)
clock = overlap_report.calibrated_clock(mesh, "v5e", sizes=(2048, 4096))
timeline = overlap_report.step_timeline(text, mesh, "v5e", clock)
cost = compiled.cost_analysis()
flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
print(
  json.dumps(
    {
      "clock_hz": clock,
      "peak_flops": hlo_schedule.PEAK_FLOPS["v5e"],
      "flops": flops,
      "compute_s": timeline.compute_s,
      "rows": [dataclasses.asdict(row) for row in timeline.rows],
      "summary": timeline.summary(),
    }
  )
)
