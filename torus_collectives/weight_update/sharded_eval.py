"""Runs a traced optimizer update on flat shards, with whole-leaf reductions made global.

``sharded_update`` gives each of p devices the shard ``[d*m, (d+1)*m)`` of every leaf's
flattened, zero-padded values (``m = ceil(n / p)``). An optax transformation written for
whole leaves is exact on such shards only where it acts elementwise; any reduction over a
leaf (a norm, a mean, a max) would silently become a shard-local one. Xu et al. 2020
("Automatic Cross-Replica Sharding of Weight Update in Data-Parallel Training") handle this
inside XLA by turning each such reduction into a local reduction followed by an
all-reduce. This module does the same on the jaxpr of ``tx.update``, traced on the leaves'
*full* shapes (so ``jnp.mean`` divides by the leaf's size, not the shard's):

* **values.** Every value is either ``Sharded`` (this device's ``[m]`` slice of a value of
  some logical shape, in row-major flat order; the padding past the leaf's end holds
  unspecified values), replicated (the whole value, identical on every device: step
  counts, hyperparameters, reduction results) or ``Uniform`` (a replicated broadcast of one
  scalar, kept unmaterialised). A replicated value meeting a sharded one is cut to this
  device's slice, which is always exact.
* **elementwise** primitives on sharded values run on the slices; a replicated operand
  whose size-one axes lax broadcasts implicitly (``mul f32[4,5] f32[1,5]``) is broadcast
  whole before it is cut.
* **reshape, squeeze, size-preserving broadcasts and transposes that keep the order of the
  non-unit axes** keep the flat order, so they only relabel the logical shape.
* **reductions over every axis** (``reduce_sum``/``max``/``min``/``and``/``or`` and a
  ``dot_general`` contracting every axis of both operands) mask the padding with the
  reduction's identity, reduce the slice locally, and are completed by one
  ``psum``/``pmax``/``pmin`` over the sharding axes.
* **batching of the completions.** Equations run in dependency order, and every reduction
  is deferred until some equation needs its value; then all deferred reductions of one
  kind are completed together, stacked into one vector and one collective. The
  collectives per step therefore equal the depth of the reduction chain, not the number of
  leaves: ``clip_by_global_norm``, ``lamb``'s trust ratios and ``novograd`` need one each;
  ``optax.safe_norm`` (``optax.lars``, ``lamb``) two, since its second norm depends on the
  first.
* **control flow.** ``jit``/``custom_jvp``/``custom_vjp`` calls are inlined (so their
  reductions batch with the rest); ``cond``/``switch`` with a replicated index (as in
  ``optax.MultiSteps``) runs its branches on the slices; loops run only on replicated values.
* **refusals.** Everything else that touches a sharded value depends on the leaf's layout
  (a partial-axis reduction such as Adafactor's factored row and column statistics, sort,
  cumsum, top-k, gathers, slices, concatenation, argmax, transposes that reorder axes,
  broadcasts of a leaf to a larger shape, explicit or implicit, collectives over the
  sharding axes) and raises ``UnshardableTransformError`` at trace time, naming the
  primitive, the leaf and the fix, before any device work.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torus_collectives import inlining
from torus_collectives._vma import ensure_varying
from torus_collectives.axes import names as axis_names
from torus_collectives.tiling import ceil_div, pad_to

# Primitives that act elementwise: the value at a position depends only on the operands at
# that position (scalars broadcast).
ELEMENTWISE = frozenset(
  """
  abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
  convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
  floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p logistic lt max
  min mul ne neg nextafter not or polygamma pow real reduce_precision rem round rsqrt
  select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
  sub tan tanh xor population_count clz
  """.split()
)
# Identity on values; present only for sharding or vma bookkeeping.
PASS_THROUGH = frozenset({"reshard", "pvary", "pcast", "sharding_constraint"})
# Full reductions: (kind of completing collective, local reduction, identity of the padding).
REDUCTIONS: dict[str, tuple[str, Callable, Callable]] = {
  "reduce_sum": ("sum", jnp.sum, lambda dtype: jnp.zeros((), dtype)),
  "reduce_max": ("max", jnp.max, lambda dtype: _extreme(dtype, lowest=True)),
  "reduce_min": ("min", jnp.min, lambda dtype: _extreme(dtype, lowest=False)),
  "reduce_and": ("and", jnp.all, lambda dtype: jnp.ones((), dtype)),
  "reduce_or": ("or", jnp.any, lambda dtype: jnp.zeros((), dtype)),
}
# Shape changes that keep the flat order of a leaf (when they keep its size, and a
# transpose its non-unit axes' order).
RELABELLING = frozenset({"reshape", "squeeze", "broadcast_in_dim", "transpose", "expand_dims"})


class UnshardableTransformError(ValueError):
  """Raised by ``sharded_update`` when its optax transformation does something to a leaf
  that a 1/p shard of it cannot compute exactly.

  ``sharded_update`` runs the transformation's update on flat shards of each leaf; it
  makes whole-leaf reductions (norms, means, maxima) global itself, and refuses whatever
  depends on a leaf's layout: reductions over some axes of a leaf only (Adafactor's
  factored statistics, a per-row norm), sort, cumulative sums, top-k, argmax, gathers,
  slices, concatenation, transposes that reorder a leaf's axes, broadcasts of a leaf to a
  larger shape, a branch on a sharded value, loops over sharded values, and collectives
  over the sharding axes inside the transformation (such as ``lars(axis_name=...)``).

  It is raised when ``init`` or ``update`` is traced, before any device work. The message
  names the primitive, the leaf, its operand shapes and the fix: run that transformation
  unsharded (``all_reduce_gradients``, then ``tx.update`` on every replica), keep such
  leaves out of it with ``optax.masked`` or ``optax.partition``, or, for a collective,
  build the transformation without ``axis_name``. A subclass of ``ValueError``.
  """


def _extreme(dtype, *, lowest: bool) -> jax.Array:
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.array(-jnp.inf if lowest else jnp.inf, dtype)
  info = jnp.iinfo(dtype)
  return jnp.array(info.min if lowest else info.max, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sharded:
  """This device's ``[m]`` slice of a value of logical ``shape`` (flat, row-major)."""

  local: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  origin: str = dataclasses.field(default="", metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Uniform:
  """A replicated value of ``shape`` whose every element is ``scalar``."""

  scalar: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

  def materialise(self) -> jax.Array:
    return jnp.broadcast_to(self.scalar, self.shape)


Value = Any  # Sharded | Uniform | jax.Array (replicated)


@dataclasses.dataclass(frozen=True)
class Shards:
  """How values of ``n`` elements are split over the ``p`` devices of ``axes``."""

  axes: tuple[str, ...]
  p: int

  def shard_size(self, shape: Sequence[int]) -> int:
    return max(ceil_div(math.prod(shape), self.p), 1)

  def index(self) -> jax.Array:
    return lax.axis_index(self.axes)

  def valid(self, shape: Sequence[int]) -> jax.Array | None:
    """Which positions of a slice hold elements of the value (None: all of them)."""
    n, m = math.prod(shape), self.shard_size(shape)
    if n == self.p * m:
      return None
    return self.index() * m + jnp.arange(m) < n

  def cut(self, value: Value, shape: Sequence[int], origin: str = "") -> Sharded:
    """A replicated value of ``shape`` as this device's slice (exact: it is everywhere)."""
    if isinstance(value, Sharded):
      return value
    m = self.shard_size(shape)
    if isinstance(value, Uniform) or np.size(value) == 1:
      scalar = value.scalar if isinstance(value, Uniform) else jnp.reshape(value, ())
      # Typed varying, as every slice is (it is this device's part of the value).
      local = ensure_varying(jnp.broadcast_to(scalar, (m,)), self.axes)
      return Sharded(local, tuple(shape), origin)
    flat = pad_to(jnp.reshape(jnp.asarray(value), -1), self.p * m)
    return Sharded(lax.dynamic_slice_in_dim(flat, self.index() * m, m), tuple(shape), origin)


def _size(value: Value) -> int:
  return math.prod(value.shape) if isinstance(value, (Sharded, Uniform)) else np.size(value)


def replicated(value: Value) -> jax.Array:
  return value.materialise() if isinstance(value, Uniform) else value


@dataclasses.dataclass
class _Deferred:
  """A full reduction whose local part is known and whose collective is not yet issued."""

  kind: str
  partial: jax.Array  # this device's reduction, a scalar
  shape: tuple[int, ...]  # the result's shape (all ones: keepdims)


@dataclasses.dataclass
class Interpreter:
  """Evaluates jaxprs on ``Sharded``/replicated values over ``shards`` (see module doc).

  ``describe`` names the transformation in errors.
  """

  shards: Shards
  describe: str = "the inner transformation"

  def run(self, closed_jaxpr, args: Sequence[Value]) -> list[Value]:
    counter = itertools.count()
    constants: dict[int, Any] = {}
    in_keys = [next(counter) for _ in args]
    eqns, outs = inlining.inline(
      closed_jaxpr.jaxpr, closed_jaxpr.consts, in_keys, counter, constants
    )
    env: dict[Any, Value] = {**constants, **dict(zip(in_keys, args))}
    deferred: dict[int, _Deferred] = {}
    remaining = eqns
    while remaining:
      blocked = []
      for item in remaining:
        if any(
          not isinstance(a, inlining.Literal) and (a in deferred or a not in env) for a in item.ins
        ):
          blocked.append(item)
          continue
        results = self._apply(item.eqn, [self._read(env, a) for a in item.ins])
        for key, result in zip(item.outs, results):
          if isinstance(result, _Deferred):
            deferred[key] = result
          env[key] = result
      # A jaxpr lists equations in dependency order, so whatever waits, waits on a deferred
      # reduction: completing them lets the next pass go further.
      assert deferred or not blocked, "jaxpr equations out of dependency order"
      self._complete(deferred, env)
      remaining = blocked
    self._complete(deferred, env)
    return [self._read(env, a) for a in outs]

  @staticmethod
  def _read(env, atom) -> Value:
    return atom.value if isinstance(atom, inlining.Literal) else env[atom]

  def _complete(self, deferred: dict[int, _Deferred], env) -> None:
    """Issues one collective per kind and dtype for every deferred reduction."""
    groups: dict[tuple[str, Any], list[int]] = {}
    for key, item in deferred.items():
      groups.setdefault((item.kind, item.partial.dtype), []).append(key)
    for (kind, dtype), keys in groups.items():
      stacked = jnp.stack([deferred[k].partial for k in keys])
      totals = _global_reduce(kind, stacked, self.shards.axes)
      for i, key in enumerate(keys):
        env[key] = totals[i].reshape(deferred[key].shape).astype(dtype)
    deferred.clear()

  def _refuse(self, eqn, operands: Sequence[Value], why: str):
    leaf = next((v.origin for v in operands if isinstance(v, Sharded) and v.origin), "")
    where = f" to leaf {leaf}" if leaf else ""
    raise UnshardableTransformError(
      f"sharded_update cannot shard {self.describe}: its update applies "
      f"`{eqn.primitive.name}`{where} (operand shapes {[tuple(v.aval.shape) for v in eqn.invars]}),"
      f" which {why}. Fix: run this transformation unsharded (tc.all_reduce_gradients, "
      "then tx.update on every replica), or keep such leaves out of it with "
      "optax.masked / optax.partition."
    )

  def _apply(self, eqn, operands: list[Value]) -> list[Value]:
    out_shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    if eqn.primitive.name in inlining.COLLECTIVES and set(_axes_of(eqn)) & set(self.shards.axes):
      self._refuse(
        eqn,
        operands,
        f"already communicates over {self.shards.axes}: sharded_update makes whole-leaf "
        "reductions global itself, so build the transformation without axis_name",
      )
    if not any(isinstance(v, Sharded) for v in operands):
      return self._replicated(eqn, operands, out_shapes)
    return self._sharded(eqn, operands, out_shapes)

  def _sharded(self, eqn, operands: list[Value], out_shapes) -> list[Value]:
    """An equation with a sharded operand, by the rules of the module docstring."""
    name = eqn.primitive.name
    if name in PASS_THROUGH:
      (value,) = operands
      return [dataclasses.replace(value, shape=out_shapes[0])]
    if name in ELEMENTWISE:
      origin = next(v.origin for v in operands if isinstance(v, Sharded))
      return [self._elementwise(eqn, operands, out_shapes[0], origin)]
    if name in RELABELLING:
      return [self._relabel(eqn, operands, out_shapes[0])]
    if name in REDUCTIONS:
      (value,) = operands
      if _reduces_partially(value.shape, eqn.params["axes"]):
        self._refuse(eqn, operands, "reduces over part of a leaf's axes")
      return [self._defer(name, value, out_shapes[0])]
    if name == "dot_general":
      return [self._dot(eqn, operands, out_shapes[0])]
    if name == "cond":
      return self._cond(eqn, operands)
    self._refuse(eqn, operands, "depends on the whole leaf's layout, not on single elements")

  def _relabel(self, eqn, operands, out_shape) -> Sharded:
    """A shape change that keeps the flat order: the same slice, a new logical shape."""
    value = operands[0]
    if math.prod(out_shape) != math.prod(value.shape):
      self._refuse(eqn, operands, "broadcasts a leaf to a larger shape")
    transpose = eqn.primitive.name == "transpose"
    if transpose and not _keeps_order(value.shape, eqn.params["permutation"]):
      self._refuse(eqn, operands, "reorders a leaf's axes")
    return Sharded(value.local, out_shape, value.origin)

  def _replicated(self, eqn, operands, out_shapes) -> list[Value]:
    name = eqn.primitive.name
    if name == "broadcast_in_dim" and _size(operands[0]) == 1:
      return [Uniform(jnp.reshape(replicated(operands[0]), ()), out_shapes[0])]
    if name in ELEMENTWISE and all(isinstance(v, Uniform) or np.ndim(v) == 0 for v in operands):
      scalars = [v.scalar if isinstance(v, Uniform) else v for v in operands]
      scalar = inlining.bind(eqn.primitive, scalars, eqn.params)
      if any(isinstance(v, Uniform) for v in operands):
        return [Uniform(scalar, out_shapes[0])]
      return [scalar]
    params = eqn.primitive.get_bind_params(eqn.params)
    out = inlining.bind(eqn.primitive, list(map(replicated, operands)), params)
    return list(out) if eqn.primitive.multiple_results else [out]

  def _elementwise(self, eqn, operands, shape, origin) -> Sharded:
    # lax's binary operations broadcast size-one axes implicitly (`mul f32[4,5] f32[1,5]`):
    # a replicated operand is broadcast whole before it is cut; a sharded one would need
    # every element on every device.
    locals_ = []
    for v in operands:
      if isinstance(v, Sharded):
        if v.shape != tuple(shape):
          self._refuse(eqn, operands, "broadcasts a leaf to a larger shape")
        locals_.append(v.local)
      elif np.ndim(v) == 0 and not isinstance(v, Uniform):
        locals_.append(v)
      else:
        if not isinstance(v, Uniform) and np.size(v) != 1 and np.shape(v) != tuple(shape):
          v = jnp.broadcast_to(v, shape)
        locals_.append(self.shards.cut(v, shape).local)
    return Sharded(inlining.bind(eqn.primitive, locals_, eqn.params), shape, origin)

  def _defer(self, name: str, value: Sharded, out_shape) -> _Deferred:
    kind, local_reduce, identity = REDUCTIONS[name]
    local = value.local
    valid = self.shards.valid(value.shape)
    if valid is not None:
      local = jnp.where(valid, local, identity(local.dtype))
    return _Deferred(kind, local_reduce(local), out_shape)

  def _dot(self, eqn, operands, out_shape) -> _Deferred:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs_shape, rhs_shape = (tuple(v.aval.shape) for v in eqn.invars)
    full = len(lhs_contract) == len(lhs_shape) and len(rhs_contract) == len(rhs_shape)
    same = tuple(lhs_contract) == tuple(range(len(lhs_shape))) and lhs_shape == rhs_shape
    if lhs_batch or rhs_batch or not full or not same or tuple(rhs_contract) != tuple(lhs_contract):
      self._refuse(eqn, operands, "contracts only part of a leaf")
    lhs, rhs = (self.shards.cut(v, lhs_shape) for v in operands)
    valid = self.shards.valid(lhs_shape)
    left = lhs.local if valid is None else jnp.where(valid, lhs.local, 0)
    partial = lax.dot_general(
      left,
      rhs.local,
      (((0,), (0,)), ((), ())),
      preferred_element_type=eqn.params.get("preferred_element_type"),
    )
    return _Deferred("sum", partial, out_shape)

  def _cond(self, eqn, operands) -> list[Value]:
    index, *args = operands
    if isinstance(index, Sharded):
      self._refuse(eqn, operands, "branches on a sharded value")
    branches = eqn.params["branches"]
    out_shapes = [tuple(v.aval.shape) for v in eqn.outvars]

    def run_branch(branch, values):
      return Interpreter(self.shards, self.describe).run(branch, values)

    # Which results are sharded in any branch: those are sharded in all of them.
    kinds = [jax.eval_shape(functools.partial(run_branch, b), args) for b in branches]
    sharded = [any(isinstance(k[i], Sharded) for k in kinds) for i in range(len(out_shapes))]

    def unify(values):  # one structure for every branch: no origins, no lazy broadcasts
      return [
        Sharded(ensure_varying(self.shards.cut(v, s).local, self.shards.axes), s)
        if is_sharded
        else replicated(v)
        for v, s, is_sharded in zip(values, out_shapes, sharded)
      ]

    fns = [lambda values, b=b: unify(run_branch(b, values)) for b in branches]
    return lax.switch(replicated(index), fns, args)


def _axes_of(eqn) -> tuple:
  return axis_names(eqn.params.get("axes", eqn.params.get("axis_name", ())))


def _keeps_order(shape, permutation) -> bool:
  moved = [axis for axis in permutation if shape[axis] != 1]
  return moved == sorted(moved)


def _reduces_partially(shape, axes) -> bool:
  return any(size != 1 for axis, size in enumerate(shape) if axis not in tuple(axes))


def _global_reduce(kind: str, stacked: jax.Array, axes) -> jax.Array:
  if kind == "sum":
    return lax.psum(stacked, axes)
  if kind in ("max", "min"):
    return (lax.pmax if kind == "max" else lax.pmin)(stacked, axes)
  as_int = stacked.astype(jnp.int32)
  return (lax.pmin if kind == "and" else lax.pmax)(as_int, axes).astype(stacked.dtype)
