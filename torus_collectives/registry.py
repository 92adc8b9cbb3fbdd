"""The one registry of implementations: which exist, what each supports, what "auto" picks.

Each implementation is one ``Backend`` record in ``BACKENDS``: its ops and dtypes, what
it runs (replica groups, torus ranks, ``to=``, partially manual meshes, device kinds) and
lazy loaders of its functions. Everything that dispatches (the collectives, gradient
summation, batch norm, ``sharded_update``, the tuner) reads these records, so a new
backend is one ``register`` call. Each op gathers the facts of a call once, as a
``Request``, and ``resolve(implementation, request)`` is the one function that turns an
``implementation=`` argument into the concrete backend that runs the call.

Four ops have implementations: the three collectives (``all_reduce``, ``reduce_scatter``,
``all_gather``) and ``batch_norm``; the gradient summation of a pytree
(``all_reduce_gradients``) is tuned as a fifth op and runs the all-reduce it picks.

* ``"xla"``: ``jax.lax`` for the collectives, the jnp passes of ``norm.passes`` (fused
  by XLA) for batch norm. The reference; runs everywhere, on whatever lax accepts.
* ``"shard_map"``: the torus schedule executed with ``lax.ppermute`` (collectives only).
* ``"lax_torus"``: the torus schedule's phases as per-axis ``lax.psum_scatter`` /
  ``lax.all_gather`` (collectives only; ``backends.lax_torus``).
* ``"pallas"``: the remote-DMA torus kernels and the fused batch-norm kernels of
  ``torus_collectives.kernels``; TPU v4 and newer, or TPU interpret mode on any host.
* ``"auto"``: one rule for every op, ``auto_implementation``: what the tuner measured
  (``tuning.tables``), XLA where nothing was measured (calls over vmap, pmap or
  positional axes included: the tables time tori of mesh axes), and XLA without measuring
  below the size at which the cost model's latency term dominates. A request the measured
  choice does not run falls back to XLA (``resolve``). Batch norm is XLA whatever was
  measured: timed alone its Pallas kernels beat XLA's fusions, but inside a network XLA
  fuses batch norm into the neighbouring convolutions, which an opaque kernel cannot join
  (see ``auto_implementation``). For gradient summation a whole-step entry, where one
  was measured for the tree being summed (``tuning.step_tuning``), comes first: "auto"
  then runs its implementation and bucket size (``tuned_step``).
  What "auto" promises about values, and the switch that keeps it bitwise: see
  ``auto_implementation`` and ``bitwise_as_lax``.

Backends are imported lazily, so ``import torus_collectives`` never imports Pallas.
A collective backend provides three functions on 1-D per-device buffers, called inside the
caller's ``shard_map`` with ``axes`` bound and ``torus`` their sizes (same order):

* ``reduce_scatter(x, axes, torus)``: ``(p*m,) -> (m,)``, the own chunk of the sum, chunks
  row-major over ``axes`` (``lax.psum_scatter(x, axes, tiled=True)``);
* ``all_gather(x, axes, torus)``: ``(m,) -> (p*m,)`` (``lax.all_gather(x, axes, tiled=True)``);
* ``all_reduce(x, axes, torus)``: ``(n,) -> (n,)`` (``lax.psum(x, axes)``).

A backend that runs replica groups (``axis_index_groups`` that tile the torus) takes
``tile=`` (the group's extent per axis) as well, one with ``pallas_kernels`` takes
``config=``, and one with ``block_scaled_transport`` takes ``transport=`` (one
``quantization.BlockScaled`` or None per axis), its reduce-scatter and all-reduce also
``with_residual=`` (error feedback: they then return the quantization residual too).
``unsupported`` reads from its record which requests an implementation cannot run;
``resolve`` sends those to XLA for "auto", and raises that error for an explicit choice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp

from torus_collectives import _jax_internals as jax_internals
from torus_collectives import target
from torus_collectives.kernel_config import KernelConfig
from torus_collectives.topology import MAX_TORUS_AXES
from torus_collectives.tuning import tables

if typing.TYPE_CHECKING:
  from torus_collectives.norm.passes import Passes

# The type of every ``implementation=`` argument. "auto", the default of every op: XLA
# unless a tuning table measured a torus implementation faster for the call and that
# implementation runs it (``auto_implementation``); with a block-scaled ``transport_dtype``,
# "shard_map". "xla": ``jax.lax`` itself, called with the arguments as given, the
# reference; batch norm's jnp passes. "shard_map": the torus schedule as ``lax.ppermute``
# steps, on any backend (collectives only). "lax_torus": the schedule's phases as per-axis
# ``lax.psum_scatter`` and ``lax.all_gather`` (collectives only). "pallas": the remote-DMA
# Pallas TPU kernels and the fused batch-norm kernels, for TPU v4 and newer, or in TPU
# interpret mode on any host. A name added with ``registry.register`` is accepted too; any
# other raises ValueError listing the valid names.
Implementation = Literal["auto", "xla", "shard_map", "lax_torus", "pallas"]
Op = Literal["all_reduce", "reduce_scatter", "all_gather", "batch_norm"]
OPS: tuple[str, ...] = typing.get_args(Op)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")

_SUMMED = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32))
_FLOATS = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


@dataclasses.dataclass(frozen=True)
class CollectiveBackend:
  """The three collective functions of a backend, on 1-D per-device buffers (see the
  module docstring for their contract)."""

  reduce_scatter: Callable[..., jax.Array]
  all_gather: Callable[..., jax.Array]
  all_reduce: Callable[..., jax.Array]
  # ``(leaves, axes, torus) ->`` each leaf's sum, for arrays of one dtype and any shapes,
  # taking them where they lie rather than packed into one buffer (the gradient
  # summation's buckets); None where the backend has none.
  all_reduce_leaves: Callable[..., list] | None = None
  # The same issued one call at a time (``advance``, ``pin``, ``calls_left``, and
  # ``finish_parts``, which returns each leaf's sum; optionally ``hop_bytes``, which the
  # threading paces the calls by, evenly without it:
  # ``kernels.split_leaf_kernels.SplitLeafAllReduce``), for threading through the
  # backward pass with no packing; None where the backend has none.
  split_all_reduce_leaves: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation, as data: what it runs, and how to load it.

  Attributes:
    name: the ``implementation=`` string.
    ops: the ops it implements, each with the dtypes it takes (None: whatever lax takes).
    lax_reference: it *is* lax: the collectives call ``jax.lax`` with the caller's
      arguments as given, and batch norm runs the jnp passes. No request is refused.
    replica_groups: which ``axis_index_groups`` it runs: "any" (lax's rule), "tiles"
      (groups that are aligned tiles of the torus, listed row-major) or "none".
    max_torus_axes: the most named mesh axes it runs over (None: any number).
    gather_to: the all-gather ``to=`` values it produces (None: all of lax's).
    unreduced_inputs: it takes leaves typed unreduced or reduced over the named axes.
    partial_manual: it runs inside a ``shard_map`` that leaves some mesh axes automatic.
    runs_on: whether it compiles for a device kind here (read at trace time; the Pallas
      kernels need TPU v4 or newer, or TPU interpret mode).
    pallas_kernels: it runs Pallas kernels: its collective functions take ``config=`` (a
      ``KernelConfig``), its batch-norm passes ``block_sizes=``, and in TPU interpret
      mode its calls carry the interpreter's callback effects.
    block_scaled_transport: its collective functions take ``transport=`` (a
      ``quantization.BlockScaled`` or None per axis) and send partial sums block-scaled
      (``torus_collectives.quantization``), its reduce-scatter and all-reduce
      ``with_residual=`` as well.
    load_collectives: the three collective functions (imported on first use).
    load_batch_norm: its per-replica batch-norm passes (imported on first use).
  """

  name: str
  ops: Mapping[str, tuple[jnp.dtype, ...] | None]
  lax_reference: bool = False
  replica_groups: Literal["any", "tiles", "none"] = "none"
  max_torus_axes: int | None = MAX_TORUS_AXES
  gather_to: tuple[str, ...] | None = ("varying", "invarying")
  unreduced_inputs: bool = False
  partial_manual: bool = True
  runs_on: Callable[[str], bool] = lambda device_kind: True
  pallas_kernels: bool = False
  block_scaled_transport: bool = False
  load_collectives: Callable[[], CollectiveBackend] | None = None
  load_batch_norm: Callable[[], Passes] | None = None

  def supports(self, op: str, dtype) -> bool:
    """Whether it runs ``op`` on ``dtype``."""
    return op in self.ops and (self.ops[op] is None or jnp.dtype(dtype) in self.ops[op])

  def dtype_error(self, op: str, dtype, hint: str) -> ValueError:
    supported = ", ".join(d.name for d in self.ops[op])
    return ValueError(
      f"dtype {jnp.dtype(dtype).name} is not supported by {op} "
      f'implementation="{self.name}" (supported: {supported}); cast the input, or {hint}'
    )


