"""What each built-in implementation runs, written down here by hand, not read off its record.

The conformance bases (``test_conformance_collectives.py``, and which backends
``test_conformance_batch_norm.py`` runs) derive what they expect from each backend's
``registry.Backend`` record: a record that stopped claiming a capability would have its
refusal expected, and pass. Here every built-in backend's capabilities are a literal table
(``CAPABILITIES``), written from what its code does, and two things are checked against it:

* the record equals the table, field by field (``runs_on`` at a list of device kinds, the
  loaders by whether there is one), and no field of ``Backend`` goes unpinned;
* behaviour agrees, in a few cheap cases per capability (``CASES``): where the table
  claims a request, the implementation runs it and equals lax on small integers, exactly;
  where it does not, the call raises the documented error ("xla" claims all, and is lax
  itself; batch norm is compared with numpy's statistics). "pallas" runs one case in TPU
  interpret mode (float32 psum on a ring of two); in its other claimed cases the call must
  get past every refusal to the kernels, which off TPU and outside interpret mode say that
  they need a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import registry

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# The device kinds ``runs_on`` is pinned at (outside TPU interpret mode).
DEVICE_KINDS = (
  "cpu",
  "NVIDIA H100 80GB HBM3",
  "TPU v2",
  "TPU v3",
  "TPU v4",
  "TPU v5 lite",
  "TPU v5p",
  "TPU v6 lite",
)
EVERYWHERE = dict.fromkeys(DEVICE_KINDS, True)
TPU_V4_AND_NEWER = {
  **dict.fromkeys(DEVICE_KINDS, False),
  **dict.fromkeys(("TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite"), True),
}
SUMMED = ("float32", "bfloat16", "float16", "int32")
FLOATS = ("float32", "bfloat16", "float16")

CAPABILITIES = {
  # lax itself: every op, every dtype, every request lax takes.
  "xla": dict(
    ops={"all_reduce": None, "reduce_scatter": None, "all_gather": None, "batch_norm": None},
    lax_reference=True,
    replica_groups="any",
    max_torus_axes=None,
    gather_to=None,
    unreduced_inputs=True,
    partial_manual=True,
    runs_on=EVERYWHERE,
    runs_on_cpu_in_interpret_mode=True,
    pallas_kernels=False,
    block_scaled_transport=False,
    collectives=False,
    batch_norm=True,
  ),
  # ppermute rings: any dtype (moved as is, summed in its own type or float32), groups
  # that are aligned tiles (``tile=``), block-scaled transport (``transport=``).
  "shard_map": dict(
    ops=dict.fromkeys(COLLECTIVES),
    lax_reference=False,
    replica_groups="tiles",
    max_torus_axes=3,
    gather_to=("varying", "invarying"),
    unreduced_inputs=False,
    partial_manual=True,
    runs_on=EVERYWHERE,
    runs_on_cpu_in_interpret_mode=True,
    pallas_kernels=False,
    block_scaled_transport=True,
    collectives=True,
    batch_norm=False,
  ),
  # per-axis lax.psum_scatter / all_gather: any dtype, no ``tile=``, no ``transport=``.
  "lax_torus": dict(
    ops=dict.fromkeys(COLLECTIVES),
    lax_reference=False,
    replica_groups="none",
    max_torus_axes=3,
    gather_to=("varying", "invarying"),
    unreduced_inputs=False,
    partial_manual=True,
    runs_on=EVERYWHERE,
    runs_on_cpu_in_interpret_mode=True,
    pallas_kernels=False,
    block_scaled_transport=False,
    collectives=True,
    batch_norm=False,
  ),
  # remote DMAs addressed by full mesh coordinates: every mesh axis manual, TPU v4+ or
  # interpret mode, the four dtypes the kernels sum, int8 blocks of 128.
  "pallas": dict(
    ops={**dict.fromkeys(COLLECTIVES, SUMMED), "batch_norm": FLOATS},
    lax_reference=False,
    replica_groups="none",
    max_torus_axes=3,
    gather_to=("varying", "invarying"),
    unreduced_inputs=False,
    partial_manual=False,
    runs_on=TPU_V4_AND_NEWER,
    runs_on_cpu_in_interpret_mode=True,
    pallas_kernels=True,
    block_scaled_transport=True,
    collectives=True,
    batch_norm=True,
  ),
}
BUILT_IN = tuple(CAPABILITIES)
PINNED_FIELDS = {
  "name",
  "ops",
  "lax_reference",
  "replica_groups",
  "max_torus_axes",
  "gather_to",
  "unreduced_inputs",
  "partial_manual",
  "runs_on",
  "pallas_kernels",
  "block_scaled_transport",
  "load_collectives",
  "load_batch_norm",
}


# ---------------------------------------------------------------------- the records


def _in_interpret_mode(fn):
  from jax.experimental.pallas import tpu as pltpu

  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    return fn()


def capabilities(backend: registry.Backend) -> dict:
  """A record as plain data, in the terms of ``CAPABILITIES``."""
  return dict(
    ops={
      op: None if dtypes is None else tuple(jnp.dtype(d).name for d in dtypes)
      for op, dtypes in backend.ops.items()
    },
    lax_reference=backend.lax_reference,
    replica_groups=backend.replica_groups,
    max_torus_axes=backend.max_torus_axes,
    gather_to=backend.gather_to,
    unreduced_inputs=backend.unreduced_inputs,
    partial_manual=backend.partial_manual,
    runs_on={kind: bool(backend.runs_on(kind)) for kind in DEVICE_KINDS},
    runs_on_cpu_in_interpret_mode=bool(_in_interpret_mode(lambda: backend.runs_on("cpu"))),
    pallas_kernels=backend.pallas_kernels,
    block_scaled_transport=backend.block_scaled_transport,
    collectives=backend.load_collectives is not None,
    batch_norm=backend.load_batch_norm is not None,
  )


def test_built_in_implementations():
  assert registry.IMPLEMENTATIONS == ("auto", *BUILT_IN)
  assert tuple(registry.BACKENDS)[: len(BUILT_IN)] == BUILT_IN


def test_every_field_of_a_record_is_pinned():
  """A new capability field must be added to ``CAPABILITIES`` (and to ``capabilities``)."""
  assert {f.name for f in dataclasses.fields(registry.Backend)} == PINNED_FIELDS


@pytest.mark.parametrize("impl", BUILT_IN)
def test_record_equals_the_literal(impl):
  backend = registry.BACKENDS[impl]
  assert backend.name == impl
  assert capabilities(backend) == CAPABILITIES[impl]


# ---------------------------------------------------------------------- behaviour


def _ops(impl):
  """The ops with ``implementation=impl``; lax's own for None."""
  if impl is None:
    return lax
  names = ("psum", "pmean", "psum_scatter", "all_gather")
  return types.SimpleNamespace(
    **{name: functools.partial(getattr(tc, name), implementation=impl) for name in names}
  )


