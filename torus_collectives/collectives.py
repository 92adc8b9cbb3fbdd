"""Drop-in replacements for ``lax.psum``, ``lax.pmean``, ``lax.psum_scatter`` and
``lax.all_gather``.

``psum``, ``pmean``, ``psum_scatter`` and ``all_gather`` take lax's exact signatures plus
``implementation=`` (and ``config=`` for the Pallas kernels), so migrating a file is a
find-and-replace of ``lax.``; ``all_reduce`` and ``reduce_scatter`` are the descriptive
names of the same ops.

* ``implementation="xla"`` is lax itself, called with the arguments as given.
* ``"auto"`` asks ``registry.resolve`` whether its choice of torus implementation runs
  the request (the call's facts, read once by ``_request``), and otherwise calls lax: it
  is never stricter than lax.
  What it promises about values (``registry.auto_implementation``): where it runs XLA,
  which is everywhere no tuning table picked a torus implementation for the request, the
  result is lax's, bitwise; where a measured table picks one, the result is lax's within
  rounding, ``|auto - lax| <= registry.auto_rounding_bound(op, dtype, p) * sum_i |x_i|``
  per element over the p devices' inputs (about ``(p - 1) * eps * sum_i |x_i|``; bitwise
  for all-gathers, integers and booleans). For bitwise reproducibility whatever the
  tables say, ``with tc.bitwise_as_lax():`` or ``TORUS_COLLECTIVES_BITWISE=1`` keeps
  "auto" on lax for floating dtypes.
* ``"shard_map"`` and ``"pallas"`` run the torus schedule. The work here is what they share:
  validating the request before any device work, and packing a pytree into one flat
  buffer per dtype (one collective per dtype bucket, not one per leaf; the layout of
  ``packing``) with the scattered or gathered dimension brought to the front. The flat
  buffers go through the primitives of ``primitives``, which carry the JVP, transpose and
  batching rules.

``transport_dtype=`` (not in lax): block-scaled transport, ``jnp.int8``, an fp8 dtype, a
``tc.BlockScaled`` or a mapping from axis name to one (``quantization``): lossy within
``quantization.error_bound``, run by the implementations that have it ("auto" picks one;
"xla" raises), and never chosen by "auto" on its own.

Semantics follow lax: chunk order row-major over a tuple of axis names, lax's ``tiled``
meaning, ``axis_index_groups`` (on the torus when the groups are aligned tiles of it, see
``groups``), ``to="invarying"``, axes bound by ``shard_map``, ``pmap`` or
``vmap(axis_name=...)``, and Python scalars. Booleans are summed as int32, as lax does.

``group_sum`` sums over the replicas of each aligned tile of the torus (``groups``), as
distributed batch norm does: the sum inside a tile is latency-bound (a few per-channel
vectors), so it takes as few steps as possible:

* an axis the tile spans whole: one all-reduce over all such axes together;
* an axis the tile covers partly: recursive doubling, ``log2(t_a)`` exchanges with the XOR
  partner ``i ^ 2**k`` (``lax.ppermute``). Partners never leave an aligned tile when
  ``t_a`` is a power of two, which is therefore required of partial extents (torus axes
  are powers of two on every TPU slice this targets). ``a + b`` is commutative in IEEE
  arithmetic, so both partners, and hence every replica of the tile, hold identical bits.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import _jax_internals as jax_internals
from torus_collectives import axes, packing, primitives, quantization, registry
from torus_collectives import groups as groups_lib
from torus_collectives._vma import ensure_varying, vma_checked
from torus_collectives.axes import AxisName
from torus_collectives.kernel_config import KernelConfig
from torus_collectives.registry import Implementation

AxisIndexGroups = Sequence[Sequence[int]] | None


def _check_args(implementation, config) -> None:
  registry.check_name(implementation)
  if config is not None and not isinstance(config, KernelConfig):
    raise ValueError(f"config must be a tc.KernelConfig or None, got {config=}")


def _state(leaf, names) -> str:
  mat = getattr(jax.typeof(leaf), "mat", None)
  for kind in ("unreduced", "reduced"):
    if set(names) & set(getattr(mat, kind, ())):
      return kind
  return "varying"


def _summed_dtype(op: str, leaf) -> jnp.dtype:
  """The dtype ``leaf`` travels in: bools are summed as int32, as lax sums them."""
  dtype = jnp.result_type(leaf)
  return jnp.dtype(jnp.int32) if op == "all_reduce" and dtype == jnp.bool_ else dtype


def _request(op: str, leaves, axis_name, groups, to) -> registry.Request:
  """The facts of one collective call, read once, without touching the values: the axis
  environment, the leaves' dtypes, sizes and types, the replica groups. Raises only
  TypeError, on a leaf that is not an array or an unhashable axis name."""
  names = axes.names(axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  manual = frozenset(getattr(mesh, "manual_axes", ()))
  env = jax_internals.get_axis_env()
  positional = any(isinstance(a, int) for a in names)
  unbound = tuple(a for a in names if not isinstance(a, int) and not env.axis_exists(a))
  sizes = () if unbound or positional else tuple(env.axis_size(a) for a in names)
  tile, group_kind = sizes, None
  if groups is not None:
    found = groups_lib.tile_of_groups(groups, sizes, op != "all_reduce") if sizes else None
    tile, group_kind = found or sizes, "other" if found is None else "tile"
  dtypes = [_summed_dtype(op, leaf) for leaf in leaves]
  nbytes = sum(jnp.size(leaf) * d.itemsize for leaf, d in zip(leaves, dtypes))
  tracers = [leaf for leaf in leaves if isinstance(leaf, jax_internals.Tracer)]
  return registry.Request(
    op=op,
    dtypes=tuple(dict.fromkeys(dtypes)),
    # "auto" looks up the whole buffer: a gather's output, a scatter's input.
    nbytes=nbytes * math.prod(tile) if op == "all_gather" else nbytes,
    torus=tile,
    names=names,
    sizes=sizes,
    mesh_names=tuple(a for a in names if a in manual),
    unbound=unbound,
    positional=positional,
    groups=group_kind,
    to=to if vma_checked() else "varying",
    unreduced=any(_state(leaf, names) != "varying" for leaf in tracers),
    partial_manual=bool(manual) and manual != frozenset(mesh.axis_names),
  )


def request(op: str, leaves, axis_name: AxisName) -> registry.Request:
  """The ``registry.Request`` of ``op`` on ``leaves`` over ``axis_name`` (no replica
  groups), as the op itself would build it: for callers that resolve once for many calls."""
  return _request(op, leaves, axis_name, None, "varying")


@dataclasses.dataclass(frozen=True)
class _Call:
  """One collective call that a torus implementation runs: its request, its backend and
  its block-scaled transport (one format or None per axis, or None)."""

  request: registry.Request
  implementation: str
  transport: quantization.Transport | None = None

  @property
  def names(self) -> tuple:
    return self.request.names

  @property
  def group_size(self) -> int:
    return math.prod(self.request.torus)

  def params(self, config, invariant=False) -> dict[str, Any]:
    return dict(
      axes=self.request.names,
      sizes=self.request.sizes,
      tile=self.request.torus,
      impl=self.implementation,
      config=config,
      invariant=invariant,
      transport=self.transport,
    )

  def varying(self, leaf: jax.Array, op: str) -> jax.Array:
    """``leaf`` typed varying over the mesh axes, as lax's collectives take it."""
    mesh_names = self.request.mesh_names
    if not vma_checked() or not mesh_names:
      return leaf
    varying = jax.typeof(leaf).mat.varying
    if not jax_internals.auto_pcast() and not set(mesh_names) & set(varying):
      raise ValueError(
        f"{op} is a variant->invariant collective: the input must vary over at least one "
        f"of the axes {self.names}, but its type is {jax.typeof(leaf)}"
      )
    return ensure_varying(leaf, mesh_names)