def _load_reference_batch_norm() -> Passes:
  from torus_collectives.norm import passes

  return passes.REFERENCE


def _load_shard_map() -> CollectiveBackend:
  from torus_collectives.backends import shard_map as impl

  return CollectiveBackend(impl.reduce_scatter, impl.all_gather, impl.all_reduce)


def _load_lax_torus() -> CollectiveBackend:
  from torus_collectives.backends import lax_torus as impl

  return CollectiveBackend(impl.reduce_scatter, impl.all_gather, impl.all_reduce)


def _load_pallas() -> CollectiveBackend:
  from torus_collectives.kernels import pallas_backend as impl

  return CollectiveBackend(
    impl.reduce_scatter,
    impl.all_gather,
    impl.all_reduce,
    all_reduce_leaves=impl.all_reduce_leaves,
    split_all_reduce_leaves=impl.split_all_reduce_leaves,
  )


def _load_pallas_batch_norm() -> Passes:
  from torus_collectives.kernels import batch_norm as impl

  return impl.PALLAS


def _pallas_runs_on(device_kind: str) -> bool:
  return target.pallas_compiles_for(device_kind) or target.interpret_mode_active()


# Every implementation, "xla" (the reference, and what "auto" falls back to) first.
BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  """Adds ``backend`` to the registry: every op then dispatches to it by name, "auto"
  may pick it where a tuning table measured it, and the conformance tests run it."""
  if backend.name == "auto" or backend.name in BACKENDS:
    raise ValueError(f"an implementation named {backend.name!r} is registered already")
  BACKENDS[backend.name] = backend
  return backend