def _claims_dtype(op, dtype):
  def claims(caps):
    dtypes = caps["ops"].get(op, ())
    return dtypes is None or jnp.dtype(dtype).name in dtypes

  return claims


def _per_device(fn, shape, *, x=None, check_vma=True):
  """``fn`` on the device-local row of small integers, one row per device of a mesh of
  ``shape`` (all of its axes manual)."""
  mesh = harness.mesh(shape)
  if x is None:
    x = jnp.asarray(harness.small_integers((mesh.size, 8), np.float32))
  return harness.per_device(fn, mesh, x, check_vma=check_vma)


def _rows(dtype, n=2, width=8):
  return jnp.asarray(harness.small_integers((n, width), np.int32).astype(dtype))


def dtype_case(op, dtype):
  family = {"psum": "all_reduce", "psum_scatter": "reduce_scatter", "all_gather": "all_gather"}
  call = {
    "psum": lambda ops, v: ops.psum(v, "x"),
    "psum_scatter": lambda ops, v: ops.psum_scatter(v, "x", tiled=True),
    "all_gather": lambda ops, v: ops.all_gather(v, "x", tiled=True),
  }[op]
  name = jnp.dtype(dtype).name
  fam = family[op]
  return (
    lambda impl: _per_device(lambda v: call(_ops(impl), v), (2,), x=_rows(dtype)),
    _claims_dtype(fam, dtype),
    (ValueError, rf"dtype {name} is not supported by {fam} implementation="),
  )


def _groups(groups):
  return lambda impl: _per_device(
    lambda v: _ops(impl).psum(v, "x", axis_index_groups=groups), (4,), check_vma=False
  )


def _gather_to_reduced(impl):
  def body(v):
    return lax.pcast(_ops(impl).all_gather(v, "x", to="reduced"), "x", to="varying")

  return _per_device(body, (2,))


