"""A traced program's equations with its calls inlined, for interpreters of the package.

``inline`` flattens a jaxpr: every call in ``CALLS`` (jit, custom_jvp/custom_vjp calls,
checkpoint) is replaced by its body's equations, and every variable is renamed to a fresh
integer key (constants get keys of their own; literals stay ``Literal``). The weight-update
interpreter runs these equations on shards (``weight_update.sharded_eval``), and the
overlap interpreter re-runs them with gradient summation threaded in between
(``overlap``). ``bind`` binds one equation's primitive the way jnp would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from torus_collectives import _jax_internals as jax_internals
from torus_collectives._vma import ensure_varying, vma_checked

# Calls whose body is inlined: the weight-update interpreter batches their reductions with
# the caller's, the overlap interpreter places collective calls between their equations.
CALLS = frozenset(
  {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "checkpoint"}
)
CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# jax.lax's communicating primitives.
COLLECTIVES = frozenset(
  "psum pmax pmin ppermute all_gather all_to_all psum_scatter reduce_scatter axis_index pbroadcast"
  " psum_invariant".split()
)


@dataclasses.dataclass(frozen=True)
class Eqn:
  """An equation of the inlined jaxpr: keys of its operands and results."""

  eqn: Any  # the original JaxprEqn
  ins: tuple[Any, ...]  # int keys, or Literal
  outs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Literal:
  value: Any


def inline(jaxpr, consts, in_atoms, counter, constants) -> tuple[list[Eqn], list[Any]]:
  """``jaxpr``'s equations with calls inlined and every variable renamed to a fresh key."""
  env: dict[Any, Any] = {}

  def read(atom):
    return Literal(atom.val) if isinstance(atom, jax_internals.Literal) else env[atom]

  for var, value in zip(jaxpr.constvars, consts):
    key = next(counter)
    constants[key] = value
    env[var] = key
  for var, atom in zip(jaxpr.invars, in_atoms):
    env[var] = atom
  eqns: list[Eqn] = []
  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    inner = call_body(eqn)
    if inner is not None:
      body, body_consts = inner
      inner_eqns, inner_outs = inline(body, body_consts, ins, counter, constants)
      eqns += inner_eqns
      for var, atom in zip(eqn.outvars, inner_outs):
        env[var] = atom
      continue
    outs = tuple(next(counter) for _ in eqn.outvars)
    for var, key in zip(eqn.outvars, outs):
      env[var] = key
    eqns.append(Eqn(eqn, tuple(ins), outs))
  return eqns, [read(a) for a in jaxpr.outvars]


def call_body(eqn):
  """(jaxpr, consts) of a call to inline, or None."""
  if eqn.primitive.name not in CALLS:
    return None
  for name in CALL_JAXPR_PARAMS:
    body = eqn.params.get(name)
    if body is None:
      continue
    if isinstance(body, jax_internals.Jaxpr):  # closed: jax 0.12 has one class for both
      return body.jaxpr, body.consts
    return body, ()
  return None


def bind(primitive, operands, params):
  """``primitive.bind`` with the operands' varying axes made equal, as jnp's functions do
  implicitly (a bare ``bind`` inside ``shard_map(check_vma=True)`` requires it)."""
  if vma_checked():
    operands = [jnp.asarray(v) for v in operands]  # literals too
    axes = tuple(sorted(set().union(*(jax.typeof(v).mat.varying for v in operands))))
    operands = [ensure_varying(v, axes) for v in operands]
  return primitive.bind(*operands, **params)