def _torus_call(
  op, x, axis_name, groups, to, implementation, constants_to_lax=False, transport_dtype=None
):
  """The torus implementation that runs the call, or None where lax runs it untouched:
  "xla", "auto" wherever ``registry.resolve`` says lax, an empty tree, and
  (``constants_to_lax``) a tree of constants, which lax sums without device work.

  The request is built once, here. "xla" builds none, so lax gets the caller's arguments
  as given; for "auto" the request reads only what lax reads too (the axis environment,
  the leaves' dtypes, sizes and types, the replica groups), and a leaf or axis name it
  cannot read goes to lax, which raises its own error. A block-scaled ``transport_dtype``
  (``quantization.transport_per_axis``) is honoured or refused, never dropped: lax has
  none, so "xla" raises, and "auto" runs an implementation that has it."""
  transport = quantization.transport_per_axis(transport_dtype, axes.names(axis_name))
  leaves = jax.tree.leaves(x)
  if transport is not None and registry.runs_lax(implementation):
    registry.resolve(implementation, registry.Request(op, block_scaled=True))  # raises
  if registry.runs_lax(implementation) or not leaves:
    return None
  try:
    request = _request(op, leaves, axis_name, groups, to)
  except TypeError:
    if implementation == "auto" and transport is None:
      return None  # lax raises its own error
    raise
  request = dataclasses.replace(request, block_scaled=transport is not None)
  constants = not any(isinstance(v, jax_internals.Tracer) for v in leaves)
  if constants_to_lax and constants and transport is None:
    return None
  concrete = registry.resolve(implementation, request)
  if registry.runs_lax(concrete):
    return None
  if len(set(request.names)) != len(request.names):
    raise ValueError(f"{axis_name=} names an axis twice")
  return _Call(request, concrete, transport)