def _unreduced(impl):
  mesh = harness.mesh((2,))
  x = jnp.asarray(harness.small_integers((2, 8), np.float32))
  body = lambda v: _ops(impl).psum(lax.pcast(v, "x", to="unreduced"), "x")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))(x)


def _partial_manual(impl):
  """A 2x2 mesh, manual over "y" only; "x" stays automatic."""
  mesh = harness.mesh((2, 2))
  x = jnp.asarray(harness.small_integers((4, 8), np.float32))
  body = lambda v: _ops(impl).psum(v, "y")
  f = jax.shard_map(body, mesh=mesh, in_specs=P("y"), out_specs=P(), axis_names={"y"})
  return jax.jit(f)(x)


def _over_axes(shape, names):
  mesh = harness.mesh(shape, names)
  return lambda impl: harness.per_device(
    lambda v: _ops(impl).psum(v, names),
    mesh,
    jnp.asarray(harness.small_integers((mesh.size, 8), np.float32)),
  )


# Every element of a block is -127, 0 or 127, and every device holds the same row: each
# block-scaled quantization on a ring of two is then exact (scales 1 and 2), so the int8
# transport must give lax's sum bit for bit.
_EXACT_INT8 = np.random.default_rng(0).choice([-127.0, 0.0, 127.0], size=512).astype(np.float32)


def _block_scaled(impl):
  kwargs = {} if impl is None else dict(implementation=impl, transport_dtype=jnp.int8)
  psum = lax.psum if impl is None else tc.psum
  x = jnp.asarray(np.stack([_EXACT_INT8, _EXACT_INT8]))
  return _per_device(lambda v: psum(v, "x", **kwargs), (2,), x=x)


_BN_X = harness.small_integers((4, 3, 8), np.float32)


def _batch_norm(dtype):
  def build(impl):
    if impl is None:  # the reference: per-channel statistics over every other axis
      mean = _BN_X.mean(axis=(0, 1))
      var = _BN_X.var(axis=(0, 1))
      return (_BN_X - mean) / np.sqrt(var + 1e-5), mean, var
    scale, bias = jnp.ones(8), jnp.zeros(8)
    fn = lambda x: tc.batch_norm(x, scale, bias, implementation=impl)
    return jax.jit(fn)(jnp.asarray(_BN_X, dtype))

  return build


def _claims(field, value=True):
  return lambda caps: caps[field] == value


def _claims_groups(kind):
  return lambda caps: caps["replica_groups"] == "any" or caps["replica_groups"] == kind


def _claims_to(to):
  return lambda caps: caps["gather_to"] is None or to in caps["gather_to"]


def _claims_axes(n):
  return lambda caps: caps["max_torus_axes"] is None or n <= caps["max_torus_axes"]


_NO_BATCH_NORM = (ValueError, r"batch_norm has no implementation=")
_PARTIAL_MANUAL_REFUSAL = (ValueError, r"needs every mesh axis manual")

