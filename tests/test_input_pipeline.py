"""The tf.data pipeline: corrupt images skipped and counted, PNG fallback, padded
evaluation, per-process block sharding, and the tfds imagenet2012 path on mock data."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from resnet import data_sources, input_pipeline

PRE = input_pipeline.Preprocessing(image_size=8, random_flip=True)


def _image(value):
  return np.full((12, 10, 3), value, np.uint8)


@pytest.fixture
def folder(tmp_path):
  """Two classes: 3 JPEGs + 1 PNG in 'a', 2 JPEGs + 1 corrupt JPEG in 'b'."""
  for cls, values in (("a", (10, 20, 30)), ("b", (200, 210))):
    (tmp_path / "train" / cls).mkdir(parents=True)
    for v in values:
      (tmp_path / "train" / cls / f"{v}.jpg").write_bytes(tf.io.encode_jpeg(_image(v)).numpy())
  (tmp_path / "train" / "a" / "png.png").write_bytes(tf.io.encode_png(_image(40)).numpy())
  (tmp_path / "train" / "b" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"junk" * 50)
  return tmp_path


def test_corrupt_jpeg_is_skipped_and_counted(folder):
  split = data_sources.folder_split(folder, "train", process_index=0, process_count=1, block=1)
  assert split.num_examples == 7
  batches = input_pipeline.train_dataset(split, PRE, local_batch=1, seed=0, shuffle_buffer=0).take(
    12
  )
  labels, skipped = [], []
  for b in batches.as_numpy_iterator():
    assert b["image"].shape == (1, 8, 8, 3) and np.isfinite(b["image"]).all()
    labels.append(int(b["label"][0]))
    skipped.append(int(b["skipped"][0]))
  # Two epochs of the 6 good images, the bad one dropped each epoch and counted.
  assert sorted(labels) == [0] * 8 + [1] * 4
  assert skipped[5] == 1 and skipped[-1] == 2


def test_eval_keeps_every_readable_image_and_pads(folder):
  split = data_sources.folder_split(folder, "train", process_index=0, process_count=1, block=4)
  ds, steps = input_pipeline.eval_dataset(split, PRE, local_batch=4, global_batch=4)
  batches = list(ds.as_numpy_iterator())
  assert steps == len(batches) == 2
  masks = np.concatenate([b["mask"] for b in batches])
  labels = np.concatenate([b["label"] for b in batches])
  assert masks.sum() == 6 and sorted(labels[masks == 1]) == [0, 0, 0, 0, 1, 1]


def test_png_and_jpeg_decode_to_their_pixels(folder):
  split = data_sources.folder_split(folder, "train", process_index=0, process_count=1, block=1)
  for record in split.dataset.as_numpy_iterator():
    if record["image"].startswith(b"\xff\xd8\xff\xe0junk"):
      continue
    image = input_pipeline.preprocess_eval(record["image"], PRE).numpy()
    pixel = image * np.asarray(PRE.stddev_rgb) + np.asarray(PRE.mean_rgb)
    # Uniform images stay uniform through crop and resize; JPEG is off by a few levels.
    assert np.ptp(pixel) < 1.0
    assert int(round(pixel.mean())) in range(5, 215)


def test_block_sharding_partitions_global_batches(folder):
  shards = [
    data_sources.folder_split(folder, "train", process_index=p, process_count=2, block=2)
    for p in range(2)
  ]
  single = data_sources.folder_split(folder, "train", process_index=0, process_count=1, block=4)
  ids = [[int(r["id"]) for r in s.dataset.as_numpy_iterator()] for s in shards]
  everything = [int(r["id"]) for r in single.dataset.as_numpy_iterator()]
  # Global batch k of 4 = process 0's k-th block of 2, then process 1's.
  assert ids[0][:2] + ids[1][:2] == everything[:4]
  assert sorted(ids[0] + ids[1]) == sorted(everything)


def test_missing_folder_says_where_to_put_images(tmp_path):
  with pytest.raises(FileNotFoundError, match="one folder per class"):
    data_sources.folder_split(tmp_path, "train", process_index=0, process_count=1, block=1)


def test_imagenet2012_path_with_mock_data(tmp_path):
  with tfds.testing.mock_data(num_examples=8):
    split = data_sources.imagenet_split(str(tmp_path), "train", process_index=1, process_count=2)
    assert split.num_classes == 1000
    assert split.num_examples == split.total_examples == 8  # mock data ignores the split
    batch = next(
      input_pipeline.train_dataset(
        split, PRE, local_batch=4, seed=0, shuffle_buffer=8
      ).as_numpy_iterator()
    )
  assert batch["image"].shape == (4, 8, 8, 3)
  assert ((0 <= batch["label"]) & (batch["label"] < 1000)).all()
  assert batch["skipped"].max() == 0
