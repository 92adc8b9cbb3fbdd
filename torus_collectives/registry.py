"""The one registry of implementations: which exist, what each supports, what "auto" picks.

Four ops have implementations: the three collectives (``all_reduce``, ``reduce_scatter``,
``all_gather``) and ``batch_norm``; the gradient summation of a pytree
(``all_reduce_gradients``) is tuned as a fifth op and runs the all-reduce it picks.

* ``"xla"``: ``jax.lax`` for the collectives, the jnp passes of ``batch_norm_passes`` (fused
  by XLA) for batch norm. The reference; runs everywhere, on whatever lax accepts.
* ``"shard_map"``: the torus schedule executed with ``lax.ppermute`` (collectives only).
* ``"lax_torus"``: the torus schedule's phases as per-axis ``lax.psum_scatter`` /
  ``lax.all_gather`` (collectives only; ``lax_torus_backend``).
* ``"pallas"``: the remote-DMA torus kernels and the fused batch-norm kernels of
  ``torus_collectives.kernels``; TPU v4 and newer, or TPU interpret mode on any host.
* ``"auto"``: one rule for every op, ``auto_implementation``: what the tuner measured
  (``tuning``), XLA where nothing was measured, and XLA without measuring below the size at
  which the cost model's latency term dominates. An op or dtype the measured choice does not
  support falls back to XLA. Batch norm is XLA whatever was measured: timed alone its
  Pallas kernels beat XLA's fusions, but inside a network XLA fuses batch norm into the
  neighbouring convolutions, which an opaque kernel cannot join (see ``auto_implementation``).

Backends are imported lazily, so ``import torus_collectives`` never imports Pallas.
A collective backend provides three functions on 1-D per-device buffers, called inside the
caller's ``shard_map`` with ``axes`` bound and ``torus`` their sizes (same order):

* ``reduce_scatter(x, axes, torus)``: ``(p*m,) -> (m,)``, the own chunk of the sum, chunks
  row-major over ``axes`` (``lax.psum_scatter(x, axes, tiled=True)``);
* ``all_gather(x, axes, torus)``: ``(m,) -> (p*m,)`` (``lax.all_gather(x, axes, tiled=True)``);
* ``all_reduce(x, axes, torus)``: ``(n,) -> (n,)`` (``lax.psum(x, axes)``).

A backend that runs replica groups (``axis_index_groups`` that tile the torus) takes
``tile=`` (the group's extent per axis) as well. ``unsupported`` says which requests each
torus implementation cannot run; "auto" sends those to XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from torus_collectives import platform, tuning
from torus_collectives.batch_norm_passes import REFERENCE, Passes
from torus_collectives.configs import KernelConfig

Implementation = Literal["auto", "xla", "shard_map", "lax_torus", "pallas"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)
Op = Literal["all_reduce", "reduce_scatter", "all_gather", "batch_norm"]
OPS: tuple[str, ...] = typing.get_args(Op)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")

_SUMMED = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32))
_FLOATS = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

# The dtypes each implementation supports, per op it implements; None: whatever lax takes.
SUPPORTED_DTYPES: dict[str, dict[str, tuple[jnp.dtype, ...] | None]] = {
  "xla": dict.fromkeys(OPS),
  "shard_map": dict.fromkeys(COLLECTIVES),
  "lax_torus": dict.fromkeys(COLLECTIVES),
  "pallas": {**dict.fromkeys(COLLECTIVES, _SUMMED), "batch_norm": _FLOATS},
}

# The torus implementations run on tori of at most this many named mesh axes (TPU v4 and
# v5p are 3-D tori).
MAX_TORUS_AXES = 3


def supports(implementation: str, op: Op, dtype) -> bool:
  """Whether ``implementation`` (not "auto") runs ``op`` on ``dtype``."""
  table = SUPPORTED_DTYPES[implementation]
  return op in table and (table[op] is None or jnp.dtype(dtype) in table[op])


# The ops "auto" decides for; gradient summation runs on all-reduce's implementations.
TUNED_OPS = OPS + ("all_reduce_gradients",)


def _runs_as(op: str) -> Op:
  return "all_reduce" if op == "all_reduce_gradients" else op


def candidates(op: str, dtype, device_kind: str | None = None) -> tuple[str, ...]:
  """The concrete implementations of ``op`` that run on ``dtype`` here, "xla" first.

  Pallas runs on TPU v4 and newer (``device_kind``, default: the traced-for device) or in
  TPU interpret mode.
  """
  if device_kind is None:
    device_kind = platform.target_device().device_kind
  pallas = platform.pallas_compiles_for(device_kind) or platform.interpret_mode_active()
  return tuple(
    name
    for name in IMPLEMENTATIONS
    if name != "auto" and (name != "pallas" or pallas) and supports(name, _runs_as(op), dtype)
  )


def auto_implementation(
  op: str = "all_reduce",
  dtype=jnp.float32,
  *,
  nbytes: int | None = None,
  torus: tuple[int, ...] = (),
) -> str:
  """The implementation "auto" picks for ``op`` on ``nbytes`` of ``dtype`` over a torus of
  axis sizes ``torus`` (batch norm: the group's tile), on the traced-for device.

  XLA unless the tuner measured something faster for this (device kind, topology, op,
  dtype, size): see ``tuning``. Without ``nbytes`` nothing can be looked up: XLA. Batch
  norm: always XLA.
  """
  if op not in TUNED_OPS:
    raise ValueError(f"unknown {op=}: one of {TUNED_OPS}")
  device_kind = platform.target_device().device_kind
  if nbytes is None or len(torus) > MAX_TORUS_AXES or len(candidates(op, dtype, device_kind)) < 2:
    return "xla"
  if op == "batch_norm":
    # The tuner times batch norm alone, where the kernels win (0.34-0.73x XLA's
    # compiled bytes at ResNet-50's shapes). In a ResNet-50 step compiled for v5e:4x4
    # they lose: Pallas at every batch norm moved 1.26x XLA's bytes (``python -m
    # bench.step_report``), and 1.08x at just those they read at their floor (NHWC, batch
    # a multiple of 8, C a multiple of 128), the "auto-measured" row under an earlier rule
    # that ran them there. So "auto" never picks them; ``implementation="pallas"`` does.
    return "xla"
  if nbytes < tuning.latency_floor_bytes(tuple(torus), device_kind):
    return "xla"
  choice = tuning.lookup(device_kind, torus, op, dtype, nbytes)
  if choice is None:
    tuning.log_unmeasured(device_kind, tuple(torus))
    return "xla"
  return choice if choice in candidates(op, dtype, device_kind) else "xla"


def check_name(implementation: str) -> None:
  """Raises ValueError unless ``implementation`` is one of ``IMPLEMENTATIONS``."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown {implementation=}: implementation must be one of {IMPLEMENTATIONS}")