def _prepare(x, summed: bool):
  """(the leaves as arrays, treedef); ``summed`` bools become int32, as lax sums them."""
  leaves, treedef = jax.tree.flatten(x)
  arrays = [jnp.asarray(leaf) for leaf in leaves]
  if summed:
    arrays = [a.astype(jnp.int32) if a.dtype == jnp.bool_ else a for a in arrays]
  return arrays, treedef


def _sum(x, axis_name, axis_index_groups, implementation, config, transport_dtype):
  """psum on the torus, or None where lax runs it ("xla", and "auto" where it says so)."""
  _check_args(implementation, config)
  call = _torus_call(
    "all_reduce", x, axis_name, axis_index_groups, "varying", implementation, True, transport_dtype
  )
  if call is None:
    return None
  arrays, treedef = _prepare(x, summed=True)
  invariant = vma_checked() and axis_index_groups is None
  pieces = [call.varying(a, "psum").reshape(-1) for a in arrays]
  summed = packing.through_buckets(
    lambda flat: primitives.bind("all_reduce", flat, **call.params(config, invariant)),
    pieces,
    packing.buckets_by_dtype(arrays),
    [a.size for a in arrays],
  )
  out = [s.reshape(a.shape) for s, a in zip(summed, arrays)]
  return jax.tree.unflatten(treedef, out)


def psum(
  x: Any,
  axis_name: AxisName,
  *,
  axis_index_groups: AxisIndexGroups = None,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
  transport_dtype: Any = None,
) -> Any:
  """Sums ``x`` over the devices of ``axis_name``: ``lax.psum``, with a choice of
  implementation.

  Call it where ``lax.psum`` would go: inside ``jax.shard_map``, ``pmap`` or
  ``vmap(axis_name=...)``. Every device of a group gets the same sum. Where lax runs the
  call ("xla", and "auto" without ``transport_dtype``), it raises lax's own errors; the
  others are listed under Raises.

  Args:
    x: a pytree of arrays or Python scalars. The torus implementations pack its leaves
      into one flat buffer per dtype and run one collective per buffer; booleans are
      summed as int32, as lax sums them. A tree with nothing traced in it (constants) is
      summed by lax whatever ``implementation``, unless ``transport_dtype`` is given.
    axis_name: an axis name, or a tuple or list of them, bound by the enclosing
      ``shard_map``, ``pmap`` or ``vmap``; a tuple sums over all of them. The torus
      implementations run over one to three mesh axes (a ring, a 2-D or a 3-D torus).
    axis_index_groups: lax's meaning: a list of lists of device indices along
      ``axis_name`` (row-major over a tuple of names), equal in size and covering every
      index once; each group sums separately. None (default): one group of all devices.
      ``"shard_map"`` runs groups that are aligned tiles of the torus (see
      ``resolve_tile``); ``"lax_torus"`` and ``"pallas"`` run none; ``"auto"`` runs lax
      for any other groups.
    implementation: what runs the sum:

      * ``"auto"`` (default): ``lax.psum``, unless a tuning table measured a torus
        implementation faster than XLA, with confidence, for this device kind, torus, op,
        dtype and size, and that implementation runs this call
        (``auto_implementation``). The result is then lax's within
        ``auto_rounding_bound``; ``bitwise_as_lax`` keeps floating dtypes on lax.
      * ``"xla"``: ``lax.psum`` with the arguments as given: the reference.
      * ``"shard_map"``: the torus schedule as ``lax.ppermute`` steps; any backend.
      * ``"lax_torus"``: the schedule's phases as per-axis ``lax.psum_scatter`` and
        ``lax.all_gather``.
      * ``"pallas"``: the remote-DMA Pallas TPU kernels, for TPU v4 and newer (on other
        devices only inside ``pltpu.force_tpu_interpret_mode``); float32, bfloat16,
        float16 and int32; no ``axis_index_groups``; every mesh axis of the enclosing
        ``shard_map`` manual.

      Any name added with ``registry.register`` is accepted too.
    config: a ``KernelConfig`` for the Pallas kernels, used wherever the call runs on
      ``"pallas"`` (chosen, or picked by "auto"); the other implementations validate it
      and ignore it. None (default): chosen from the buffer size and TPU generation.
    transport_dtype: None (default): values travel in their own dtype. Otherwise
      block-scaled transport: ``jnp.int8``, ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``, a
      ``BlockScaled`` (to choose the block size), or a mapping from axis name to one of
      these (axes left out travel unquantized, e.g. ``{"dcn": jnp.int8}``). Partial sums
      then travel as int8 or fp8 blocks with a bfloat16 scale each, requantized at every
      hop: lossy within ``quantization.error_bound``, and not differentiable. Floating
      inputs only. ``"shard_map"`` runs every format, ``"pallas"`` int8 blocks of 128 on
      every axis; ``"auto"`` runs ``"shard_map"``; ``"xla"`` and ``"lax_torus"`` have
      none. "auto" never turns it on by itself.

  Returns:
    A pytree of ``x``'s structure, each leaf the sum over its group, of the leaf's shape
    and dtype (booleans become int32), typed under ``check_vma`` as ``lax.psum`` types it.

  Raises:
    ValueError: at trace time, before any device work: an unknown ``implementation``
      (the message lists the names); a ``config`` that is not a ``KernelConfig``; an
      explicit implementation that does not run the call (a dtype, a positional axis
      name, ``axis_index_groups``, unreduced inputs, a partially manual ``shard_map``;
      the message names one that does, usually "auto" or "xla"); an axis named twice;
      a ``transport_dtype`` that is a floating dtype (cast the input instead), names an
      axis outside ``axis_name``, meets integer or boolean inputs (pass None), or asks
      an implementation without it ("xla", "lax_torus"), or "pallas" for another format
      than int8 blocks of 128 on every axis (use "shard_map" or "auto"). When the call is
      compiled: ``"pallas"`` for a device that is not a TPU, outside TPU interpret mode.
    NotImplementedError: a torus implementation over more than three mesh axes (use
      "auto"); ``"pallas"`` on TPU v2 or v3 (use "shard_map"); differentiating a call with
      ``transport_dtype`` (differentiate first, then sum with it); ``axis_index_groups``
      over a vmapped axis on a torus implementation (use "auto").
    NameError: ``axis_name`` names an axis that nothing binds (lax's error).
  """
  out = _sum(x, axis_name, axis_index_groups, implementation, config, transport_dtype)
  if out is None:
    return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
  return out


