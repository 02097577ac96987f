"""`kvjax results DIR|FILE --format csv|markdown`: results rows as a table to paste.

Each row is flattened by `runner.flatten` (kvjax.lab.runner.table: its variant and workload
fields, the known metrics, then every other scalar metric), with its experiment first. CSV
keeps raw values in SI units (seconds, bytes) and every column; markdown formats them as
the run's summary table does (times in ms, bytes in one unit per column, one number format
per column, newlines and `|` escaped) and shows a compact set of columns by default: the
fields that tell its rows apart (`table.identity`'s cache keys, and the variant and workload
fields that vary), then the headline metrics (`COMPACT_METRICS`). In markdown a relative
metric (`dppl_rel`) reads as a percentage (`dppl_%`), and a metric with a 95 % interval
carries it in brackets in its own cell (CSV keeps them as `_ci95_lo`/`_hi` columns).
`--columns a,b,c` chooses the columns of either format (`all`: every one).

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
from kvjax.lab import rowfile
from kvjax.lab.rowfile import describe, warn
from kvjax.lab.runner.table import column_text, flatten, identity, is_seconds

FORMATS = ("csv", "markdown")
# Metrics a default markdown table shows, in this order, when its rows have them.
COMPACT_METRICS = ("bytes_per_token", "ttft_s", "tpot_s", "tokens_per_s", "tpot_vs_ref",
                   "tpot_vs_ref_ci95_lo", "tpot_vs_ref_ci95_hi", "max_concurrency",
                   "roof_fraction", "roof_check", "memory_utilization", "ppl",
                   "dppl_rel", "kl", "agreement", "recall", "accuracy")
ALWAYS = ("variant", "codec", "setting")  # shown when present, varying or not


def load(path: str | Path, experiment: str | None = None) -> list[dict]:
  """Results rows of a .jsonl file or of every .jsonl under a folder (kvjax.lab.rowfile's
  `read_folder`, the reader `kvjax plot` and a resumed run use too)."""
  path = Path(path)
  if not path.exists():
    raise KvjaxError(f"no results file or folder {path}; pass what `kvjax run --out` wrote")
  why = rowfile.file_problem(path)
  if why and not path.is_dir():  # a FIFO would block the read forever
    raise KvjaxError(f"results path {path} {why}; pass what `kvjax run --out` wrote")
  rows, problems = [], []
  for got in rowfile.read_folder(path):
    problems += [f"{got.path}: {describe(got.problems)}"] if got.problems else []
    rows += got.rows
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
  """Every row as one flat record (its experiment, variant and workload fields, then every
  scalar metric), with the cache keys that tell the rows apart (`table.identity`)."""
  ids = identity([r.get("config") or {} for r in rows])
  out = []
  for r, d in zip(rows, ids):
    rec = {"experiment": r["experiment"], **flatten(r, all_metrics=True)}
    out.append({**rec, **{k: v for k, v in d.items() if k not in rec}})
  return out


SHADOWED = {"k_codec": "codec", "v_codec": "codec"}  # shown by `codec` when it is there


def compact(recs: list[dict], fields: set) -> list[str]:
  """The default markdown columns: the `fields` (variant, workload and identity keys) that
  vary between the records, and `ALWAYS`, then the headline metrics."""
  keys = _columns(recs)
  varying = [k for k in keys if k in fields and len({repr(r.get(k)) for r in recs}) > 1]
  fixed = [k for k in ALWAYS if k in keys and any(r.get(k) not in (None, "") for r in recs)]
  front = [k for k in dict.fromkeys(fixed + varying) if SHADOWED.get(k) not in keys]
  return front + [k for k in COMPACT_METRICS if k in keys]


def choose(recs: list[dict], columns: str | None, default) -> list[str]:
  """`--columns` (comma-separated names, or `all`) against the records' columns."""
  keys = _columns(recs)
  if not columns:
    return default(recs)
  if columns.strip() == "all":
    return keys
  asked = [c.strip() for c in columns.split(",") if c.strip()]
  named = {_head(k): k for k in keys}
  bad = [c for c in asked if c not in keys and c not in named]
  if bad or not asked:
    raise KvjaxError(f"--columns names no column '{bad[0] if bad else columns}'; these rows "
                     f"have: {', '.join(keys)} (or all)")
  return [named.get(c, c) for c in asked]


