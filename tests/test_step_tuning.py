"""Whole-step tuning (``tuning.step_tuning``) and the "auto" gradient summation that reads it.

The decision is checked with fake timers on a real tiny step (compiled once per variant,
never timed); "auto" by the programs it traces under hand-made step entries; and one short
real run on the 2x4 mesh, in two simulated processes, records XLA.
"""

import functools
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torus_collectives as tc
from torus_collectives import gradients, packing, registry
from torus_collectives.tuning import step_tuning, tables

AXES = ("x", "y")
SMALL_BUCKET = 1024

pytestmark = pytest.mark.usefixtures("isolated_tables")  # tests/conftest.py


def _params():
  rng = np.random.default_rng(0)
  return {
    "w1": jnp.asarray(rng.standard_normal((16, 32)) * 0.3, jnp.float32),  # 2 KiB
    "w2": jnp.asarray(rng.standard_normal((32, 4)) * 0.3, jnp.float32),  # 512 B
  }


def _batch():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8 * 4, 16)), jnp.float32)
  return x, jnp.asarray(rng.standard_normal((8 * 4, 4)), jnp.float32)


TREE_BYTES = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(_params()))


def _loss(p, x, y):
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


@functools.cache
def make_step(implementation, bucket_bytes):
  """One SGD step of a 2-layer MLP, data-parallel over the 2x4 mesh."""
  mesh = harness.mesh((2, 4))

  def body(p, x, y):
    g = jax.grad(_loss)(p, x, y)
    g = tc.all_reduce_gradients(g, AXES, implementation=implementation, bucket_bytes=bucket_bytes)
    return jax.tree.map(lambda w, d: w - 0.1 * d, p, g)

  specs = (jax.P(), jax.P(AXES), jax.P(AXES))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=jax.P()))


def _fake_timer(seconds):
  """Replays ``seconds.get(name, [1.0])`` round after round, without calling."""
  calls = {}

  def timer(name, call):
    del call
    values = seconds.get(name, [1.0])
    calls[name] = calls.get(name, 0) + 1
    return values[(calls[name] - 1) % len(values)]

  return timer


def _tune(path, monkeypatch, per_process, **kwargs):
  """One ``tune_step`` call per process (each with its own fake seconds) into ``path``."""
  result = None
  for i, seconds in enumerate(per_process):
    monkeypatch.setattr(tables, "PROCESS", f"process-{i}")
    result = step_tuning.tune_step(
      make_step,
      (_params(), *_batch()),
      implementations=("xla", "shard_map"),
      bucket_sizes=(SMALL_BUCKET, gradients.DEFAULT_BUCKET_BYTES),
      rounds=tables.MIN_ROUNDS,
      timer=_fake_timer(seconds),
      output=str(path),
      progress=None,
      **kwargs,
    )
  return result


# The decision.

FAST_SMALL = f"shard_map@{SMALL_BUCKET}"


@pytest.mark.parametrize(
  "per_process,expected",
  [
    ([{FAST_SMALL: [0.5]}] * 2, ("shard_map", SMALL_BUCKET)),  # faster in every run
    ([{f"xla@{SMALL_BUCKET}": [0.8]}] * 2, ("xla", SMALL_BUCKET)),  # a bucket size alone
    (  # both pass: the lowest worst-case bound
      [{FAST_SMALL: [0.7], f"shard_map@{gradients.DEFAULT_BUCKET_BYTES}": [0.6]}] * 2,
      ("shard_map", gradients.DEFAULT_BUCKET_BYTES),
    ),
    ([{FAST_SMALL: [0.6, 1.3, 0.7, 1.4, 0.9]}] * 2, ("xla", gradients.DEFAULT_BUCKET_BYTES)),
    ([{FAST_SMALL: [1.4]}] * 2, ("xla", gradients.DEFAULT_BUCKET_BYTES)),  # slower
    ([{FAST_SMALL: [0.5]}, {}], ("xla", gradients.DEFAULT_BUCKET_BYTES)),  # one process only
    ([{FAST_SMALL: [0.5]}], ("xla", gradients.DEFAULT_BUCKET_BYTES)),  # one run: never enough
  ],
  ids=["fast", "bucket", "lowest-bound", "noisy", "slower", "one-process", "one-run"],
)
def test_step_tuning_decides_by_the_rule(per_process, expected, tmp_path, monkeypatch):
  result = _tune(tmp_path / "t.json", monkeypatch, per_process)
  assert (result.implementation, result.bucket_bytes) == expected
  entry = result.entry
  assert entry.key == ("2x4", tables.STEP_OP, "float32", tables.size_bucket(TREE_BYTES))
  assert entry.choice == tables.decide(entry.runs)
  assert tables.parse_step_variant(entry.choice)[0] == expected[0]
  # Timed: every (implementation, bucket size) against XLA at the default bucket size.
  assert set(entry.ratios) == {
    f"xla@{SMALL_BUCKET}",
    FAST_SMALL,
    f"shard_map@{gradients.DEFAULT_BUCKET_BYTES}",
  }
  assert [r.process for r in entry.runs] == [f"process-{i}" for i in range(len(per_process))]
  (saved,) = tables.Table.from_json((tmp_path / "t.json").read_text()).entries
  assert saved == entry


