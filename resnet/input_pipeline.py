"""tf.data input pipeline with the paper's optimizations, feeding global jax.Arrays.

Training, per process (each stage overlaps with the next through tf.data's threads):

  own shard of encoded files (data_sources, per-process sharding, parallel reads)
  -> cache of the raw encoded bytes (the epoch-2+ reads cost nothing; decoded images would
     be ~10x larger)
  -> shuffle -> repeat -> skip the batches already trained on when resuming
  -> parallel map (AUTOTUNE): fused ``decode_and_crop_jpeg`` of an Inception-style random
     crop (only the crop's pixels are decoded), resize, optional flip, normalise
  -> skip corrupt images, counted -> batch (drop_remainder) -> prefetch
  -> host-to-device prefetch of global arrays built with make_array_from_process_local_data.

Randomness is stateless: an example's crop and flip depend only on (seed, epoch, id). A run
is therefore reproducible regardless of thread scheduling, the process count or a
restart, and resuming at step k sees exactly the batches the uninterrupted run saw
(unless a corrupt image precedes step k, which shifts later batches by one example).

Evaluation decodes a fused centre crop, keeps every example and pads each process's stream
to the same number of full batches, with ``mask`` = 0 on the padding.

Non-JPEG images (PNG) cannot use the fused op; they are fully decoded, then cropped.
"""

import collections
import dataclasses
import itertools
import math
from collections.abc import Iterator

import jax
import numpy as np
import tensorflow as tf

from resnet import data_sources


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """How encoded images become model inputs."""

  image_size: int
  crop_area_range: tuple[float, float] = (0.08, 1.0)
  crop_aspect_ratio_range: tuple[float, float] = (3 / 4, 4 / 3)
  random_flip: bool = True
  eval_crop_fraction: float = 0.875  # centre crop side / shorter image side
  mean_rgb: tuple[float, float, float] = (0.485 * 255, 0.456 * 255, 0.406 * 255)
  stddev_rgb: tuple[float, float, float] = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _decode_window(image_bytes: tf.Tensor, window_fn) -> tf.Tensor:
  """Decodes only ``window_fn(shape)`` = [y, x, h, w] of the image, as uint8 RGB."""

  def jpeg():
    window = window_fn(tf.image.extract_jpeg_shape(image_bytes))
    return tf.image.decode_and_crop_jpeg(image_bytes, window, channels=3)

  def other():
    image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    y, x, h, w = tf.unstack(window_fn(tf.shape(image)))
    return image[y : y + h, x : x + w]

  return tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)


def _random_window(shape, seed, p: Preprocessing) -> tf.Tensor:
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
    shape,
    bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
    seed=seed,
    min_object_covered=0.1,
    aspect_ratio_range=p.crop_aspect_ratio_range,
    area_range=p.crop_area_range,
    max_attempts=10,
    use_image_if_no_bounding_boxes=True,
  )
  return tf.stack([begin[0], begin[1], size[0], size[1]])


def _centre_window(shape, p: Preprocessing) -> tf.Tensor:
  side = tf.cast(
    tf.cast(tf.minimum(shape[0], shape[1]), tf.float32) * p.eval_crop_fraction, tf.int32
  )
  return tf.stack([(shape[0] - side) // 2, (shape[1] - side) // 2, side, side])


def _finish(image: tf.Tensor, p: Preprocessing) -> tf.Tensor:
  image = tf.image.resize(image, (p.image_size, p.image_size), method="bicubic")
  return (image - p.mean_rgb) / p.stddev_rgb


def preprocess_train(image_bytes, seed, p: Preprocessing) -> tf.Tensor:
  """Random-crop decode, resize, flip and normalise one image; ``seed`` is int32[2]."""
  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
  image = _decode_window(image_bytes, lambda s: _random_window(s, crop_seed, p))
  image = _finish(image, p)
  if p.random_flip:
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
  return image


def preprocess_eval(image_bytes, p: Preprocessing) -> tf.Tensor:
  return _finish(_decode_window(image_bytes, lambda s: _centre_window(s, p)), p)


def train_dataset(
  split: data_sources.Split,
  p: Preprocessing,
  *,
  local_batch: int,
  seed: int,
  start_step: int = 0,
  cache: bool = True,
  shuffle_buffer: int = 16_384,
) -> tf.data.Dataset:
  """Endless training batches ``{'image', 'label', 'skipped'}`` for this process.

  ``skipped`` (per row) counts the corrupt images dropped before that row since
  ``start_step``; a batch's maximum is the running total.
  """
  ds = split.dataset
  if cache:
    ds = ds.cache()
  if shuffle_buffer > 1:
    ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
  ds = ds.repeat().enumerate().skip(start_step * local_batch)
  per_epoch = split.num_examples

  def decode(position, record):
    epoch = tf.cast(position // per_epoch, tf.int32)
    key = tf.stack([tf.cast(record["id"] % (2**31 - 1), tf.int32), epoch + seed])
    return position, {"image": preprocess_train(record["image"], key, p), "label": record["label"]}

  ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.ignore_errors(log_warning=True).enumerate()
  first = start_step * local_batch

  def count_skipped(kept, item):
    position, example = item
    return dict(example, skipped=position - first - kept)

  ds = ds.map(count_skipped, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return ds.batch(local_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def eval_dataset(
  split: data_sources.Split,
  p: Preprocessing,
  *,
  local_batch: int,
  global_batch: int,
  cache: bool = True,
) -> tuple[tf.data.Dataset, int]:
  """Padded evaluation batches ``{'image', 'label', 'mask'}`` and the number of steps."""
  num_steps = math.ceil(split.total_examples / global_batch)
  ds = split.dataset
  if cache:
    ds = ds.cache()
  ds = ds.map(
    lambda r: {
      "image": preprocess_eval(r["image"], p),
      "label": r["label"],
      "mask": tf.constant(1, tf.int32),
    },
    num_parallel_calls=tf.data.AUTOTUNE,
    deterministic=True,
  ).ignore_errors(log_warning=True)
  padding = tf.data.Dataset.from_tensors(
    {
      "image": tf.zeros((p.image_size, p.image_size, 3)),
      "label": tf.constant(0, tf.int32),
      "mask": tf.constant(0, tf.int32),
    }
  ).repeat()
  ds = ds.concatenate(padding).take(num_steps * local_batch)
  return ds.batch(local_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE), num_steps


def device_prefetch(
  batches: Iterator[dict[str, np.ndarray]],
  sharding: jax.sharding.Sharding,
  size: int = 2,
  host_keys: tuple[str, ...] = ("skipped",),
) -> Iterator[tuple[dict[str, jax.Array], dict[str, np.ndarray]]]:
  """Yields (global device arrays, host-only fields), keeping ``size`` batches in flight.

  Each process passes its local rows; ``make_array_from_process_local_data`` stitches them
  into one global array sharded over the data-parallel mesh axes without any gather.
  """

  def put(batch):
    on_device = {
      k: jax.make_array_from_process_local_data(sharding, v)
      for k, v in batch.items()
      if k not in host_keys
    }
    return on_device, {k: batch[k] for k in host_keys if k in batch}

  queue = collections.deque(put(b) for b in itertools.islice(batches, size))
  while queue:
    yield queue.popleft()
    queue.extend(put(b) for b in itertools.islice(batches, 1))
