"""The wheel installs one import name, ``torus_collectives``, and lives beside others.

``kernels`` and ``resnet`` are import names of other distributions on the package index,
so the wheel must not ship them: ``kernels/`` is packaged as ``torus_collectives.kernels``
and the ResNet example and benchmarks run from a checkout. The wheel is built offline and
installed into a fresh virtual environment next to stand-in top-level ``kernels`` and
``resnet`` packages; a subprocess there runs every implementation (Pallas in TPU interpret
mode) and checks that neither stand-in was touched or shadowed.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE_PACKAGES = pathlib.Path(
  next(p for p in sys.path if p.endswith("site-packages") and pathlib.Path(p).is_dir())
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  # Built from a copy of the sources, so that no stale build/ folder of the checkout can
  # leak files into the wheel, and the checkout stays untouched.
  source = tmp_path_factory.mktemp("source")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, source / name)
  for name in ("torus_collectives", "kernels"):
    shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
  out = tmp_path_factory.mktemp("wheel")
  subprocess.run(
    [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    + ["-w", str(out), str(source)],
    check=True,
    timeout=300,
  )
  (path,) = out.glob("torus_collectives-*.whl")
  return path


def test_wheel_has_one_top_level_package(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  assert top_level == {"torus_collectives"}
  assert "torus_collectives/kernels/torus_kernels.py" in names
  assert "torus_collectives/kernels/pallas_backend.py" in names
  for name in ("__init__.py", "aot.py", "hlo_schedule.py", "split_interpret.py", "README.md"):
    assert f"torus_collectives/testing/{name}" in names
  assert any(n.startswith("torus_collectives/tuning/tuned/") and n.endswith(".json") for n in names)
  assert not any(
    n.startswith(("torus_collectives/resnet", "torus_collectives/bench")) for n in names
  )


def _fresh_venv(wheel, tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
  """A new virtual environment with only the wheel installed: its python and site dir."""
  env = tmp_path / "env"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
  python = env / "bin" / "python"
  subprocess.run(
    [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    + ["--no-index", str(wheel)],
    check=True,
    timeout=300,
  )
  site = pathlib.Path(
    subprocess.check_output(
      [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
    ).strip()
  )
  return python, site


def _run_ok(python, program: str, tmp_path) -> None:
  """``program`` run by ``python`` on 8 simulated CPU devices; it must print "ok" last."""
  environ = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    "PYTHONPATH": "",
  }
  result = subprocess.run(
    [str(python), "-c", program],
    cwd=tmp_path,  # not the checkout, whose folders would shadow the installed package
    env=environ,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.strip().endswith("ok")


USER_PROGRAM = textwrap.dedent(
  """
  import sys
  import jax, jax.numpy as jnp, numpy as np
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import AxisType, PartitionSpec as P
  import torus_collectives as tc

  assert "site-packages" in tc.__file__, tc.__file__
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  x = jnp.arange(8 * 256, dtype=jnp.int32).reshape(8, 256) % 7
  expected = np.tile(np.asarray(x).sum(0), (8, 1))

  def run(impl):
    f = jax.shard_map(lambda v: tc.all_reduce(v, ("x", "y"), implementation=impl), mesh=mesh,
                      in_specs=P(("x", "y")), out_specs=P(("x", "y")), check_vma=False)
    return np.asarray(jax.jit(f)(x))

  for impl in ("auto", "xla", "shard_map"):
    np.testing.assert_array_equal(run(impl), expected)
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    np.testing.assert_array_equal(run("pallas"), expected)
    bn = lambda v: tc.batch_norm(v, jnp.ones(128), jnp.zeros(128), axis_name=("x", "y"),
                                 group_size=2, implementation="pallas")[0]
    act = jax.random.normal(jax.random.key(0), (8 * 16, 128))
    y = jax.jit(jax.shard_map(bn, mesh=mesh, in_specs=P(("x", "y")),
                              out_specs=P(("x", "y")), check_vma=False))(act)
    assert np.all(np.isfinite(np.asarray(y)))
  assert "kernels" not in sys.modules and "resnet" not in sys.modules, "stand-in imported"
  assert tc.kernels.__file__.startswith(tc.__file__.rsplit("/", 1)[0])

  import kernels, resnet
  assert (kernels.WHO, resnet.WHO) == ("stand-in kernels", "stand-in resnet")
  print("ok")
  """
)


def test_wheel_installs_beside_packages_named_kernels_and_resnet(wheel, tmp_path):
  python, site = _fresh_venv(wheel, tmp_path)
  for name in ("kernels", "resnet"):
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f'WHO = "stand-in {name}"\n')
  # The dependencies (jax, ...) come from this environment, after the fresh one's packages.
  (site / "dependencies.pth").write_text(f"{SITE_PACKAGES}\n")
  _run_ok(python, USER_PROGRAM, tmp_path)


CORE_PROGRAM = textwrap.dedent(
  """
  import sys
  import jax, jax.numpy as jnp, numpy as np
  from jax.sharding import AxisType, PartitionSpec as P
  import torus_collectives as tc
  import torus_collectives.tuning.tuner

  for missing in ("optax", "flax", "matplotlib"):
    try:
      __import__(missing)
    except ImportError:
      pass
    else:
      raise AssertionError(f"{missing} is installed in the core-only environment")
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  x = jnp.arange(8 * 256, dtype=jnp.int32).reshape(8, 256) % 7
  expected = np.tile(np.asarray(x).sum(0), (8, 1))
  for impl in ("auto", "xla", "shard_map", "lax_torus"):
    f = jax.shard_map(lambda v: tc.all_reduce(v, ("x", "y"), implementation=impl), mesh=mesh,
                      in_specs=P(("x", "y")), out_specs=P(("x", "y")), check_vma=False)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), expected)
  grads = jax.jit(jax.shard_map(
    lambda g: tc.all_reduce_gradients({"w": g}, ("x", "y"), mean=False)["w"], mesh=mesh,
    in_specs=P(("x", "y")), out_specs=P(("x", "y"))))(x.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(grads), expected)  # small integers: exact
  act = jax.random.normal(jax.random.key(0), (8 * 16, 128))
  bn = lambda v: tc.batch_norm(v, jnp.ones(128), jnp.zeros(128), axis_name=("x", "y"))[0]
  y = jax.jit(jax.shard_map(bn, mesh=mesh, in_specs=P(("x", "y")), out_specs=P(("x", "y"))))(act)
  assert np.all(np.isfinite(np.asarray(y)))
  loaded = [m for m in sys.modules if "pallas" in m or m.split(".")[0] in ("optax", "flax")]
  assert not loaded, loaded
  try:
    tc.sharded_update
  except ImportError as e:
    assert "pip install 'torus-collectives[optax]'" in str(e), e
  else:
    raise AssertionError("sharded_update loaded without optax")
  from torus_collectives.testing import aot, hlo_schedule, split_interpret  # without libtpu
  print("ok")
  """
)


def _distribution_closure(names: list[str]) -> set[str]:
  """``names`` and everything they require (no extras), as installed here."""
  from importlib import metadata

  from packaging.requirements import Requirement

  seen: set[str] = set()
  todo = list(names)
  while todo:
    name = metadata.distribution(todo.pop()).metadata["Name"]
    if name in seen:
      continue
    seen.add(name)
    for text in metadata.requires(name) or ():
      requirement = Requirement(text)
      if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
        todo.append(requirement.name)
  return seen


def test_core_runs_with_jax_and_numpy_only(wheel, tmp_path):
  """In an environment with the wheel, jax and numpy (and what they require) only: the
  collectives, gradient summation, batch norm and the tuner import and run, load neither
  optax, flax, matplotlib nor Pallas, and ``sharded_update`` names the extra to install;
  the tests' support (``torus_collectives.testing``) imports without libtpu."""
  from importlib import metadata

  python, site = _fresh_venv(wheel, tmp_path)
  deps = tmp_path / "deps"
  deps.mkdir()
  for name in _distribution_closure(["jax", "numpy"]):
    for top in {pathlib.PurePath(f).parts[0] for f in metadata.distribution(name).files or ()}:
      source = SITE_PACKAGES / top
      if source.exists() and not (deps / top).exists() and top != "..":
        (deps / top).symlink_to(source)
  assert not (deps / "optax").exists() and (deps / "jax").exists()
  (site / "dependencies.pth").write_text(f"{deps}\n")
  _run_ok(python, CORE_PROGRAM, tmp_path)
