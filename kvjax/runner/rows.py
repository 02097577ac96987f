"""Results files of `kvjax run`: writing rows (JSON, NaN/inf as null, each line ending in a
CRC-32 of itself), reading them back with every corrupt line found and named by its line
number, telling complete cells from partial ones, and repairing a file a killed run left.

A line is corrupt when it is not UTF-8, not JSON, its checksum does not match (a changed
byte), or a `kvjax run` row has a field of the wrong shape (rows written before checksums
are checked by shape only). Corrupt lines are skipped, never fatal: readers warn with the
file and line numbers, and `repair` moves them to `<file>.rejected`, so their cells run
again. Lines without `experiment` or `cell` (a benchmark script's rows) are not `kvjax run`
rows and are passed over silently.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import zlib
from pathlib import Path
from typing import Any

from kvjax.errors import KvjaxError

RUN_FIELDS = ("experiment", "config_hash", "cell", "variant", "workload", "metrics", "config",
              "env", "crc32")
_CRC = re.compile(r', "crc32": "([0-9a-f]{8})"\}$')


def encode(row: dict) -> str:
  """One row as its line (no newline): JSON, then `crc32`, the CRC-32 of the line's text
  without that field, so a reader finds any changed byte."""
  body = json.dumps(clean(row), default=json_default)
  return body[:-1] + f', "crc32": "{zlib.crc32(body.encode()):08x}"}}'


def _is_count(v: Any, least: int) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= least


def shape_problem(row: Any) -> str | None:
  """Why a row cannot be read as a results row (a field of the wrong shape), or None."""
  if not isinstance(row, dict):
    return "not a JSON object"
  if "cell" not in row:  # a row another tool wrote: experiment and metrics are enough
    if "experiment" in row and "config" in row and "env" in row:
      return "cell is missing (a kvjax run row has one)"
    if "metrics" in row and not isinstance(row["metrics"], dict):
      return "metrics is not an object"
    bad = [k for k in ("variant", "workload") if k in row and not isinstance(row[k], dict)]
    return f"{bad[0]} is not an object" if bad else None
  unknown = [k for k in row if k not in RUN_FIELDS]
  if unknown:
    return f"unknown field {unknown[0]!r}"
  if not isinstance(row.get("experiment"), str) or not row["experiment"]:
    return "experiment is not a name"
  if not isinstance(row.get("config_hash"), str) or not row["config_hash"]:
    return "config_hash is not a hash"
  for k in ("variant", "workload", "metrics", "config", "env"):
    if not isinstance(row.get(k), dict):
      return f"{k} is not an object"
  cell = row["cell"]
  if not isinstance(cell, dict) or not isinstance(cell.get("grid"), dict):
    return "cell is not an object with a grid"
  for k, least in (("index", 0), ("of", 1), ("row", 0), ("rows", 1)):
    if not _is_count(cell.get(k), least):
      return f"cell.{k} is not an integer >= {least}"
  if cell["row"] >= cell["rows"]:
    return "cell.row is not below cell.rows"
  return None


def _line_problem(row: Any, line: str) -> str | None:
  if isinstance(row, dict) and "crc32" in row:
    m = _CRC.search(line)
    if not m or zlib.crc32((line[:m.start()] + "}").encode()) != int(m.group(1), 16):
      return ("checksum mismatch (a byte changed after it was written; a row edited on "
              "purpose: remove its crc32)")
  return shape_problem(row)


@dataclasses.dataclass
class Scan:
  """A results file read: its rows, each row's line number, and its corrupt lines
  (`line N: why`)."""
  rows: list = dataclasses.field(default_factory=list)
  numbers: list = dataclasses.field(default_factory=list)
  problems: list = dataclasses.field(default_factory=list)
  torn_end: bool = False  # the last line has no newline


def scan(path: str | Path) -> Scan:
  """Read a results file line by line; corrupt lines go to `problems`, never raise."""
  out = Scan()
  path = Path(path)
  if not path.is_file():
    return out
  data = path.read_bytes()
  out.torn_end = bool(data) and not data.endswith(b"\n")
  lines = data.split(b"\n")
  for n, raw in enumerate(lines, 1):
    if not raw.strip():
      continue
    why = None
    try:
      line = raw.decode("utf-8")
      row = json.loads(line)
      why = _line_problem(row, line)
    except UnicodeDecodeError:
      why = "not UTF-8 text"
    except (ValueError, RecursionError):
      why = ("torn (no newline at the end: a killed run, or one still writing)"
             if n == len(lines) else "not valid JSON")
    if why:
      out.problems.append(f"line {n}: {why}")
    else:
      out.rows.append(row)
      out.numbers.append(n)
  return out


def read_rows(path: str | Path) -> list[dict]:
  """Every readable row of a results file (corrupt lines skipped: see `scan`)."""
  return scan(path).rows


def describe(problems: list[str], most: int = 3) -> str:
  """`N corrupt line(s) (line 3: why; ...)`, at most `most` named."""
  more = f"; {len(problems) - most} more" if len(problems) > most else ""
  noun = "line" if len(problems) == 1 else "lines"
  return f"{len(problems)} corrupt {noun} ({'; '.join(problems[:most])}{more})"


def warn(message: str) -> None:
  print(f"kvjax: warning: {message}", file=sys.stderr)


def complete_rows(rows: list[dict]) -> tuple[list[dict], set[str]]:
  """Rows of cells whose every row is present, and those cells' hashes. A row of the wrong
  shape counts for nothing; a cell's rows that disagree on its row count leave it
  incomplete; the first row of each (cell, row) wins, so rows two runs wrote count once."""
  got: dict[str, set] = {}
  need: dict[str, set] = {}
  for row in rows:
    if not isinstance(row, dict) or "cell" not in row or shape_problem(row):
      continue
    h, cell = row["config_hash"], row["cell"]
    got.setdefault(h, set()).add(cell["row"])
    need.setdefault(h, set()).add(cell["rows"])
  done = {h for h in got if len(need[h]) == 1 and len(got[h]) >= min(need[h])}
  seen, keep = set(), []
  for row in rows:  # a complete cell's rows, each once
    if (not isinstance(row, dict) or "cell" not in row or shape_problem(row)
        or row["config_hash"] not in done):
      continue
    key = (row["config_hash"], row["cell"]["row"])
    if key not in seen:
      seen.add(key)
      keep.append(row)
  return keep, done


def repair(path: Path) -> set[str]:
  """Drop corrupt lines, partial cells (a killed run) and repeated rows from a results file;
  return its complete cells' hashes. Dropped lines are appended to `<file>.rejected` and
  named in one warning line. The caller holds the file's lock (kvjax.runner.claims)."""
  path = Path(path)
  got = scan(path)
  keep, done = complete_rows(got.rows)
  kept = {id(r) for r in keep}
  numbers = {n for r, n in zip(got.rows, got.numbers) if id(r) in kept}
  raw = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), 1)
         if line.strip()] if path.is_file() else []
  if len(numbers) == len(raw) and not got.torn_end:
    return done
  rejected = [line for n, line in raw if n not in numbers]
  if rejected:  # nothing a user might recover is lost
    with open(str(path) + ".rejected", "ab") as f:
      f.write(b"".join(line + b"\n" for line in rejected))
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_bytes(b"".join(line + b"\n" for n, line in raw if n in numbers))
  os.replace(tmp, path)  # atomic: a kill here leaves the old file or the new one
  parts = [describe(got.problems)] if got.problems else []
  if len(rejected) > len(got.problems):
    parts.append(f"{len(rejected) - len(got.problems)} rows of unfinished or repeated cells")
  if parts:
    warn(f"{path}: dropped {' and '.join(parts)}, kept in {path.name}.rejected; "
         "their cells run again")
  return done


def json_default(x: Any) -> Any:
  """`json.dumps(default=)`: numpy / jax values as lists or scalars, anything else as text."""
  if hasattr(x, "tolist"):  # numpy / jax scalars and arrays
    return x.tolist()
  return str(x)


def clean(value: Any) -> Any:
  """NaN/inf are not JSON; write them as null."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: clean(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [clean(v) for v in value]
  return value


def check_rows(name: str, rows: Any) -> list[dict]:
  """An experiment's rows for one cell, or a one-line error naming what its run_cell got
  wrong."""
  if not isinstance(rows, list) or not rows:
    raise KvjaxError(f"experiment '{name}' returned no rows for a cell; run_cell must return "
                     "a non-empty list of dicts")
  for row in rows:
    if not isinstance(row, dict) or not all(isinstance(row.get(k), dict)
                                            for k in ("variant", "workload", "metrics")):
      raise KvjaxError(f"experiment '{name}' returned a row without variant/workload/metrics "
                       "dicts; fix its run_cell")
  return rows
