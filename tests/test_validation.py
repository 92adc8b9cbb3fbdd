"""Every validation and refusal of the core, from both sides.

For each ``raise`` in ``collectives``, ``gradients``, ``registry``, ``packing``,
``schedule``, ``primitives``, ``quantization``, ``groups``, ``backends`` and
``weight_update`` (but the interpreter, and the refusals read off the backends' capability
records, which ``test_conformance_collectives`` derives from the records), a test here
sends the bad input and checks the error's type and message, and sends the nearest good
input and checks that it is accepted (and, where that is cheap, that it equals lax). A
check that is inverted then rejects the good input, and one that is dropped or loosened
accepts the bad one; either fails here.

Covered elsewhere, so not repeated (the good side of each is the ordinary call that every
other test makes):

* an unbound or repeated axis name, an untiled or tiled size that does not fit, a
  ``scatter_dimension`` or ``axis`` that is out of range or not an int, an unknown
  implementation, gradients that are not floating point, a bad ``bucket_bytes`` for
  ``all_reduce_gradients``, a ``group_size`` that is not an int: ``test_bad_input``;
* every refusal read off a backend's record (dtypes, torus rank, replica groups, ``to=``,
  unreduced inputs, partially manual meshes): ``test_conformance_collectives``;
* a transport dtype that would truncate gradients: ``test_gradient_summation``;
* transport on "xla" and "lax_torus", formats the Pallas kernels do not run, a mapping
  naming another axis, ``residual=`` without transport, differentiating a quantized
  collective, ``error_feedback`` without transport: ``test_block_scaled_transport``;
* an unknown schedule variant, a bad ring rank or buffer shape: ``test_schedule``;
* ``sharded_update`` on integer parameters or an unbound axis: ``test_sharded_update``.

The sections headed "found by mutation testing" pin behaviours that mutants showed no test
held (``tests/README.md``: how it was run, what it found); the last section holds the two
validations it found accepting what their siblings refuse, now fixed.

Validation fires at trace time, so most bad inputs are only traced (``jax.eval_shape``);
the good inputs whose values matter run once each, several cases to a program.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax._src import config as jax_config
from jax.sharding import PartitionSpec as P

import torus_collectives as tc
from torus_collectives import axes, packing, quantization, registry
from torus_collectives import groups as groups_lib
from torus_collectives import schedule as S
from torus_collectives.backends import shard_map as shard_map_backend
from torus_collectives.norm.passes import REFERENCE
from torus_collectives.weight_update.sharded_update import ErrorFeedbackState
from torus_collectives.weight_update.trust_ratio import scale_by_trust_ratio

AXES = ("x", "y")
TORUS = "shard_map"  # the portable torus implementation, which runs on CPU
INT8 = tc.BlockScaled("int8")


@functools.cache
def _mesh():
  return harness.mesh((2, 4))


def _trace(fn, *inputs, check_vma=True):
  """The shapes ``fn`` returns on each device's slice of ``inputs``: traced, not run."""
  return jax.eval_shape(harness.sharded(fn, _mesh(), check_vma), *inputs)


def _run(fn, *inputs, check_vma=True):
  return jax.tree.map(np.asarray, harness.per_device(fn, _mesh(), *inputs, check_vma=check_vma))


def _floats(*shape, seed=0):
  """float32 small integers, one slice per device: every sum of them, in any order, and
  its eighth are exact, so each torus implementation equals lax bitwise on them."""
  return harness.small_integers((8, *shape), np.float32, seed=seed)


def _error(fn):
  """The exception ``fn()`` raises."""
  with pytest.raises(Exception) as info:
    fn()
  return info.value


def _equal_trees(ours, ref):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------- collectives: config=

OPS = {
  "psum": lambda v, **kw: tc.psum(v, AXES, **kw),
  "pmean": lambda v, **kw: tc.pmean(v, AXES, **kw),
  "psum_scatter": lambda v, **kw: tc.psum_scatter(v, AXES, tiled=True, **kw),
  "all_gather": lambda v, **kw: tc.all_gather(v, AXES, tiled=True, **kw),
}
LAX_OPS = {
  "psum": lambda v: lax.psum(v, AXES),
  "pmean": lambda v: lax.pmean(v, AXES),
  "psum_scatter": lambda v: lax.psum_scatter(v, AXES, tiled=True),
  "all_gather": lambda v: lax.all_gather(v, AXES, tiled=True),
}


@pytest.mark.parametrize("implementation", ["auto", "xla", TORUS])
@pytest.mark.parametrize("config", ["fast", {"block_rows": 16}], ids=["str", "dict"])
@pytest.mark.parametrize("op", OPS)
def test_config_must_be_a_kernel_config(op, config, implementation):
  """Checked for every implementation, before anything is resolved: a config that only
  the Pallas kernels read is still refused where it would be ignored."""
  with pytest.raises(ValueError, match=r"config must be a tc\.KernelConfig or None, got config="):
    _trace(lambda v: OPS[op](v, implementation=implementation, config=config), _floats(16))


def test_a_kernel_config_or_none_is_accepted_and_equals_lax():
  x = _floats(16)
  configs = (None, tc.KernelConfig())
  ours = _run(
    lambda v: [
      OPS[op](v, implementation=impl, config=c)
      for op in OPS
      for impl in ("auto", TORUS)
      for c in configs
    ],
    x,
  )
  ref = _run(lambda v: [LAX_OPS[op](v) for op in OPS for _ in range(2 * len(configs))], x)
  _equal_trees(ours, ref)


# ----------------------------------------------------- collectives: variant->invariant inputs

INVARIANT_CALLS = {
  "psum": (lambda v, impl: tc.psum(v, "y", implementation=impl), lambda v: lax.psum(v, "y")),
  "psum_scatter": (
    lambda v, impl: tc.psum_scatter(v, "y", tiled=True, implementation=impl),
    lambda v: lax.psum_scatter(v, "y", tiled=True),
  ),
  "all_gather": (
    lambda v, impl: tc.all_gather(v, "y", tiled=True, implementation=impl),
    lambda v: lax.all_gather(v, "y", tiled=True),
  ),
}


def _on_replicated(fn, x, run=False):
  """``fn`` on ``x`` replicated to every device (typed invariant over the mesh axes) inside
  ``shard_map(check_vma=True)``; the results stacked per device."""
  body = lambda v: jax.tree.map(lambda o: o[None], fn(v))
  mapped = jax.jit(
    jax.shard_map(body, mesh=_mesh(), in_specs=P(), out_specs=P(AXES), check_vma=True)
  )
  return jax.tree.map(np.asarray, mapped(x)) if run else jax.eval_shape(mapped, x)