def unregister(name: str) -> None:
  """Removes a registered backend ("xla" stays)."""
  if name == "xla":
    raise ValueError('"xla" is the reference every other implementation falls back to')
  del BACKENDS[name]


register(
  Backend(
    "xla",
    ops=dict.fromkeys(OPS),
    lax_reference=True,
    replica_groups="any",
    max_torus_axes=None,
    gather_to=None,
    unreduced_inputs=True,
    load_batch_norm=_load_reference_batch_norm,
  )
)
register(
  Backend(
    "shard_map",
    ops=dict.fromkeys(COLLECTIVES),
    replica_groups="tiles",
    block_scaled_transport=True,
    load_collectives=_load_shard_map,
  )
)
register(Backend("lax_torus", ops=dict.fromkeys(COLLECTIVES), load_collectives=_load_lax_torus))
register(
  Backend(
    "pallas",
    ops={**dict.fromkeys(COLLECTIVES, _SUMMED), "batch_norm": _FLOATS},
    partial_manual=False,
    runs_on=_pallas_runs_on,
    pallas_kernels=True,
    block_scaled_transport=True,
    load_collectives=_load_pallas,
    load_batch_norm=_load_pallas_batch_norm,
  )
)


def implementations() -> tuple[str, ...]:
  """Every ``implementation=`` name: "auto" and each registered backend."""
  return ("auto", *BACKENDS)


# The built-in ``implementation=`` names: "auto", then the backends registered when the
# package is imported, "xla" first (what each one is: ``Implementation``). Fixed at import:
# ``registry.implementations()`` also lists backends added later with ``registry.register``.
IMPLEMENTATIONS: tuple[str, ...] = implementations()


def runs_lax(implementation: str) -> bool:
  """Whether the concrete ``implementation`` is lax itself (the "xla" record)."""
  return implementation != "auto" and BACKENDS[implementation].lax_reference


def supports(implementation: str, op: Op, dtype) -> bool:
  """Whether ``implementation`` (not "auto") runs ``op`` on ``dtype``."""
  return BACKENDS[implementation].supports(op, dtype)


# The ops "auto" decides for; gradient summation runs on all-reduce's implementations.
TUNED_OPS = OPS + ("all_reduce_gradients",)


def _runs_as(op: str) -> Op:
  return "all_reduce" if op == "all_reduce_gradients" else op


def candidates(op: str, dtype, device_kind: str | None = None) -> tuple[str, ...]:
  """The registered implementations of ``op`` that run on ``dtype`` for ``device_kind``
  (default: the traced-for device), "xla" first."""
  if device_kind is None:
    device_kind = target.target_device().device_kind
  return tuple(
    name
    for name, backend in BACKENDS.items()
    if backend.supports(_runs_as(op), dtype) and backend.runs_on(device_kind)
  )


