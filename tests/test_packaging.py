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
  assert any(n.startswith("torus_collectives/tuned/") and n.endswith(".json") for n in names)
  assert not any(
    n.startswith(("torus_collectives/resnet", "torus_collectives/bench")) for n in names
  )


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
  for name in ("kernels", "resnet"):
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f'WHO = "stand-in {name}"\n')
  # The dependencies (jax, ...) come from this environment, after the fresh one's packages.
  (site / "dependencies.pth").write_text(f"{SITE_PACKAGES}\n")
  environ = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    "PYTHONPATH": "",
  }
  result = subprocess.run(
    [str(python), "-c", USER_PROGRAM],
    cwd=tmp_path,  # not the checkout, whose folders would shadow the installed package
    env=environ,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.strip().endswith("ok")