@pytest.mark.parametrize("op", INVARIANT_CALLS)
def test_an_invariant_input_is_refused_without_auto_pcast(op):
  """Without jax's automatic pcast, lax's collectives refuse an input that varies over
  none of their axes; the torus implementations refuse it too, with the same type."""
  ours, theirs = INVARIANT_CALLS[op]
  x = jnp.ones((8, 3), jnp.float32)
  with jax_config.auto_pcast(False):
    lax_error = _error(lambda: _on_replicated(theirs, x))
    with pytest.raises(
      ValueError, match=rf"{op} is a variant->invariant collective: the input must vary over"
    ):
      _on_replicated(lambda v: ours(v, TORUS), x)
    # "auto" is lax there: lax's own error.
    auto_error = _error(lambda: _on_replicated(lambda v: ours(v, "auto"), x))
  assert isinstance(lax_error, ValueError)
  assert type(auto_error) is type(lax_error) and str(auto_error) == str(lax_error)


def test_a_varying_input_is_accepted_without_auto_pcast():
  x = _floats(8, 3)
  with jax_config.auto_pcast(False):
    ours = _run(lambda v: [mine(v, TORUS) for mine, _ in INVARIANT_CALLS.values()], x)
    ref = _run(lambda v: [theirs(v) for _, theirs in INVARIANT_CALLS.values()], x)
  _equal_trees(ours, ref)


def test_without_vma_checks_nothing_is_invariant():
  """Under ``check_vma=False`` values carry no varying axes: nothing to refuse, with or
  without jax's automatic pcast."""
  x = _floats(8, 3)
  with jax_config.auto_pcast(False):
    ours = _run(
      lambda v: [mine(v, TORUS) for mine, _ in INVARIANT_CALLS.values()], x, check_vma=False
    )
  ref = _run(lambda v: [theirs(v) for _, theirs in INVARIANT_CALLS.values()], x, check_vma=False)
  _equal_trees(ours, ref)


def test_an_invariant_input_is_accepted_with_auto_pcast_and_equals_lax():
  """jax's default: the input is cast to varying first, as lax does."""
  x = jnp.arange(24, dtype=jnp.float32).reshape(8, 3)
  ours = _on_replicated(lambda v: [mine(v, TORUS) for mine, _ in INVARIANT_CALLS.values()], x, True)
  ref = _on_replicated(lambda v: [theirs(v) for _, theirs in INVARIANT_CALLS.values()], x, True)
  _equal_trees(ours, ref)


# ------------------------------------------------ collectives: a leaf that is not an array


def test_auto_answers_a_leaf_lax_cannot_read_with_lax_error():
  """Under "auto", a leaf that is not an array (no request can be built for it) leaves the
  call to lax, which raises its own error, word for word."""
  x = _floats(3)
  lax_error = _error(lambda: _trace(lambda v: lax.psum((v, "abc"), "y"), x))
  ours = _error(lambda: _trace(lambda v: tc.psum((v, "abc"), "y"), x))
  assert isinstance(lax_error, TypeError) and "not a valid JAX type" in str(lax_error)
  assert type(ours) is type(lax_error) and str(ours) == str(lax_error)


@pytest.mark.parametrize(
  "call",
  [
    lambda v: tc.psum((v, "abc"), "y", implementation=TORUS),
    lambda v: tc.psum_scatter((v, "abc"), "y", implementation=TORUS),
    lambda v: tc.all_gather((v, "abc"), "y", implementation=TORUS),
    # Block-scaled transport is never left to lax (which has none): "auto" raises too.
    lambda v: tc.psum((v, "abc"), "y", transport_dtype=jnp.int8),
  ],
  ids=["psum", "psum_scatter", "all_gather", "auto-transport"],
)
def test_a_torus_implementation_raises_its_own_type_error_for_such_a_leaf(call):
  """An explicit torus implementation (or transport) raises the request's own TypeError:
  not lax's, whose call it does not make."""
  with pytest.raises(TypeError, match="data type 'abc' not understood"):
    _trace(call, _floats(4, 3))


def test_python_scalar_leaves_are_accepted_and_equal_lax():
  x = _floats(4, 3)
  arrays = functools.partial(jax.tree.map, jnp.asarray)  # lax sums a constant in Python
  ours = _run(
    lambda v: arrays([tc.psum((v, 2.0), "y", implementation=i) for i in ("auto", TORUS)]), x
  )
  ref = _run(lambda v: arrays([lax.psum((v, 2.0), "y")] * 2), x)
  _equal_trees(ours, ref)
  assert ours[1][1].tolist() == [8.0] * 8
  # With transport (lossy, so only traced): the scalar travels block-scaled too.
  out = _trace(lambda v: tc.psum((v, 2.0), "y", transport_dtype=jnp.int8), x)
  assert out[1].shape == (8,) and out[1].dtype == jnp.float32


# ------------------------------------------------- collectives: dimensions at their bounds


@pytest.mark.parametrize("dim", [2, -3])
def test_scatter_dimension_just_outside_the_range_is_refused(dim):
  with pytest.raises(ValueError, match=rf"scatter_dimension={dim} is out of range for 2"):
    _trace(
      lambda v: tc.psum_scatter(v, "y", scatter_dimension=dim, tiled=True, implementation=TORUS),
      _floats(8, 8),
    )


@pytest.mark.parametrize("axis,tiled", [(3, False), (-4, False), (2, True), (-3, True)])
def test_gather_axis_just_outside_the_range_is_refused(axis, tiled):
  """Untiled, the gathered axis is a new one: ``x.ndim + 1`` positions; tiled, ``x.ndim``."""
  ndim = 2 if tiled else 3
  with pytest.raises(ValueError, match=rf"axis={axis} is out of range for {ndim} dimensions"):
    _trace(
      lambda v: tc.all_gather(v, "y", axis=axis, tiled=tiled, implementation=TORUS), _floats(8, 8)
    )


def test_every_dimension_in_range_is_accepted_and_equals_lax():
  """Each bound from inside, negative indices and numpy ints included, and the sizes the
  scatter checks accept exactly: untiled size equal to the group, tiled a multiple of it
  (the group of ``axis_index_groups``, not the axis)."""
  x = _floats(8, 8)
  scatters = [(d, True) for d in (-2, -1, 0, 1, np.int64(1))]
  gathers = [(a, False) for a in (-3, -1, 0, 2)] + [(a, True) for a in (-2, 1)]
  groups = [[0, 1], [2, 3]]

  def run(ops):
    def body(v):
      out = [ops.psum_scatter(v, "y", scatter_dimension=d, tiled=t) for d, t in scatters]
      out += [ops.all_gather(v, "y", axis=a, tiled=t) for a, t in gathers]
      out.append(ops.psum_scatter(v[:4], "y"))  # untiled: size 4 == the axis
      out.append(ops.psum_scatter(v[:2], "y", axis_index_groups=groups))  # size 2 == a group
      out.append(ops.psum_scatter(v[:4], "y", axis_index_groups=groups, tiled=True))
      return out

    return _run(body, x)

  torus = types.SimpleNamespace(
    psum_scatter=functools.partial(tc.psum_scatter, implementation=TORUS),
    all_gather=functools.partial(tc.all_gather, implementation=TORUS),
  )
  _equal_trees(run(torus), run(lax))