def pmean(
  x: Any,
  axis_name: AxisName,
  *,
  axis_index_groups: AxisIndexGroups = None,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
  transport_dtype: Any = None,
) -> Any:
  """Averages ``x`` over the devices of ``axis_name``: ``lax.pmean``, with a choice of
  implementation.

  The sum runs as in ``psum`` (same implementations, same refusals), then each leaf is
  divided by the number of devices in its group. Where lax runs the call ("xla", and
  "auto" without ``transport_dtype``), it raises lax's own errors.

  Args:
    x: a pytree of arrays or Python scalars, as for ``psum``.
    axis_name: an axis name, or a tuple or list of them, bound by the enclosing
      ``shard_map``, ``pmap`` or ``vmap``; a tuple averages over all of them.
    axis_index_groups: lax's replica groups (see ``psum``); each group averages
      separately. None (default): one group of all devices.
    implementation: ``"auto"`` (default), ``"xla"``, ``"shard_map"``, ``"lax_torus"``,
      ``"pallas"`` or a registered name: what runs the sum (see ``psum``). "auto" runs
      ``lax.pmean`` unless a tuning table picked a torus implementation for this call.
    config: a ``KernelConfig`` for the Pallas kernels, used wherever the sum runs on
      ``"pallas"``; validated and ignored by the other implementations.
    transport_dtype: None (default), or block-scaled transport for the sum (``jnp.int8``,
      an fp8 dtype, a ``BlockScaled``, or a mapping from axis name to one), lossy and
      floating inputs only, as in ``psum``.

  Returns:
    A pytree of ``x``'s structure, each leaf the mean over its group, of the leaf's shape;
    its dtype is ``lax.pmean``'s (integer inputs give floating means).

  Raises:
    ValueError: as ``psum``: an unknown ``implementation``, a ``config`` that is not a
      ``KernelConfig``, an explicit implementation that does not run the call (the
      message names one that does), a refused ``transport_dtype`` (the message names the
      fix); ``"pallas"`` compiled for a device that is not a TPU outside TPU interpret
      mode.
    NotImplementedError: as ``psum``: more than three mesh axes, ``"pallas"`` on TPU v2
      or v3, differentiating a call with ``transport_dtype``, ``axis_index_groups`` over
      a vmapped axis on a torus implementation.
    NameError: ``axis_name`` names an axis that nothing binds (lax's error).
  """
  out = _sum(x, axis_name, axis_index_groups, implementation, config, transport_dtype)
  if out is None:
    return lax.pmean(x, axis_name, axis_index_groups=axis_index_groups)
  n = lax.psum(1, axes.names(axis_name), axis_index_groups=axis_index_groups)
  return jax.tree.map(lambda v: v / n, out)


