"""Data-parallel ResNet training on a torus: the paper's system end to end.

Every device of a torus mesh (one, two or three axes; ``config.mesh_shape``, by default the
most square 2-D torus) holds a replica of the train state and a slice of the global batch,
split over every mesh axis. One step is ``jax.jit`` of a ``jax.shard_map`` body that:
  1. runs the model with batch norm statistics averaged over a group of replicas,
  2. sums gradients over the whole torus with ``tc.all_reduce_gradients`` (torus
     reduce-scatter / all-gather where the platform has it, lax elsewhere; with
     ``config.grad_error_feedback``, adding back what the previous step's quantization
     took off),
  3. applies LARS, and averages the moving BN statistics so the state stays replicated.
Steps 2-3 are the run's gradient synchronisation, one strategy that
``grad_sync.strategy_from_config`` picks from the config: with ``weight_update_sharding``
they become ``tc.sharded_update``: reduce-scatter, LARS on each device's 1/p of the weights
(its state stored split over the devices), all-gather of the new weights; with
``defer_weight_gather`` that all-gather moves to the start of the next step
(``ParamsLayout``), where it can overlap the forward pass; with ``grad_overlap`` the
summation runs during the backward pass. With ``tuning.tuner``, the gradient summation and
batch norms of the model are timed on the mesh first, so that "auto" runs what is fastest
there.

Around it: the config validated before anything is built; orbax checkpoints every N
steps with content digests, and a resume from the newest one that verifies (see
``checkpoints``); SIGTERM/SIGINT on any process makes every process save the same step and
exit, and a silent peer is named within a quarter of the heartbeat timeout (see ``faults``); a
stop without saving when the loss or gradient turns non-finite; periodic top-1/top-5
evaluation; TensorBoard scalars and ``metrics.jsonl``, one row per step across resumes; a
progress bar; and a PNG plot.

As in flax's examples/imagenet, each piece is its own function (``create_mesh``,
``create_model``, ``create_learning_rate_fn``, ``grad_sync.strategy_from_config``,
``make_init_fn``, ``make_train_step``, ``make_eval_step``, ``evaluate``,
``restore_or_create_state``); ``build_train_step(config, mesh, ...)`` composes the step's
(benchmarks and ``torus_collectives.check`` build theirs with it too), and
``train_and_evaluate(config, workdir)`` composes them all: it sets up the data
(``_open_data``) and the functions (``_build_program``), restores or creates the state, and
runs the loop
(``_train``), whose steps are ``_dispatch_step`` and, on the steps that log,
``_log_evaluate_and_save``; ``_summarize`` reports the end.
"""

import dataclasses
import functools
import itertools
import math
import pathlib
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
import tqdm
from absl import logging
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from resnet import (
  checkpoints,
  data_sources,
  faults,
  grad_sync,
  input_pipeline,
  models,
  optim,
  pretune,
  reporting,
  validation,
)
from resnet.grad_sync import ParamsLayout
from torus_collectives.topology import most_square_shape

MESH_AXIS_NAMES = ("x", "y", "z")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any


def state_specs(opt_state_spec: P, params_spec: P | None = None) -> TrainState:
  """``shard_map`` specs of the state: replicated, but for a sharded optimizer state (and,
  while training with a deferred weight gather, sharded parameters)."""
  params_spec = P() if params_spec is None else params_spec
  return TrainState(step=P(), params=params_spec, batch_stats=P(), opt_state=opt_state_spec)


def replicas_per_bn_group(span_examples: int, per_replica_batch: int, num_replicas: int) -> int:
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