@pytest.mark.parametrize("implementation", [TORUS, "lax_torus"])
def test_psum_scatter_refuses_booleans_at_trace_time(implementation):
  """lax refuses them too, when it compiles (test_conformance_collectives)."""
  x = _floats(8) > 0
  with pytest.raises(
    TypeError,
    # The whole message, to its end (or jax's note on filtered frames after it).
    match=r"^psum_scatter does not accept dtype bool \(neither does lax\.psum_scatter\)(\n|$)",
  ):
    _trace(lambda v: tc.psum_scatter(v, "y", tiled=True, implementation=implementation), x)
  # The nearest good input, a one-byte integer, is accepted: psum of booleans is int32.
  out = _trace(
    lambda v: tc.psum_scatter(v.astype(jnp.int8), "y", tiled=True, implementation=implementation), x
  )
  assert out.dtype == jnp.int8 and out.shape == (8, 2)


def test_untiled_size_is_checked_against_the_group_not_the_axis():
  with pytest.raises(ValueError, match=r"untiled psum_scatter .* to equal the group size 2"):
    _trace(
      lambda v: tc.psum_scatter(v, "y", axis_index_groups=[[0, 1], [2, 3]], implementation=TORUS),
      _floats(4, 3),
    )


# ------------------------------------------------------------------------------- registry


def test_a_backend_name_is_registered_once():
  copy = dataclasses.replace(registry.BACKENDS[TORUS], name="torus_copy")
  for taken in ("xla", TORUS, "auto"):
    with pytest.raises(ValueError, match=f"an implementation named '{taken}' is registered"):
      registry.register(dataclasses.replace(copy, name=taken))
  assert registry.register(copy) is copy
  try:
    assert registry.implementations()[-1] == "torus_copy"
    assert registry.resolve("torus_copy", registry.Request("all_reduce", (jnp.float32,)))
    with pytest.raises(ValueError, match="'torus_copy' is registered already"):
      registry.register(copy)
  finally:
    registry.unregister("torus_copy")
  assert "torus_copy" not in registry.BACKENDS
  with pytest.raises(ValueError, match="unknown implementation='torus_copy'"):
    registry.check_name("torus_copy")


def test_xla_cannot_be_unregistered():
  with pytest.raises(ValueError, match='"xla" is the reference every other implementation'):
    registry.unregister("xla")
  assert "xla" in registry.BACKENDS


def test_auto_implementation_knows_its_ops():
  with pytest.raises(ValueError, match=r"unknown op='psum': one of \("):
    registry.auto_implementation("psum", nbytes=1 << 20, torus=(2, 4))
  for op in registry.TUNED_OPS:  # no tuning table on CPU: XLA, whatever the size
    assert registry.auto_implementation(op, nbytes=1 << 20, torus=(2, 4)) == "xla"


def test_auto_rounding_bound_knows_its_ops():
  with pytest.raises(ValueError, match=r"no rounding bound for op='all_to_all': pass one of \("):
    registry.auto_rounding_bound("all_to_all", jnp.float32, 8)
  u = 2.0**-24
  gamma = lambda k, u: k * u / (1 - k * u)
  for op in ("all_reduce", "psum", "reduce_scatter", "psum_scatter", "all_reduce_gradients"):
    assert registry.auto_rounding_bound(op, jnp.float32, 8) == pytest.approx(2 * gamma(7, u))
    assert registry.auto_rounding_bound(op, jnp.float32, 1) == 0.0
  assert registry.auto_rounding_bound("pmean", jnp.float32, 8) == pytest.approx(2 * gamma(8, u) / 8)
  # bfloat16 partial sums are rounded twice (to float32 and to bfloat16): u_eff.
  u_eff = (1 + 2.0**-8) * (1 + u) - 1
  assert registry.auto_rounding_bound("psum", jnp.bfloat16, 8) == pytest.approx(2 * gamma(7, u_eff))
  assert registry.auto_rounding_bound("all_gather", jnp.float32, 8) == 0.0
  assert registry.auto_rounding_bound("psum", jnp.int32, 8) == 0.0
  assert registry.auto_rounding_bound("psum", jnp.bfloat16, 257) == math.inf  # 256 u_eff >= 1
  assert registry.auto_rounding_bound("psum", jnp.bfloat16, 256) < math.inf


@pytest.mark.parametrize("implementation", ["auto", TORUS])
@pytest.mark.parametrize(
  "call",
  [
    lambda v, **kw: tc.psum(v.astype(jnp.int32), AXES, **kw),
    lambda v, **kw: tc.psum(v > 0, AXES, **kw),  # booleans are summed as int32
    lambda v, **kw: tc.psum_scatter(v.astype(jnp.int32), AXES, tiled=True, **kw),
    lambda v, **kw: tc.all_gather(v.astype(jnp.int8), AXES, **kw),
    lambda v, **kw: tc.psum({"f": v, "i": v.astype(jnp.int32)}, AXES, **kw),
  ],
  ids=["psum-int32", "psum-bool", "psum_scatter-int32", "all_gather-int8", "mixed-tree"],
)
def test_block_scaled_transport_refuses_integer_dtypes(call, implementation):
  """Refused by the registry, for "auto" and an explicit implementation alike, with the
  registry's own message (the backend's check, ``test_backend_refuses...``, comes later)."""
  with pytest.raises(
    ValueError,
    match=r"block-scaled transport quantizes floating-point values, got dtype (int32|int8); "
    "integer sums are exact: pass transport_dtype=None",
  ):
    _trace(lambda v: call(v, implementation=implementation, transport_dtype=jnp.int8), _floats(16))


@pytest.mark.parametrize("implementation", ["auto", TORUS])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
def test_block_scaled_transport_accepts_every_floating_dtype(dtype, implementation):
  out = _trace(
    lambda v: tc.psum(
      v.astype(dtype), AXES, implementation=implementation, transport_dtype=jnp.int8
    ),
    _floats(16),
  )
  assert out.dtype == dtype


def test_auto_runs_block_scaled_transport_on_the_torus():
  request = registry.Request("all_reduce", (jnp.dtype(jnp.float32),), block_scaled=True)
  assert registry.resolve("auto", request) == TORUS


def test_the_nearest_good_integer_call_drops_transport_and_is_exact():
  x = harness.small_integers((8, 16), np.int32)
  ours = _run(lambda v: tc.psum(v, "y", implementation=TORUS, transport_dtype=None), x)
  np.testing.assert_array_equal(ours, _run(lambda v: lax.psum(v, "y"), x))


