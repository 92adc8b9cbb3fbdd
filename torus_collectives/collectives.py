"""Drop-in replacements for ``lax.psum``, ``lax.pmean``, ``lax.psum_scatter`` and
``lax.all_gather``.

``psum``, ``pmean``, ``psum_scatter`` and ``all_gather`` take lax's exact signatures plus
``implementation=`` (and ``config=`` for the Pallas kernels), so migrating a file is a
find-and-replace of ``lax.``; ``all_reduce`` and ``reduce_scatter`` are the descriptive
names of the same ops.

* ``implementation="xla"`` is lax itself, called with the arguments as given.
* ``"auto"`` asks ``registry.resolve_collective`` whether its choice of torus
  implementation runs the request, and otherwise calls lax: it is never stricter than lax.
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
  buffer per dtype (one collective per dtype bucket, not one per leaf) with the scattered
  or gathered dimension brought to the front. The flat buffers go through the primitives
  of ``primitives``, which carry the JVP, transpose and batching rules.

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

import math
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from torus_collectives import _jax_internals as jax_internals
from torus_collectives import axes, primitives, registry
from torus_collectives import groups as groups_lib
from torus_collectives._vma import ensure_varying, vma_checked
from torus_collectives.configs import KernelConfig
from torus_collectives.registry import Implementation

AxisName = Hashable | Sequence[Hashable]
AxisIndexGroups = Sequence[Sequence[int]] | None


def _names(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _check_args(implementation, config) -> None:
  registry.check_name(implementation)
  if config is not None and not isinstance(config, KernelConfig):
    raise ValueError(f"config must be a tc.KernelConfig or None, got {config=}")


def _full_nbytes(op: str, leaves, group_size: int) -> int:
  """The bytes of the whole (unscattered, gathered) buffer: what "auto" looks up."""
  nbytes = sum(jnp.size(leaf) * jnp.result_type(leaf).itemsize for leaf in leaves)
  return nbytes * group_size if op == "all_gather" else nbytes


def _state(leaf, names) -> str:
  mat = jax.typeof(leaf).mat
  for kind in ("unreduced", "reduced"):
    if set(names) & set(getattr(mat, kind, ())):
      return kind
  return "varying"


class _Call:
  """One collective call on a torus implementation: its axes, sizes, group tile."""

  def __init__(self, op, leaves, axis_name, groups, to, implementation):
    names = _names(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ()))
    env = jax_internals.get_axis_env()
    positional = any(isinstance(a, int) for a in names)
    unbound = tuple(a for a in names if not isinstance(a, int) and not env.axis_exists(a))
    self.names = names
    self.sizes = () if unbound or positional else tuple(env.axis_size(a) for a in names)
    self.tile = self.sizes
    group_kind = None
    if groups is not None and self.sizes:
      tile = groups_lib.tile_of_groups(groups, self.sizes, ordered=op != "all_reduce")
      group_kind = "other" if tile is None else "tile"
      self.tile = tile or self.sizes
    elif groups is not None:
      group_kind = "other"
    tracers = [leaf for leaf in leaves if isinstance(leaf, jax_internals.Tracer)]
    request = registry.CollectiveRequest(
      op=op,
      dtypes=tuple(dict.fromkeys(jnp.result_type(leaf) for leaf in leaves)),
      mesh_axes=sum(a in manual for a in names),
      unbound=unbound,
      positional=positional,
      groups=group_kind,
      to=to if vma_checked() else "varying",
      unreduced=any(_state(leaf, names) != "varying" for leaf in tracers),
      partial_manual=bool(manual) and manual != frozenset(mesh.axis_names),
      nbytes=_full_nbytes(op, leaves, math.prod(self.tile)),
      torus=self.tile,
    )
    self.implementation = registry.resolve_collective(implementation, request)
    if not registry.runs_lax(self.implementation) and len(set(names)) != len(names):
      raise ValueError(f"{axis_name=} names an axis twice")
    self.mesh_names = tuple(a for a in names if a in manual)

  def params(self, config, invariant=False) -> dict[str, Any]:
    return dict(
      axes=self.names,
      sizes=self.sizes,
      tile=self.tile,
      impl=self.implementation,
      config=config,
      invariant=invariant,
    )

  @property
  def group_size(self) -> int:
    return math.prod(self.tile)

  def varying(self, leaf: jax.Array, op: str) -> jax.Array:
    """``leaf`` typed varying over the mesh axes, as lax's collectives take it."""
    if not vma_checked() or not self.mesh_names:
      return leaf
    varying = jax.typeof(leaf).mat.varying
    if not jax_internals.auto_pcast() and not set(self.mesh_names) & set(varying):
      raise ValueError(
        f"{op} is a variant->invariant collective: the input must vary over at least one "
        f"of the axes {self.names}, but its type is {jax.typeof(leaf)}"
      )
    return ensure_varying(leaf, self.mesh_names)


