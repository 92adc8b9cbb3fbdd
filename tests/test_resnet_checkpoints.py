"""resnet.checkpoints.VerifiedCheckpoints on a small state, without training: a same-size
change that orbax itself would load is caught by the SHA-256 record, and a step without its
record is refused, moved aside whole, and the previous step resumed."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resnet import checkpoints


def _state(step):
  return {"w": jnp.arange(6.0) * step, "step": jnp.int32(step)}


def _abstract():
  return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), _state(1))


@pytest.fixture
def saved(tmp_path):
  """A workdir with steps 1 and 2 saved and recorded."""
  store = checkpoints.VerifiedCheckpoints(tmp_path)
  for step in (1, 2):
    store.save(step, _state(step))
  store.close()
  return tmp_path


def _restore(workdir):
  store = checkpoints.VerifiedCheckpoints(workdir)
  try:
    return store.restore_newest_intact(_abstract()), store.latest
  finally:
    store.close()


def _change_a_timestamp_digit(step_dir: pathlib.Path) -> None:
  """One digit of ``init_timestamp_nsecs`` changed: the file keeps its size and stays valid
  JSON, so orbax loads the step as if nothing happened; only the digest can tell."""
  path = step_dir / "_CHECKPOINT_METADATA"
  text = path.read_text()
  match = re.search(r'"init_timestamp_nsecs": (\d+)', text)
  i = match.start(1) + 3
  digit = "1" if text[i] != "1" else "2"
  path.write_text(text[:i] + digit + text[i + 1 :])


def test_a_valid_same_size_change_is_caught_by_the_sha256(saved, caplog):
  newest = saved / "checkpoints" / "2"
  before = newest.joinpath("_CHECKPOINT_METADATA").stat().st_size
  _change_a_timestamp_digit(newest)
  assert newest.joinpath("_CHECKPOINT_METADATA").stat().st_size == before
  assert checkpoints.verification_problem(newest) == (
    f"_CHECKPOINT_METADATA does not match its SHA-256 ({before} bytes)"
  )
  state, latest = _restore(saved)
  assert latest == 1
  jax.tree.map(np.testing.assert_array_equal, state, _state(1))
  assert "does not match its SHA-256" in caplog.text
  (moved,) = (saved / "rejected_checkpoints").iterdir()
  assert moved.name.startswith("2-")


def test_a_step_without_its_digest_record_is_refused_and_kept(saved, caplog):
  newest = saved / "checkpoints" / "2"
  (newest / checkpoints.DIGESTS).unlink()
  files = checkpoints.file_digests(newest)
  assert checkpoints.verification_problem(newest).startswith(f"no {checkpoints.DIGESTS}")
  state, latest = _restore(saved)
  assert latest == 1
  jax.tree.map(np.testing.assert_array_equal, state, _state(1))
  assert f"Checkpoint step 2 at {newest} is unusable: no {checkpoints.DIGESTS}" in caplog.text
  # Nothing is lost: the refused step is moved aside with every file as it was.
  (moved,) = (saved / "rejected_checkpoints").iterdir()
  assert checkpoints.file_digests(moved) == files
  assert checkpoints.verification_problem(saved / "checkpoints" / "1") is None


def test_the_only_step_without_its_record_is_not_resumed(tmp_path, caplog):
  store = checkpoints.VerifiedCheckpoints(tmp_path)
  store.save(1, _state(1))
  store.close()
  (tmp_path / "checkpoints" / "1" / checkpoints.DIGESTS).unlink()
  state, latest = _restore(tmp_path)
  assert state is None and latest is None
  assert f"is unusable: no {checkpoints.DIGESTS}" in caplog.text
  (moved,) = (tmp_path / "rejected_checkpoints").iterdir()
  assert (moved / "default").is_dir()


def test_error_feedback_residuals_round_trip_into_their_shardings(tmp_path):
  """A train state whose optimizer state holds each device's gradient residual
  (``optim.ErrorFeedbackState``, ``[devices, *shape]`` split over the mesh) is saved and
  restored by ``train.restore_or_create_state`` bitwise, every device's row back on it."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import torus_collectives as tc
  from resnet import optim, train

  mesh = tc.make_torus_mesh((2, 4), axis_names=("x", "y"))
  spec = train.state_specs(optim.ErrorFeedbackState(inner=P(), residual=P(("x", "y"))))
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), spec)

  def state(scale):
    return train.TrainState(
      step=jnp.int32(3),
      params={"w": jnp.arange(6.0)},
      batch_stats={"mean": jnp.ones(2)},
      opt_state=optim.ErrorFeedbackState(
        inner={"momentum": jnp.full(6, 0.5)},
        residual={"w": scale * jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)},
      ),
    )

  saved = jax.device_put(state(1e-3), sharding)
  store = checkpoints.VerifiedCheckpoints(tmp_path)
  store.save(3, saved)
  store.close()
  store = checkpoints.VerifiedCheckpoints(tmp_path)
  try:
    restored = train.restore_or_create_state(store, jax.jit(lambda key: state(0.0)), None, sharding)
  finally:
    store.close()
  assert store.latest == 3
  jax.tree.map(np.testing.assert_array_equal, restored, saved)
  (residual,) = jax.tree.leaves(restored.opt_state.residual)
  assert residual.sharding.spec == P(("x", "y"))
  for shard in residual.addressable_shards:
    row = shard.index[0].start
    np.testing.assert_array_equal(
      np.asarray(shard.data), np.asarray(saved.opt_state.residual["w"])[row : row + 1]
    )