def test_auto_with_transport_raises_what_the_able_backend_refuses(monkeypatch):
  """With transport, "auto" runs the first registered backend that has it and runs the
  request; where none does, it raises the first one's refusal, or a plain error where no
  refusal applies, or (none registered) that "auto" has none."""
  f32 = (jnp.dtype(jnp.float32),)
  tile = registry.Request("all_reduce", f32, groups="tile", block_scaled=True)
  other = dataclasses.replace(tile, groups="other")
  plain = registry.Request("all_reduce", f32, block_scaled=True)
  assert registry.resolve("auto", tile) == TORUS
  with pytest.raises(ValueError, match='implementation="shard_map" runs axis_index_groups only'):
    registry.resolve("auto", other)
  # A registry (in its order) without shard_map: Pallas has transport but does not run here.
  without = {name: b for name, b in registry.BACKENDS.items() if name != TORUS}
  monkeypatch.setattr(registry, "BACKENDS", without)
  with pytest.raises(
    ValueError,
    match=r"no registered implementation with block-scaled transport runs here "
    r"\(of \['pallas'\]\)",
  ):
    registry.resolve("auto", plain)
  monkeypatch.setattr(registry, "BACKENDS", {"xla": without["xla"]})
  with pytest.raises(ValueError, match='implementation="auto" has no block-scaled'):
    registry.resolve("auto", plain)


def test_loading_functions_a_backend_does_not_have():
  with pytest.raises(ValueError, match="implementation 'xla' has no collective functions"):
    registry.collective_backend("xla")
  functions = registry.collective_backend(TORUS, tc.KernelConfig())
  assert functions.all_reduce is shard_map_backend.all_reduce  # no config: nothing to tune
  with pytest.raises(ValueError, match="implementation 'shard_map' has no batch norm"):
    registry.batch_norm_passes(TORUS)
  assert registry.batch_norm_passes("xla") is REFERENCE


# ---------------------------------------------------------------------------- gradients


def test_gradients_of_every_floating_dtype_and_any_bucket_size_are_accepted():
  """The nearest good inputs to the refusals of ``test_bad_input``: the smallest positive
  bucket (every leaf alone), and half-precision leaves; equal to lax's pmean."""
  tree = {"a": _floats(5, 3), "b": _floats(7, seed=1)}
  half = {  # small integers: exact in these dtypes too
    "h": harness.small_integers((8, 6), jnp.bfloat16, seed=3),
    "f": harness.small_integers((8, 6), np.float16, seed=4),
  }
  ours = _run(
    lambda t, h: [
      tc.all_reduce_gradients(t, "y", bucket_bytes=1, implementation=TORUS),
      tc.all_reduce_gradients(t, "y", bucket_bytes=1),
      tc.all_reduce_gradients(h, "y", implementation=TORUS),
    ],
    tree,
    half,
  )
  ref = _run(lambda t, h: [lax.pmean(t, "y")] * 2 + [lax.pmean(h, "y")], tree, half)
  _equal_trees(ours, ref)


