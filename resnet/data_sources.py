"""Where the images come from: encoded bytes, labels and stable ids, sharded per process.

A source yields ``{'image': encoded bytes, 'label': int32, 'id': int64}`` records in a
fixed order, already restricted to this process's shard (the paper's per-host sharding:
each host reads only its own files). ``id`` is stable across runs and process counts; the
input pipeline derives each example's augmentation randomness from it.

Sources:
- ``digits``: scikit-learn's 1797 real 8x8 handwritten digits (shipped with the package,
  no download), written once as 32x32 JPEG files in class folders under the data
  directory, with a fixed 80/20 held-out split. This exercises the same decode-and-crop
  path as ImageNet.
- ``folder``: any ``<root>/<split>/<class>/<image>`` tree of JPEG or PNG files.
- ``imagenet2012``: the tensorflow-datasets builder (ImageNet needs a manual download).

Folder sources are sharded in blocks of ``block`` files: file ``i`` of the globally
shuffled list belongs to process ``(i // block) % process_count``. With ``block`` equal to
the per-process batch, process ``p``'s ``k``-th batch is rows ``[p*block, (p+1)*block)`` of
the ``k``-th global batch, so the global batches do not depend on the process count.
"""

import dataclasses
import os
import pathlib

import numpy as np
import tensorflow as tf

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
DIGITS_IMAGE_SIZE = 32
DIGITS_HELD_OUT_FRACTION = 0.2


@dataclasses.dataclass(frozen=True)
class Split:
  """One split of a dataset as seen by this process."""

  dataset: tf.data.Dataset  # {'image': tf.string, 'label': tf.int32, 'id': tf.int64}
  num_examples: int  # in this process's shard
  total_examples: int  # over all processes
  num_classes: int


def write_digits(root: pathlib.Path) -> None:
  """Writes the digits as JPEGs under ``root/{train,test}/<digit>/`` unless present.

  The tree is built in a temporary sibling directory and renamed into place, so a reader
  never sees a half-written dataset and concurrent writers (several processes on one
  host) do not collide.
  """
  if root.is_dir():
    return
  from sklearn import datasets

  digits = datasets.load_digits()
  images = digits.images.astype(np.float32) * (255.0 / 16.0)  # 0..16 -> 0..255
  order = np.random.default_rng(0).permutation(len(images))
  num_test = int(len(images) * DIGITS_HELD_OUT_FRACTION)
  splits = {"test": order[:num_test], "train": order[num_test:]}
  tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
  for split, indices in splits.items():
    for i in indices:
      image = tf.image.resize(images[i][..., None], (DIGITS_IMAGE_SIZE,) * 2, method="bicubic")
      image = tf.image.grayscale_to_rgb(
        tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
      )
      path = tmp / split / str(digits.target[i]) / f"{i:04d}.jpg"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_bytes(tf.io.encode_jpeg(image, quality=95).numpy())
  try:
    tmp.rename(root)
  except OSError:  # another process finished first
    if not root.is_dir():
      raise


def folder_split(
  root: str | os.PathLike,
  split: str,
  *,
  process_index: int,
  process_count: int,
  block: int,
  seed: int = 0,
) -> Split:
  """Lists ``root/split/<class>/*`` and keeps this process's blocks of files."""
  split_dir = pathlib.Path(root) / split
  if not split_dir.is_dir():
    raise FileNotFoundError(
      f"No {split!r} split at {split_dir}: put the images in "
      f"{split_dir}/<class name>/<image>.jpg (or .png), one folder per class."
    )
  classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
  paths, labels = [], []
  for label, name in enumerate(classes):
    files = sorted(p for p in (split_dir / name).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    paths += [str(p) for p in files]
    labels += [label] * len(files)
  if not paths:
    raise FileNotFoundError(f"No JPEG or PNG images under {split_dir}/<class name>/.")
  # One fixed permutation, identical on every process, mixes the classes before sharding.
  ids = np.random.default_rng(seed).permutation(len(paths))
  mine = ids[(np.arange(len(ids)) // block) % process_count == process_index]
  dataset = tf.data.Dataset.from_tensor_slices(
    {
      "path": np.asarray(paths)[mine],
      "label": np.asarray(labels, np.int32)[mine],
      "id": mine.astype(np.int64),
    }
  ).map(
    lambda r: {"image": tf.io.read_file(r["path"]), "label": r["label"], "id": r["id"]},
    num_parallel_calls=tf.data.AUTOTUNE,
    deterministic=True,
  )
  return Split(dataset, len(mine), len(paths), len(classes))


def imagenet_split(
  data_dir: str | None, split: str, *, process_index: int, process_count: int
) -> Split:
  """This process's even share of tfds ``imagenet2012``, images left encoded."""
  import tensorflow_datasets as tfds

  builder = tfds.builder("imagenet2012", data_dir=data_dir or None)
  try:
    builder.download_and_prepare()
  except AssertionError as e:  # tfds signals a missing manual download this way
    raise FileNotFoundError(
      "ImageNet needs a manual download: put ILSVRC2012_img_train.tar and "
      f"ILSVRC2012_img_val.tar in {builder.data_dir_root}/downloads/manual/ "
      "and rerun; tfds then prepares it once."
    ) from e
  shard = tfds.even_splits(split, n=process_count)[process_index]
  read_config = tfds.ReadConfig(
    interleave_cycle_length=16, num_parallel_calls_for_interleave_files=tf.data.AUTOTUNE
  )
  dataset = builder.as_dataset(
    split=shard,
    decoders={"image": tfds.decode.SkipDecoding()},
    read_config=read_config,
    shuffle_files=False,
  )
  dataset = dataset.map(
    lambda r: {
      "image": r["image"],
      "label": tf.cast(r["label"], tf.int32),
      "id": tf.strings.to_hash_bucket_fast(r["file_name"], 2**62),
    }
  )
  whole = builder.as_dataset(split=split, decoders={"image": tfds.decode.SkipDecoding()})
  num_examples, total = int(dataset.cardinality()), int(whole.cardinality())
  if min(num_examples, total) < 0:
    raise ValueError(
      f"tfds reports no example count for imagenet2012 {split=}; "
      "regenerate it with tfds build imagenet2012."
    )
  return Split(dataset, num_examples, total, builder.info.features["label"].num_classes)


def get_split(
  name: str,
  data_dir: str | os.PathLike,
  split: str,
  *,
  process_index: int,
  process_count: int,
  block: int,
) -> Split:
  """Dispatches on the dataset name: 'digits', 'imagenet2012' or 'folder:<path>'."""
  if name == "digits":
    root = pathlib.Path(data_dir) / "digits"
    write_digits(root)
    return folder_split(
      root, split, process_index=process_index, process_count=process_count, block=block
    )
  if name == "imagenet2012":
    return imagenet_split(data_dir, split, process_index=process_index, process_count=process_count)
  if name.startswith("folder:"):
    return folder_split(
      name.removeprefix("folder:"),
      split,
      process_index=process_index,
      process_count=process_count,
      block=block,
    )
  raise ValueError(
    f"Unknown dataset {name=}; use 'digits', 'imagenet2012' or "
    "'folder:<root>' with <root>/<split>/<class>/<image> files."
  )