BITWISE_ENV_VAR = "TORUS_COLLECTIVES_BITWISE"
# A jax config option (so that jit's caches are keyed by it), named so that jax reads
# its default from the environment variable above.
_BITWISE = jax_internals.bool_state(
  name=BITWISE_ENV_VAR.lower(),
  default=False,
  help='Keep implementation="auto" on XLA (lax) for floating-point dtypes, whatever a '
  "tuning table measured, so that its results are bitwise those of lax.",
  include_in_jit_key=True,
  include_in_trace_context=True,
)


def bitwise_as_lax(enabled: bool = True):
  """The one switch for bitwise reproducibility: while it is on, "auto" runs XLA (lax
  itself) for every floating-point (and complex) dtype, whatever a tuning table says, so
  its results are bitwise those of lax. Integer and boolean collectives are exact on every
  implementation, and keep their measured choice.

  It applies to the functions traced inside it (jit caches traces per setting, so a
  function jitted outside is retraced inside). For a whole program, set the environment
  variable ``TORUS_COLLECTIVES_BITWISE=1`` before jax is imported, or call
  ``jax.config.update("torus_collectives_bitwise", True)``. Explicit implementations
  (``implementation="shard_map"`` and the others) are not affected, nor is a block-scaled
  ``transport_dtype``, which is lossy by request.

  Args:
    enabled: True (default) turns it on inside the ``with`` block; False turns it off
      there, where the environment variable or ``jax.config`` turned it on.

  Returns:
    A context manager, for ``with tc.bitwise_as_lax(): ...``.
  """
  return _BITWISE(bool(enabled))


def bitwise_requested() -> bool:
  """Whether ``bitwise_as_lax`` is on here."""
  return bool(_BITWISE.value)


def _keep_on_xla(dtype) -> bool:
  return bitwise_requested() and jnp.issubdtype(jnp.dtype(dtype), jnp.inexact)


def unit_roundoff(dtype) -> float:
  """``u``, half the machine epsilon of a floating dtype: the largest relative error of
  one rounding to nearest (bfloat16: 2**-8, float32: 2**-24); 0 for exact dtypes."""
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return 0.0
  return float(jnp.finfo(dtype).eps) / 2


def auto_rounding_bound(op: str, dtype, group_size: int) -> float:
  """The coefficient ``c`` of the bound "auto" keeps against lax where a measured table
  picks a torus implementation: for each element, ``|auto - lax| <= c * sum_i |x_i|``,
  the sum over the ``group_size`` (p) devices' inputs of that element.

  Derivation. Every implementation computes an element of a sum as p - 1 additions of
  partial sums in some order (lax's order, or the torus schedule's), each rounded at most
  once to a format of unit roundoff ``u`` or finer, where ``u`` is the input dtype's
  (``unit_roundoff``): the torus implementations keep bfloat16 and float16 partial sums in
  float32 and round to the input dtype to send them on, which is one rounding to ``u``
  and one to float32's, both within ``(1 + u_eff) = (1 + u)(1 + u_f32)``. By the standard
  bound (Higham, Accuracy and Stability of Numerical Algorithms, 4.2) each computed sum
  is within ``gamma(p - 1) * sum|x_i|`` of the exact one, ``gamma(k) = k u_eff / (1 - k
  u_eff)``, so two of them differ by at most ``2 gamma(p - 1) * sum|x_i|``, about
  ``(p - 1) * eps * sum|x_i|``.

  * ``all_reduce``, ``psum``, ``reduce_scatter``, ``psum_scatter``:
    ``2 gamma(p - 1)``.
  * ``pmean``: the sum divided by p, one more rounding: ``2 gamma(p) / p``.
  * ``all_gather``: 0 (it moves bits, it adds nothing).
  * integer and boolean dtypes: 0 (their sums are exact, wrapping as lax's do).

  To check a result: ``|auto - lax| <= c * sum_i |x_i|`` elementwise, with ``sum_i |x_i|``
  e.g. ``lax.psum(jnp.abs(x), axes)`` (pmean: the same sum, not divided by p). The bound
  does not cover a block-scaled ``transport_dtype``, which "auto" never picks by itself
  (``quantization.error_bound`` bounds that).

  Args:
    op: ``"all_reduce"``, ``"psum"``, ``"pmean"``, ``"reduce_scatter"``,
      ``"psum_scatter"``, ``"all_gather"`` or ``"all_reduce_gradients"`` (bounded as
      ``"all_reduce"``).
    dtype: the inputs' dtype (anything ``jnp.dtype`` takes).
    group_size: p, the number of devices summed over (the product of the axis sizes, or
      the size of a replica group).

  Returns:
    ``c``, a float; 0.0 for all-gathers and exact dtypes, ``math.inf`` where the group
    is too large for the bound to say anything (``gamma``'s ``k u_eff >= 1``).

  Raises:
    ValueError: for a floating ``dtype``, an ``op`` not listed above (``"batch_norm"``
      included: batch norm under "auto" always runs XLA).
  """
  u = unit_roundoff(dtype)
  if op == "all_gather" or u == 0.0:
    return 0.0
  u32 = unit_roundoff(jnp.float32)
  u_eff = u if jnp.dtype(dtype).itemsize >= 4 else (1 + u) * (1 + u32) - 1
  p = int(group_size)

  def gamma(k: int) -> float:
    if k * u_eff >= 1:
      return math.inf
    return k * u_eff / (1 - k * u_eff)

  if op == "pmean":
    return 2 * gamma(p) / p
  summing = ("all_reduce", "psum", "reduce_scatter", "psum_scatter", "all_reduce_gradients")
  if op in summing:
    return 2 * gamma(p - 1)
  raise ValueError(f"no rounding bound for {op=}: pass one of {('all_gather', 'pmean', *summing)}")