def all_reduce(
  x: Any,
  axis_name: AxisName,
  *,
  axis_index_groups: AxisIndexGroups = None,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
  transport_dtype: Any = None,
) -> Any:
  """Sums ``x`` over the devices of ``axis_name``: ``psum`` under its descriptive name,
  with the same arguments, results and errors.

  Args:
    x: a pytree of arrays or Python scalars (booleans are summed as int32).
    axis_name: an axis name, or a tuple or list of them, bound by the enclosing
      ``shard_map``, ``pmap`` or ``vmap``; a tuple sums over all of them.
    axis_index_groups: lax's replica groups (see ``psum``); each group sums separately.
      None (default): one group of all devices.
    implementation: ``"auto"`` (default: lax unless a tuning table picked a torus
      implementation for this call), ``"xla"``, ``"shard_map"``, ``"lax_torus"``,
      ``"pallas"`` or a registered name (see ``psum``).
    config: a ``KernelConfig`` for the Pallas kernels, used wherever the call runs on
      ``"pallas"``; validated and ignored by the other implementations.
    transport_dtype: None (default), or block-scaled transport (``jnp.int8``, an fp8
      dtype, a ``BlockScaled``, or a mapping from axis name to one), lossy and floating
      inputs only, as in ``psum``.

  Returns:
    A pytree of ``x``'s structure, each leaf the sum over its group, of the leaf's shape
    and dtype (booleans become int32).

  Raises:
    ValueError: as ``psum``: an unknown ``implementation``, a ``config`` that is not a
      ``KernelConfig``, an explicit implementation that does not run the call (the
      message names one that does), a refused ``transport_dtype`` (the message names the
      fix); ``"pallas"`` compiled for a device that is not a TPU outside TPU interpret
      mode.
    NotImplementedError: as ``psum``: more than three mesh axes, ``"pallas"`` on TPU v2
      or v3, differentiating a call with ``transport_dtype``, ``axis_index_groups`` over
      a vmapped axis on a torus implementation.
    NameError: ``axis_name`` names an axis that nothing binds (lax's error).
  """
  return psum(
    x,
    axis_name,
    axis_index_groups=axis_index_groups,
    implementation=implementation,
    config=config,
    transport_dtype=transport_dtype,
  )


def _dimension(value, ndim: int, name: str) -> int:
  try:
    value = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be an int, got {name}={value!r}") from None
  if not -ndim <= value < ndim:
    raise ValueError(f"{name}={value} is out of range for {ndim} dimensions")
  return value % ndim