def _mean_over_mesh(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``lax.pmean`` over every mesh axis of a value that may vary over only some of them:
  the statistics of a batch-norm group that spans a whole axis do not vary over it, and
  lax refuses a mean over axes of mixed state, so those axes are cast to varying first."""
  invariant = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
  return lax.pmean(lax.pcast(x, invariant, to="varying") if invariant else x, axes)


def _train_step(
  state: TrainState,
  batch,
  *,
  model,
  sync: grad_sync.GradSync,
  learning_rate_fn,
  axes,
  num_classes,
  label_smoothing,
):
  """Per-device body of one training step (inside shard_map)."""

  def loss_fn(params):
    logits, updates = model.apply(
      {"params": params, "batch_stats": state.batch_stats},
      batch["image"],
      train=True,
      mutable=["batch_stats"],
    )
    loss = _cross_entropy(logits, batch["label"], num_classes, label_smoothing).mean()
    return loss, (logits, updates["batch_stats"])

  (loss, (logits, batch_stats)), (params, opt_state, grad_norm) = sync.value_and_update(
    loss_fn, state.params, state.opt_state, axes
  )
  stepped = (params, batch_stats, opt_state, loss, logits, grad_norm)
  return _new_state_and_metrics(state, batch, stepped, axes, learning_rate_fn)


def _new_state_and_metrics(state: TrainState, batch, stepped, axes, learning_rate_fn):
  """The train step's result from what this device stepped: (new state, metrics)."""
  params, batch_stats, opt_state, loss, logits, grad_norm = stepped
  new_state = TrainState(
    step=state.step + 1,
    params=params,
    batch_stats=jax.tree.map(lambda x: _mean_over_mesh(x, axes), batch_stats),
    opt_state=opt_state,
  )
  metrics = {
    "train_loss": lax.pmean(loss, axes),
    "train_accuracy": lax.pmean(jnp.mean(jnp.argmax(logits, -1) == batch["label"]), axes),
    "grad_norm": grad_norm,
    "learning_rate": learning_rate_fn(state.step),
  }
  if "stop" in batch:  # one more scalar in the step's own collectives: the stop agreement
    metrics["stop"] = lax.pmax(jnp.max(batch["stop"]), axes)
  return new_state, metrics


def make_train_step(
  model: nn.Module,
  tx: optax.GradientTransformation,
  learning_rate_fn: optax.Schedule,
  mesh: jax.sharding.Mesh,
  *,
  num_classes: int,
  label_smoothing: float,
  sync: grad_sync.GradSync,
) -> Callable:
  """One data-parallel step ``(state, batch) -> (state, metrics)`` over every mesh axis.

  The batch is split over all devices. ``sync`` (``grad_sync``; ``tx`` is its ``tx``)
  turns the per-device gradients into the optimizer's step, and says how the state holds
  the optimizer's state (``sync.opt_state_spec``) and the parameters (the running state of
  ``sync.layout``; replicated unless the weight gather is deferred). A batch may carry
  ``'stop'``, one int32 per device (see ``faults.StopRequest``); ``metrics['stop']`` is
  then its maximum over the mesh, the same on every process. The result is not jitted, so
  the caller chooses whether to donate the state.
  """
  if tx is not sync.tx:
    raise ValueError("make_train_step takes sync= with its own tx (sync.tx).")
  body = functools.partial(
    _train_step,
    model=model,
    sync=sync,
    learning_rate_fn=learning_rate_fn,
    axes=mesh.axis_names,
    num_classes=num_classes,
    label_smoothing=label_smoothing,
  )
  spec = state_specs(sync.opt_state_spec, sync.layout.spec)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec, P(mesh.axis_names)), out_specs=(spec, P()))


def _eval_step(state: TrainState, batch, *, model, axes):
  """Counts of top-1 and top-5 hits and of real (unpadded) examples, summed over devices."""
  logits = model.apply(
    {"params": state.params, "batch_stats": state.batch_stats}, batch["image"], train=False
  )
  top5 = lax.top_k(logits, 5)[1]
  hits = top5 == batch["label"][:, None]
  mask = batch["mask"]
  return lax.psum(
    {
      "top1": jnp.sum(hits[:, 0] * mask),
      "top5": jnp.sum(hits.any(-1) * mask),
      "count": jnp.sum(mask),
    },
    axes,
  )