def resolve(
  op: Op,
  implementation: str,
  dtype,
  *,
  nbytes: int | None = None,
  torus: tuple[int, ...] = (),
) -> str:
  """The concrete implementation to run; raises ValueError on a name or dtype it lacks.

  ``nbytes`` and ``torus`` are what "auto" looks up (``auto_implementation``).
  """
  check_name(implementation)
  if implementation == "auto":
    return auto_implementation(op, dtype, nbytes=nbytes, torus=torus)
  if op not in SUPPORTED_DTYPES[implementation]:
    offered = [i for i in IMPLEMENTATIONS if i == "auto" or op in SUPPORTED_DTYPES[i]]
    raise ValueError(f'{op} has no implementation="{implementation}"; choose one of {offered}')
  if not supports(implementation, op, dtype):
    supported = ", ".join(d.name for d in SUPPORTED_DTYPES[implementation][op])
    raise ValueError(
      f'dtype {jnp.dtype(dtype).name} is not supported by {op} implementation="{implementation}" '
      f'(supported: {supported}); cast the input, or use implementation="auto" or "xla"'
    )
  return implementation


@dataclasses.dataclass(frozen=True)
class CollectiveRequest:
  """The facts of one collective call that decide whether a torus implementation runs it.

  Attributes:
    op: one of ``COLLECTIVES``.
    dtypes: the dtypes of the leaves.
    mesh_axes: how many of the named axes are mesh axes (the rest are vmap axes).
    unbound: named axes bound by nothing (lax raises NameError for them, except
      ``lax.psum`` inside ``shard_map(check_vma=True)``, which fails an AssertionError; the
      torus implementations raise NameError either way).
    positional: an int (positional) axis is named.
    groups: None, "tile" (``axis_index_groups`` that are aligned tiles of the torus, in
      row-major order) or "other".
    to: the all-gather's ``to=``.
    unreduced: a leaf is typed unreduced or reduced over the named axes.
    partial_manual: the enclosing shard_map leaves some mesh axes automatic.
    nbytes: the full (unscattered) buffer's bytes, which "auto" looks up with ``torus``.
    torus: the sizes of the named mesh axes.
  """

  op: str
  dtypes: tuple
  mesh_axes: int
  unbound: tuple = ()
  positional: bool = False
  groups: str | None = None
  to: str = "varying"
  unreduced: bool = False
  partial_manual: bool = False
  nbytes: int | None = None
  torus: tuple[int, ...] = ()


