"""A backend registered under a new name needs only its record: the conformance base then
runs it, as many cases as the backend it copies.

``conftest.py`` registers stand-ins named in ``TORUS_COLLECTIVES_STAND_INS`` before
collection; here a subprocess collects ``test_conformance_collectives.py`` with two of
them, a copy of "xla" and a copy of "shard_map", and runs every case of the first and the
ring's (1d) cases of the second (the whole of a "shard_map" copy would compile every
torus program of the base a second time, minutes on 2 cores). Each must pass exactly as
many cases as the original has in the same selection.
"""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from harness import COLLECTED_ENV_VAR, STAND_INS_ENV_VAR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "tests/test_conformance_collectives.py"
# stand-in -> (the backend it copies, the -k selection of its cases that runs)
STAND_INS = {
  "xla_standin": ("xla", "xla_standin"),
  "shard_map_standin": ("shard_map", "shard_map_standin and 1d"),
}


def _in_selection(node_id: str, selection: str) -> bool:
  """The ``-k`` selections above: an implementation, and maybe the ring's cases."""
  return "and 1d" not in selection or "-1d" in node_id


@pytest.mark.slow
def test_stand_in_backends_run_as_many_cases_as_their_originals(tmp_path):
  collected, report = tmp_path / "collected.json", tmp_path / "report.xml"
  env = dict(
    os.environ,
    **{
      STAND_INS_ENV_VAR: ",".join(f"{new}={old}" for new, (old, _) in STAND_INS.items()),
      COLLECTED_ENV_VAR: str(collected),
    },
  )
  selection = " or ".join(f"({k})" for _, k in STAND_INS.values())
  result = subprocess.run(
    [sys.executable, "-m", "pytest", BASE, "-q", "-p", "no:cacheprovider", "-k", selection]
    + ["-m", "not slow", f"--junit-xml={report}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=3000,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  items = json.loads(collected.read_text())
  cases = ET.parse(report).getroot().iter("testcase")
  passed = [
    c.get("name")
    for c in cases
    if not any(child.tag in ("failure", "error", "skipped") for child in c)
  ]
  fast = [i for i in items if not i["slow"]]  # the slow ones are subprocesses of their own
  for new, (old, selection) in STAND_INS.items():
    original = [i for i in fast if i["impl"] == old and _in_selection(i["id"], selection)]
    copies = [i for i in fast if i["impl"] == new and _in_selection(i["id"], selection)]
    ran = [n for n in passed if f"[{new}-" in n or n.endswith(f"[{new}]")]
    assert len(original) > 0
    assert len(copies) == len(original), (new, len(copies), len(original))
    assert len(ran) == len(original), (new, len(ran), len(original))