def test_variants_are_the_candidates_that_run_here():
  request = step_tuning.traced_request(make_step("xla", 1), (_params(), *_batch()))
  assert (request.op, request.nbytes, request.torus) == ("all_reduce_gradients", TREE_BYTES, (2, 4))
  named = step_tuning.variants(request, None, (SMALL_BUCKET,))
  here = registry.candidates("all_reduce_gradients", jnp.float32)
  assert list(named)[0] == tables.BASELINE
  assert named[tables.BASELINE] == ("xla", gradients.DEFAULT_BUCKET_BYTES)
  assert {impl for impl, _ in named.values()} == set(here)
  assert "pallas" not in here  # no TPU, no interpret mode: not a candidate on CPU
  assert set(step_tuning.variants(request, ("lax_torus",), (SMALL_BUCKET,))) == {
    "xla",
    f"xla@{SMALL_BUCKET}",
    f"lax_torus@{SMALL_BUCKET}",
  }


def test_a_step_without_gradient_summation_is_refused():
  with pytest.raises(ValueError, match="sums no gradients"):
    step_tuning.traced_request(jax.jit(lambda p: p), (_params(),))


# What "auto" reads.


def _step_table(choice, nbytes=TREE_BYTES, dtype="float32"):
  """A table whose step entry gives ``choice`` by the rule (as "auto" requires): two runs,
  from two processes, with ``choice`` at half the baseline's time in every round."""
  runs = [tables.Run.of({choice: [0.5] * tables.MIN_ROUNDS}, process=p) for p in ("a", "b")]
  entry = tables.Entry.from_runs("2x4", tables.STEP_OP, dtype, tables.size_bucket(nbytes), runs)
  assert entry.choice == choice
  return tables.Table("cpu", "test machine", tables.now(), [entry])


@pytest.fixture
def bucket_sizes(monkeypatch):
  """The ``bucket_bytes`` of every bucketing the gradient summations traced make."""
  seen = []
  real = packing.buckets_by_size

  def spy(leaves, bucket_bytes, order=None):
    seen.append(bucket_bytes)
    return real(leaves, bucket_bytes, order)

  monkeypatch.setattr(packing, "buckets_by_size", spy)
  return seen


def _traced(bucket_sizes, tree, **kwargs):
  """(the implementation ``all_reduce_gradients(tree)``, "auto" unless told, runs when
  traced over the 2x4 mesh, read off its program; the bucket size it packed by)."""
  mesh = harness.mesh((2, 4))
  body = lambda t: tc.all_reduce_gradients(t, AXES, **kwargs)
  f = jax.shard_map(body, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())
  bucket_sizes.clear()
  program = str(jax.make_jaxpr(f)(tree))
  torus = set(re.findall(r"torus_all_reduce\[.*?impl=(\w+)", program, re.DOTALL))
  assert bool(torus) != ("psum" in program)  # a torus implementation, or lax's psum
  (implementation,) = torus or {"xla"}
  (size,) = bucket_sizes
  return implementation, size


DEFAULT = gradients.DEFAULT_BUCKET_BYTES


def test_auto_runs_the_step_entry_implementation_and_bucket_size(bucket_sizes):
  run = functools.partial(_traced, bucket_sizes, _params())
  assert run() == ("xla", DEFAULT)  # nothing measured
  tables.use_table(_step_table(f"xla@{SMALL_BUCKET}"))
  assert run() == ("xla", SMALL_BUCKET)
  assert run(bucket_bytes=1 << 20) == ("xla", 1 << 20)  # the caller's bucket size wins
  assert run(implementation="xla") == ("xla", DEFAULT)  # not "auto": no table read
  tables.use_table(_step_table(FAST_SMALL))
  assert run() == ("shard_map", SMALL_BUCKET)
  assert run(bucket_bytes=1 << 20) == ("shard_map", 1 << 20)
  tables.use_table(_step_table("lax_torus@2048"))
  assert run() == ("lax_torus", 2048)
  tables.use_table(_step_table("shard_map"))  # no bucket size recorded: the default
  assert run() == ("shard_map", DEFAULT)
  with tc.bitwise_as_lax():  # floats stay on lax, whatever a step entry says
    assert run() == ("xla", DEFAULT)


