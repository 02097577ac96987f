"""The one reader of results rows: `kvjax results`, `kvjax plot`, a resumed `kvjax run` and
the Python API (`kvjax.results`, `kvjax.plot`) read results files through `scan` and
results folders through `read_folder`, so a row one of them refuses none of them uses.

A line is corrupt when it is not UTF-8, not strict JSON (kvjax.config.jsonfile: no NaN or
infinity, no over-long number, no deep nesting), its checksum does not match (a changed
byte), or a row of `kvjax run` has a field of the wrong shape (rows written before checksums
are checked by shape only): `shape_problem`. A row with an `experiment` is a results row and
needs its `variant`, `workload` and `metrics` objects, an experiment name that is a name
(not `../../x`: plots write folders named after it), and a `config` whose sections are
objects; a row of `kvjax run` (one with a `cell`) needs every field. Corrupt lines are
skipped, never fatal: readers warn with the file and line numbers. Lines without
`experiment` (a benchmark script's rows) are not results rows: `scan` keeps them (they are
counted, not plotted), `read_folder` sets them apart as `foreign`. This module imports no
JAX, so `kvjax plot` and `kvjax results` start fast.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import zlib
from pathlib import Path
from typing import Any

from kvjax.config import jsonfile

RUN_FIELDS = ("experiment", "config_hash", "cell", "variant", "workload", "metrics", "config",
              "env", "crc32")
CRC = re.compile(r', "crc32": "([0-9a-f]{8})"\}$')
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
# Config sections that are objects, and fields that are text, when a row's config has them.
CONFIG_OBJECTS = ("model", "cache", "workload", "mesh", "train", "grid", "params")
CONFIG_TEXTS = ("name", "experiment", "tokenizer")


def is_name(value: Any) -> bool:
  """A name a folder or module may carry: letters, digits, `_.+-`, not `.`/`..`-led."""
  return isinstance(value, str) and bool(NAME.fullmatch(value)) and ".." not in value


def _is_count(v: Any, least: int) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _config_problem(cfg: Any) -> str | None:
  if not isinstance(cfg, dict):
    return "config is not an object"
  for k in CONFIG_OBJECTS:
    if k in cfg and not isinstance(cfg[k], dict):
      return f"config.{k} is not an object"
  for k in CONFIG_TEXTS:
    if k in cfg and cfg[k] is not None and not isinstance(cfg[k], str):
      return f"config.{k} is not text"
  if cfg.get("name") and not is_name(cfg["name"]):
    return "config.name is not a name"
  return None


def shape_problem(row: Any) -> str | None:
  """Why a row cannot be read as a results row (a field missing or of the wrong shape), or
  None (also for a row that is not a results row: no `experiment`)."""
  if not isinstance(row, dict):
    return "not a JSON object"
  if "cell" not in row:
    if "experiment" not in row:  # another tool's row: not read as results
      if "metrics" in row and not isinstance(row["metrics"], dict):
        return "metrics is not an object"
      return None
    if "config" in row and "env" in row:
      return "cell is missing (a kvjax run row has one)"
  else:
    unknown = [k for k in row if k not in RUN_FIELDS]
    if unknown:
      return f"unknown field {unknown[0]!r}"
    missing = [k for k in RUN_FIELDS[:-1] if k not in row]
    if missing:
      return f"{missing[0]} is missing"
  if not is_name(row.get("experiment")):
    return "experiment is not a name"
  for k in ("variant", "workload", "metrics"):
    if not isinstance(row.get(k), dict):
      return f"{k} is {'missing' if k not in row else 'not an object'}"
  if "env" in row and not isinstance(row["env"], dict):
    return "env is not an object"
  if "config" in row and (why := _config_problem(row["config"])):
    return why
  if "cell" not in row:
    return None
  if not isinstance(row.get("config_hash"), str) or not row["config_hash"]:
    return "config_hash is not a hash"
  cell = row["cell"]
  if not isinstance(cell, dict) or not isinstance(cell.get("grid"), dict):
    return "cell is not an object with a grid"
  for k, least in (("index", 0), ("of", 1), ("row", 0), ("rows", 1)):
    if not _is_count(cell.get(k), least):
      return f"cell.{k} is not an integer >= {least}"
  if cell["row"] >= cell["rows"]:
    return "cell.row is not below cell.rows"
  return None


def line_problem(row: Any, line: str) -> str | None:
  """`shape_problem`, after the line's checksum when it has one."""
  if isinstance(row, dict) and "crc32" in row:
    m = CRC.search(line)
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


def file_problem(path: str | Path) -> str | None:
  """Why `path`, which exists, cannot be read as a results file (a FIFO, a folder), or None."""
  why = jsonfile.regular_problem(path)
  return None if why in (None, "does not exist") else why


def scan(path: str | Path) -> Scan:
  """Read a results file line by line; corrupt lines go to `problems`, never raise. A path
  that is not a regular file (a FIFO would block) is one problem, not read."""
  out = Scan()
  path = Path(path)
  why = jsonfile.regular_problem(path)
  if why == "does not exist":
    return out
  if why:
    out.problems.append(f"not read: {why}")
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
      row = jsonfile.loads(line)
      why = line_problem(row, line)
    except UnicodeDecodeError:
      why = "not UTF-8 text"
    except jsonfile.JsonProblem as e:
      why = ("torn (no newline at the end: a killed run, or one still writing)"
             if n == len(lines) else f"not valid JSON ({e})")
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
  ok = [r for r in rows if isinstance(r, dict) and "cell" in r and not shape_problem(r)]
  for row in ok:
    h, cell = row["config_hash"], row["cell"]
    got.setdefault(h, set()).add(cell["row"])
    need.setdefault(h, set()).add(cell["rows"])
  done = {h for h in got if len(need[h]) == 1 and len(got[h]) >= min(need[h])}
  seen, keep = set(), []
  for row in ok:  # a complete cell's rows, each once
    key = (row["config_hash"], row["cell"]["row"])
    if row["config_hash"] in done and key not in seen:
      seen.add(key)
      keep.append(row)
  return keep, done


@dataclasses.dataclass
class FileRead:
  """One file of a folder: its results rows kept, and what was passed over."""
  path: Path
  rows: list
  problems: list  # corrupt lines (`line N: why`), or why the file was not read
  foreign: int  # rows that are not results rows (no experiment: a benchmark's own rows)
  repeated: int  # rows of cells an earlier line or file of the same folder holds


def read_folder(path: str | Path) -> list[FileRead]:
  """Every *.jsonl under a folder (or the one file `path`), in order: results rows only, a
  cell's row (same experiment, config, config hash and row number) that an earlier line or file of the same
  folder already holds left out (runs that shared it, `--shard` parts: the first wins; the
  same cell in another folder, another machine's run say, is kept)."""
  path = Path(path)
  files = sorted(f for f in path.rglob("*.jsonl") if not f.is_dir()) if path.is_dir() \
      else [path]
  out, seen = [], set()
  for f in files:
    got = scan(f)
    rows, foreign, repeated = [], 0, 0
    for r in got.rows:
      if "experiment" not in r:
        foreign += 1
        continue
      key = None if "cell" not in r else (f.parent, r["experiment"], r["config_hash"],
                                          r["cell"]["row"], json.dumps(r["config"],
                                                                       sort_keys=True))
      if key is not None and key in seen:
        repeated += 1
        continue
      seen.add(key)
      rows.append(r)
    out.append(FileRead(f, rows, got.problems, foreign, repeated))
  return out
