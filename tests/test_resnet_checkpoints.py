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
