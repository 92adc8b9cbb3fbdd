"""JPEG decode-and-crop throughput per core: fused against decode-then-crop.

The images are scikit-learn's two sample photographs, read as the original JPEG files
(640x427, the size of a typical ImageNet image). Each element gets an Inception-style
random crop (8-100% of the area, aspect 3/4-4/3) from a stateless seed, so both variants
cut the same windows, then a bilinear resize to 224x224. "fused" decodes only the crop
window (``tf.image.decode_and_crop_jpeg``); "decode_then_crop" decodes the whole image
and slices it. A sequential tf.data map with intra-op parallelism 1 runs inside each
``next()``, so the figure is images/s per core.
"""

import pathlib

import pytest
import tensorflow as tf
from settings import FULL
from sklearn import datasets

IMAGE_SIZE = 224
BATCH = 64 if FULL else 16  # images per timed round
VARIANTS = ("decode_then_crop", "fused")


def _photos() -> list[bytes]:
  return [pathlib.Path(f).read_bytes() for f in datasets.load_sample_images().filenames]


def _crop_window(jpeg: tf.Tensor, seed: tf.Tensor):
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
    tf.image.extract_jpeg_shape(jpeg),
    tf.zeros([0, 0, 4]),
    seed=seed,
    min_object_covered=0.1,
    aspect_ratio_range=(3 / 4, 4 / 3),
    area_range=(0.08, 1.0),
    max_attempts=10,
    use_image_if_no_bounding_boxes=True,
  )
  return begin, size


def _decode(variant: str):
  def fn(index, jpeg):
    begin, size = _crop_window(jpeg, tf.stack([index, tf.constant(0, tf.int64)]))
    if variant == "fused":
      window = tf.stack([begin[0], begin[1], size[0], size[1]])
      image = tf.image.decode_and_crop_jpeg(jpeg, window, channels=3)
    else:
      image = tf.slice(tf.io.decode_jpeg(jpeg, channels=3), begin, size)
    return tf.image.resize(image, (IMAGE_SIZE, IMAGE_SIZE))

  return fn


def _one_core_batches(variant: str):
  photos = tf.data.Dataset.from_tensor_slices(_photos()).repeat()
  ds = tf.data.Dataset.zip(tf.data.Dataset.counter(), photos)
  ds = ds.map(_decode(variant)).batch(BATCH)  # sequential map: runs inside next()
  options = tf.data.Options()
  options.threading.private_threadpool_size = 1
  options.threading.max_intra_op_parallelism = 1
  options.autotune.enabled = False
  return iter(ds.with_options(options))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_and_crop(benchmark, variant):
  batches = _one_core_batches(variant)
  for _ in range(2):  # warm up: trace the map function, fill caches
    next(batches)

  benchmark.group = "JPEG decode + random crop + resize, 1 core"
  images = benchmark.pedantic(lambda: next(batches).numpy(), rounds=7 if FULL else 5)

  assert images.shape == (BATCH, IMAGE_SIZE, IMAGE_SIZE, 3)
  benchmark.extra_info.update(
    variant=variant,
    baseline="decode_then_crop",
    items_per_s=BATCH / benchmark.stats.stats.median,
    unit="images/s/core",
  )