@pytest.mark.parametrize("transport_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_a_floating_transport_dtype_is_a_cast(transport_dtype):
  out = _trace(
    lambda v: tc.all_reduce_gradients(v, AXES, transport_dtype=transport_dtype), _floats(16)
  )
  assert out.dtype == jnp.float32  # the gradients' own dtype comes back


# ------------------------------------------------------------------------------ packing


@pytest.mark.parametrize(
  "order", [[0, 0, 1], [0, 1, 1], [0, 1, 3], [0, 1], [0, 1, 2, 3], [2, 1, -1]]
)
def test_bucket_order_must_name_every_leaf_once(order):
  leaves = [jax.ShapeDtypeStruct((4,), jnp.float32)] * 3
  with pytest.raises(ValueError, match=r"order must hold every leaf index 0\.\.2 once"):
    packing.buckets_by_size(leaves, 1 << 20, order)


def test_any_permutation_is_a_bucket_order():
  leaves = [jax.ShapeDtypeStruct((4,), jnp.float32)] * 3
  assert packing.buckets_by_size(leaves, 1 << 20, [2, 0, 1]) == [[2, 0, 1]]
  assert packing.buckets_by_size(leaves, 32, (1, 2, 0)) == [[1, 2], [0]]
  assert packing.buckets_by_size(leaves, 16, range(3)) == [[0], [1], [2]]


# ----------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("kind", ["all_reduce", "reduce", ""])
def test_a_phase_is_a_reduce_scatter_or_an_all_gather(kind):
  with pytest.raises(
    ValueError,
    match=rf"Phase kind must be reduce_scatter or all_gather, got "
    rf"self.kind='{kind}'",
  ):
    S.Phase(kind, 0, 1)


@pytest.mark.parametrize("direction", [0, 2, -2])
def test_a_phase_runs_one_way_or_the_other(direction):
  with pytest.raises(
    ValueError, match=rf"direction must be \+1 or -1, got self.direction={direction}"
  ):
    S.Phase("all_gather", 0, direction)


def test_every_kind_and_direction_is_a_phase():
  for kind in ("reduce_scatter", "all_gather"):
    for direction in (1, -1):
      phase = S.Phase(kind, 1, direction)
      assert (phase.kind, phase.axis, phase.direction) == (kind, 1, direction)


@pytest.mark.parametrize("torus", [(0,), (2, 0), (4, -1)])
def test_torus_sizes_must_be_positive(torus):
  streams = ((S.Phase("reduce_scatter", 0, 1),),)
  with pytest.raises(ValueError, match=r"torus sizes must be positive, got self.torus="):
    S.Schedule(torus, streams)


def test_axes_of_size_one_are_a_torus():
  """Size one is the smallest axis: its ring has no steps."""
  assert S.Schedule((1,), ((S.Phase("reduce_scatter", 0, 1),),)).num_steps == 0
  sched = S.build("all_reduce", (1, 4), "torus")
  assert sched.num_steps == 2 * 3
  x = np.arange(1 * 4 * 1 * 4 * 2, dtype=np.float64).reshape(1, 4, 1, 4, 2)
  out, _ = S.simulate(sched, x)
  np.testing.assert_array_equal(out[0, 2], x.sum(axis=(0, 1)))


def test_every_stream_takes_the_same_number_of_steps():
  """The streams advance in lockstep (``Schedule.steps`` zips them), so a stream with
  fewer steps would silently drop the others' last transfers."""
  rs = lambda axis, direction=1: S.Phase("reduce_scatter", axis, direction)
  with pytest.raises(
    ValueError, match=r"all streams must take the same number of steps, got \{1, 3\}"
  ):
    S.Schedule((2, 4), ((rs(0),), (rs(1),)))
  with pytest.raises(ValueError, match=r"same number of steps, got \{3, 4\}"):
    S.Schedule((2, 4), ((rs(0), rs(1)), (rs(1),)))
  assert S.Schedule((2, 4), ((rs(0), rs(1)), (rs(1), rs(0)))).num_steps == 4
  assert S.Schedule((4, 4), ((rs(0),), (rs(1, -1),))).num_steps == 3  # other axes, same steps


@pytest.mark.parametrize("variant", ["ring", "bidirectional_ring"])
def test_the_ring_variants_need_one_axis(variant):
  with pytest.raises(ValueError, match=rf"{variant} runs on a 1-axis torus; got torus=\(2, 4\)"):
    S.build("all_reduce", (2, 4), variant)
  assert S.build("all_reduce", (8,), variant).num_steps == 2 * 7


def test_a_chunk_splits_evenly_over_the_streams():
  sched = S.build("all_reduce", (2,), "bidirectional_ring")  # two streams
  with pytest.raises(ValueError, match="chunk size 3 is not divisible by 2 streams"):
    S.simulate(sched, np.zeros((2, 2, 3)))
  x = np.arange(2 * 2 * 4, dtype=np.float64).reshape(2, 2, 4)
  out, _ = S.simulate(sched, x)
  np.testing.assert_array_equal(out, np.broadcast_to(x.sum(0), x.shape))


# --------------------------------------------------------------------------- primitives


@pytest.mark.parametrize(
  "call",
  [
    lambda ops, v, **kw: ops.psum(v, "i", **kw),
    lambda ops, v, **kw: ops.all_gather(v, "i", **kw),
    lambda ops, v, **kw: ops.psum_scatter(v, "i", tiled=True, **kw),
  ],
  ids=["psum", "all_gather", "psum_scatter"],
)
def test_replica_groups_over_a_vmapped_axis_are_refused(call):
  groups = [[0, 1], [2, 3]]
  x = jnp.ones((4, 8))
  lax_error = _error(
    lambda: jax.vmap(lambda v: call(lax, v, axis_index_groups=groups), axis_name="i")(x)
  )
  assert isinstance(lax_error, NotImplementedError)
  torus = functools.partial(call, axis_index_groups=groups, implementation=TORUS)
  with pytest.raises(NotImplementedError, match="axis_index_groups over a vmapped axis are not"):
    jax.vmap(lambda v: torus(tc, v), axis_name="i")(x)


@pytest.mark.parametrize("name", ["psum", "all_gather"])
def test_vmapped_axes_without_groups_are_accepted(name):
  x = harness.small_integers((4, 6), np.float32)
  ours = jax.vmap(lambda v: getattr(tc, name)(v, "i", implementation=TORUS), axis_name="i")(x)
  ref = jax.vmap(lambda v: getattr(lax, name)(v, "i"), axis_name="i")(x)
  np.testing.assert_array_equal(ours, ref)


def test_groups_beside_a_vmap_are_accepted():
  """Groups on a mesh axis while a vmap batches the values (its axis not among the
  collective's): folded into one collective."""
  groups = [[0, 1], [2, 3]]
  y = _floats(3, 5)
  ours = _run(
    lambda v: jax.vmap(lambda r: tc.psum(r, "y", axis_index_groups=groups, implementation=TORUS))(
      v
    ),
    y,
  )
  # lax refuses groups under any vmap; a vmap over rows is the sum of the whole block.
  ref = _run(lambda v: lax.psum(v, "y", axis_index_groups=groups), y, check_vma=False)
  np.testing.assert_array_equal(ours, ref)


def _transposed(fn):
  """``fn``'s transpose, applied to ``fn``'s own output as the cotangent."""
  return lambda v: jax.linear_transpose(fn, v)(fn(v))[0]


def _jvp(fn):
  return lambda v: jax.jvp(fn, (v,), (2 * v,))[1]


@pytest.mark.parametrize("transform", [_transposed, _jvp], ids=["transpose", "jvp"])
@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_a_quantized_collective_has_no_transpose_or_jvp(op, transform):
  """``grad`` is refused in test_block_scaled_transport; the transpose rule and the JVP rule
  each refuse on their own (``linear_transpose`` reaches the transpose without a JVP)."""
  fn = lambda u: OPS[op](u, transport_dtype=jnp.int8)
  with pytest.raises(
    NotImplementedError, match="block-scaled transport_dtype is not differentiable"
  ):
    _trace(transform(fn), _floats(16), check_vma=False)


def test_unquantized_collectives_transpose_and_differentiate_as_lax():
  """The transposes run (each op's is another collective); the JVPs are traced."""
  x = _floats(16)
  torus_ops = {op: functools.partial(OPS[op], implementation=TORUS) for op in OPS}
  transposed = lambda ops: lambda v: [_transposed(ops[op])(v) for op in OPS]
  ours = _run(transposed(torus_ops), x, check_vma=False)
  _equal_trees(ours, _run(transposed(LAX_OPS), x, check_vma=False))
  jvps = _trace(lambda v: [_jvp(torus_ops[op])(v) for op in OPS], x, check_vma=False)
  assert [j.shape for j in jvps] == [(8, 16), (8, 16), (8, 2), (8, 128)]


# ------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int16", "uint8", jnp.int4])
def test_a_block_scaled_format_is_int8_or_fp8(dtype):
  with pytest.raises(
    ValueError,
    match=r"block-scaled transport needs one of \('int8', "
    r"'float8_e4m3fn', 'float8_e5m2'\), got dtype \w+; for a floating",
  ):
    tc.BlockScaled(dtype)


def test_every_block_scaled_format_is_accepted_by_any_spelling():
  for spelling in ("int8", jnp.int8, np.dtype("int8")):
    assert tc.BlockScaled(spelling).dtype == "int8"
  for name in ("float8_e4m3fn", "float8_e5m2"):
    assert tc.BlockScaled(getattr(jnp, name)).dtype == name


@pytest.mark.parametrize("block_size", [0, -128, 64.0, "128"])
def test_the_block_size_is_a_positive_int(block_size):
  with pytest.raises(ValueError, match=rf"block_size must be a positive int, got {block_size!r}"):
    tc.BlockScaled("int8", block_size)


def test_a_block_of_one_is_a_block_size():
  fmt = tc.BlockScaled("int8", 1)
  assert fmt.block_size == 1 and fmt.wire_bytes_per_element == 3.0


@pytest.mark.parametrize("entry", ["bogus", 8, object()])
def test_transport_entries_are_dtypes_or_formats(entry):
  with pytest.raises(ValueError, match="transport_dtype entries must be dtypes or tc.BlockScaled"):
    quantization.transport_per_axis({"y": entry}, AXES)
  with pytest.raises(ValueError, match="transport_dtype entries must be dtypes or tc.BlockScaled"):
    quantization.transport_per_axis(entry, AXES)


def test_transport_per_axis_reads_every_accepted_spelling():
  fp8 = tc.BlockScaled("float8_e5m2")
  assert quantization.transport_per_axis({"y": "int8"}, AXES) == (None, INT8)
  assert quantization.transport_per_axis({"x": fp8, "y": None}, AXES) == (fp8, None)
  assert quantization.transport_per_axis(jnp.int8, AXES) == (INT8, INT8)
  assert quantization.transport_per_axis({}, AXES) is None  # nothing quantized
  assert quantization.transport_per_axis({"x": None}, AXES) is None
  assert quantization.transport_per_axis(None, AXES) is None
  with pytest.raises(ValueError, match=r"names axes \['z'\] that the collective does not run"):
    quantization.transport_per_axis({"y": jnp.int8, "z": jnp.int8}, AXES)


def test_what_asks_for_block_scaled_transport():
  for value in (jnp.int8, "int8", jnp.float8_e4m3fn, INT8, {}, {"x": jnp.int8}):
    assert quantization.is_block_scaled(value), value
  for value in (None, jnp.bfloat16, jnp.float32, jnp.int32, "bogus"):
    assert not quantization.is_block_scaled(value), value


# ------------------------------------------------------------------------------- groups


@pytest.mark.parametrize("group_size", [0, -2, 3, 6, 16])
def test_a_group_size_that_is_no_tile_is_refused(group_size):
  with pytest.raises(
    ValueError,
    match=rf"group_size={group_size} is not a tile of the mesh with "
    r"axis sizes \(2, 4\).*valid group sizes: \[1, 2, 4, 8\], or None for the whole mesh\.",
  ):
    tc.resolve_tile(group_size, (2, 4))


@pytest.mark.parametrize("tile", [(2, 3), (1, 8), (2,), (1, 2, 1), (0, 4)])
def test_a_tile_shape_that_is_no_tile_is_refused(tile):
  with pytest.raises(
    ValueError,
    match=r"is not a tile of the mesh with axis sizes \(2, 4\): give one extent per named "
    "axis that divides the axis size and is either the whole axis or a power of two",
  ):
    tc.resolve_tile(tile, (2, 4))


def test_an_extent_must_be_the_whole_axis_or_a_power_of_two():
  """On an axis of 6: 1, 2 and 6 tile it; 3 divides it but is not a power of two."""
  for good in (1, 2, 6):
    assert tc.resolve_tile((good,), (6,)) == (good,)
    assert tc.resolve_tile(good, (6,)) == (good,)
  with pytest.raises(ValueError, match=r"valid extents per axis: \[\[1, 2, 6\]\]"):
    tc.resolve_tile((3,), (6,))
  with pytest.raises(ValueError, match=r"valid group sizes: \[1, 2, 6\]"):
    tc.resolve_tile(3, (6,))


def test_every_tile_is_accepted():
  expected = {1: (1, 1), 2: (1, 2), 4: (1, 4), 8: (2, 4)}
  for size, tile in expected.items():
    assert tc.resolve_tile(size, (2, 4)) == tile
    assert tc.resolve_tile(np.int32(size), (2, 4)) == tile
    assert tc.resolve_tile(tile, (2, 4)) == tile
    assert tc.resolve_tile(list(tile), (2, 4)) == tile
  assert tc.resolve_tile((2, 1), (2, 4)) == (2, 1)
  assert tc.resolve_tile(None, (2, 4)) == (2, 4)


# --------------------------------------------------------------------- backends.shard_map


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_reduce"])
def test_backend_refuses_block_scaled_transport_of_integers(op):
  """The backend's own check, for callers that reach it without the registry."""
  fn = getattr(shard_map_backend, op)
  x = harness.small_integers((8, 16), np.int32)
  with pytest.raises(
    ValueError,
    match=r"block-scaled transport quantizes floating-point values; got dtype int32\. Pass "
    r"transport_dtype=None for integer collectives",
  ):
    _trace(lambda v: fn(v, AXES, (2, 4), transport=(INT8, None)), x, check_vma=False)
  out = _trace(
    lambda v: fn(v.astype(jnp.float32), AXES, (2, 4), transport=(INT8, None)), x, check_vma=False
  )
  assert out.dtype == jnp.float32


def test_backend_sums_integers_exactly_without_transport():
  x = harness.small_integers((8, 16), np.int32)
  ours = _run(
    lambda v: [
      shard_map_backend.all_reduce(v, AXES, (2, 4), transport=None),
      shard_map_backend.reduce_scatter(v, AXES, (2, 4), transport=None),
      shard_map_backend.all_gather(v, AXES, (2, 4), transport=None),
    ],
    x,
    check_vma=False,
  )
  ref = _run(
    lambda v: [
      lax.psum(v, AXES),
      lax.psum_scatter(v, AXES, tiled=True),
      lax.all_gather(v, AXES, tiled=True),
    ],
    x,
    check_vma=False,
  )
  _equal_trees(ours, ref)


# ------------------------------------------------------------------------- weight_update


def _sharded_step(tx, grads, params, state_from=None):
  """Traces ``tx.update(grads, state, params)`` on the 2x4 mesh, the state from
  ``state_from`` (default ``tx``)."""

  def body(g):
    state = (state_from or tx).init(params)
    return tx.update({"w": g}, state, params)[0]

  return _trace(body, grads, check_vma=False)


PARAMS = {"w": jnp.ones((4, 6), jnp.float32)}


@pytest.mark.parametrize("bucket_bytes", [0, -1])
def test_sharded_update_bucket_bytes_must_be_positive(bucket_bytes):
  with pytest.raises(ValueError, match=rf"bucket_bytes={bucket_bytes} must be positive"):
    tc.sharded_update(optax.sgd(1.0), AXES, bucket_bytes=bucket_bytes)
  tx = tc.sharded_update(optax.sgd(1.0), AXES, bucket_bytes=1)
  assert _sharded_step(tx, _floats(4, 6), PARAMS)["w"].shape == (8, 4, 6)


@pytest.mark.parametrize("transport_dtype", [jnp.bfloat16, jnp.float32, jnp.int32, "bogus"])
def test_sharded_update_transport_is_block_scaled(transport_dtype):
  with pytest.raises(ValueError, match="sharded_update's transport_dtype takes a block-scaled"):
    tc.sharded_update(optax.sgd(1.0), AXES, transport_dtype=transport_dtype)


def test_sharded_update_accepts_every_block_scaled_transport():
  for transport in (jnp.int8, jnp.float8_e4m3fn, INT8, {"y": jnp.int8}):
    tx = tc.sharded_update(optax.sgd(1.0), AXES, transport_dtype=transport)
    assert _sharded_step(tx, _floats(4, 6), PARAMS)["w"].dtype == jnp.float32


def test_sharded_update_needs_params():
  tx = tc.sharded_update(optax.sgd(1.0), AXES)

  def body(g):
    return tx.update({"w": g}, tx.init(PARAMS))[0]

  with pytest.raises(ValueError, match=r"sharded_update needs params: call update\(grads, state, "):
    _trace(body, _floats(4, 6), check_vma=False)


def test_error_feedback_needs_its_own_state():
  ef = tc.sharded_update(optax.sgd(1.0), AXES, transport_dtype=jnp.int8, error_feedback=True)
  plain = tc.sharded_update(optax.sgd(1.0), AXES, transport_dtype=jnp.int8)
  with pytest.raises(ValueError, match="error_feedback=True: pass the state that this sharded"):
    _sharded_step(ef, _floats(4, 6), PARAMS, state_from=plain)
  assert _sharded_step(ef, _floats(4, 6), PARAMS)["w"].shape == (8, 4, 6)

  def own_state(g):
    state = ef.init(PARAMS)
    assert isinstance(state, ErrorFeedbackState)
    return ef.update({"w": g}, state, PARAMS)[0]

  assert _trace(own_state, _floats(4, 6), check_vma=False)["w"].shape == (8, 4, 6)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_sharded_update_needs_floating_gradients(dtype):
  tx = tc.sharded_update(optax.sgd(1.0), AXES)
  grads = _floats(4, 6).astype(dtype)
  with pytest.raises(ValueError, match=r"floating-point gradients, got dtype \w+ at \['w'\]"):
    _sharded_step(tx, grads, PARAMS)
  assert _sharded_step(tx, _floats(4, 6).astype(jnp.bfloat16), PARAMS)["w"].shape == (8, 4, 6)


def test_sharded_update_with_params_equals_the_unsharded_step():
  """The good side of the refusals above, run: the mean gradient's SGD step."""
  tx = tc.sharded_update(optax.sgd(0.5), AXES, bucket_bytes=1)
  sgd = optax.sgd(0.5)
  g = _floats(4, 6)
  ours = _run(lambda v: tx.update({"w": v}, tx.init(PARAMS), PARAMS)[0], g, check_vma=False)
  ref = _run(
    lambda v: sgd.update({"w": lax.pmean(v, AXES)}, sgd.init(PARAMS), PARAMS)[0], g, check_vma=False
  )
  _equal_trees(ours, ref)


def test_scale_by_trust_ratio_needs_params():
  tx = scale_by_trust_ratio()
  updates = {"w": jnp.asarray(harness.random_floats((3, 4)))}
  with pytest.raises(ValueError, match=r"scale_by_trust_ratio needs params: call update\(updates"):
    tx.update(updates, tx.init(updates))
  params = {"w": jnp.asarray(harness.random_floats((3, 4), seed=1))}
  ours, _ = tx.update(updates, tx.init(params), params)
  theirs = optax.scale_by_trust_ratio()
  ref, _ = theirs.update(updates, theirs.init(params), params)
  np.testing.assert_array_equal(ours["w"], ref["w"])


# ------------------------------------- found by mutation testing (tests/README.md): schedule


def test_streams_of_equal_steps_may_differ_in_phases():
  """The invariant counts ring steps, not phases: one phase of 2 steps beside two of 1."""
  rs = lambda axis: S.Phase("reduce_scatter", axis, 1)
  assert S.Schedule((3, 2, 2), ((rs(0),), (rs(1), rs(2)))).num_steps == 2
  with pytest.raises(ValueError, match=r"same number of steps, got \{1, 2\}"):
    S.Schedule((3, 2, 2), ((rs(0),), (rs(1),)))


@pytest.mark.parametrize(
  "torus,variant",
  [
    ((8,), "ring"),
    ((8,), "bidirectional_ring"),
    ((2, 4), "torus"),
    ((2, 4), "torus_split"),
    ((2, 2, 2), "torus_split"),
  ],
)
def test_the_gather_retraces_the_scatter_backwards(torus, variant):
  """Each stream gathers its axes in the reverse order of its scatter, in the same
  directions: the last slab it reduced is the first it gathers."""
  for phases in S.build("all_reduce", torus, variant).streams:
    scatter = [(p.axis, p.direction) for p in phases if p.kind == "reduce_scatter"]
    gather = [(p.axis, p.direction) for p in phases if p.kind == "all_gather"]
    assert [p.kind for p in phases] == ["reduce_scatter"] * len(torus) + ["all_gather"] * len(torus)
    assert gather == scatter[::-1]


def test_the_torus_all_reduce_loads_each_link_with_the_slabs_it_moves():
  """On a 2x4 torus (one direction, chunks of one element) a device sends 4 + 4 elements
  along x (rows of the y grid, scattered first and gathered last) and 3 + 3 along y."""
  _, links = S.simulate(S.build("all_reduce", (2, 4), "torus"), np.zeros((2, 4, 2, 4, 1)))
  for device in np.ndindex(2, 4):
    assert (links[device, 0, 1], links[device, 1, 1]) == (8, 6)
  assert len(links) == 2 * 8


def test_slab_elements_scale_with_the_chunk():
  sched = S.build("reduce_scatter", (2, 4), "torus")
  first, last = sched.stream_transfers(0)[0], sched.stream_transfers(0)[-1]
  assert (first.slab_elements((2, 4), 5), last.slab_elements((2, 4), 5)) == (20, 5)
  assert sched.bytes_sent_per_device(8 * 5 * 4) == (4 + 3) * 5 * 4


def test_simulate_poisons_every_chunk_a_device_does_not_hold():
  """After a reduce-scatter only the own chunk holds a sum; a gather that does not deliver
  a chunk leaves NaN there, not the value the device started with. Integer inputs are
  summed in float64 (they must be able to hold NaN)."""
  x = np.ones((2, 2, 2, 2, 1), np.int32)
  out, _ = S.simulate(S.build("reduce_scatter", (2, 2), "torus"), x)
  assert out.dtype == np.float64
  for device in np.ndindex(2, 2):
    grid = out[device][..., 0]
    assert grid[device] == 4
    assert np.isnan(np.delete(grid.reshape(-1), np.ravel_multi_index(device, (2, 2)))).all()
  along_x_only = S.Schedule((2, 2), ((S.Phase("all_gather", 0, 1),),))
  out, _ = S.simulate(along_x_only, 7 * x)
  for i, j in np.ndindex(2, 2):
    grid = out[i, j][..., 0]
    np.testing.assert_array_equal(grid[:, j], [7, 7])  # delivered along x
    assert np.isnan(grid[:, 1 - j]).all()  # never sent: poisoned, not the stale 7


# ------------------------------------ found by mutation testing: replica groups, axis names


def test_group_sizes_fill_the_last_axis_first_in_ints():
  """A group size fills the last axis, then the next: on 4x4, 8 is (2, 4), as ints."""
  for sizes, group_size, tile in [
    ((4, 4), 8, (2, 4)),
    ((4, 4), 2, (1, 2)),
    ((2, 2, 4), 8, (1, 2, 4)),
    ((4, 2, 2), 8, (2, 2, 2)),
    ((8,), 4, (4,)),
  ]:
    resolved = tc.resolve_tile(group_size, sizes)
    assert resolved == tile and all(type(t) is int for t in resolved), (sizes, group_size)


TILES_OF_2x4 = {
  (1, 1): [[d] for d in range(8)],
  (1, 2): [[0, 1], [2, 3], [4, 5], [6, 7]],
  (1, 4): [[0, 1, 2, 3], [4, 5, 6, 7]],
  (2, 1): [[0, 4], [1, 5], [2, 6], [3, 7]],
  (2, 2): [[0, 1, 4, 5], [2, 3, 6, 7]],
  (2, 4): [list(range(8))],
}


@pytest.mark.parametrize("tile", TILES_OF_2x4, ids=str)
def test_replica_groups_that_are_aligned_tiles_are_read_as_tiles(tile):
  """What makes ``axis_index_groups`` run on the torus (``_request``'s group kind)."""
  groups = TILES_OF_2x4[tile]
  assert groups_lib.tile_of_groups(groups, (2, 4), ordered=True) == tile
  assert groups_lib.tile_of_groups(groups[::-1], (2, 4), ordered=True) == tile  # any group order
  as_arrays = [np.asarray(g, np.int32) for g in groups]
  assert groups_lib.tile_of_groups(as_arrays, (2, 4), ordered=False) == tile


@pytest.mark.parametrize(
  "groups",
  [
    [[0, 2], [1, 3], [4, 6], [5, 7]],  # strided along y: no tile
    [[1, 2], [3, 4], [5, 6], [7, 0]],  # shifted: not aligned
    [[0, 1, 2], [3, 4, 5, 6, 7]],  # unequal sizes
    [[0, 1], [2, 3], [4, 5]],  # not every replica
    [[0, 1], [2, 3], [4, 5], [6, 6]],
    [],
    [["a", "b"]],
    [[None]],
    None,
  ],
  ids=str,
)
def test_replica_groups_that_are_no_tile_are_not(groups):
  assert groups_lib.tile_of_groups(groups, (2, 4), ordered=False) is None


def test_a_tile_listed_out_of_row_major_order_is_a_tile_only_unordered():
  """A scatter or gather hands chunk i to the i-th replica of a group, so there the order
  inside a group must be the tile's row-major order; a sum does not care."""
  reversed_inside = [g[::-1] for g in TILES_OF_2x4[(1, 2)]]
  assert groups_lib.tile_of_groups(reversed_inside, (2, 4), ordered=True) is None
  assert groups_lib.tile_of_groups(reversed_inside, (2, 4), ordered=False) == (1, 2)


def test_axis_names_are_split_only_from_tuples_and_lists():
  assert axes.names("data") == ("data",)
  assert axes.names(("data", "model")) == axes.names(["data", "model"]) == ("data", "model")
  assert axes.names(0) == (0,)
  assert axes.names(None) == (None,)


def test_unit_axes_are_dropped_with_their_aligned_entries():
  assert axes.drop_unit_axes((1, 4, 1, 2), ("a", "b", "c", "d"), (1, 2, 1, 2)) == (
    (4, 2),
    ("b", "d"),
    (2, 2),
  )
  assert axes.drop_unit_axes((1, 1), ("a", "b")) == ((), ())
  assert axes.drop_unit_axes((2, 3), ("a", "b")) == ((2, 3), ("a", "b"))


# ------------------------------------------- found by mutation testing: constants, transport


def _primitives(fn, x):
  """The torus primitives in the traced program of ``fn`` on the 2x4 mesh."""
  jaxpr = str(jax.make_jaxpr(harness.sharded(fn, _mesh()))(x))
  return {
    kind for kind in ("all_reduce", "reduce_scatter", "all_gather") if f"torus_{kind}" in jaxpr
  }


def test_an_explicit_implementation_runs_and_validates_constants_except_a_plain_sum():
  """lax sums a constant in Python, so a psum of constants goes to lax whatever the
  implementation, unless it asks for transport; a scatter or gather of constants runs on
  the implementation asked for, which then also checks it."""
  x = _floats(3)
  const = np.ones((4, 2), np.float32)
  assert _primitives(lambda v: tc.psum(const, "y", implementation=TORUS), x) == set()
  assert _primitives(
    lambda v: tc.psum(const, "y", implementation=TORUS, transport_dtype=jnp.int8), x
  ) == {"all_reduce"}
  assert _primitives(
    lambda v: [
      tc.psum_scatter(const, "y", implementation=TORUS),
      tc.all_gather(const, "y", implementation=TORUS),
    ],
    x,
  ) == {"reduce_scatter", "all_gather"}
  with pytest.raises(ValueError, match=r"untiled psum_scatter over \('y',\) needs x.shape\[0\]=3"):
    _trace(lambda v: tc.psum_scatter(const[:3], "y", implementation=TORUS), x)


def _torus_params(fn, x):
  """The parameters of every torus primitive in the traced program of ``fn`` on the mesh."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name.startswith("torus_"):
        found.append(eqn.params)
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
          walk(inner)

  walk(jax.make_jaxpr(harness.sharded(fn, _mesh()))(x).jaxpr)
  return found


@pytest.mark.parametrize(
  "transport,per_axis",
  [(jnp.int8, (INT8, INT8)), ({"y": jnp.int8}, (None, INT8)), ({"x": "int8"}, (INT8, None))],
  ids=["every-axis", "y-only", "x-only"],
)
def test_transport_reaches_the_collective_axis_by_axis(transport, per_axis):
  calls = lambda v: [OPS[op](v, transport_dtype=transport) for op in ("psum", "psum_scatter")]
  found = _torus_params(calls, _floats(16))
  assert len(found) == 2
  for params in found:
    assert params["impl"] == TORUS and params["axes"] == AXES
    assert params["transport"] == per_axis


@pytest.mark.parametrize("implementation", ["xla", "lax_torus"])
@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_transport_is_refused_where_lax_runs_and_plain_calls_are_not(op, implementation):
  """With transport, "xla" (lax itself) and "lax_torus" refuse before anything runs;
  without it they run the call (on lax, or its per-axis phases)."""
  with pytest.raises(
    ValueError, match=rf'implementation="{implementation}" has no block-scaled \(int8/fp8\)'
  ):
    _trace(
      lambda v: OPS[op](v, implementation=implementation, transport_dtype=jnp.int8), _floats(16)
    )
  out = _trace(
    lambda v: OPS[op](v, implementation=implementation, transport_dtype=None), _floats(16)
  )
  assert out.dtype == jnp.float32
  assert not _torus_params(lambda v: OPS[op](v, implementation="xla"), _floats(16))


# ------------------------------------------------------------ validations aligned with siblings
# Each accepted what its sibling refuses until fixed.


@pytest.mark.parametrize("bucket_bytes", [float("nan"), float("inf")])
def test_sharded_update_bucket_bytes_must_be_finite(bucket_bytes):
  """As all_reduce_gradients: NaN gave every leaf a bucket of its own, silently."""
  with pytest.raises(ValueError, match="bucket_bytes=.* must be positive and finite"):
    tc.sharded_update(optax.sgd(1.0), AXES, bucket_bytes=bucket_bytes)
  tc.sharded_update(optax.sgd(1.0), AXES, bucket_bytes=1 << 20)


def test_block_size_takes_numpy_ints_but_not_booleans():
  """As groups.resolve_tile: a numpy integer is a block size, True is not."""
  scaled = tc.BlockScaled("int8", np.int64(64))
  assert scaled.block_size == 64 and type(scaled.block_size) is int
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    tc.BlockScaled("int8", True)