def psum_scatter(
  x: Any,
  axis_name: AxisName,
  *,
  scatter_dimension: int = 0,
  axis_index_groups: AxisIndexGroups = None,
  tiled: bool = False,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
  transport_dtype: Any = None,
) -> Any:
  """Sums ``x`` over the devices of ``axis_name`` and keeps this device's chunk of the sum:
  ``lax.psum_scatter``, with a choice of implementation.

  Device ``d`` of a group of ``p`` (``d`` row-major over a tuple of axis names, or its
  position in its group's list) keeps chunk ``d`` of ``scatter_dimension``. Where lax runs
  the call ("xla", and "auto" without ``transport_dtype``), it raises lax's own errors.

  Args:
    x: a pytree of arrays (not boolean), packed by the torus implementations into one
      flat buffer per dtype.
    axis_name: an axis name, or a tuple or list of them, bound by the enclosing
      ``shard_map``, ``pmap`` or ``vmap``; a tuple scatters over all of them, chunks in
      row-major order.
    scatter_dimension: the dimension of each leaf that is cut into ``p`` chunks (negative
      counts from the end). Default 0.
    axis_index_groups: lax's replica groups (see ``psum``); ``"shard_map"`` runs groups
      that are aligned tiles of the torus, each listed row-major. None (default): one
      group of all devices.
    tiled: lax's meaning. False (default): ``x.shape[scatter_dimension]`` must equal
      ``p``, and the result drops that dimension. True: it must be a multiple of ``p``,
      and the result keeps it, ``p`` times shorter.
    implementation: ``"auto"`` (default: ``lax.psum_scatter`` unless a tuning table picked
      a torus implementation for this call), ``"xla"``, ``"shard_map"``, ``"lax_torus"``,
      ``"pallas"`` or a registered name (see ``psum``).
    config: a ``KernelConfig`` for the Pallas kernels, used wherever the call runs on
      ``"pallas"``; validated and ignored by the other implementations.
    transport_dtype: None (default), or block-scaled transport (``jnp.int8``, an fp8
      dtype, a ``BlockScaled``, or a mapping from axis name to one): partial sums
      quantized at every hop, lossy within ``quantization.error_bound``, floating inputs
      only, not differentiable (see ``psum``).

  Returns:
    A pytree of ``x``'s structure, each leaf this device's chunk of the sum, of the
    leaf's dtype: ``x.shape`` without ``scatter_dimension`` (untiled), or with it divided
    by ``p`` (tiled).

  Raises:
    ValueError: as ``psum`` (an unknown ``implementation``, a ``config`` that is not a
      ``KernelConfig``, an explicit implementation that does not run the call, a refused
      ``transport_dtype``: each message names the fix; ``"pallas"`` compiled for a device
      that is not a TPU outside TPU interpret mode); and on a torus implementation,
      ``x.shape[scatter_dimension]`` not a multiple of ``p`` (tiled: pad it) or not ``p``
      (untiled: reshape, or pass ``tiled=True``), or ``scatter_dimension`` out of range.
    TypeError: on a torus implementation, a boolean leaf (lax refuses it too) or a
      ``scatter_dimension`` that is not an int.
    NotImplementedError: as ``psum``: more than three mesh axes, ``"pallas"`` on TPU v2
      or v3, differentiating a call with ``transport_dtype``, ``axis_index_groups`` over
      a vmapped axis on a torus implementation.
    NameError: ``axis_name`` names an axis that nothing binds (lax's error).
  """

  def on_lax():
    return lax.psum_scatter(
      x,
      axis_name,
      scatter_dimension=scatter_dimension,
      axis_index_groups=axis_index_groups,
      tiled=tiled,
    )

  _check_args(implementation, config)
  call = _torus_call(
    "reduce_scatter",
    x,
    axis_name,
    axis_index_groups,
    "varying",
    implementation,
    transport_dtype=transport_dtype,
  )
  if call is None:
    return on_lax()
  arrays, treedef = _prepare(x, summed=False)
  grids, chunks, dims = zip(*(_scatter_rows(call, a, scatter_dimension, tiled) for a in arrays))
  scattered = packing.through_buckets(
    lambda flat: primitives.bind("reduce_scatter", flat, **call.params(config)),
    grids,
    packing.buckets_by_dtype(arrays),
    [math.prod(chunk) for chunk in chunks],
  )
  out = [
    jnp.moveaxis(part.reshape(chunk), 0, dim) if tiled else part.reshape(chunk)
    for part, chunk, dim in zip(scattered, chunks, dims)
  ]
  return jax.tree.unflatten(treedef, out)