def make_eval_step(model: nn.Module, mesh: jax.sharding.Mesh, state_spec: TrainState) -> Callable:
  """Jitted ``(state, batch) -> {'top1', 'top5', 'count'}`` summed over the whole mesh; the
  state comes in as ``state_spec`` says (a sharded optimizer state is not gathered)."""
  return jax.jit(
    jax.shard_map(
      functools.partial(_eval_step, model=model, axes=mesh.axis_names),
      mesh=mesh,
      in_specs=(state_spec, P(mesh.axis_names)),
      out_specs=P(),
    )
  )


def evaluate(
  eval_step: Callable,
  state: TrainState,
  batches: Iterable[dict[str, jax.Array]],
  num_examples: int,
) -> dict[str, float]:
  """Top-1 and top-5 accuracy of ``state`` over every real example of ``batches``, and
  how many of the split's ``num_examples`` images could not be decoded (the pipeline
  drops those, so they are the ones that never arrived)."""
  totals = {"top1": 0, "top5": 0, "count": 0}
  for batch in batches:
    for k, v in eval_step(state, batch).items():
      totals[k] += int(v)
  if not totals["count"]:
    raise ValueError(f"None of the {num_examples} evaluation images could be decoded.")
  return {
    "eval_top1": totals["top1"] / totals["count"],
    "eval_top5": totals["top5"] / totals["count"],
    "eval_skipped_images": num_examples - totals["count"],
  }


def bn_group_size(config: ml_collections.ConfigDict, num_replicas: int) -> int:
  """Replicas per batch-norm group: ``config.bn_group_size``, or (0) as many as hold
  ``config.bn_span_examples`` examples."""
  return config.bn_group_size or replicas_per_bn_group(
    config.bn_span_examples, config.global_batch_size // num_replicas, num_replicas
  )


def create_model(
  config: ml_collections.ConfigDict, num_classes: int, mesh: jax.sharding.Mesh
) -> models.ResNet:
  """The configured ResNet, with batch norm over ``bn_group_size(config, ...)`` replicas."""
  group = bn_group_size(config, mesh.devices.size)
  return models.create_model(
    config.model,
    num_classes=num_classes,
    dtype=jnp.dtype(config.dtype),
    axis_name=mesh.axis_names,
    bn_group_size=group,
    bn_momentum=config.bn_momentum,
  )


def create_learning_rate_fn(
  config: ml_collections.ConfigDict, steps_per_epoch: int, total_steps: int
) -> optax.Schedule:
  warmup_steps = round(config.warmup_epochs * steps_per_epoch)
  if warmup_steps >= total_steps:
    raise ValueError(
      f"config.warmup_epochs={config.warmup_epochs} is {warmup_steps} steps; it must be "
      f"shorter than the {total_steps} training steps, i.e. below "
      f"{total_steps / steps_per_epoch:.3g} epochs at {steps_per_epoch} steps per epoch."
    )
  return optim.learning_rate_schedule(
    base_learning_rate=config.base_learning_rate,
    global_batch=config.global_batch_size,
    warmup_steps=warmup_steps,
    total_steps=total_steps,
    end_learning_rate=config.end_learning_rate,
    power=config.lr_decay_power,
  )


def make_init_fn(
  model: nn.Module,
  tx: optax.GradientTransformation,
  image_size: int,
  mesh: jax.sharding.Mesh,
  opt_state_spec: P,
) -> Callable[[jax.Array], TrainState]:
  """Jitted ``key -> TrainState`` at step 0.

  It runs on one device and the result is replicated afterwards (a sharded optimizer state
  is made by its own ``shard_map`` from the replicated parameters): partitioning the random
  initialisers over every device only costs compile time.
  """

  @jax.jit
  def init(key):
    variables = model.init(key, jnp.zeros((1, image_size, image_size, 3), model.dtype), train=False)
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      opt_state=jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=opt_state_spec)(
        variables["params"]
      ),
    )

  return init


def restore_or_create_state(
  store: checkpoints.VerifiedCheckpoints,
  init_fn: Callable[[jax.Array], TrainState],
  key: jax.Array,
  sharding: TrainState,
) -> TrainState:
  """The newest intact checkpoint if there is one (read straight into ``sharding``, a
  sharding per state field; nothing is initialised just to be overwritten), else a fresh
  state."""
  abstract = jax.tree.map(
    lambda field_sharding, field: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=field_sharding), field
    ),
    sharding,
    jax.eval_shape(init_fn, key),
  )
  state = store.restore_newest_intact(abstract)
  if state is None:
    return jax.device_put(init_fn(key), sharding)
  logging.warning("Resumed from the verified step %d in %s", int(state.step), store.directory)
  return state