def _torus_candidate(op: str, implementation: str, leaves, axis_name) -> bool:
  """Whether the call may run on a torus implementation; if not, lax runs it untouched
  (so "xla", and "auto" wherever it means lax, inspect nothing lax would not).

  For "auto" this asks the tuning tables about the whole named torus; a call over replica
  groups is looked up again, for its tile, by ``_Call``.
  """
  if registry.runs_lax(implementation) or not leaves:
    return False
  if implementation != "auto":
    return True
  env = jax_internals.get_axis_env()
  names = _names(axis_name)
  manual = frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  if any(isinstance(a, int) or a not in manual or not env.axis_exists(a) for a in names):
    return False  # lax raises, or the call spans vmap or positional axes: nothing measured
  try:
    dtypes = {jnp.result_type(leaf) for leaf in leaves}
  except TypeError:
    return False
  torus = tuple(env.axis_size(a) for a in names)
  nbytes = _full_nbytes(op, leaves, math.prod(torus))
  return any(
    registry.auto_implementation(op, d, nbytes=nbytes, torus=torus) != "xla" for d in dtypes
  )


def _buckets(leaves: list[jax.Array]) -> dict[jnp.dtype, list[int]]:
  """Leaf indices per dtype, in order: each bucket travels as one buffer."""
  buckets: dict[jnp.dtype, list[int]] = {}
  for i, leaf in enumerate(leaves):
    buckets.setdefault(leaf.dtype, []).append(i)
  return buckets


def _prepare(x, op):
  """(leaves as arrays, treedef, their original dtypes); bools are summed as int32."""
  leaves, treedef = jax.tree.flatten(x)
  arrays = [jnp.asarray(leaf) for leaf in leaves]
  if op != "all_gather":
    arrays = [a.astype(jnp.int32) if a.dtype == jnp.bool_ else a for a in arrays]
  return leaves, arrays, treedef


def _sum(op, x, axis_name, axis_index_groups, implementation, config):
  """psum on the torus, or on lax when "xla"/"auto" say so."""
  _check_args(implementation, config)
  if not _torus_candidate("all_reduce", implementation, jax.tree.leaves(x), axis_name):
    return None
  leaves, arrays, treedef = _prepare(x, op)
  if all(not isinstance(leaf, jax_internals.Tracer) for leaf in leaves):
    return None  # constants: lax multiplies by the axis size, no device work
  call = _Call("all_reduce", arrays, axis_name, axis_index_groups, "varying", implementation)
  if registry.runs_lax(call.implementation):
    return None
  out: list[jax.Array | None] = [None] * len(arrays)
  invariant = vma_checked() and axis_index_groups is None
  for _, idx in _buckets(arrays).items():
    flat = jnp.concatenate([call.varying(arrays[i], "psum").reshape(-1) for i in idx])
    summed = primitives.bind("all_reduce", flat, **call.params(config, invariant))
    offset = 0
    for i in idx:
      out[i] = summed[offset : offset + arrays[i].size].reshape(arrays[i].shape)
      offset += arrays[i].size
  return jax.tree.unflatten(treedef, out)


def psum(
  x: Any,
  axis_name: AxisName,
  *,
  axis_index_groups: AxisIndexGroups = None,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
) -> Any:
  """Sums ``x`` (a pytree) over ``axis_name``; as ``lax.psum``."""
  out = _sum("psum", x, axis_name, axis_index_groups, implementation, config)
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
) -> Any:
  """Averages ``x`` (a pytree) over ``axis_name``; as ``lax.pmean``."""
  out = _sum("pmean", x, axis_name, axis_index_groups, implementation, config)
  if out is None:
    return lax.pmean(x, axis_name, axis_index_groups=axis_index_groups)
  n = lax.psum(1, _names(axis_name), axis_index_groups=axis_index_groups)
  return jax.tree.map(lambda v: v / n, out)


