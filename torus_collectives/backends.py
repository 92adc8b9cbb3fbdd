"""Which implementation runs a collective.

* ``"xla"``: ``jax.lax`` itself, the reference.
* ``"shard_map"``: the torus schedule executed with ``lax.ppermute`` (runs anywhere).
* ``"pallas"``: remote-DMA Pallas TPU kernels that execute the same schedule.
* ``"auto"``: XLA off TPU, where it was measured fastest; the Pallas kernels on TPU v4 and
  newer and the shard_map schedule on v2/v3 (these TPU choices are not yet measured).

On CPU the benchmarks in ``bench/`` show XLA's in-process collectives ahead of any ppermute
schedule (a ring step is a rendezvous of all device threads), so "auto" is "xla" there. On
GPU nothing here was measured, so "auto" stays with XLA (NCCL). See the README for the
figures.

A non-XLA backend provides three functions on 1-D per-device buffers, called inside the
caller's ``shard_map`` with ``axes`` bound and ``torus`` their sizes (same order):

* ``reduce_scatter(x, axes, torus)``: ``(p*m,) -> (m,)``, the own chunk of the sum, chunks
  row-major over ``axes`` (``lax.psum_scatter(x, axes, tiled=True)``);
* ``all_gather(x, axes, torus)``: ``(m,) -> (p*m,)`` (``lax.all_gather(x, axes, tiled=True)``);
* ``all_reduce(x, axes, torus)``: ``(n,) -> (n,)`` (``lax.psum(x, axes)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "shard_map", "pallas")

# Dtypes the schedule-based backends sum exactly as lax does (floats in float32 or wider).
SUPPORTED_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32))


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  reduce_scatter: Callable[..., jax.Array]
  all_gather: Callable[..., jax.Array]
  all_reduce: Callable[..., jax.Array]


def _shard_map_backend() -> Backend:
  from torus_collectives import shard_map_backend as impl

  return Backend("shard_map", impl.reduce_scatter, impl.all_gather, impl.all_reduce)


def _pallas_backend() -> Backend:
  from kernels import torus_collectives as impl

  return Backend("pallas", impl.reduce_scatter, impl.all_gather, impl.all_reduce)


_BACKENDS: dict[str, Callable[[], Backend]] = {
  "shard_map": _shard_map_backend,
  "pallas": _pallas_backend,
}


def get(name: str) -> Backend:
  """The backend behind a concrete (non-"xla", non-"auto") implementation name."""
  return _BACKENDS[name]()


def auto_implementation() -> str:
  """The implementation "auto" resolves to on the platform being traced for.

  TPU v4 and newer: the Pallas kernels. TPU v2/v3: the shard_map schedule (libtpu cannot
  compile Pallas remote DMAs there; not benchmarked against XLA). Elsewhere: XLA.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device or jax.devices()[0]
  if device.platform != "tpu":
    return "xla"
  from kernels import torus_collectives as pallas_impl

  return "pallas" if pallas_impl.supports_device_kind(device.device_kind) else "shard_map"


def resolve(implementation: str) -> str:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown {implementation=}; choose one of {IMPLEMENTATIONS}")
  return auto_implementation() if implementation == "auto" else implementation
