"""Data-parallel ResNet training on a 2-D torus: the paper's system end to end.

Every device of a 2-D torus mesh holds a replica of the train state and a slice of the
global batch. One step is ``jax.jit`` of a ``jax.shard_map`` body that:
  1. runs the model with batch norm statistics averaged over ``bn_group_size`` replicas,
  2. sums gradients over the whole torus with ``tc.all_reduce_gradients`` (2-D torus
     reduce-scatter / all-gather where the platform has it, lax elsewhere),
  3. applies LARS, and averages the moving BN statistics so the state stays replicated.
With ``weight_update_sharding``, steps 2-3 become ``tc.sharded_update``: reduce-scatter,
LARS on each device's 1/p of the weights (its state stored split over the devices),
all-gather of the new weights.

Around it: orbax checkpoints every N steps and on SIGTERM/SIGINT with automatic resume,
a stop with the last good checkpoint kept when the loss or gradient turns non-finite,
periodic top-1/top-5 evaluation, TensorBoard scalars, a progress bar, and a PNG plot.
"""

import functools
import itertools
import math
import pathlib
import signal
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax
import orbax.checkpoint as ocp
import tqdm
from absl import logging
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import data_sources, input_pipeline, models, optim, reporting


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any


def state_specs(opt_state_spec: P) -> TrainState:
  """``shard_map`` specs of the state: replicated, but for a sharded optimizer state."""
  return TrainState(step=P(), params=P(), batch_stats=P(), opt_state=opt_state_spec)


def torus_shape(num_devices: int) -> tuple[int, int]:
  """The most square X x Y factorisation with X <= Y."""
  x = max(d for d in range(1, math.isqrt(num_devices) + 1) if num_devices % d == 0)
  return x, num_devices // x


def bn_group_size(span_examples: int, per_replica_batch: int, num_replicas: int) -> int:
  """Replicas per BN group: the largest divisor of the replica count whose group holds at
  most ``span_examples`` examples (at least one replica)."""
  return max(
    g
    for g in range(1, num_replicas + 1)
    if num_replicas % g == 0 and (g == 1 or g * per_replica_batch <= span_examples)
  )


def _cross_entropy(logits, labels, num_classes: int, label_smoothing: float):
  targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets)


def _train_step(
  state: TrainState,
  batch,
  *,
  model,
  tx,
  schedule,
  axes,
  num_classes,
  label_smoothing,
  average_gradients,
):
  """Per-device body of one training step (inside shard_map)."""

  def loss_fn(params):
    logits, updates = model.apply(
      {'params': params, 'batch_stats': state.batch_stats},
      batch['image'],
      train=True,
      mutable=['batch_stats'],
    )
    loss = _cross_entropy(logits, batch['label'], num_classes, label_smoothing).mean()
    return loss, (logits, updates['batch_stats'])

  (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  if average_gradients is None:  # weight-update sharding: tx reduce-scatters them itself
    params, opt_state = tx.apply_gradients(grads, state.opt_state, state.params)
    # The mean gradient exists only as shards: log the replicas' RMS gradient norm, an
    # upper bound of the mean's norm that is just as non-finite when it is.
    grad_norm = jnp.sqrt(lax.pmean(optax.tree.norm(grads) ** 2, axes))
  else:
    grads = average_gradients(grads, axes)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
  new_state = TrainState(
    step=state.step + 1,
    params=params,
    batch_stats=lax.pmean(batch_stats, axes),
    opt_state=opt_state,
  )
  metrics = {
    'train_loss': lax.pmean(loss, axes),
    'train_accuracy': lax.pmean(jnp.mean(jnp.argmax(logits, -1) == batch['label']), axes),
    'grad_norm': grad_norm,
    'learning_rate': schedule(state.step),
  }
  return new_state, metrics


def make_train_step(
  model,
  tx,
  schedule,
  mesh: jax.sharding.Mesh,
  *,
  num_classes: int,
  label_smoothing: float,
  average_gradients: Callable[[Any, tuple[str, ...]], Any] | None,
  opt_state_spec: P | None = None,
) -> Callable:
  """One data-parallel step ``(state, batch) -> (state, metrics)`` over every mesh axis.

  The state is replicated and the batch split over all devices. ``average_gradients(grads,
  axes)`` averages the per-device gradients over the mesh (``tc.all_reduce_gradients`` in
  training; a benchmark may pass ``lax.pmean``); ``None`` when ``tx`` is a
  ``tc.sharded_update``, which averages them itself and keeps its state split as
  ``opt_state_spec`` says (default: replicated). The result is not jitted, so the caller
  chooses whether to donate the state.
  """
  body = functools.partial(
    _train_step,
    model=model,
    tx=tx,
    schedule=schedule,
    axes=mesh.axis_names,
    num_classes=num_classes,
    label_smoothing=label_smoothing,
    average_gradients=average_gradients,
  )
  spec = state_specs(P() if opt_state_spec is None else opt_state_spec)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec, P(mesh.axis_names)), out_specs=(spec, P()))


