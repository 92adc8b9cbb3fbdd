"""The torus collectives as JAX primitives on flat per-device buffers.

Three linear primitives, one per collective, each taking a 1-D buffer:

* ``torus_reduce_scatter``: ``(p*m,) -> (m,)``, this device's chunk of the sum;
* ``torus_all_gather``: ``(m,) -> (p*m,)``, every device's chunk;
* ``torus_all_reduce``: ``(n,) -> (n,)``, the sum;

with chunks row-major over ``axes`` and ``p`` the product of ``tile`` (the extent of a
replica group along each axis: the whole axis, or an aligned tile of it, see ``groups``).

Why primitives: a Pallas kernel has no JVP, transpose or batching rule of its own, and a
``custom_vjp`` supplies only reverse mode (``jvp``, ``linearize``, ``jacfwd`` refuse it).
As primitives the ops get every rule lax's collectives have, so any composition of
``jvp``, ``grad``, ``vmap``, ``jit`` and ``scan`` works:

* JVP: each op is linear, so its tangent is the op applied to the input tangent;
* transpose: reduce-scatter and all-gather transpose to each other; the all-reduce to
  itself, or (typed invariant under ``check_vma=True``, as ``lax.psum``) to ``pvary``;
  the invariant all-gather (``to="invarying"``) to taking the own chunk;
* batching: a ``vmap`` axis named in ``axes`` is reduced over the batch dimension here,
  as lax does, and the rest of ``axes`` runs on the torus; any other batch dimension is
  folded into each device's chunk, so one collective still serves the whole batch.

Lowering traces the chosen backend (``registry.collective_backend``) inside the enclosing
``shard_map``; the backend sees only mesh axes, since batching has removed vmap axes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir

from torus_collectives import _jax_internals as jax_internals
from torus_collectives import registry, target
from torus_collectives._vma import vma_checked
from torus_collectives.axes import names as axis_names
from torus_collectives.tiling import accumulation_dtype

KINDS = ("reduce_scatter", "all_gather", "all_reduce")
PRIMITIVES = {kind: jax_internals.Primitive(f"torus_{kind}") for kind in KINDS}


def bind(
  kind: str, x: jax.Array, *, axes, sizes, tile, impl, config, invariant=False, transport=None
):
  """Runs collective ``kind`` on the 1-D ``x``; the identity when ``axes`` is empty.
  ``transport``: a ``quantization.BlockScaled`` or None per axis, or None."""
  if not axes:
    return x
  return PRIMITIVES[kind].bind(
    x,
    axes=tuple(axes),
    sizes=tuple(sizes),
    tile=tuple(tile),
    impl=impl,
    config=config,
    invariant=bool(invariant),
    transport=None if transport is None else tuple(transport),
  )


def _out_length(kind: str, n: int, tile) -> int:
  p = math.prod(tile)
  return {"reduce_scatter": n // max(p, 1), "all_gather": n * p, "all_reduce": n}[kind]


def lowering(kind, x, *, axes, sizes, tile, impl, config, invariant, transport):
  """The backend's collective: what the primitive lowers to."""
  del invariant  # a type, not a computation
  out = _out_length(kind, x.shape[0], tile)
  if out == 0 or x.shape[0] == 0:
    return jnp.zeros((out,), x.dtype)
  backend = registry.collective_backend(impl, config)
  options = {} if tuple(tile) == tuple(sizes) else {"tile": tuple(tile)}
  if transport is not None:
    options["transport"] = transport
  return getattr(backend, kind)(x, tuple(axes), tuple(sizes), **options)


def _effects(kind, aval, params):
  """The backend's effects: none, except the callbacks of TPU interpret mode."""
  if not registry.BACKENDS[params["impl"]].pallas_kernels or not target.interpret_mode_active():
    return set()
  return set(jax.make_jaxpr(functools.partial(lowering, kind, **params))(aval).effects)


def _abstract_eval(kind):
  def rule(aval, **params):
    out = aval.update(shape=(_out_length(kind, aval.shape[0], params["tile"]),))
    if vma_checked():
      varying = frozenset(aval.mat.varying)
      axes = frozenset(params["axes"])
      varying = varying - axes if params["invariant"] else varying | axes
      out = out.update(manual_axis_type=aval.mat.update(varying=varying))
    return out, _effects(kind, aval, params)

  return rule


# Transposes (linear in the cotangent).


def _own_chunk(ct, axes, tile):
  """This device's chunk of a ``(p*m,)`` buffer: the transpose of an invariant gather."""
  index = 0
  for axis, extent in zip(axes, tile):
    index = index * extent + lax.axis_index(axis) % extent
  m = ct.shape[0] // math.prod(tile)
  return lax.dynamic_slice_in_dim(ct, index * m, m)


def _transpose(kind):
  def rule(ct, x, **params):
    assert ad.is_undefined_primal(x)
    _check_linear(params)
    if type(ct) is ad.Zero:
      return (ad.Zero(x.aval),)
    if kind == "reduce_scatter":
      return (bind("all_gather", ct, **{**params, "invariant": False}),)
    if kind == "all_gather":
      if params["invariant"]:
        return (_own_chunk(ct, params["axes"], params["tile"]),)
      return (bind("reduce_scatter", ct, **params),)
    if params["invariant"]:  # d(sum)/dx_i is the identity on each device: no communication.
      return (jax_internals.pvary(ct, tuple(params["axes"])),)
    return (bind("all_reduce", ct, **params),)

  return rule


