"""ResNet-50 on the embedded digits, on 8 simulated CPU devices as a 2x4 torus.

What ``make train`` runs:

  JAX_PLATFORMS=cpu python -m resnet --config=resnet/configs/default.py --workdir=runs/digits

Any field can be overridden, e.g. ``--config.num_epochs=2 --config.model=resnet18``.
The other configs derive from this one and change only what differs.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Devices: simulate this many CPU devices per process when running on the CPU
  # (0 = use the devices that exist); the torus shape (empty = most square).
  c.simulated_cpu_devices = 8
  c.mesh_shape = (2, 4)

  # Data: 'digits', 'imagenet2012' or 'folder:<root>' (<root>/<split>/<class>/<image>).
  c.dataset = "digits"
  c.data_dir = "data"
  c.train_split = "train"
  c.eval_split = "test"
  c.image_size = 32
  # Digits are neither mirror-symmetric nor recognisable from an 8% crop.
  c.crop_area_range = (0.5, 1.0)
  c.random_flip = False
  c.eval_crop_fraction = 1.0
  c.cache = True
  c.shuffle_buffer = 2048
  c.prefetch_to_device = 2

  # Model: 'resnet50', 'resnet34', 'resnet18' or 'resnet_tiny'. Compute dtype: bfloat16
  # is emulated on CPUs and much slower there, so the CPU default is float32.
  c.model = "resnet50"
  c.dtype = "float32"
  c.bn_momentum = 0.9
  # Batch norm statistics span this many examples (a group of replicas) unless
  # bn_group_size (replicas per group) is set above 0.
  c.bn_span_examples = 64
  c.bn_group_size = 0

  # Optimisation: LARS, peak LR = base_learning_rate * global_batch_size / 256.
  c.global_batch_size = 64
  c.eval_batch_size = 360
  c.num_epochs = 5.0
  c.num_train_steps = -1  # > 0 overrides num_epochs
  c.warmup_epochs = 1.0
  c.base_learning_rate = 4.0
  c.end_learning_rate = 1e-4
  c.lr_decay_power = 2.0
  c.weight_decay = 1e-4
  c.momentum = 0.9
  c.lars_trust_coefficient = 0.001
  c.lars_eps = 0.0
  c.label_smoothing = 0.1
  # Gradient summation backend of torus_collectives ('auto', 'xla', 'shard_map', ...).
  c.grad_implementation = "auto"
  # Largest gradient bucket of the torus implementations (one collective each; on XLA each
  # leaf is its own collective, see torus_collectives.xla_settings). Measure a change with
  # python -m bench.overlap_report --bucket-mib.
  c.grad_bucket_bytes = 32 * 2**20
  # The dtype the gradients travel in while they are summed: '' (their own, float32 here),
  # 'bfloat16' (a cast), or a block-scaled format, 'int8', 'float8_e4m3fn' or 'float8_e5m2':
  # blocks of 128 values in that dtype plus a scale each, requantized at every hop of the
  # torus schedule, about half of bfloat16's bytes. Block-scaled transport runs on the
  # 'shard_map' implementation (which 'auto' then picks), int8 on 'pallas' too; with
  # weight_update_sharding only block-scaled formats apply. Without grad_error_feedback each
  # step's quantization error is lost.
  # bench/results/grad_transport_int8_vs_bf16.png compares int8, with and without error
  # feedback, with bfloat16 here.
  c.grad_transport_dtype = ""
  # Error feedback (EF-SGD) for a block-scaled grad_transport_dtype: each device keeps what
  # its quantizations took off the gradients (a float32 copy of the gradient per device, in
  # the optimizer state and so in checkpoints, with or without weight_update_sharding) and
  # adds it to the next step's, so the summed gradients over a run lose only the last
  # step's error. Needs the 'auto' or 'shard_map' grad_implementation.
  c.grad_error_feedback = False
  # Thread the gradient summation through the backward pass (tc.experimental.value_and_summed_grad):
  # each bucket starts once the backward pass has produced its gradients. With the 'pallas'
  # grad_implementation its split kernels run between the later backward convolutions
  # (verified in TPU interpret mode and in compiled programs, not measured on a TPU); any
  # other implementation runs value_and_grad, then all_reduce_gradients, as without it.
  # Needs grad_transport_dtype='' and weight_update_sharding=False (the package has no
  # threaded sharded step). Off by default: the barriers that pin the backward convolutions into the
  # windows cost fusion, and by the compiler's estimate (bench.overlap_report
  # --grad-overlap on) the step is slower.
  c.grad_overlap = False
  # Time the gradient summation and batch norms of this model on this mesh before training
  # (resnet/pretune.py); 'auto' runs a torus implementation once it beat XLA with confidence
  # here in two runs from different processes (this one and an earlier one in the cache).
  c.tune = False
  # Cross-replica weight-update sharding (tc.sharded_update): reduce-scatter the gradients,
  # run LARS on each device's 1/p of the weights, all-gather the updates. Optimizer FLOPs
  # and state per device / p. A torus grad_implementation moves one all-reduce's bytes; on XLA
  # ('auto' without a table) too: genuine reduce-scatters and all-gathers, in the forms
  # XLA's TPU compiler accepts (torus_collectives.weight_update.xla_collectives).
  c.weight_update_sharding = False
  # With weight-update sharding: keep each device's shard of the new weights and all-gather
  # them at the start of the next step, one bucket at a time in the order the forward pass
  # needs them, so the gather can overlap the forward pass (ZeRO's parameter prefetch).
  # Checkpoints and evaluation still see the whole, replicated weights.
  c.defer_weight_gather = False
  # Pass libtpu the flags under which gradient collectives stay apart and asynchronous,
  # overlapping the backward pass (torus_collectives.xla_settings); read only on TPU.
  # Whether they pay depends on the topology: python -m bench.overlap_report says.
  c.xla_overlap_settings = False

  # Bookkeeping.
  c.seed = 0
  c.log_every_steps = 2
  c.eval_every_epochs = 1.0
  c.checkpoint_every_steps = 25

  # Faults. Multi-process runs: the coordination service counts a process dead after this
  # many seconds without a heartbeat, and each process names a silent peer after half of
  # it. After SIGTERM/SIGINT, a process gives up on saving after stop_timeout_seconds.
  c.heartbeat_timeout_seconds = 30
  c.stop_timeout_seconds = 120.0
  return c
