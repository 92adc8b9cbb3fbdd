"""ResNet training step and input pipeline, images/s, as ``make train`` configures them.

Training step: the step that resnet/train.py runs (``train.make_train_step``: forward,
backward, gradient averaging, LARS, moving-statistics averaging) on 8 simulated CPU devices
as a 2x4 torus, with the global batch split over all of them; each variant's gradient
synchronisation is its config's ``grad_sync.strategy_from_config``. Three variants share
the model, batch, optimizer and devices:
  "torus_collectives"  gradients averaged by ``tc.all_reduce_gradients`` and batch norm by
                       ``torus_collectives.norm.linen.BatchNorm`` (what training uses);
  "weight_update_sharding"  the same with ``weight_update_sharding=True``: gradients
                       reduce-scattered, LARS on each device's 1/8 of the weights, new
                       weights all-gathered (``tc.sharded_update``);
  "flax"               the usual approach: ``lax.pmean`` of the gradients and
                       ``flax.linen.BatchNorm(axis_name=...)``.
Each records its optimizer-state bytes per device (from the state's shards).
Batch norm statistics span all 8 replicas in both (group size 8), so the two compute the
same function. The state is not donated here, so every round reuses the same inputs. The
variants are timed interleaved (``conftest.interleaved``); "auto" reads the tuning tables
(see ``torus_collectives.tuning.tables``), and the implementation it picked for the gradient
summation is recorded.

Input pipeline: resnet/input_pipeline.py on the embedded digits, with the default config's
preprocessing, cache, shuffle buffer and device prefetch; one round pulls one global
batch onto the devices, after a first epoch has filled the cache. Its time ratio to "flax"
is therefore pipeline time per batch over step time per batch: below 1, it keeps up. It
is timed alone; in training it shares the cores with the step.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from settings import FULL

import torus_collectives as tc
from resnet import data_sources, grad_sync, input_pipeline, models, optim, train
from resnet.configs import default
from torus_collectives.norm import linen as tc_nn
from torus_collectives.tuning import tuner

CONFIG = default.get_config()
# ResNet-50 (what ``make train`` trains) takes minutes to compile on two shared cores, so
# the default run times ResNet-18; TC_BENCH_FULL=1 times ResNet-50.
CONFIG.model = "resnet50" if FULL else "resnet18"
MESH_SHAPE = tuple(CONFIG.mesh_shape)
NUM_REPLICAS = MESH_SHAPE[0] * MESH_SHAPE[1]
NUM_CLASSES = 10
VARIANTS = ("flax", "torus_collectives", "weight_update_sharding")  # the baseline first
GROUP = (
  f"{CONFIG.model} train step, {CONFIG.image_size}x{CONFIG.image_size} "
  f"{CONFIG.dtype}, global batch {CONFIG.global_batch_size}, "
  f"{MESH_SHAPE[0]}x{MESH_SHAPE[1]} mesh"
)


def _step_and_state(mesh, variant: str, config: ml_collections.ConfigDict):
  """The jitted (not donating) training step of ``variant`` and its initial state."""
  model = models.create_model(
    CONFIG.model,
    num_classes=NUM_CLASSES,
    dtype=jnp.dtype(CONFIG.dtype),
    axis_name=mesh.axis_names,
    bn_momentum=CONFIG.bn_momentum,
    # Statistics over all replicas in both: group_size None is the whole mesh for ours.
    norm=nn.BatchNorm if variant == "flax" else tc_nn.BatchNorm,
  )
  learning_rate_fn = optim.learning_rate_schedule(
    base_learning_rate=CONFIG.base_learning_rate,
    global_batch=CONFIG.global_batch_size,
    warmup_steps=10,
    total_steps=100,
    end_learning_rate=CONFIG.end_learning_rate,
    power=CONFIG.lr_decay_power,
  )
  sync = grad_sync.strategy_from_config(
    config, mesh, optim.create_lars(config, learning_rate_fn), model=model
  )
  if variant == "flax":  # the usual approach: lax.pmean of the gradients
    sync = dataclasses.replace(sync, average=lax.pmean)
  init = train.make_init_fn(model, sync.tx, CONFIG.image_size, mesh, sync.opt_state_spec)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), train.state_specs(sync.opt_state_spec))
  state = jax.device_put(init(jax.random.key(0, impl="rbg")), shardings)
  step = jax.jit(
    train.make_train_step(
      model,
      sync.tx,
      learning_rate_fn,
      mesh,
      num_classes=NUM_CLASSES,
      label_smoothing=CONFIG.label_smoothing,
      sync=sync,
    )
  )
  return step, state


def _per_device_bytes(tree) -> int:
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def test_train_step(benchmark, interleaved):
  mesh = tc.make_torus_mesh(MESH_SHAPE)
  key_image, key_label = jax.random.split(jax.random.key(1))
  shape = (CONFIG.global_batch_size, CONFIG.image_size, CONFIG.image_size, 3)
  batch = jax.device_put(
    {
      "image": jax.random.normal(key_image, shape),
      "label": jax.random.randint(key_label, shape[:1], 0, NUM_CLASSES),
    },
    NamedSharding(mesh, P(mesh.axis_names)),
  )
  calls, states = {}, {}
  for variant in VARIANTS:
    config = CONFIG.copy_and_resolve_references()
    config.weight_update_sharding = variant == "weight_update_sharding"
    step, states[variant] = _step_and_state(mesh, variant, config)
    calls[variant] = lambda step=step, state=states[variant]: step(state, batch)

  benchmark.group = GROUP
  runs = interleaved(calls, baseline="flax")

  for variant in VARIANTS:
    _, metrics = calls[variant]()
    assert jnp.isfinite(metrics["train_loss"])
    benchmark.extra_info["variants"][variant].update(
      items_per_s=CONFIG.global_batch_size / runs.median(variant),
      unit="images/s",
      optimizer_state_bytes_per_device=_per_device_bytes(states[variant].opt_state),
    )
  gradients = tuner.gradients_case(mesh, states["torus_collectives"].params)
  benchmark.extra_info["variants"]["torus_collectives"]["grad_implementation"] = (
    f"{CONFIG.grad_implementation} -> {tuner.auto_choice(gradients, mesh)}"
  )
  benchmark.extra_info.update(
    model=CONFIG.model,
    image_size=CONFIG.image_size,
    global_batch=CONFIG.global_batch_size,
    bn_group_size=NUM_REPLICAS,
  )


def test_input_pipeline(benchmark, steady, tmp_path_factory):
  mesh = tc.make_torus_mesh(MESH_SHAPE)
  split = data_sources.get_split(
    CONFIG.dataset,
    tmp_path_factory.mktemp("data"),
    CONFIG.train_split,
    process_index=0,
    process_count=1,
    block=CONFIG.global_batch_size,
  )
  preprocessing = input_pipeline.Preprocessing(
    image_size=CONFIG.image_size,
    crop_area_range=tuple(CONFIG.crop_area_range),
    random_flip=CONFIG.random_flip,
    eval_crop_fraction=CONFIG.eval_crop_fraction,
  )
  batches = input_pipeline.device_prefetch(
    input_pipeline.train_dataset(
      split,
      preprocessing,
      local_batch=CONFIG.global_batch_size,
      seed=CONFIG.seed,
      cache=CONFIG.cache,
      shuffle_buffer=CONFIG.shuffle_buffer,
    ).as_numpy_iterator(),
    NamedSharding(mesh, P(mesh.axis_names)),
    size=CONFIG.prefetch_to_device,
  )
  for _ in range(split.num_examples // CONFIG.global_batch_size + 1):  # fill the cache
    next(batches)

  benchmark.group = GROUP
  on_device = steady(lambda: next(batches)[0])

  assert on_device["image"].shape == (
    CONFIG.global_batch_size,
    CONFIG.image_size,
    CONFIG.image_size,
    3,
  )
  benchmark.extra_info.update(
    variant="input_pipeline",
    baseline="flax",
    dataset=CONFIG.dataset,
    global_batch=CONFIG.global_batch_size,
    items_per_s=CONFIG.global_batch_size / benchmark.stats.stats.median,
    unit="images/s",
  )