def auto_implementation(
  op: str = "all_reduce",
  dtype=jnp.float32,
  *,
  nbytes: int | None = None,
  torus: tuple[int, ...] = (),
) -> str:
  """The implementation "auto" picks for ``op`` on ``nbytes`` of ``dtype`` over a torus of
  axis sizes ``torus`` (batch norm: the group's tile), on the traced-for device.

  XLA unless a tuning table holds a measurement for this (device kind, topology, op,
  dtype, size) that picked a torus implementation (see ``tuning.tables`` for the rule). Without
  ``nbytes`` nothing can be looked up: XLA. Batch norm: always XLA. Floating dtypes while
  ``bitwise_as_lax`` is on: XLA. Also XLA below the size where the cost model's per-hop
  latency dominates (without looking), on more than three axes, and where the measured
  choice does not run on this device. The tables read, most specific first: one installed
  with ``tuning.tables.use_table``, the user cache (``$TORUS_COLLECTIVES_TUNING``, else
  ``torus_collectives/tuning.json`` under ``$XDG_CACHE_HOME`` or ``~/.cache``), then the
  tables shipped in the package. Where none measured this device kind and topology, a
  warning says once how to tune (``python -m torus_collectives.tuning``).

  This is the choice per (op, dtype, size, torus). A call goes further (``resolve``): it
  runs XLA where its axes are not all bound mesh axes (vmap, pmap, positional), or where
  the chosen implementation does not run it (replica groups, dtypes, ``to=``, ...).

  What "auto" promises:

  * where it runs XLA, its result is lax's, bitwise: it calls lax with the arguments as
    given;
  * where a table picks a torus implementation, that implementation beat XLA in the
    table's measurements by the rule of ``tuning.tables``, and its result is lax's within
    rounding: ``|auto - lax| <= auto_rounding_bound(op, dtype, p) * sum_i |x_i|`` per
    element (about ``(p - 1) * eps * sum_i |x_i|``); bitwise for all-gathers and for
    integer and boolean dtypes.

  Args:
    op: ``"all_reduce"`` (default), ``"reduce_scatter"``, ``"all_gather"``,
      ``"batch_norm"`` or ``"all_reduce_gradients"``.
    dtype: the dtype of the data (default float32).
    nbytes: the whole buffer's bytes: a reduce-scatter's input, an all-gather's output.
      None (default): nothing to look up, so ``"xla"``.
    torus: the sizes of the axes the op runs over (or of its replica group's tile), e.g.
      ``(2, 4)``.

  Returns:
    The implementation's name, ``"xla"`` or a registered torus implementation.

  Raises:
    ValueError: an ``op`` not listed above (the message lists them).
  """
  if op not in TUNED_OPS:
    raise ValueError(f"unknown {op=}: one of {TUNED_OPS}")
  device_kind = target.target_device().device_kind
  if nbytes is None or len(torus) > MAX_TORUS_AXES or len(candidates(op, dtype, device_kind)) < 2:
    return "xla"
  if _keep_on_xla(dtype):
    return "xla"
  if op == "batch_norm":
    # The tuner times batch norm alone, where the kernels move fewer compiled bytes than
    # XLA at ResNet-50's shapes. In a whole ResNet-50 step compiled for v5e they move more
    # (``python -m bench.step_report``; the recorded figures are on the batch-norm page):
    # XLA fuses batch norm into the convolutions, which an opaque kernel cannot join. So
    # "auto" never picks them; ``implementation="pallas"`` does.
    return "xla"
  if nbytes < tables.latency_floor_bytes(tuple(torus), device_kind):
    return "xla"
  choice = tables.lookup(device_kind, torus, op, dtype, nbytes)
  if choice is None:
    tables.log_unmeasured(device_kind, tuple(torus))
    return "xla"
  return choice if choice in candidates(op, dtype, device_kind) else "xla"