class ThroughputMeter:
  """Training images per second over the steps since the last ``restart``.

  The loop restarts it after compilation, evaluation and checkpointing, so that only
  training steps are timed; ``rate`` keeps the last measurement when nothing was timed.
  """

  def __init__(self, global_batch_size: int):
    self._batch = global_batch_size
    self.rate = 0.0
    self.restart()

  def restart(self) -> None:
    self._start, self._steps = time.time(), 0

  def count_step(self) -> None:
    self._steps += 1

  def measure(self) -> float:
    if self._steps:
      self.rate = self._steps * self._batch / (time.time() - self._start)
    return self.rate


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from ``workdir``'s newest intact checkpoint) and returns final metrics.

  Raises:
    ValueError: for an invalid config, before anything is built.
    FloatingPointError: when the training metrics turn non-finite (nothing is saved).
  """
  validation.validate_config(config, num_devices=jax.device_count())
  workdir = pathlib.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  store = checkpoints.VerifiedCheckpoints(workdir)
  # Both from the start: a signal or a dead peer during setup or compilation counts too.
  stop = faults.StopRequest(config.stop_timeout_seconds, store.describe_latest)
  watchdog = faults.PeerWatchdog(
    faults.peer_timeout(config.heartbeat_timeout_seconds), store.describe_latest
  )
  finished = False
  try:
    summary = _train_and_evaluate(config, workdir, store, stop)
    finished = True
  finally:
    watchdog.close(finished=finished)
    stop.close()
    store.close()
  return summary


def _train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: pathlib.Path,
  store: checkpoints.VerifiedCheckpoints,
  stop: faults.StopRequest,
) -> dict[str, float]:
  """The run itself, once the fault handlers are up: set up, train, evaluate, summarize."""
  start_time = time.time()
  mesh = create_mesh(config)
  data = _open_data(config, mesh)
  program = _build_program(config, mesh, data)
  stored = restore_or_create_state(store, program.init_fn, program.key, program.state_sharding)
  state = program.layout.to_running(stored)
  start_step = int(state.step)
  run = _Run(
    config=config,
    workdir=workdir,
    data=data,
    program=program,
    store=store,
    stop=stop,
    batches=_train_batches(config, data, start_step),
    evaluate=_make_evaluator(config, data, program.eval_step),
    reporter=_Reporter(config, workdir, start_step, data.schedule.total_steps),
  )
  try:
    state, eval_metrics, evaluated_at = _train(run, state, start_step)
  finally:
    run.reporter.close()
  if evaluated_at != int(state.step):  # stopped by a signal, or resumed at the end
    eval_metrics = run.evaluate(program.layout.to_stored(state))
  return _summarize(run, state, eval_metrics, wall=time.time() - start_time)


def create_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The torus mesh of ``config.mesh_shape`` (one, two or three axes, named from
  ``MESH_AXIS_NAMES``), or (empty) the most square 2-D torus over every device. Training
  uses every axis as a data axis. Assumes a validated config (the shape multiplies to the
  device count)."""
  shape = tuple(config.mesh_shape) or most_square_shape(jax.device_count())
  return tc.make_torus_mesh(shape, axis_names=MESH_AXIS_NAMES[: len(shape)])


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """Which steps train, log, evaluate and save (``stop_code``: the agreed stop, 0 if none)."""

  total_steps: int
  log_every: int
  eval_every: int
  checkpoint_every: int

  def evaluates(self, step: int) -> bool:
    return step % self.eval_every == 0 or step == self.total_steps

  def saves(self, step: int, stop_code: int) -> bool:
    return step % self.checkpoint_every == 0 or step == self.total_steps or bool(stop_code)

  def logs(self, step: int, stop_code: int) -> bool:
    """Every ``log_every`` steps, and whenever the step evaluates or saves."""
    return step % self.log_every == 0 or self.evaluates(step) or self.saves(step, stop_code)


