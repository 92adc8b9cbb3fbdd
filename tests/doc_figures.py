"""Figures in the documentation's prose, and where each comes from.

A *figure* is a number a command or a measurement produced: a decimal (``21.65``, ``0.95``)
or a whole number with a unit of time, size, rate or share (``958 s``, ``6 images/s``,
``100%``). Versions (``jax 0.12``) and paper identifiers are not figures. Every figure in a
page's prose (outside code) must be one of:

* **derived**: it lies inside a phrase of ``LEDGER``, which renders the phrase from the
  package's code or a command's output file; the page must contain the rendered phrase,
  so an edited figure, or a changed source, fails the test;
* **recorded**: it lies in a section whose heading (or an enclosing one) carries the date
  and the commit it was measured at, ``(2026-12-05, commit 0562259)``: a record of what a
  command printed then, which later code cannot make false, and which the docs test
  checks names a commit of this repository.

Anything else is a figure typed into prose with nothing to keep it true.
"""

import dataclasses
import json
import pathlib
import re
from collections.abc import Callable, Mapping

ROOT = pathlib.Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(```+|~~~+)([^\n]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$")
RECORD = re.compile(r"\((\d{4}-\d{2}-\d{2}), commit ([0-9a-f]{7,40})\)")
# Sizes in MiB and KiB are the inputs a page chooses, not results.
UNITS = r"ms|µs|s|GiB|GB|MB|%|images/s|img/s|minutes|tests|GFLOP"
FIGURE = re.compile(
  rf"(?<![\w.\-/])(?:(\d+\.\d+)(?![\d.])|(\d[\d,]*)\s?(?:{UNITS})(?![\w/]))"
  r"(?!\s*(?:x|×)\s*\d)"  # a shape (16×16, 4 × 8): not a figure
)
# What precedes a version or an identifier, not a figure.
NOT_A_FIGURE = re.compile(r"(?:jax|Python|python|libtpu|optax|flax|arXiv|>=|<|v)\s*$")


@dataclasses.dataclass(frozen=True)
class Derived:
  """``phrase`` on ``page``, with ``{name}`` fields rendered from ``values()``."""

  page: str
  phrase: str
  values: Callable[[], Mapping[str, object]]

  def rendered(self) -> str:
    return " ".join(self.phrase.format(**self.values()).split())


def quoted(path: str, pattern: str, *names: str) -> Callable[[], dict[str, str]]:
  """The groups of ``pattern`` in the file at ``path`` (from the repository root), as
  written there: for a phrase that quotes a test's threshold or a constant."""

  def values():
    match = re.search(pattern, (ROOT / path).read_text(), re.M)
    if match is None:
      raise AssertionError(f"{pattern!r} not found in {path}")
    return dict(zip(names, match.groups()))

  values.__name__ = f"{path}: {pattern}"
  return values


def _error_bounds():
  import jax.numpy as jnp

  from torus_collectives import quantization

  def bound(torus):
    transport = quantization.transport_per_axis(jnp.int8, tuple(f"a{i}" for i in torus))
    return quantization.error_bound("all_reduce", torus, transport)

  torus, ring = bound((16, 16)) / (31 / 254), bound((256,)) / (256 / 254)
  return {"torus": torus, "ring": ring}


def _wire():
  from torus_collectives.quantization import BlockScaled

  per_element = BlockScaled("int8").wire_bytes_per_element
  return {"per_element": per_element, "of_bf16": per_element / 2}


def _rule():
  from torus_collectives.tuning import tables

  return {"threshold": tables.THRESHOLD, "confidence": round(100 * tables.CONFIDENCE)}


def _hop_latency():
  from torus_collectives import cost_model

  return {"us": round(cost_model.DEFAULT_HOP_LATENCY_S * 1e6)}


def _block_scaled_bytes():
  """The int8 over bfloat16 HBM-bytes ratio of a float32 gradient on v5e:4x4, from the
  report's output file."""
  report = json.loads((ROOT / "bench" / "results" / "block_scaled_bytes.json").read_text())
  (row,) = [
    r for r in report["rows"] if r["topology"] == "v5e:4x4" and r["gradient_dtype"] == "float32"
  ]
  return {"ratio": row["hbm_ratio_int8_to_bf16"]}


LEDGER: tuple[Derived, ...] = (
  Derived(
    "docs/transport.md",
    "{torus:.2f} × 31/254 on the 16×16 torus, {ring:.2f} × 256/254 on the ring of 256",
    _error_bounds,
  ),
  Derived("docs/benchmarks.md", "- {us} µs per hop: no TPU generation publishes", _hop_latency),
  Derived("docs/transport.md", "int8 puts {of_bf16:.3f} of bfloat16's bytes on the wire", _wire),
  Derived("docs/transport.md", "{per_element:.3f} for int8 blocks of 128", _wire),
  Derived(
    "docs/transport.md",
    "on v5e:4x4 the int8 program of a float32 gradient accesses {ratio:.2f} of the bytes",
    _block_scaled_bytes,
  ),
  Derived(
    "docs/transport.md",
    "asserts at most {bf16} for the bfloat16 gradient and {f32} for the float32 gradient on "
    "v5e:4x4",
    quoted(
      "tests/test_quantized_kernels.py",
      r'\("v5e:4x4", jnp\.bfloat16, ([\d.]+)\),\s*\("v5e:4x4", jnp\.float32, ([\d.]+)\),',
      "bf16",
      "f32",
    ),
  ),
  Derived(
    "docs/transport.md",
    "sends at most {bound} of bfloat16's bytes",
    quoted("tests/test_block_scaled_transport.py", r"assert int8 / bf16 <= ([\d.]+)$", "bound"),
  ),
  Derived(
    "docs/transport.md",
    "The kernels declare between {low} and {high} of the bfloat16 kernels' wire bytes",
    quoted(
      "tests/test_quantized_kernels.py",
      r"assert ([\d.]+) < declared.remote_bytes_transferred / bf16_wire < ([\d.]+)",
      "low",
      "high",
    ),
  ),
  Derived(
    "docs/multi-host.md",
    "a SIGKILLed peer is named within {limit} s",
    quoted("tests/test_resnet_train.py", r"^DEAD_PEER_LIMIT_S = (\d+)", "limit"),
  ),
  Derived(
    "docs/tuning.md",
    "one at {ratio}× is picked in at least {picked} of {seeds}",
    quoted(
      "tests/test_tuning.py",
      r'_noisy_decision\(\{"shard_map": ([\d.]+)\}, seed\) for seed in range\((\d+)\)\]'
      r'[\s\S]*?choices.count\("shard_map"\) >= (\d+)',
      "ratio",
      "seeds",
      "picked",
    ),
  ),
  Derived(
    "docs/tuning.md",
    "bootstrap {confidence} % interval of the median of its per-round time ratios to XLA is "
    "at most {threshold}",
    _rule,
  ),
)


def sections(text: str) -> list[tuple[str | None, str]]:
  """The page's prose cut at its headings: (the record commit its section or an enclosing
  one names, or None; the section's text without code)."""
  text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
  out, stack, lines = [], [], []

  def flush():
    commit = next((c for _, c in reversed(stack) if c), None)
    out.append((commit, "\n".join(lines)))
    lines.clear()

  for line in text.splitlines():
    match = HEADING.match(line)
    if match:
      flush()
      level = len(match.group(1))
      while stack and stack[-1][0] >= level:
        stack.pop()
      record = RECORD.search(match.group(2))
      stack.append((level, record.group(2) if record else None))
    lines.append(line)
  flush()
  return out


def figures(text: str) -> list[str]:
  """The figures in ``text`` (prose, code already removed)."""
  found = []
  for match in FIGURE.finditer(text):
    if NOT_A_FIGURE.search(text[: match.start()]):
      continue
    found.append(match.group(0))
  return found


def problems(page: str, text: str, ledger=LEDGER) -> tuple[list[str], set[str]]:
  """What is wrong with the figures of ``page`` (its path from the repository root), and
  the commits its records name."""
  out, commits = [], set()
  phrases = [d.rendered() for d in ledger if d.page == page]
  flat = " ".join(text.split())
  for d, phrase in zip([d for d in ledger if d.page == page], phrases):
    if phrase not in flat:
      out.append(f"{page}: expected {phrase!r} (from {d.values.__name__}), not found")
  for commit, prose in sections(text):
    if commit:
      commits.add(commit)
      continue
    prose = " ".join(prose.split())
    for phrase in phrases:
      prose = prose.replace(phrase, " ")
    out += [
      f"{page}: figure {f!r} is neither derived (LEDGER) nor in a dated record section"
      for f in figures(prose)
    ]
  return out, commits