def tuned_step(request: Request) -> tuple[str, int | None] | None:
  """What a whole-step tuning (``tuning.step_tuning.tune_step``) measured for the gradient
  summation ``request`` under "auto": ``(implementation, bucket bytes)`` (bucket bytes
  None: the caller's), or None where no step entry speaks for it.

  A step entry speaks for a gradient summation on this device kind over a torus of the
  same axis sizes, whose dominant dtype and total bytes on the wire (in the size bucket
  of ``tables.size_bucket``, exactly: a step measured with one gradient tree says nothing
  of another) are the entry's, and only where "auto" could run a measured choice at all:
  a summation over mesh axes, not block-scaled, with ``bitwise_as_lax`` off for its
  dtypes, and a choice that runs here and runs the request. Otherwise None: "auto" then
  decides as for any op (``auto_implementation``).
  """
  if request.op != "all_reduce_gradients" or request.block_scaled or request.nbytes is None:
    return None
  if not request.over_mesh_axes or len(request.torus) > MAX_TORUS_AXES:
    return None
  if any(_keep_on_xla(d) for d in request.dtypes):
    return None
  device_kind = target.target_device().device_kind
  dtype = request.dtypes[0] if request.dtypes else jnp.float32
  choice = tables.lookup(
    device_kind, request.torus, tables.STEP_OP, dtype, request.nbytes, exact=True
  )
  if choice is None:
    return None
  implementation, bucket_bytes = tables.parse_step_variant(choice)
  if implementation not in candidates(request.op, dtype, device_kind):
    return None
  if unsupported(implementation, request) is not None:
    return None
  return implementation, bucket_bytes


def check_name(implementation: str) -> None:
  """Raises ValueError unless ``implementation`` is "auto" or a registered backend."""
  if implementation != "auto" and implementation not in BACKENDS:
    raise ValueError(
      f"unknown {implementation=}: implementation must be one of {implementations()}"
    )


@dataclasses.dataclass(frozen=True)
class Request:
  """The facts of one call that decide which implementation runs it; the op gathers them
  once per call and hands them to ``resolve``.

  Every op gives ``op``, ``dtypes``, ``nbytes`` and ``torus``; a collective call gives the
  facts of its axes and arguments as well (the defaults are those of a call over bound
  mesh axes that asks nothing special).

  Attributes:
    op: one of ``TUNED_OPS``.
    dtypes: the dtypes of the inputs (a collective's leaves, as summed), distinct; the
      first is the one "auto" looks up.
    nbytes: the full (unscattered, gathered) buffer's bytes, which "auto" looks up with
      ``torus``; None: nothing to look up.
    torus: the extents of the group the op runs over: the sizes of the named axes, or of
      the tile of its replica groups.
    names: a collective's axis names, as given.
    sizes: the sizes of the named axes (empty where one is unbound or positional).
    mesh_names: the named axes that are manual mesh axes (the others are bound by vmap or
      pmap).
    unbound: named axes bound by nothing (lax raises NameError for them, except
      ``lax.psum`` inside ``shard_map(check_vma=True)``, which fails an AssertionError; the
      torus implementations raise NameError either way).
    positional: an int (positional) axis is named.
    groups: None, "tile" (``axis_index_groups`` that are aligned tiles of the torus, in
      row-major order) or "other".
    to: the all-gather's ``to=``.
    unreduced: a leaf is typed unreduced or reduced over the named axes.
    partial_manual: the enclosing shard_map leaves some mesh axes automatic.
    block_scaled: the call asks for block-scaled transport (``transport_dtype=jnp.int8``).
  """

  op: str
  dtypes: tuple = ()
  nbytes: int | None = None
  torus: tuple[int, ...] = ()
  names: tuple = ()
  sizes: tuple[int, ...] = ()
  mesh_names: tuple = ()
  unbound: tuple = ()
  positional: bool = False
  groups: str | None = None
  to: str = "varying"
  unreduced: bool = False
  partial_manual: bool = False
  block_scaled: bool = False

  @property
  def over_mesh_axes(self) -> bool:
    """Whether every named axis is a bound mesh axis: only then can a tuning table speak
    for the call (the tables time tori of mesh axes, never vmap, pmap or positional
    axes). True for an op that names no axes in its request."""
    return not self.unbound and not self.positional and len(self.mesh_names) == len(self.names)