def _make_schedule(config: ml_collections.ConfigDict, train_examples: int) -> tuple[int, _Schedule]:
  """``(steps_per_epoch, schedule)`` for ``train_examples`` training examples in all.

  Raises:
    ValueError: when the global batch is larger than the training split.
  """
  steps_per_epoch = train_examples // config.global_batch_size
  if not steps_per_epoch:
    raise ValueError(
      f"config.global_batch_size={config.global_batch_size} must be at most the "
      f"{train_examples} training examples of {config.dataset!r}."
    )
  total_steps = (
    config.num_train_steps
    if config.num_train_steps > 0
    else int(config.num_epochs * steps_per_epoch)
  )
  return steps_per_epoch, _Schedule(
    total_steps=total_steps,
    log_every=config.log_every_steps,
    eval_every=max(1, round(config.eval_every_epochs * steps_per_epoch)),
    checkpoint_every=config.checkpoint_every_steps,
  )


@dataclasses.dataclass(frozen=True)
class _Data:
  """This process's view of the run's data and the step counts the training split implies."""

  train: data_sources.Split
  eval: data_sources.Split
  local_batch: int  # this process's rows of a global training batch
  local_eval_batch: int  # and of a global evaluation batch
  sharding: NamedSharding  # of a global batch: its rows split over every mesh axis
  preprocessing: input_pipeline.Preprocessing
  steps_per_epoch: int
  schedule: _Schedule