def test_a_step_entry_speaks_only_for_its_own_tree(bucket_sizes):
  tables.use_table(_step_table(FAST_SMALL))
  bigger = {"w": jnp.zeros((64, 64), jnp.float32)}  # 16 KiB: another size bucket
  assert _traced(bucket_sizes, bigger) == ("xla", DEFAULT)
  as_bf16 = jax.tree.map(lambda v: v.astype(jnp.bfloat16), _params())  # another dtype
  assert _traced(bucket_sizes, as_bf16) == ("xla", DEFAULT)
  tables.use_table(_step_table("no_such_backend@1024"))  # not a candidate here: ignored
  assert _traced(bucket_sizes, _params()) == ("xla", DEFAULT)


def test_auto_reads_what_tune_step_wrote(tmp_path, monkeypatch, bucket_sizes):
  result = _tune(tmp_path / "t.json", monkeypatch, [{FAST_SMALL: [0.5]}] * 2)
  assert (result.implementation, result.bucket_bytes) == ("shard_map", SMALL_BUCKET)
  assert _traced(bucket_sizes, _params()) == ("shard_map", SMALL_BUCKET)  # installed here
  tables.use_table(None)
  assert _traced(bucket_sizes, _params()) == ("xla", DEFAULT)  # the user cache is empty
  tables.use_table(tmp_path / "t.json")
  assert _traced(bucket_sizes, _params()) == ("shard_map", SMALL_BUCKET)  # read from the file


# A real run.


def test_short_real_run_on_cpu_records_xla(tmp_path, monkeypatch, bucket_sizes):
  """Two runs (as two processes) of 10 rounds each: on CPU no torus implementation beats
  XLA with confidence in both, so the entry is XLA's, and "auto" runs XLA."""
  path = tmp_path / "t.json"
  for process in ("first", "second"):
    monkeypatch.setattr(tables, "PROCESS", process)
    result = step_tuning.tune_step(
      make_step,
      (_params(), *_batch()),
      bucket_sizes=(SMALL_BUCKET, gradients.DEFAULT_BUCKET_BYTES),
      rounds=tables.MIN_ROUNDS,
      output=str(path),
      progress=None,
    )
  entry = result.entry
  assert entry.key == ("2x4", tables.STEP_OP, "float32", tables.size_bucket(TREE_BYTES))
  assert len(entry.runs) == 2 and all(r.rounds == tables.MIN_ROUNDS for r in entry.runs)
  assert {"shard_map", "lax_torus"} <= {tables.parse_step_variant(n)[0] for n in entry.ratios}
  assert all(np.isfinite(v) and v > 0 for v in entry.ratios.values())
  assert entry.choice == tables.decide(entry.runs)
  assert result.implementation == "xla"
  (saved,) = tables.Table.from_json(path.read_text()).entries
  assert saved == entry
  assert _traced(bucket_sizes, _params()) == ("xla", result.bucket_bytes)  # "auto": XLA


def _threaded_program(bucket_sizes, **kwargs):
  """(the program ``value_and_summed_grad(_loss, "auto" unless told)`` traces over the
  2x4 mesh, TPU interpret mode on so that "pallas" runs here; the bucket sizes packed)."""
  from torus_collectives.testing.split_interpret import async_interpret_mode

  mesh = harness.mesh((2, 4))
  step = tc.experimental.value_and_summed_grad(_loss, AXES, **{"implementation": "auto", **kwargs})
  body = lambda p, x, y: step(p, x, y)[1]
  f = jax.shard_map(
    body, mesh=mesh, in_specs=(jax.P(), jax.P(AXES), jax.P(AXES)), out_specs=jax.P()
  )
  bucket_sizes.clear()
  with async_interpret_mode("eager"):
    program = str(jax.make_jaxpr(f)(_params(), *_batch()))
  return program, list(bucket_sizes)


def test_auto_in_value_and_summed_grad_threads_what_the_step_entry_measured(bucket_sizes):
  """A "pallas" step entry: the split calls (``async_*``) inside the backward pass, at the
  entry's bucket size unless the caller's; a "shard_map" one: ``all_reduce_gradients``
  with it after the backward pass; none: "auto" as ``all_reduce_gradients`` decides."""
  tables.use_table(_step_table("pallas@2048"))
  program, sizes = _threaded_program(bucket_sizes)
  assert "async_leaf_all_gather_done" in program and sizes == [2048]
  program, sizes = _threaded_program(bucket_sizes, bucket_bytes=SMALL_BUCKET)
  assert "async_leaf_all_gather_done" in program and sizes == [SMALL_BUCKET]
  tables.use_table(_step_table(FAST_SMALL))
  program, sizes = _threaded_program(bucket_sizes)
  assert "async_" not in program and "impl=shard_map" in program and sizes == [SMALL_BUCKET]
  tables.use_table(None)
  program, sizes = _threaded_program(bucket_sizes)
  assert "async_" not in program and "torus_all_reduce" not in program and sizes == [DEFAULT]