def resolve(implementation: str, request: Request) -> str:
  """The concrete implementation that runs ``request``: the one rule of every op.

  * a lax reference ("xla") runs everything, whatever the request;
  * an explicit choice runs the request or raises the error ``unsupported`` names;
  * "auto" runs ``auto_implementation``'s measured choice where that choice runs the
    request, and "xla" everywhere else: where no table speaks for it
    (``Request.over_mesh_axes``), for floating dtypes under ``bitwise_as_lax``, and for
    whatever the choice does not support.
  * block-scaled transport (``Request.block_scaled``) is never chosen, only honoured: an
    explicit implementation must have ``block_scaled_transport`` (lax does not) or the
    call raises; "auto" runs the first registered one that runs the request.

  Raises ValueError on an unknown name.
  """
  check_name(implementation)
  if request.block_scaled:
    return _block_scaled(implementation, request)
  if runs_lax(implementation):
    return implementation
  if implementation != "auto":
    error = unsupported(implementation, request)
    if error is not None:
      raise error
    return implementation
  if not request.over_mesh_axes or any(_keep_on_xla(d) for d in request.dtypes):
    return "xla"
  dtype = request.dtypes[0] if request.dtypes else jnp.float32
  choice = auto_implementation(request.op, dtype, nbytes=request.nbytes, torus=request.torus)
  return "xla" if choice == "xla" or unsupported(choice, request) else choice


def _block_scaled(implementation: str, request: Request) -> str:
  """The implementation that runs a request for block-scaled transport (see ``resolve``)."""
  able = [name for name, b in BACKENDS.items() if b.block_scaled_transport]
  for dtype in request.dtypes:
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
      raise ValueError(
        f"block-scaled transport quantizes floating-point values, got dtype "
        f"{jnp.dtype(dtype).name}; integer sums are exact: pass transport_dtype=None"
      )
  device_kind = target.target_device().device_kind
  if implementation == "auto":
    for name in able:
      if BACKENDS[name].runs_on(device_kind) and unsupported(name, request) is None:
        return name
    if able:
      raise unsupported(able[0], request) or ValueError(
        f"no registered implementation with block-scaled transport runs here (of {able})"
      )
  elif implementation in able:
    error = unsupported(implementation, request)
    if error is not None:
      raise error
    return implementation
  raise ValueError(
    f'implementation="{implementation}" has no block-scaled (int8/fp8) transport; use one '
    f'of {able} or "auto" (which runs it), or pass transport_dtype=None'
  )


# The lax collective each op stands in for, called as lax would be on an unbound axis.
_LAX_CALLS = {
  "all_reduce": lambda x, axis: jax.lax.psum(x, axis),
  "reduce_scatter": lambda x, axis: jax.lax.psum_scatter(x, axis, tiled=True),
  "all_gather": lambda x, axis: jax.lax.all_gather(x, axis),
}


def lax_unbound_axis_error(op: str, axis) -> NameError:
  """The NameError lax raises for ``op`` over the unbound ``axis``, with lax's own text
  (traced, not copied, so it stays lax's in every jax version). Where lax fails otherwise
  (``lax.psum`` inside ``shard_map(check_vma=True)`` fails an assertion), a NameError."""
  try:
    jax.eval_shape(lambda x: _LAX_CALLS[op](x, axis), jax.ShapeDtypeStruct((1,), jnp.float32))
  except NameError as e:
    return NameError(*e.args)
  except Exception:  # noqa: BLE001 (any other failure of lax's: fall through)
    pass
  return NameError(f"unbound axis name: {axis}")


