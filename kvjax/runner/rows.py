"""Results files of `kvjax run`: reading rows, telling complete cells from partial ones,
repairing a file a killed run left, and writing rows as JSON (NaN/inf as null).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from kvjax.errors import KvjaxError


def read_rows(path: str | Path) -> list[dict]:
  """Every complete JSON row of a results file (torn or foreign lines are skipped)."""
  rows = []
  path = Path(path)
  if not path.is_file():
    return rows
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(row, dict):
      rows.append(row)
  return rows


def complete_rows(rows: list[dict]) -> tuple[list[dict], set[str]]:
  """Rows of cells whose every row is present, and those cells' hashes."""
  got: dict[str, set] = {}
  need: dict[str, int] = {}
  for row in rows:
    cell = row.get("cell") or {}
    h = row.get("config_hash")
    if h is None or "row" not in cell or "rows" not in cell:
      continue
    got.setdefault(h, set()).add(cell["row"])
    need[h] = cell["rows"]
  done = {h for h in got if len(got[h]) >= need[h] and need[h] > 0}
  seen, keep = set(), []
  for row in rows:  # a complete cell's rows, each once
    h = row.get("config_hash")
    key = (h, (row.get("cell") or {}).get("row"))
    if h in done and key not in seen:
      seen.add(key)
      keep.append(row)
  return keep, done


def repair(path: Path) -> set[str]:
  """Drop torn lines and partial cells left by a killed run; return the done hashes."""
  if not path.is_file():
    return set()
  text = path.read_text()
  rows = read_rows(path)
  keep, done = complete_rows(rows)
  n_lines = sum(1 for line in text.splitlines() if line.strip())
  if len(keep) != n_lines or (text and not text.endswith("\n")):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, default=json_default) + "\n" for r in keep))
    os.replace(tmp, path)  # atomic: a kill here leaves the old file or the new one
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