def unsupported(implementation: str, request: CollectiveRequest) -> Exception | None:
  """Why the torus ``implementation`` cannot run ``request`` (the error to raise), or None."""
  if request.unbound:
    return NameError(f"unbound axis name: {request.unbound[0]}")
  hint = 'use implementation="auto" (it runs lax here) or "xla"'
  for dtype in request.dtypes:
    if not supports(implementation, request.op, dtype):
      supported = ", ".join(d.name for d in SUPPORTED_DTYPES[implementation][request.op])
      return ValueError(
        f"dtype {jnp.dtype(dtype).name} is not supported by {request.op} "
        f'implementation="{implementation}" (supported: {supported}); cast the input, or {hint}'
      )
  if request.positional:
    return ValueError(f'positional (int) axis names are not collectives over devices; {hint}')
  if request.mesh_axes > MAX_TORUS_AXES:
    return NotImplementedError(
      f'implementation="{implementation}" runs on tori of at most {MAX_TORUS_AXES} mesh axes, '
      f"got {request.mesh_axes}; {hint}"
    )
  if request.groups == "other" or (request.groups and implementation != "shard_map"):
    return ValueError(
      f'implementation="{implementation}" runs axis_index_groups only when they are aligned '
      "tiles of the torus, listed row-major"
      + (' (and only with "shard_map")' if implementation != "shard_map" else "")
      + f"; {hint}"
    )
  if request.to not in ("varying", "invarying"):
    return ValueError(
      f'implementation="{implementation}" does not gather to={request.to!r}; {hint}'
    )
  if request.unreduced:
    return ValueError(
      f'implementation="{implementation}" does not take unreduced or reduced inputs; {hint}'
    )
  if request.partial_manual and implementation == "pallas":
    return ValueError(
      'implementation="pallas" needs every mesh axis manual in the enclosing shard_map; '
      'use implementation="shard_map" or "auto"'
    )
  return None


def resolve_collective(implementation: str, request: CollectiveRequest) -> str:
  """The concrete implementation for a collective call: "auto" falls back to "xla" for
  whatever its choice does not support; an explicit torus choice raises instead."""
  check_name(implementation)
  if implementation == "xla":
    return "xla"
  if implementation == "auto":
    dtype = request.dtypes[0] if request.dtypes else jnp.float32
    choice = auto_implementation(request.op, dtype, nbytes=request.nbytes, torus=request.torus)
    return "xla" if choice == "xla" or unsupported(choice, request) else choice
  error = unsupported(implementation, request)
  if error is not None:
    raise error
  return implementation


@dataclasses.dataclass(frozen=True)
class CollectiveBackend:
  reduce_scatter: Callable[..., jax.Array]
  all_gather: Callable[..., jax.Array]
  all_reduce: Callable[..., jax.Array]


def collective_backend(name: str, config: KernelConfig | None = None) -> CollectiveBackend:
  """The functions behind a concrete, non-"xla" collective implementation.

  ``config`` tunes the Pallas kernels; the other implementations have nothing to tune.
  """
  if name == "shard_map":
    from torus_collectives import shard_map_backend as impl

    return CollectiveBackend(impl.reduce_scatter, impl.all_gather, impl.all_reduce)
  if name == "lax_torus":
    from torus_collectives import lax_torus_backend as impl

    return CollectiveBackend(impl.reduce_scatter, impl.all_gather, impl.all_reduce)
  if name == "pallas":
    from torus_collectives.kernels import pallas_backend as impl

    def with_config(fn):
      return functools.partial(fn, config=config)

    return CollectiveBackend(
      with_config(impl.reduce_scatter), with_config(impl.all_gather), with_config(impl.all_reduce)
    )
  raise ValueError(f"no collective backend named {name!r}")


def batch_norm_passes(name: str) -> Passes:
  """The per-replica batch-norm passes of a concrete implementation."""
  if name == "pallas":
    from torus_collectives.kernels import batch_norm as impl

    return impl.PALLAS
  return REFERENCE