def _hint(request: Request) -> str:
  if request.op in COLLECTIVES:
    return 'use implementation="auto" (it runs lax here) or "xla"'
  return 'use implementation="auto" or "xla"'


def _inputs_error(backend: Backend, request: Request) -> Exception | None:
  """The op itself, an unbound axis, a dtype."""
  op = _runs_as(request.op)
  if op not in backend.ops:
    offered = ["auto"] + [name for name, b in BACKENDS.items() if op in b.ops]
    return ValueError(f'{op} has no implementation="{backend.name}"; choose one of {offered}')
  if request.unbound:
    return lax_unbound_axis_error(op, request.unbound[0])
  for dtype in request.dtypes:
    if not backend.supports(op, dtype):
      return backend.dtype_error(op, dtype, _hint(request))
  return None


def _axes_error(backend: Backend, request: Request) -> Exception | None:
  """Positional axes, too many mesh axes."""
  name, hint = f'implementation="{backend.name}"', _hint(request)
  if request.positional:
    return ValueError(f"positional (int) axis names are not collectives over devices; {hint}")
  mesh_axes = len(request.mesh_names)
  if backend.max_torus_axes is not None and mesh_axes > backend.max_torus_axes:
    return NotImplementedError(
      f"{name} runs on tori of at most {backend.max_torus_axes} mesh axes, got {mesh_axes}; {hint}"
    )
  return None


def _groups_error(backend: Backend, request: Request) -> Exception | None:
  """``axis_index_groups`` the backend does not run."""
  if not request.groups or backend.replica_groups == "any":
    return None
  if request.groups == "tile" and backend.replica_groups == "tiles":
    return None
  if backend.replica_groups == "tiles":
    which = "only when they are aligned tiles of the torus, listed row-major"
  else:
    tiles = [n for n, b in BACKENDS.items() if b.replica_groups == "tiles"]
    which = f"not at all (aligned tiles of the torus, listed row-major, run on {tiles})"
  return ValueError(
    f'implementation="{backend.name}" runs axis_index_groups {which}; {_hint(request)}'
  )


def _arguments_error(backend: Backend, request: Request) -> Exception | None:
  """``to=``, unreduced inputs, a partially manual mesh."""
  name, hint = f'implementation="{backend.name}"', _hint(request)
  if backend.gather_to is not None and request.to not in backend.gather_to:
    return ValueError(f"{name} does not gather to={request.to!r}; {hint}")
  if request.unreduced and not backend.unreduced_inputs:
    return ValueError(f"{name} does not take unreduced or reduced inputs; {hint}")
  if request.partial_manual and not backend.partial_manual:
    others = [n for n, b in BACKENDS.items() if b.partial_manual and not b.lax_reference]
    return ValueError(
      f"{name} needs every mesh axis manual in the enclosing shard_map; "
      f'use implementation="auto" or one of {others}'
    )
  return None


def unsupported(implementation: str, request: Request) -> Exception | None:
  """Why ``implementation`` cannot run ``request`` (the error to raise), or None: read off
  its record, in this order: the op, unbound axes, the dtypes, the axes, the replica
  groups, then ``to=``, unreduced inputs and partially manual meshes."""
  backend = BACKENDS[implementation]
  if backend.lax_reference:
    return None
  for check in (_inputs_error, _axes_error, _groups_error, _arguments_error):
    error = check(backend, request)
    if error is not None:
      return error
  return None


def collective_backend(name: str, config: KernelConfig | None = None) -> CollectiveBackend:
  """The collective functions of a registered, non-lax backend.

  ``config`` tunes the kernels of a backend with ``pallas_kernels``; the others have
  nothing to tune and get none.
  """
  backend = BACKENDS[name]
  if backend.load_collectives is None:
    raise ValueError(f"implementation {name!r} has no collective functions")
  functions = backend.load_collectives()
  if not backend.pallas_kernels:
    return functions
  tuned = {
    op: functools.partial(getattr(functions, op), config=config)
    for op in ("reduce_scatter", "all_gather", "all_reduce")
  }
  return dataclasses.replace(functions, **tuned)


def batch_norm_passes(name: str) -> Passes:
  """The per-replica batch-norm passes of a registered implementation."""
  backend = BACKENDS[name]
  if backend.load_batch_norm is None:
    raise ValueError(f"implementation {name!r} has no batch norm")
  return backend.load_batch_norm()