def _eval_step(state: TrainState, batch, *, model, axes):
  """Counts of top-1 and top-5 hits and of real (unpadded) examples, summed over devices."""
  logits = model.apply(
    {'params': state.params, 'batch_stats': state.batch_stats}, batch['image'], train=False
  )
  top5 = lax.top_k(logits, 5)[1]
  hits = top5 == batch['label'][:, None]
  mask = batch['mask']
  return lax.psum(
    {
      'top1': jnp.sum(hits[:, 0] * mask),
      'top5': jnp.sum(hits.any(-1) * mask),
      'count': jnp.sum(mask),
    },
    axes,
  )


class _StopRequest:
  """Turns SIGTERM/SIGINT into a flag the loop polls, so it can checkpoint and exit."""

  def __init__(self):
    self.signal = None
    self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

  def _handle(self, signum, frame):
    del frame
    self.signal = signal.Signals(signum).name

  def restore(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from ``workdir``'s latest checkpoint) and returns final metrics."""
  start_time = time.time()
  workdir = pathlib.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  num_devices, num_processes = jax.device_count(), jax.process_count()
  if config.global_batch_size % num_devices or config.eval_batch_size % num_devices:
    raise ValueError(
      f'{config.global_batch_size=} and {config.eval_batch_size=} must be '
      f'multiples of the {num_devices} devices.'
    )
  mesh = tc.make_torus_mesh(tuple(config.mesh_shape) or torus_shape(num_devices))
  axes = mesh.axis_names
  data_sharding = NamedSharding(mesh, P(axes))
  local_batch = config.global_batch_size // num_processes
  local_eval_batch = config.eval_batch_size // num_processes

  split_args = dict(process_index=jax.process_index(), process_count=num_processes)
  train_split = data_sources.get_split(
    config.dataset, config.data_dir, config.train_split, block=local_batch, **split_args
  )
  eval_split = data_sources.get_split(
    config.dataset, config.data_dir, config.eval_split, block=local_eval_batch, **split_args
  )
  steps_per_epoch = train_split.total_examples // config.global_batch_size
  total_steps = (
    config.num_train_steps
    if config.num_train_steps > 0
    else int(config.num_epochs * steps_per_epoch)
  )
  eval_every = max(1, round(config.eval_every_epochs * steps_per_epoch))

  per_replica = config.global_batch_size // num_devices
  group = (
    config.bn_group_size
    if config.bn_group_size > 0
    else bn_group_size(config.bn_span_examples, per_replica, num_devices)
  )
  model = models.create_model(
    config.model,
    num_classes=train_split.num_classes,
    dtype=jnp.dtype(config.dtype),
    axis_name=axes,
    bn_group_size=group,
    bn_momentum=config.bn_momentum,
  )
  schedule = optim.learning_rate_schedule(
    base_learning_rate=config.base_learning_rate,
    global_batch=config.global_batch_size,
    warmup_steps=round(config.warmup_epochs * steps_per_epoch),
    total_steps=total_steps,
    end_learning_rate=config.end_learning_rate,
    power=config.lr_decay_power,
  )
  tx, opt_state_spec = optim.create_optimizer(config, schedule, axes)
  state_spec = state_specs(opt_state_spec)
  state_sharding = jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_spec)

  # Initialised on one device and then replicated (a sharded optimizer state is made by
  # its shard_map from the replicated parameters): partitioning the random initialisers
  # over every device only costs compile time.
  @jax.jit
  def init(key):
    shape = (1, config.image_size, config.image_size, 3)
    variables = model.init(key, jnp.zeros(shape, model.dtype), train=False)
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=variables['params'],
      batch_stats=variables['batch_stats'],
      opt_state=jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=opt_state_spec)(
        variables['params']
      ),
    )

  train_step = jax.jit(
    make_train_step(
      model,
      tx,
      schedule,
      mesh,
      num_classes=train_split.num_classes,
      label_smoothing=config.label_smoothing,
      average_gradients=None
      if config.weight_update_sharding
      else functools.partial(tc.all_reduce_gradients, implementation=config.grad_implementation),
      opt_state_spec=opt_state_spec,
    ),
    donate_argnums=0,
  )
  eval_step = jax.jit(
    jax.shard_map(
      functools.partial(_eval_step, model=model, axes=axes),
      mesh=mesh,
      in_specs=(state_spec, P(axes)),
      out_specs=P(),
    )
  )

  checkpoints = ocp.CheckpointManager(
    workdir / 'checkpoints', options=ocp.CheckpointManagerOptions(max_to_keep=2)
  )
  # rbg: XLA's RngBitGenerator compiles far faster than threefry for large inits.
  key = jax.random.key(config.seed, impl='rbg')
  if checkpoints.latest_step() is None:
    state = jax.device_put(init(key), state_sharding)
  else:  # shapes only: nothing is initialised just to be overwritten
    abstract = jax.tree.map(
      lambda sharding, part: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), part
      ),
      state_sharding,
      jax.eval_shape(init, key),
    )
    state = checkpoints.restore(checkpoints.latest_step(), args=ocp.args.StandardRestore(abstract))
    logging.warning('Resumed from step %d in %s', int(state.step), checkpoints.directory)
  start_step = int(state.step)

  preprocessing = input_pipeline.Preprocessing(
    image_size=config.image_size,
    crop_area_range=tuple(config.crop_area_range),
    random_flip=config.random_flip,
    eval_crop_fraction=config.eval_crop_fraction,
  )
  train_batches = input_pipeline.device_prefetch(
    input_pipeline.train_dataset(
      train_split,
      preprocessing,
      local_batch=local_batch,
      seed=config.seed,
      start_step=start_step,
      cache=config.cache,
      shuffle_buffer=config.shuffle_buffer,
    ).as_numpy_iterator(),
    data_sharding,
    size=config.prefetch_to_device,
  )
  eval_data, eval_steps = input_pipeline.eval_dataset(
    eval_split,
    preprocessing,
    local_batch=local_eval_batch,
    global_batch=config.eval_batch_size,
    cache=config.cache,
  )

  def evaluate() -> dict[str, float]:
    totals = {'top1': 0, 'top5': 0, 'count': 0}
    batches = input_pipeline.device_prefetch(
      eval_data.as_numpy_iterator(), data_sharding, host_keys=()
    )
    for batch, _ in itertools.islice(batches, eval_steps):
      for k, v in eval_step(state, batch).items():
        totals[k] += int(v)
    return {
      'eval_top1': totals['top1'] / totals['count'],
      'eval_top5': totals['top5'] / totals['count'],
    }

  writer = reporting.MetricWriter(workdir)
  stop = _StopRequest()
  progress = tqdm.tqdm(
    total=total_steps,
    initial=start_step,
    unit='step',
    disable=jax.process_index() != 0,
    dynamic_ncols=True,
  )
  last_good = checkpoints.latest_step()
  images_per_second, eval_metrics, evaluated_at = 0.0, {}, None
  skipped = reported_skipped = 0
  window_start, window_steps = time.time(), 0
  try:
    for step in range(start_step + 1, total_steps + 1):
      batch, host = next(train_batches)
      state, metrics = train_step(state, batch)
      window_steps += 1
      if step == start_step + 1:  # keep compilation out of the throughput
        jax.block_until_ready(state)
        window_start, window_steps = time.time(), 0
      skipped = max(skipped, int(host['skipped'].max()))
      log_now = step % config.log_every_steps == 0 or step == total_steps
      stopping = stop.signal is not None  # read once: a signal may land mid-iteration
      checkpoint_now = step % config.checkpoint_every_steps == 0 or step == total_steps or stopping
      if not (log_now or checkpoint_now or step % eval_every == 0):
        continue
      scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
      if not all(map(math.isfinite, scalars.values())):
        raise FloatingPointError(
          f'Non-finite training metrics at step {step}: {scalars}. Stopped without '
          f'saving; the last good checkpoint (step {last_good}) is kept in '
          f'{checkpoints.directory}. Lower base_learning_rate or raise warmup_epochs.'
        )
      if window_steps:
        images_per_second = window_steps * config.global_batch_size / (time.time() - window_start)
      scalars.update(images_per_second=images_per_second, skipped_images=skipped)
      if step % eval_every == 0 or step == total_steps:
        eval_metrics, evaluated_at = evaluate(), step
        scalars.update(eval_metrics)
      writer.write(step, scalars)
      progress.set_postfix(
        loss=f"{scalars['train_loss']:.3f}", img_s=f'{images_per_second:.1f}', refresh=False
      )
      progress.update(step - progress.n)
      if skipped > reported_skipped:
        logging.warning('Skipped %d unreadable training images so far.', skipped)
        reported_skipped = skipped
      if checkpoint_now:
        checkpoints.save(step, args=ocp.args.StandardSave(state))
        last_good = step
      window_start, window_steps = time.time(), 0  # evaluation and saving not counted
      if stopping:
        checkpoints.wait_until_finished()
        logging.warning(
          '%s: saved step %d to %s; rerun the same command to resume.',
          stop.signal,
          step,
          checkpoints.directory,
        )
        break
  finally:
    checkpoints.wait_until_finished()
    checkpoints.close()
    progress.close()
    stop.restore()

  if evaluated_at != int(state.step):  # stopped by a signal, or resumed at the end
    eval_metrics = evaluate()
  wall = time.time() - start_time
  plot = reporting.plot_curves(workdir)
  summary = {
    **eval_metrics,
    'images_per_second': images_per_second,
    'wall_seconds': wall,
    'step': int(state.step),
    'skipped_images': skipped,
  }
  if jax.process_index() == 0:
    print(
      f"{config.model} on {config.dataset}: top-1 {eval_metrics['eval_top1']:.2%}, "
      f"top-5 {eval_metrics['eval_top5']:.2%} after {int(state.step)} steps; "
      f'{images_per_second:.1f} images/s; wall time {wall:.0f} s; curves in {plot}'
    )
  return summary
