"""`kvjax results DIR|FILE --format csv|markdown`: results rows as a table to paste.

Each row is flattened by `runner.flatten` (kvjax.runner.table: its variant and workload
fields, the known metrics, then every other scalar metric), with its experiment first. CSV
keeps raw values in SI units (seconds, bytes); markdown formats them as the run's summary
table does (times in ms, bytes in KiB/MiB/GiB).

The files of one folder are merged (a sweep split with `--shard`, or runs that shared it): a
row of a cell that an earlier file or line of the same folder already holds is left out (the
first complete row of a cell wins); the same cell in another folder is another run (another
machine, say) and is kept. Corrupt lines are skipped with one warning line per file
naming their line numbers; when no row is left, the error names them instead.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from kvjax.errors import KvjaxError
from kvjax.runner.rows import describe, scan, warn
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
  rows, seen, problems = [], set(), []
  for f in files:
    got = scan(f)
    problems += [f"{f}: {describe(got.problems)}"] if got.problems else []
    for r in got.rows:
      key = (f.parent, r["config_hash"], r["cell"]["row"]) if "cell" in r else None
      if isinstance(r.get("metrics"), dict) and isinstance(r.get("experiment"), str) and (
          key is None or key not in seen):
        seen.add(key)
        rows.append(r)
  if not rows:
    why = f" ({'; '.join(problems)})" if problems else ""
    raise KvjaxError(f"no readable results rows in {path}{why}; run `kvjax run CONFIG --out "
                     f"{path if path.is_dir() else path.parent}` first")
  for line in problems:
    warn(f"{line} skipped")
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
