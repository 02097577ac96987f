"""Redraw every plot that a results folder supports.

    python scripts/plot_all.py RESULTS_DIR --out DIR

Reads every *.jsonl under RESULTS_DIR (results rows only, nothing else), groups rows by
their `experiment`, and calls `scripts/plots/<experiment>.py:plot(rows, out_dir)` for
each experiment that has a plot module. Writes PNG and SVG files into DIR. Whatever it
does not draw (a benchmark's own rows, torn lines, an experiment without a plot module,
rows that give a module nothing to draw) is reported on stderr, one line each, with why.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plots import scan_rows  # noqa: E402


def plot_all(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
  results_dir, out_dir = Path(results_dir), Path(out_dir)
  if not results_dir.is_dir():
    raise SystemExit(f"plot_all: error: no results folder {results_dir}; run `kvjax run` first")
  groups, skipped = scan_rows(results_dir)
  for line in skipped:
    print(f"plot_all: skipped {line}", file=sys.stderr)
  if not groups:
    raise SystemExit(f"plot_all: error: no results rows under {results_dir}")
  written = []
  for name, rows in sorted(groups.items()):
    try:
      module = importlib.import_module(f"plots.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"plots.{name}":  # the module exists but one of its imports is missing
        raise
      print(f"plot_all: skipped experiment '{name}' ({len(rows)} rows): no plot module "
            f"scripts/plots/{name}.py", file=sys.stderr)
      continue
    # Runs of different configs (say quickstart and latency) are never mixed in one plot:
    # when an experiment has rows from several configs, each gets its own subfolder.
    by_config: dict[str, list] = {}
    for row in rows:
      by_config.setdefault(row.get("config", {}).get("name") or name, []).append(row)
    for config_name, sub in sorted(by_config.items()):
      where = out_dir / config_name if len(by_config) > 1 else out_dir
      paths = module.plot(sub, where)
      if not paths:
        print(f"plot_all: skipped {name} ({config_name}): its {len(sub)} rows give "
              f"scripts/plots/{name}.py nothing to draw", file=sys.stderr)
        continue
      print(f"{name} ({config_name}): {len(sub)} rows -> {where}/: "
            + ", ".join(p.name for p in paths if p.suffix == ".png"))
      written += paths
  return written


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("results_dir")
  p.add_argument("--out", default="plots")
  args = p.parse_args(argv)
  written = plot_all(args.results_dir, args.out)
  print(f"{len(written)} files in {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
