"""ResNet-50 on ImageNet (tfds imagenet2012), 224x224, bfloat16, LARS, BN over 64 examples.

  python -m resnet --config=resnet/configs/imagenet.py --workdir=runs/imagenet \
      --config.data_dir=$HOME/tensorflow_datasets

ImageNet needs a manual download: put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar
in <data_dir>/downloads/manual/; the first run prepares the dataset once. On a multi-host
machine run the same command on every host (see resnet/__main__.py for the process flags).
"""

from resnet.configs import default

TRAIN_IMAGES = 1_281_167

# Peak learning rate and warmup epochs of the LARS polynomial schedule in Google's MLPerf
# ResNet-50 TPU reference, by global batch (the rate is not linear in the batch there).
LARS_TABLE = ((8192, 5.0, 5), (16384, 10.0, 5), (32768, 25.0, 5), (None, 32.0, 14))


def lars_hyperparameters(global_batch: int) -> tuple[float, float]:
  """(base_learning_rate per 256 examples, warmup_epochs) for ``global_batch``."""
  for limit, peak, warmup in LARS_TABLE:
    if limit is None or global_batch < limit:
      return peak * 256 / global_batch, warmup
  raise AssertionError("unreachable: the last row has no limit")


def get_config(global_batch: int = 4096):
  c = default.get_config()
  c.simulated_cpu_devices = 0
  c.mesh_shape = ()  # the most square torus over all devices
  c.dataset = "imagenet2012"
  c.data_dir = ""  # tfds default (~/tensorflow_datasets)
  c.train_split = "train"
  c.eval_split = "validation"
  c.image_size = 224
  c.crop_area_range = (0.08, 1.0)
  c.random_flip = True
  c.eval_crop_fraction = 0.875
  c.shuffle_buffer = 16_384
  c.model = "resnet50"
  c.dtype = "bfloat16"
  c.bn_span_examples = 64
  c.global_batch_size = global_batch
  c.eval_batch_size = 1024
  c.num_epochs = 90.0
  c.base_learning_rate, c.warmup_epochs = lars_hyperparameters(global_batch)
  c.weight_decay = 1e-4
  c.weight_update_sharding = True
  c.defer_weight_gather = True
  # Off: by bench.overlap_report (compiler estimates and the cost model), the libtpu flags
  # for async gradient collectives shorten this step on v5e:4x4 but lengthen it on v5e:16x16,
  # where each of the many collectives they leave apart pays the torus's latency
  # (docs/benchmarks.md). Turn on after the report says they win on your topology.
  c.xla_overlap_settings = False
  c.log_every_steps = 100
  c.eval_every_epochs = 4.0
  c.checkpoint_every_steps = 1000
  return c