# name -> (build(impl or None for the reference), claimed(capabilities), the refusal
# (exception type, message pattern), or a function of the capabilities giving it)
CASES = {
  "float32_psum": dtype_case("psum", np.float32),
  "bfloat16_psum": dtype_case("psum", jnp.bfloat16),
  "int32_psum_scatter": dtype_case("psum_scatter", np.int32),
  "int8_psum": dtype_case("psum", np.int8),
  "uint32_psum_scatter": dtype_case("psum_scatter", np.uint32),
  "complex64_psum": dtype_case("psum", np.complex64),
  "bool_all_gather": dtype_case("all_gather", np.bool_),
  "groups_that_tile": (
    _groups([[0, 1], [2, 3]]),
    _claims_groups("tiles"),
    (ValueError, r"axis_index_groups not at all.*aligned tiles"),
  ),
  "groups_that_do_not_tile": (
    _groups([[0, 2], [1, 3]]),
    _claims_groups("other"),
    lambda caps: (
      ValueError,
      r"axis_index_groups only when they are aligned tiles"
      if caps["replica_groups"] == "tiles"
      else r"axis_index_groups not at all.*aligned tiles",
    ),
  ),
  "gather_to_invarying": (
    lambda impl: _per_device(lambda v: _ops(impl).all_gather(v, "x", to="invarying"), (2,)),
    _claims_to("invarying"),
    (ValueError, r"does not gather to='invarying'"),
  ),
  "gather_to_reduced": (
    _gather_to_reduced,
    _claims_to("reduced"),
    (ValueError, r"does not gather to='reduced'"),
  ),
  "unreduced_input": (
    _unreduced,
    _claims("unreduced_inputs"),
    (ValueError, r"does not take unreduced or reduced inputs"),
  ),
  "partially_manual_mesh": (_partial_manual, _claims("partial_manual"), _PARTIAL_MANUAL_REFUSAL),
  "three_mesh_axes": (
    _over_axes((2, 2, 2), ("x", "y", "z")),
    _claims_axes(3),
    (NotImplementedError, r"at most \d mesh axes, got 3"),
  ),
  "four_mesh_axes": (
    _over_axes((2, 2, 2, 1), ("a", "b", "c", "d")),
    _claims_axes(4),
    (NotImplementedError, r"at most 3 mesh axes, got 4"),
  ),
  "int8_block_scaled_transport": (
    _block_scaled,
    _claims("block_scaled_transport"),
    (ValueError, r"has no block-scaled \(int8/fp8\) transport"),
  ),
  "float32_batch_norm": (
    _batch_norm(jnp.float32),
    lambda caps: "batch_norm" in caps["ops"] and _claims_dtype("batch_norm", jnp.float32)(caps),
    _NO_BATCH_NORM,
  ),
  "float8_batch_norm": (
    _batch_norm(jnp.float8_e4m3fn),
    lambda caps: "batch_norm" in caps["ops"] and _claims_dtype("batch_norm", "float8_e4m3fn")(caps),
    lambda caps: (
      (ValueError, r"dtype float8_e4m3fn is not supported by batch_norm implementation=")
      if "batch_norm" in caps["ops"]
      else _NO_BATCH_NORM
    ),
  ),
}
# The one case of "pallas" that runs its kernels, in TPU interpret mode (seconds).
INTERPRETED = {("pallas", "float32_psum")}
# Off TPU, outside interpret mode, a call that got past every refusal meets the kernels.
NEEDS_A_TPU = r"needs a TPU|Only interpret mode is supported on CPU"
# The reference of a case that compares with something other than lax at the same call.
TOLERANCES = {"float32_batch_norm": 1e-6}


def _params():
  for impl in BUILT_IN:
    for name, (_, claimed, _) in CASES.items():
      if name == "float8_batch_norm" and CAPABILITIES[impl]["ops"].get("batch_norm", ()) is None:
        continue  # lax's passes take any floating dtype: nothing of the record to check
      yield pytest.param(impl, name, claimed(CAPABILITIES[impl]), id=f"{impl}-{name}")


def _assert_same(ours, ref, rtol=None):
  assert jax.tree.structure(ours) == jax.tree.structure(ref)
  for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    o, r = np.asarray(o), np.asarray(r)
    assert o.shape == r.shape, (o.shape, r.shape)
    if rtol is None:
      assert o.dtype == r.dtype, (o.dtype, r.dtype)
      np.testing.assert_array_equal(o, r)
    else:
      np.testing.assert_allclose(o, r, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("impl,case,claimed", list(_params()))
def test_behaviour_agrees_with_the_literal(impl, case, claimed):
  build, _, refusal = CASES[case]
  if not claimed:
    error, pattern = refusal(CAPABILITIES[impl]) if callable(refusal) else refusal
    with pytest.raises(error, match=pattern):
      jax.block_until_ready(build(impl))
    return
  if CAPABILITIES[impl]["pallas_kernels"] and (impl, case) not in INTERPRETED:
    with pytest.raises(ValueError, match=NEEDS_A_TPU):
      jax.block_until_ready(build(impl))
    return
  if (impl, case) in INTERPRETED:
    with harness.interpret_mode("on_wait"):
      ours = jax.block_until_ready(build(impl))
  else:
    ours = jax.block_until_ready(build(impl))
  _assert_same(ours, build(None), TOLERANCES.get(case))


def test_every_capability_has_a_claimed_and_a_refused_case():
  """Each capability the table varies over is exercised both ways by some backend."""
  outcomes: dict[str, set[bool]] = {}
  for param in _params():
    impl, case, claimed = param.values
    outcomes.setdefault(case, set()).add(claimed)
  both = {case for case, seen in outcomes.items() if seen == {True, False}}
  assert {
    "int8_psum",
    "groups_that_tile",
    "groups_that_do_not_tile",
    "gather_to_reduced",
    "unreduced_input",
    "partially_manual_mesh",
    "four_mesh_axes",
    "int8_block_scaled_transport",
    "float32_batch_norm",
  } <= both
