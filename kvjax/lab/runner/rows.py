"""Results files of `kvjax run`: writing rows (JSON, NaN/inf as null, each line ending in a
CRC-32 of itself), and repairing a file a killed run left (`repair` moves corrupt lines,
partial cells and repeated rows to `<file>.rejected`, so their cells run again).

Reading is kvjax.lab.rowfile's, the one reader every command uses (its names are re-exported
here): every corrupt line found and named by its line number, complete cells told from
partial ones.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

from kvjax.errors import KvjaxError
from kvjax.lab.rowfile import (
    RUN_FIELDS, Scan, complete_rows, describe, read_rows, scan, shape_problem, warn)

__all__ = ["RUN_FIELDS", "Scan", "check_rows", "clean", "complete_rows", "describe", "encode",
           "json_default", "read_rows", "repair", "scan", "shape_problem", "warn"]


def encode(row: dict) -> str:
  """One row as its line (no newline): JSON, then `crc32`, the CRC-32 of the line's text
  without that field, so a reader finds any changed byte."""
  body = json.dumps(clean(row), default=json_default)
  return body[:-1] + f', "crc32": "{zlib.crc32(body.encode()):08x}"}}'


def repair(path: Path) -> set[str]:
  """Drop corrupt lines, partial cells (a killed run) and repeated rows from a results file;
  return its complete cells' hashes. Dropped lines are appended to `<file>.rejected` and
  named in one warning line. The caller holds the file's lock (kvjax.lab.claims)."""
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
