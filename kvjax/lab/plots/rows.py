"""Reading a results folder for the plots: every *.jsonl row of `kvjax run`, grouped by
experiment, each cell once, with what was skipped and why. The rows are read by
kvjax.lab.rowfile, the reader `kvjax results` and a resumed run use, so a row whose checksum
fails or whose fields have the wrong shape is skipped here as it is there."""

from __future__ import annotations

from pathlib import Path

from kvjax.lab import rowfile


def scan_rows(results_dir: str | Path) -> tuple[dict[str, list[dict]], list[str]]:
  """(rows of every *.jsonl under a folder grouped by experiment, what was skipped and why).
  A cell's row (same experiment, config and row number) that an earlier line or file of the
  same folder already holds (runs that shared it, or `--shard` parts) is skipped: the first
  one wins (the same cell in another folder, another machine's run say, is kept)."""
  out: dict[str, list[dict]] = {}
  skipped = []
  root = Path(results_dir)
  for got in rowfile.read_folder(root):
    for row in got.rows:
      out.setdefault(row["experiment"], []).append(row)
    where = got.path.relative_to(root) if got.path != root else got.path
    if got.foreign:
      skipped.append(f"{where}: {got.foreign} rows that are not `kvjax run` results rows (no "
                     "experiment/metrics fields; a benchmark script's own output, shown as a "
                     "table in the docs, not plotted)")
    if got.problems:
      skipped.append(f"{where}: {len(got.problems)} unreadable lines (torn, not JSON, a "
                     f"failed checksum or a field of the wrong shape: "
                     f"{'; '.join(got.problems[:3])})")
    if got.repeated:
      skipped.append(f"{where}: {got.repeated} rows of cells already read (the first is kept)")
  return out, skipped


def load_rows(results_dir: str | Path) -> dict[str, list[dict]]:
  """Rows of every *.jsonl under a folder, grouped by experiment (torn lines skipped)."""
  return scan_rows(results_dir)[0]