def _open_data(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> _Data:
  """Lists this process's shards of the training and evaluation splits (each process reads
  its share of every global batch) and derives the schedule from the training split's size;
  nothing is decoded yet. Raises ValueError when the global batch exceeds the split."""
  num_processes = jax.process_count()
  local_batch = config.global_batch_size // num_processes
  local_eval_batch = config.eval_batch_size // num_processes
  split_args = dict(process_index=jax.process_index(), process_count=num_processes)
  train_split = data_sources.get_split(
    config.dataset, config.data_dir, config.train_split, block=local_batch, **split_args
  )
  eval_split = data_sources.get_split(
    config.dataset, config.data_dir, config.eval_split, block=local_eval_batch, **split_args
  )
  steps_per_epoch, schedule = _make_schedule(config, train_split.total_examples)
  return _Data(
    train=train_split,
    eval=eval_split,
    local_batch=local_batch,
    local_eval_batch=local_eval_batch,
    sharding=NamedSharding(mesh, P(mesh.axis_names)),
    preprocessing=input_pipeline.Preprocessing(
      image_size=config.image_size,
      crop_area_range=tuple(config.crop_area_range),
      random_flip=config.random_flip,
      eval_crop_fraction=config.eval_crop_fraction,
    ),
    steps_per_epoch=steps_per_epoch,
    schedule=schedule,
  )


@dataclasses.dataclass(frozen=True)
class _Program:
  """The run's functions on its mesh, built but not yet compiled."""

  init_fn: Callable[[jax.Array], TrainState]  # jitted key -> state at step 0
  key: jax.Array  # the key init_fn takes
  state_sharding: TrainState  # a sharding per field of the stored state
  layout: ParamsLayout  # the running state's parameters (to_running, to_stored)
  train_step: Callable  # jitted (running state, batch) -> (state, metrics); donates it
  eval_step: Callable  # jitted (stored state, batch) -> {'top1', 'top5', 'count'}


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The config's training step on a mesh, built but not yet compiled."""

  model: models.ResNet
  learning_rate_fn: optax.Schedule
  sync: grad_sync.GradSync  # the gradient synchronisation: tx, its state's spec, layout
  init_fn: Callable[[jax.Array], TrainState]  # jitted key -> stored state at step 0
  key: jax.Array  # the key init_fn takes
  state_spec: TrainState  # shard_map specs of the stored state
  running_spec: TrainState  # and of the running state (sync.layout)
  train_step: Callable  # (running state, batch) -> (state, metrics), not jitted


def build_train_step(
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  *,
  num_classes: int,
  steps_per_epoch: int,
  total_steps: int,
) -> TrainStep:
  """The model, learning rate schedule, gradient synchronisation
  (``grad_sync.strategy_from_config``), init and train step of ``config`` on ``mesh``.
  With ``config.tune``, first times the model's collectives on the mesh (see ``pretune``),
  so that the train step, traced later, runs what was fastest.

  Raises:
    ValueError: when the warmup is not shorter than the run, or for a combination of the
      gradient fields that ``validation`` refuses.
  """
  model = create_model(config, num_classes, mesh)
  learning_rate_fn = create_learning_rate_fn(config, steps_per_epoch, total_steps)
  sync = grad_sync.strategy_from_config(
    config, mesh, optim.create_lars(config, learning_rate_fn), model=model
  )
  init_fn = make_init_fn(model, sync.tx, config.image_size, mesh, sync.opt_state_spec)
  # rbg: XLA's RngBitGenerator compiles far faster than threefry for large inits.
  key = jax.random.key(config.seed, impl="rbg")
  if config.tune:
    pretune.tune_model(
      model,
      jax.eval_shape(init_fn, key),
      mesh,
      per_replica_batch=config.global_batch_size // mesh.devices.size,
      image_size=config.image_size,
      bn_group_size=bn_group_size(config, mesh.devices.size),
    )
  train_step = make_train_step(
    model,
    sync.tx,
    learning_rate_fn,
    mesh,
    num_classes=num_classes,
    label_smoothing=config.label_smoothing,
    sync=sync,
  )
  return TrainStep(
    model=model,
    learning_rate_fn=learning_rate_fn,
    sync=sync,
    init_fn=init_fn,
    key=key,
    state_spec=state_specs(sync.opt_state_spec),
    running_spec=state_specs(sync.opt_state_spec, sync.layout.spec),
    train_step=train_step,
  )


def _build_program(
  config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, data: _Data
) -> _Program:
  """``build_train_step`` for the data's classes and schedule, its train step jitted
  (donating the state), and the eval step."""
  built = build_train_step(
    config,
    mesh,
    num_classes=data.train.num_classes,
    steps_per_epoch=data.steps_per_epoch,
    total_steps=data.schedule.total_steps,
  )
  return _Program(
    init_fn=built.init_fn,
    key=built.key,
    state_sharding=jax.tree.map(lambda spec: NamedSharding(mesh, spec), built.state_spec),
    layout=built.sync.layout,
    train_step=jax.jit(built.train_step, donate_argnums=0),
    eval_step=make_eval_step(built.model, mesh, built.state_spec),
  )


def _train_batches(
  config: ml_collections.ConfigDict, data: _Data, start_step: int
) -> Iterator[tuple[dict[str, jax.Array], dict[str, Any]]]:
  """The global training batches of steps ``start_step + 1`` on (a resumed run gets the
  batches an uninterrupted one would have), prefetched to the devices, each with its
  host-side fields (``'skipped'``: this process's count of unreadable images so far)."""
  batches = input_pipeline.train_dataset(
    data.train,
    data.preprocessing,
    local_batch=data.local_batch,
    seed=config.seed,
    start_step=start_step,
    cache=config.cache,
    shuffle_buffer=config.shuffle_buffer,
  )
  return input_pipeline.device_prefetch(
    batches.as_numpy_iterator(), data.sharding, size=config.prefetch_to_device
  )


def _make_evaluator(
  config: ml_collections.ConfigDict, data: _Data, eval_step: Callable
) -> Callable[[TrainState], dict[str, float]]:
  """``state -> evaluate(...)`` over the whole evaluation split. Its tf.data pipeline is
  built here, once, so that its cache (``config.cache``) serves every evaluation."""
  eval_data, eval_steps = input_pipeline.eval_dataset(
    data.eval,
    data.preprocessing,
    local_batch=data.local_eval_batch,
    global_batch=config.eval_batch_size,
    cache=config.cache,
  )

  def evaluate_state(state: TrainState) -> dict[str, float]:
    batches = input_pipeline.device_prefetch(
      eval_data.as_numpy_iterator(), data.sharding, host_keys=()
    )
    return evaluate(
      eval_step,
      state,
      (batch for batch, _ in itertools.islice(batches, eval_steps)),
      data.eval.total_examples,
    )

  return evaluate_state


class _Reporter:
  """Where the loop's measurements go, besides checkpoints: TensorBoard and
  ``metrics.jsonl`` (``reporting.MetricWriter``), the progress bar, the throughput, and a
  warning each time the count of unreadable training or evaluation images grows. Only
  process 0 writes files or shows the bar."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: pathlib.Path,
    start_step: int,
    total_steps: int,
  ):
    self.throughput = ThroughputMeter(config.global_batch_size)
    self.skipped = 0  # unreadable training images so far (this process's count)
    self._writer = reporting.MetricWriter(workdir, start_step)
    self._progress = tqdm.tqdm(
      total=total_steps,
      initial=start_step,
      unit="step",
      disable=jax.process_index() != 0,
      dynamic_ncols=True,
    )
    self._reported_skipped = self._reported_eval_skipped = 0

  def count_step(self, host: dict[str, Any]) -> None:
    """Counts a dispatched step and its batch's host-side ``'skipped'`` count."""
    self.throughput.count_step()
    self.skipped = max(self.skipped, int(host["skipped"].max()))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """Writes the step's scalars, moves the bar to ``step``, and warns of newly skipped
    images (the evaluation's count is in ``scalars`` on the steps that evaluate)."""
    self._writer.write(step, scalars)
    self._progress.set_postfix(
      loss=f"{scalars['train_loss']:.3f}", img_s=f"{self.throughput.rate:.1f}", refresh=False
    )
    self._progress.update(step - self._progress.n)
    if self.skipped > self._reported_skipped:
      logging.warning("Skipped %d unreadable training images so far.", self.skipped)
      self._reported_skipped = self.skipped
    if scalars.get("eval_skipped_images", 0) > self._reported_eval_skipped:
      self._reported_eval_skipped = scalars["eval_skipped_images"]
      logging.warning("Skipped %d unreadable evaluation images.", self._reported_eval_skipped)

  def close(self) -> None:
    self._progress.close()


@dataclasses.dataclass(frozen=True)
class _Run:
  """What the training loop reads: the set-up pieces, the fault handlers and the outputs."""

  config: ml_collections.ConfigDict
  workdir: pathlib.Path
  data: _Data
  program: _Program
  store: checkpoints.VerifiedCheckpoints
  stop: faults.StopRequest
  batches: Iterator[tuple[dict[str, jax.Array], dict[str, Any]]]  # from _train_batches
  evaluate: Callable[[TrainState], dict[str, float]]  # from _make_evaluator
  reporter: _Reporter


def _train(
  run: _Run, state: TrainState, start_step: int
) -> tuple[TrainState, dict[str, float], int | None]:
  """Trains from ``start_step`` (the state's step) to the schedule's last step, or to the
  step after which every process agreed to stop, logging, evaluating and saving as the
  schedule says. Returns the final state, the newest evaluation metrics and their step
  (``{}`` and None if no step evaluated).

  Raises:
    FloatingPointError: when a logged step's metrics are not finite (nothing is saved).
  """
  eval_metrics, evaluated_at = {}, None
  previous_stop = None  # the previous step's agreed stop code, still on its way to the host
  for step in range(start_step + 1, run.data.schedule.total_steps + 1):
    state, metrics, agreed_stop = _dispatch_step(run, state, first=step == start_step + 1)
    # Reading the previous step's agreement keeps one step in flight; every process reads
    # the same value here, so all stop after this same step.
    stop_code = 0 if previous_stop is None else int(previous_stop)
    previous_stop = agreed_stop
    if not run.data.schedule.logs(step, stop_code):
      continue
    evaluation = _log_evaluate_and_save(run, step, state, metrics, stop_code)
    if evaluation is not None:
      eval_metrics, evaluated_at = evaluation, step
    if stop_code:
      _report_stop(run, step, stop_code)
      break
  return state, eval_metrics, evaluated_at


def _dispatch_step(
  run: _Run, state: TrainState, *, first: bool
) -> tuple[TrainState, dict[str, jax.Array], jax.Array]:
  """Starts one training step on the next batch, this process's stop code riding along,
  and counts it for the throughput (the ``first`` step is waited for, so that compilation
  is not timed). Returns the new state, the step's metrics (on the devices, without
  ``'stop'``) and the agreed stop code, being copied to the host but not waited for."""
  batch, host = next(run.batches)
  stop_flags = run.stop.device_flags(run.data.sharding)
  state, metrics = run.program.train_step(state, dict(batch, stop=stop_flags))
  agreed_stop = metrics.pop("stop")
  agreed_stop.copy_to_host_async()
  run.reporter.count_step(host)
  if first:  # keep compilation out of the throughput
    jax.block_until_ready(state)
    run.reporter.throughput.restart()
  return state, metrics, agreed_stop


def _log_evaluate_and_save(
  run: _Run, step: int, state: TrainState, metrics: dict[str, jax.Array], stop_code: int
) -> dict[str, float] | None:
  """Logs the step's metrics (with the evaluation's when the step evaluates), saves a
  checkpoint when the step saves, and restarts the throughput meter so that neither is
  timed. Returns the evaluation's metrics, or None when the step does not evaluate.

  Raises:
    FloatingPointError: when the metrics are not finite, before anything is saved.
  """
  scalars = _finite_scalars(metrics, step, run.store)
  scalars.update(
    images_per_second=run.reporter.throughput.measure(), skipped_images=run.reporter.skipped
  )
  evaluates, saves = run.data.schedule.evaluates(step), run.data.schedule.saves(step, stop_code)
  stored = run.program.layout.to_stored(state) if evaluates or saves else None
  evaluation = run.evaluate(stored) if evaluates else None
  scalars.update(evaluation or {})
  run.reporter.write(step, scalars)
  if saves:
    run.store.save(step, stored)
  run.reporter.throughput.restart()  # evaluation and saving are not counted
  return evaluation


def _finite_scalars(
  metrics: dict[str, jax.Array], step: int, store: checkpoints.VerifiedCheckpoints
) -> dict[str, float]:
  """The step's metrics as floats (this waits for the step).

  Raises:
    FloatingPointError: when one is not finite, naming the checkpoint a rerun resumes from.
  """
  scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
  if not all(map(math.isfinite, scalars.values())):
    raise FloatingPointError(
      f"Non-finite training metrics at step {step}: {scalars}. Stopped without saving; "
      f"the newest checkpoint is {store.describe_latest()}."
    )
  return scalars


def _report_stop(run: _Run, step: int, stop_code: int) -> None:
  """Ends the stop's deadline once ``step`` is saved, and logs which signal stopped the
  run, where it arrived, and that rerunning the command resumes."""
  run.stop.saved()
  logging.warning(
    "Stopped for %s (received by %s): saved step %d to %s; rerun the same command to resume.",
    signal.Signals(stop_code).name,
    "this process" if run.stop.code else "another process",
    step,
    run.store.directory,
  )


def _summarize(
  run: _Run, state: TrainState, eval_metrics: dict[str, float], *, wall: float
) -> dict[str, float]:
  """Plots the curves, prints the final result on process 0 and returns the summary: the
  final state's evaluation, throughput, wall time, step and skipped training images."""
  plot = reporting.plot_curves(run.workdir)
  step = int(state.step)
  rate = run.reporter.throughput.rate
  if jax.process_index() == 0:
    print(
      f"{run.config.model} on {run.config.dataset}: top-1 {eval_metrics['eval_top1']:.2%}, "
      f"top-5 {eval_metrics['eval_top5']:.2%} after {step} steps; "
      f"{rate:.1f} images/s; wall time {wall:.0f} s; curves in {plot}"
    )
  return {
    **eval_metrics,
    "images_per_second": rate,
    "wall_seconds": wall,
    "step": step,
    "skipped_images": run.reporter.skipped,
  }
