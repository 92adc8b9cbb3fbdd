"""The command line of a report that prints one Markdown text and writes it to a file."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable, Sequence


def main(
  argv: Sequence[str] | None,
  description: str,
  default_out: pathlib.Path,
  report: Callable[[], tuple[str, float]],
) -> None:
  """Parses ``--out`` (default ``default_out``), runs ``report()`` (the text and the seconds
  it took), prints the text and writes it there."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--out", type=pathlib.Path, default=default_out, help="markdown file")
  args = parser.parse_args(argv)
  text, seconds = report()
  print(text)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(text)
  print(f"wrote {args.out} ({seconds:.0f} s)")