def _columns(recs: list[dict]) -> list[str]:
  keys: list[str] = []
  for rec in recs:
    keys += [k for k in rec if k not in keys]
  return keys


def to_csv(recs: list[dict], columns: str | None = None) -> str:
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=choose(recs, columns, _columns), lineterminator="\n",
                          extrasaction="ignore")
  writer.writeheader()
  writer.writerows(recs)
  return buf.getvalue()


def escape(text: str) -> str:
  """A cell's text for a markdown table: `|` and line breaks escaped, one line."""
  return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\r", "\\r") \
      .replace("\n", "\\n")


def _head(key: str) -> str:
  """A column's markdown name: seconds in ms, a relative metric in percent."""
  return key[:-2] + "_ms" if is_seconds(key) else key[:-4] + "_%" if key.endswith("_rel") \
      else key


def _column(key: str, recs: list[dict]) -> list[str]:
  """A markdown column: `column_text`'s, a relative metric in percent with its sign, and
  the interval (`KEY_ci95_lo`, `_hi`) in brackets, in the column's format, where a record
  has one."""
  lo, hi = f"{key}_ci95_lo", f"{key}_ci95_hi"
  rel = key.endswith("_rel")
  def num(v):
    return 100 * v if rel and isinstance(v, (int, float)) and not isinstance(v, bool) else v
  vals = [num(r.get(key)) for r in recs]
  ends = [(num(r.get(lo)), num(r.get(hi))) for r in recs]
  flat = column_text(key, vals + [e for pair in ends for e in pair if e is not None])
  texts, it = flat[:len(vals)], iter(flat[len(vals):])
  def signed(t, v):
    return "+" + t if rel and isinstance(v, (int, float)) and v > 0 else t
  out = []
  for t, v, (a, b) in zip(texts, vals, ends):
    ci = f" [{signed(next(it), a)}, {signed(next(it), b)}]" if a is not None and b is not None \
        else ""
    out.append(signed(t, v) + ci)
  return out


def to_markdown(recs: list[dict], columns: str | None = None, fields: set = frozenset()) -> str:
  keys = choose(recs, columns, lambda rs: compact(rs, fields))
  shown = set(keys)
  keys = [k for k in keys if not (k.endswith(("_ci95_lo", "_ci95_hi")) and
                                  k.rsplit("_ci95_", 1)[0] in shown)]  # in their metric's cell
  heads = [_head(k) for k in keys]
  cols = [_column(k, recs) for k in keys]
  lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
  lines += ["| " + " | ".join(escape(c) for c in cells) + " |" for cells in zip(*cols)]
  return "\n".join(lines) + "\n"


def table(path: str | Path, fmt: str = "markdown", experiment: str | None = None,
          columns: str | None = None) -> str:
  """The rows under `path` as one CSV table, or one markdown table per experiment."""
  if fmt not in FORMATS:
    raise KvjaxError(f"unknown --format '{fmt}'; use {' or '.join(FORMATS)}")
  rows = load(path, experiment)
  if fmt == "csv":
    return to_csv(records(rows), columns)
  names = list(dict.fromkeys(r["experiment"] for r in rows))
  parts = []
  for name in names:
    mine = [r for r in rows if r["experiment"] == name]
    recs = records(mine)
    fields = {k for r in mine for sec in ("variant", "workload") for k in r.get(sec) or {}}
    fields |= {k for d in identity([r.get("config") or {} for r in mine]) for k in d}
    parts.append((f"### {name}\n\n" if len(names) > 1 else "")
                 + to_markdown(recs, columns, fields))
  return "\n".join(parts)
