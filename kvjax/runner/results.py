"""`kvjax results DIR|FILE --format csv|markdown`: results rows as a table to paste.

Each row is flattened by `runner.flatten` (kvjax.runner.table: its variant and workload
fields, the known metrics, then every other scalar metric), with its experiment first. CSV
keeps raw values in SI units (seconds, bytes); markdown formats them as the run's summary
table does (times in ms, bytes in KiB/MiB/GiB).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from kvjax.errors import KvjaxError
from kvjax.runner.rows import read_rows
from kvjax.runner.table import cell_text, flatten, is_seconds

FORMATS = ("csv", "markdown")


def load(path: str | Path, experiment: str | None = None) -> list[dict]:
  """Complete results rows of a .jsonl file or of every .jsonl under a folder."""
  path = Path(path)
  if path.is_dir():
    files = sorted(path.rglob("*.jsonl"))
  elif path.is_file():
    files = [path]
  else:
    raise KvjaxError(f"no results file or folder {path}; pass what `kvjax run --out` wrote")
  rows = [r for f in files for r in read_rows(f)
          if isinstance(r.get("metrics"), dict) and "experiment" in r]
  if not rows:
    raise KvjaxError(f"no results rows in {path}; run `kvjax run CONFIG --out {path}` first")
  if experiment:
    known = sorted({r["experiment"] for r in rows})
    rows = [r for r in rows if r["experiment"] == experiment]
    if not rows:
      raise KvjaxError(f"no rows of experiment '{experiment}' in {path}; it has "
                       + ", ".join(known))
  return rows


def records(rows: list[dict]) -> list[dict]:
  return [{"experiment": r["experiment"], **flatten(r, all_metrics=True)} for r in rows]


def _columns(recs: list[dict]) -> list[str]:
  keys: list[str] = []
  for rec in recs:
    keys += [k for k in rec if k not in keys]
  return keys


def to_csv(recs: list[dict]) -> str:
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=_columns(recs), lineterminator="\n")
  writer.writeheader()
  writer.writerows(recs)
  return buf.getvalue()


def to_markdown(recs: list[dict]) -> str:
  keys = _columns(recs)
  heads = [k[:-2] + "_ms" if is_seconds(k) else k for k in keys]
  esc = lambda text: str(text).replace("|", "\\|")  # noqa: E731
  lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
  for rec in recs:
    lines.append("| " + " | ".join(esc(cell_text(k, rec.get(k))) for k in keys) + " |")
  return "\n".join(lines) + "\n"


def table(path: str | Path, fmt: str = "markdown", experiment: str | None = None) -> str:
  """The rows under `path` as one CSV table, or one markdown table per experiment."""
  if fmt not in FORMATS:
    raise KvjaxError(f"unknown --format '{fmt}'; use {' or '.join(FORMATS)}")
  rows = load(path, experiment)
  if fmt == "csv":
    return to_csv(records(rows))
  names = list(dict.fromkeys(r["experiment"] for r in rows))
  parts = []
  for name in names:
    recs = records([r for r in rows if r["experiment"] == name])
    parts.append((f"### {name}\n\n" if len(names) > 1 else "") + to_markdown(recs))
  return "\n".join(parts)