# Batching.


def _acc_sum(x, axis):
  return jnp.sum(x.astype(accumulation_dtype(x.dtype)), axis=axis).astype(x.dtype)


def _without(params, position):
  """``params`` with the named axis at ``position`` removed."""
  drop = lambda t: tuple(v for i, v in enumerate(t) if i != position)
  return {
    **params,
    "axes": drop(params["axes"]),
    "sizes": drop(params["sizes"]),
    "tile": drop(params["tile"]),
    "transport": None if params["transport"] is None else drop(params["transport"]),
  }


def _fold_batch(kind, x, params):
  """Batch dimension 0 of ``x`` folded into each chunk: one collective for the batch.

  A batch dimension sharded over mesh axes that are not manual here (an Explicit-axes
  mesh outside the ``shard_map``, as ``vmap`` of a ``shard_map`` makes) cannot be folded
  into a flat buffer: the fold then runs on each device's own batch rows, inside a
  ``shard_map`` over those axes, with no communication over them.
  """
  batch_axes = _explicit_batch_axes(x)
  if batch_axes:
    spec = jax.sharding.PartitionSpec(batch_axes)
    local = functools.partial(_fold_batch_local, kind, params=params)
    # Traced, not run eagerly: jax evaluating a shard_map nested in a running one (vmap of
    # a shard_map called without jit) misplaces a vmapped value's dimensions.
    folded = jax.shard_map(local, in_specs=spec, out_specs=spec, axis_names=set(batch_axes))
    return jax.jit(folded)(x)
  return _fold_batch_local(kind, x, params)


def _explicit_batch_axes(x) -> tuple[str, ...]:
  """The mesh axes that shard dimension 0 of ``x`` (none under a manual mesh)."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if not spec or spec[0] is None:
    return ()
  return axis_names(spec[0])


def _fold_batch_local(kind, x, params):
  b = x.shape[0]
  p = math.prod(params["tile"])
  if kind == "all_reduce":
    return bind(kind, x.reshape(-1), **params).reshape(x.shape)
  if kind == "reduce_scatter":
    grid = x.reshape(b, p, -1).transpose(1, 0, 2).reshape(-1)
    return bind(kind, grid, **params).reshape(b, -1)
  out = bind(kind, x.reshape(-1), **params)
  return out.reshape(p, b, -1).transpose(1, 0, 2).reshape(b, -1)


def _over_batch_axis(kind, x, d, position, size, params):
  """The collective over ``axes``, of which the vmapped axis (batch dim ``d``, at
  ``position`` in ``axes``) is one: the batch part is summed or stacked here, the rest
  of the axes run as one collective. Returns ``(out, out_dim)``."""
  rest = _without(params, position)
  if kind == "all_reduce":
    summed = x * jnp.asarray(size, x.dtype) if d is None else _acc_sum(x, d)
    return bind(kind, summed, **rest), None
  x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
  rest_tile = rest["tile"]
  if kind == "reduce_scatter":
    grid = x.reshape((size,) + tuple(params["tile"]) + (-1,))
    grid = jnp.moveaxis(grid, (0, 1 + position), (-3, -2))  # (*rest, batch, own axis, m)
    out = bind(kind, grid.reshape(-1), **rest).reshape(size, size, -1)
    return _acc_sum(out, 0), 0
  out = bind(kind, x.reshape(-1), **rest).reshape(tuple(rest_tile) + (size, -1))
  return jnp.moveaxis(out, len(rest_tile), position).reshape(-1), None


def _batcher(kind):
  def rule(axis_data, vals, dims, **params):
    (x,), (d,) = vals, dims
    if axis_data.name in params["axes"]:
      position = params["axes"].index(axis_data.name)
      if params["tile"][position] != params["sizes"][position]:
        raise NotImplementedError(
          "axis_index_groups over a vmapped axis are not supported by the torus "
          'implementations (nor by lax); use implementation="auto"'
        )
      return _over_batch_axis(kind, x, d, position, axis_data.size, params)
    if d is None:
      return bind(kind, x, **params), None
    return _fold_batch(kind, jnp.moveaxis(x, d, 0), params), 0

  return rule


def _check_linear(params) -> None:
  """Block-scaled transport makes a collective nonlinear: its JVP or transpose would
  silently be that of the unquantized sum, so both are refused."""
  if params["transport"] is not None:
    raise NotImplementedError(
      "a collective with a block-scaled transport_dtype is not differentiable (quantization "
      "is not linear); differentiate first and quantize the gradients' summation, or pass "
      "transport_dtype=None"
    )


def _not_linear(linear_jvp):
  def rule(primals, tangents, **params):
    _check_linear(params)
    return linear_jvp(primals, tangents, **params)

  return rule


for _kind, _prim in PRIMITIVES.items():
  _prim.def_effectful_abstract_eval(_abstract_eval(_kind))
  mlir.register_lowering(_prim, mlir.lower_fun(functools.partial(lowering, _kind), False))
  ad.deflinear2(_prim, _transpose(_kind))
  ad.primitive_jvps[_prim] = _not_linear(ad.primitive_jvps[_prim])
  batching.fancy_primitive_batchers[_prim] = _batcher(_kind)
del _kind, _prim
