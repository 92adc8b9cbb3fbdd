"""Varying-manual-axes (vma) typing for collectives built from point-to-point steps.

Inside ``jax.shard_map(check_vma=True)`` every value carries the set of mesh axes along
which it may differ. ``lax.psum`` returns a value that is *invariant* over the summed axes;
a sum assembled from ``ppermute`` steps or a Pallas kernel is typed *varying*, even though
every device ends with bit-identical data (each chunk is reduced once, by its owner, then
copied). ``mark_invariant`` records that fact in the type; at run time it is the identity.
Under ``check_vma=False`` there are no such types and every helper here is a no-op.
"""

from __future__ import annotations

import jax
from jax._src import config as _config
from jax._src.core import Primitive  # not jax.extend: its __init__ loads Pallas
from jax.interpreters import batching, mlir

AxisNames = tuple[str, ...]


def vma_checked() -> bool:
  """Whether the enclosing shard_map checks varying-axes types (``check_vma=True``)."""
  return bool(_config._check_vma.value)


def ensure_varying(x: jax.Array, axes: AxisNames) -> jax.Array:
  """Marks ``x`` varying over ``axes`` (as lax collectives do implicitly)."""
  if not vma_checked():
    return x
  missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_like(x: jax.Array, shape, dtype=None) -> jax.ShapeDtypeStruct:
  """An output type of ``shape`` varying over the same mesh axes as ``x`` (a kernel's
  ``out_shape`` must say so under ``check_vma=True``)."""
  return jax.ShapeDtypeStruct(shape, dtype or x.dtype, manual_axis_type=jax.typeof(x).mat)


mark_invariant_p = Primitive("torus_mark_invariant")


def _abstract_eval(aval, *, axes):
  varying = frozenset(aval.mat.varying) - frozenset(axes)
  return aval.update(manual_axis_type=aval.mat.update(varying=varying))


mark_invariant_p.def_abstract_eval(_abstract_eval)
mark_invariant_p.def_impl(lambda x, *, axes: x)
mlir.register_lowering(mark_invariant_p, mlir.lower_fun(lambda x, *, axes: x, False))
batching.primitive_batchers[mark_invariant_p] = lambda args, dims, *, axes: (
  mark_invariant_p.bind(args[0], axes=axes),
  dims[0],
)


def mark_invariant(x: jax.Array, axes: AxisNames) -> jax.Array:
  """Types ``x`` (identical on every device along ``axes``) as invariant over them."""
  if not vma_checked():
    return x
  return mark_invariant_p.bind(x, axes=tuple(axes))


__all__ = ["ensure_varying", "mark_invariant", "varying_like", "vma_checked"]