def _scatter_rows(call: _Call, a: jax.Array, scatter_dimension, tiled: bool):
  """``a`` with its scattered dimension brought to the front, as ``[p, w]`` rows (row d:
  device d's chunk), the shape of a chunk, and the dimension; a clear error on a bad
  dtype, dimension or shape."""
  if a.dtype == jnp.bool_:
    raise TypeError("psum_scatter does not accept dtype bool (neither does lax.psum_scatter)")
  dim = _dimension(scatter_dimension, a.ndim, "scatter_dimension")
  p, size = call.group_size, a.shape[dim]
  if tiled and size % p:
    raise ValueError(
      f"tiled psum_scatter over {call.names} (group size {p}) needs x.shape[{dim}]={size} "
      f"to be a multiple of {p}; pad that dimension"
    )
  if not tiled and size != p:
    raise ValueError(
      f"untiled psum_scatter over {call.names} needs x.shape[{dim}]={size} to equal the "
      f"group size {p}; reshape, or pass tiled=True"
    )
  moved = jnp.moveaxis(call.varying(a, "psum_scatter"), dim, 0)
  chunk = (size // p,) + moved.shape[1:] if tiled else moved.shape[1:]
  return packing.as_rows(moved, p), chunk, dim


def reduce_scatter(
  x: Any,
  axis_name: AxisName,
  *,
  scatter_dimension: int = 0,
  axis_index_groups: AxisIndexGroups = None,
  tiled: bool = False,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
  transport_dtype: Any = None,
) -> Any:
  """Sums ``x`` over the devices of ``axis_name`` and keeps this device's chunk:
  ``psum_scatter`` under its descriptive name, with the same arguments, results and
  errors.

  Args:
    x: a pytree of arrays (not boolean).
    axis_name: an axis name, or a tuple or list of them, bound by the enclosing
      ``shard_map``, ``pmap`` or ``vmap``; chunks row-major over a tuple.
    scatter_dimension: the dimension of each leaf cut into one chunk per device (negative
      counts from the end). Default 0.
    axis_index_groups: lax's replica groups (see ``psum``). None (default): one group of
      all devices.
    tiled: False (default): the dimension's size equals the group size ``p`` and the
      result drops it. True: it is a multiple of ``p`` and the result keeps it, ``p``
      times shorter.
    implementation: ``"auto"`` (default: lax unless a tuning table picked a torus
      implementation for this call), ``"xla"``, ``"shard_map"``, ``"lax_torus"``,
      ``"pallas"`` or a registered name (see ``psum``).
    config: a ``KernelConfig`` for the Pallas kernels, used wherever the call runs on
      ``"pallas"``; validated and ignored by the other implementations.
    transport_dtype: None (default), or block-scaled transport (``jnp.int8``, an fp8
      dtype, a ``BlockScaled``, or a mapping from axis name to one), lossy and floating
      inputs only, as in ``psum``.

  Returns:
    A pytree of ``x``'s structure, each leaf this device's chunk of the sum (see
    ``psum_scatter``).

  Raises:
    ValueError: as ``psum_scatter``: a bad ``implementation``, ``config`` or
      ``transport_dtype``, an explicit implementation that does not run the call, or a
      scattered dimension that does not fit the group size; each message names the fix.
    TypeError: as ``psum_scatter``: a boolean leaf or a non-int ``scatter_dimension`` on
      a torus implementation.
    NotImplementedError: as ``psum``: more than three mesh axes, ``"pallas"`` on TPU v2
      or v3, differentiating a call with ``transport_dtype``, ``axis_index_groups`` over
      a vmapped axis on a torus implementation.
    NameError: ``axis_name`` names an axis that nothing binds (lax's error).
  """
  return psum_scatter(
    x,
    axis_name,
    scatter_dimension=scatter_dimension,
    axis_index_groups=axis_index_groups,
    tiled=tiled,
    implementation=implementation,
    config=config,
    transport_dtype=transport_dtype,
  )


def all_gather(
  x: Any,
  axis_name: AxisName,
  *,
  axis_index_groups: AxisIndexGroups = None,
  axis: int = 0,
  tiled: bool = False,
  to: str = "varying",
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
  transport_dtype: Any = None,
) -> Any:
  """Gathers ``x`` from every device of ``axis_name``: ``lax.all_gather``, with a choice of
  implementation.

  Device ``d``'s value (``d`` row-major over a tuple of axis names, or its position in its
  group's list) lands at index ``d`` of the gathered dimension. Where lax runs the call
  ("xla", and "auto" without ``transport_dtype``), it raises lax's own errors.

  Args:
    x: a pytree of arrays or Python scalars, of any dtype (``"pallas"``: float32,
      bfloat16, float16, int32); the torus implementations pack its leaves into one flat
      buffer per dtype.
    axis_name: an axis name, or a tuple or list of them, bound by the enclosing
      ``shard_map``, ``pmap`` or ``vmap``; a tuple gathers over all of them.
    axis_index_groups: lax's replica groups (see ``psum``); ``"shard_map"`` runs groups
      that are aligned tiles of the torus, each listed row-major. None (default): one
      group of all devices.
    axis: where the gathered dimension goes (lax's meaning; negative counts from the
      end): the position of the new dimension (untiled), or the existing dimension that
      is concatenated (tiled). Default 0.
    tiled: False (default): stack the ``p`` values along a new dimension of size ``p`` at
      ``axis``. True: concatenate them along ``axis``, ``p`` times longer.
    to: the result's type under ``check_vma``, as lax's: ``"varying"`` (default),
      ``"invarying"`` (the same on every device of the group) or ``"reduced"`` (lax only:
      "auto" runs lax for it, the torus implementations refuse it). The torus
      implementations ignore it without ``check_vma``.
    implementation: ``"auto"`` (default: ``lax.all_gather`` unless a tuning table picked a
      torus implementation for this call), ``"xla"``, ``"shard_map"``, ``"lax_torus"``,
      ``"pallas"`` or a registered name (see ``psum``).
    config: a ``KernelConfig`` for the Pallas kernels, used wherever the call runs on
      ``"pallas"``; validated and ignored by the other implementations.
    transport_dtype: None (default), or block-scaled transport (``jnp.int8``, an fp8
      dtype, a ``BlockScaled``, or a mapping from axis name to one): each device's value
      is quantized once and every device receives the same bytes, so all get the same
      bits; lossy within ``quantization.error_bound``, floating inputs only, not
      differentiable (see ``psum``).

  Returns:
    A pytree of ``x``'s structure, each leaf of its dtype, shaped as ``lax.all_gather``
    shapes it: a new dimension of size ``p`` at ``axis`` (untiled), or dimension ``axis``
    ``p`` times longer (tiled).

  Raises:
    ValueError: as ``psum`` (an unknown ``implementation``, a ``config`` that is not a
      ``KernelConfig``, an explicit implementation that does not run the call, a refused
      ``transport_dtype``: each message names the fix; ``"pallas"`` compiled for a device
      that is not a TPU outside TPU interpret mode); on a torus implementation,
      ``to="reduced"`` under ``check_vma`` (use "auto" or "xla") or ``axis`` out of range.
    TypeError: on a torus implementation, an ``axis`` that is not an int.
    NotImplementedError: as ``psum``: more than three mesh axes, ``"pallas"`` on TPU v2
      or v3, differentiating a call with ``transport_dtype``, ``axis_index_groups`` over
      a vmapped axis on a torus implementation.
    NameError: ``axis_name`` names an axis that nothing binds (lax's error).
  """

  def on_lax():
    return lax.all_gather(
      x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, to=to
    )

  _check_args(implementation, config)
  if to not in ("varying", "reduced", "invarying"):
    return on_lax()
  call = _torus_call(
    "all_gather",
    x,
    axis_name,
    axis_index_groups,
    to,
    implementation,
    transport_dtype=transport_dtype,
  )
  if call is None:
    return on_lax()
  arrays, treedef = _prepare(x, summed=False)
  p = call.group_size
  dims = [_dimension(axis, a.ndim if tiled else a.ndim + 1, "axis") for a in arrays]
  invariant = vma_checked() and to == "invarying"
  gathered = packing.through_buckets(
    lambda flat: primitives.bind("all_gather", flat, **call.params(config, invariant)),
    [call.varying(a, "all_gather").reshape(-1) for a in arrays],
    packing.buckets_by_dtype(arrays),
    [a.size for a in arrays],
    rows=p,
  )
  out = []
  for part, a, dim in zip(gathered, arrays, dims):
    stacked = jnp.moveaxis(part.reshape((p,) + a.shape), 0, dim)
    if tiled:
      stacked = stacked.reshape(a.shape[:dim] + (p * a.shape[dim],) + a.shape[dim + 1 :])
    out.append(stacked)
  return jax.tree.unflatten(treedef, out)


def _xor_exchange_sum(x, axis: str, size: int, extent: int):
  """Sum of ``x`` over aligned blocks of ``extent`` replicas along ``axis``."""
  distance = 1
  while distance < extent:
    perm = [(i, i ^ distance) for i in range(size)]
    x = jax.tree.map(lambda v, perm=perm: v + lax.ppermute(v, axis, perm), x)
    distance *= 2
  return x


def group_sum(x, axis_names: Sequence[str], tile: Sequence[int]):
  """Sums ``x`` over the replicas of each aligned tile of the torus, as distributed batch
  norm sums its statistics; call it inside ``jax.shard_map`` (or another context that
  binds the axes).

  Axes the tile spans whole go through one ``all_reduce`` (its ``"auto"``; there is no
  ``implementation=``); axes it covers partly through recursive doubling, ``log2(t)``
  ``lax.ppermute`` exchanges with the partner ``i ^ 2**k`` (module
  ``torus_collectives.collectives``). Built for small, latency-bound
  sums such as per-channel vectors.

  Args:
    x: a pytree of arrays.
    axis_names: the mesh axes the tiles live on, in the order of ``tile``.
    tile: the tile's extent along each of ``axis_names``, as ``resolve_tile`` returns it
      (e.g. ``resolve_tile(4, (2, 4))`` is ``(1, 4)``): each extent divides its axis and
      is the whole axis or a power of two.

  Returns:
    A pytree of ``x``'s structure, each leaf the sum over its tile, of the leaf's shape
    and dtype; every replica of a tile holds the same bits.

  Raises:
    NameError: an axis of ``axis_names`` that nothing binds (lax's error).
    ValueError: ``tile`` is not a tile of those axes (build it with ``resolve_tile``).
  """
  axis_names = tuple(axis_names)
  sizes = tuple(lax.axis_size(a) for a in axis_names)
  if not groups_lib.is_valid_tile(tuple(tile), sizes):
    raise ValueError(
      f"tile={tuple(tile)} is not a tile of axes {axis_names} of sizes {sizes}: each extent "
      "must divide its axis and be the whole axis or a power of two; build it with "
      "tc.resolve_tile(group_size, sizes)"
    )
  sizes, axis_names, tile = axes.drop_unit_axes(sizes, axis_names, tuple(tile))
  whole = tuple(a for a, t, n in zip(axis_names, tile, sizes) if t == n)
  if whole:
    x = jax.tree.map(lambda v: all_reduce(v, whole), x)
  for axis, extent, size in zip(axis_names, tile, sizes):
    if 1 < extent < size:
      x = _xor_exchange_sum(x, axis, size, extent)
  return x