def all_reduce(
  x: Any,
  axis_name: AxisName,
  *,
  axis_index_groups: AxisIndexGroups = None,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
) -> Any:
  """Sums ``x`` over ``axis_name``: ``psum`` under its descriptive name."""
  return psum(
    x,
    axis_name,
    axis_index_groups=axis_index_groups,
    implementation=implementation,
    config=config,
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
) -> Any:
  """Sums ``x`` (a pytree) over ``axis_name`` and keeps this device's chunk; as
  ``lax.psum_scatter``."""

  def on_lax():
    return lax.psum_scatter(
      x,
      axis_name,
      scatter_dimension=scatter_dimension,
      axis_index_groups=axis_index_groups,
      tiled=tiled,
    )

  _check_args(implementation, config)
  if not _torus_candidate("reduce_scatter", implementation, jax.tree.leaves(x), axis_name):
    return on_lax()
  leaves, arrays, treedef = _prepare(x, "all_gather")
  call = _Call("reduce_scatter", arrays, axis_name, axis_index_groups, "varying", implementation)
  if registry.runs_lax(call.implementation):
    return on_lax()
  p = call.group_size
  grids, shapes = [], []
  for a in arrays:
    if a.dtype == jnp.bool_:
      raise TypeError("psum_scatter does not accept dtype bool (neither does lax.psum_scatter)")
    dim = _dimension(scatter_dimension, a.ndim, "scatter_dimension")
    size = a.shape[dim]
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
    grids.append(moved.reshape(p, -1))
    chunk = (size // p,) + moved.shape[1:] if tiled else moved.shape[1:]
    shapes.append((dim, chunk))
  out: list[jax.Array | None] = [None] * len(arrays)
  for _, idx in _buckets(arrays).items():
    packed = jnp.concatenate([grids[i] for i in idx], axis=1).reshape(-1)
    scattered = primitives.bind("reduce_scatter", packed, **call.params(config))
    offset = 0
    for i in idx:
      dim, chunk = shapes[i]
      n = math.prod(chunk)
      part = scattered[offset : offset + n].reshape(chunk)
      out[i] = jnp.moveaxis(part, 0, dim) if tiled else part
      offset += n
  return jax.tree.unflatten(treedef, out)


def reduce_scatter(
  x: Any,
  axis_name: AxisName,
  *,
  scatter_dimension: int = 0,
  axis_index_groups: AxisIndexGroups = None,
  tiled: bool = False,
  implementation: Implementation = "auto",
  config: KernelConfig | None = None,
) -> Any:
  """``psum_scatter`` under its descriptive name."""
  return psum_scatter(
    x,
    axis_name,
    scatter_dimension=scatter_dimension,
    axis_index_groups=axis_index_groups,
    tiled=tiled,
    implementation=implementation,
    config=config,
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
) -> Any:
  """Concatenates (``tiled``) or stacks ``x`` (a pytree) from every device; as
  ``lax.all_gather``."""

  def on_lax():
    return lax.all_gather(
      x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, to=to
    )

  _check_args(implementation, config)
  leaves = jax.tree.leaves(x)
  if not _torus_candidate("all_gather", implementation, leaves, axis_name) or to not in (
    "varying",
    "reduced",
    "invarying",
  ):
    return on_lax()
  leaves, arrays, treedef = _prepare(x, "all_gather")
  call = _Call("all_gather", arrays, axis_name, axis_index_groups, to, implementation)
  if registry.runs_lax(call.implementation):
    return on_lax()
  p = call.group_size
  dims = [_dimension(axis, a.ndim if tiled else a.ndim + 1, "axis") for a in arrays]
  invariant = vma_checked() and to == "invarying"
  out: list[jax.Array | None] = [None] * len(arrays)
  for _, idx in _buckets(arrays).items():
    packed = jnp.concatenate([call.varying(arrays[i], "all_gather").reshape(-1) for i in idx])
    gathered = primitives.bind("all_gather", packed, **call.params(config, invariant))
    gathered = gathered.reshape(p, -1)
    offset = 0
    for i in idx:
      a, dim = arrays[i], dims[i]
      part = gathered[:, offset : offset + a.size].reshape((p,) + a.shape)
      stacked = jnp.moveaxis(part, 0, dim)
      if tiled:
        stacked = stacked.reshape(a.shape[:dim] + (p * a.shape[dim],) + a.shape[dim + 1 :])
      out[i] = stacked
      offset += a.size
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
  """Sums the pytree ``x`` over the replicas of each tile (``tile`` from
  ``groups.resolve_tile``), inside ``jax.shard_map`` (or another context that binds the
  axes).

  Whole axes go through one torus all-reduce (``all_reduce``); partial axes through
  recursive doubling (see the module docstring).
  """
  axis_names = tuple(axis_names)
  sizes = tuple(lax.axis_size(a) for a in axis_names)
  sizes, axis_names, tile = axes.drop_unit_axes(sizes, axis_names, tuple(tile))
  whole = tuple(a for a, t, n in zip(axis_names, tile, sizes) if t == n)
  if whole:
    x = jax.tree.map(lambda v: all_reduce(v, whole), x)
  for axis, extent, size in zip(axis_names, tile, sizes):
    if 1 < extent < size:
      x = _xor_exchange_sum(x, axis, size, extent)
  return x
