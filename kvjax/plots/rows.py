"""Reading a results folder for the plots: every *.jsonl row of `kvjax run`, grouped by
experiment, each cell once, with what was skipped and why."""

from __future__ import annotations

import json
from pathlib import Path


def scan_rows(results_dir: str | Path) -> tuple[dict[str, list[dict]], list[str]]:
  """(rows of every *.jsonl under a folder grouped by experiment, what was skipped and why).
  A cell's row (same experiment, config and row number) that an earlier line or file of the
  same folder already holds (runs that shared it, or `--shard` parts) is skipped: the first
  one wins (the same cell in another folder, another machine's run say, is kept)."""
  out: dict[str, list[dict]] = {}
  skipped = []
  root = Path(results_dir)
  seen = set()
  for path in sorted(root.rglob("*.jsonl")):
    torn = foreign = repeated = 0
    for line in path.read_text().splitlines():
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        torn += 1
        continue
      cell = row.get("cell") if isinstance(row, dict) else None
      key = None if not isinstance(cell, dict) else json.dumps(
          [str(path.parent), cell.get("row")] + [row.get(k) for k in ("experiment",
                                                                    "config_hash", "config")],
          sort_keys=True, default=str)
      if key is not None and key in seen:
        repeated += 1
      elif isinstance(row, dict) and "experiment" in row and "metrics" in row:
        if key is not None:
          seen.add(key)
        out.setdefault(row["experiment"], []).append(row)
      else:
        foreign += 1
    where = path.relative_to(root) if path != root else path
    if foreign:
      skipped.append(f"{where}: {foreign} rows that are not `kvjax run` results rows (no "
                     "experiment/metrics fields; a benchmark script's own output, shown as a "
                     "table in the docs, not plotted)")
    if torn:
      skipped.append(f"{where}: {torn} unreadable lines (torn or not JSON)")
    if repeated:
      skipped.append(f"{where}: {repeated} rows of cells already read (the first is kept)")
  return out, skipped


def load_rows(results_dir: str | Path) -> dict[str, list[dict]]:
  """Rows of every *.jsonl under a folder, grouped by experiment (torn lines skipped)."""
  return scan_rows(results_dir)[0]

