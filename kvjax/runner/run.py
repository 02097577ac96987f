"""Running a grid: `run_file` runs every unfinished cell and appends its rows, `dry_run`
lists the cells and their resolved cache settings without running anything.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.runner.grid import Cell, check_params, coords_str, expand, load_experiment
from kvjax.runner.rows import check_rows, clean, complete_rows, json_default, read_rows, repair
from kvjax.runner.table import flatten, format_table


CELL_CACHE_KEYS = ("k_codec", "v_codec", "k_axis", "group_size", "residual", "layout")


def cell_record(cell: Cell) -> dict:
  """What `--dry-run` lists for a cell: its grid coordinates, setting and resolved cache."""
  c, m = cell.cfg.cache, cell.cfg.model
  rec = {"cell": cell.index}
  rec.update({k.split(".")[-1]: v for k, v in cell.coords.items()})
  if cell.cfg.param("setting", ""):
    rec["setting"] = cell.cfg.param("setting")
  rec["variant"] = m.variant
  rec.update({k: getattr(c, k) for k in CELL_CACHE_KEYS})
  return rec


def _out_path(base: config_lib.Config, out_dir) -> Path:
  out = Path(out_dir) if out_dir else Path("results") / (base.name or base.experiment)
  return out / f"{base.experiment}.jsonl"


def dry_run(path: str | Path, overrides: list[str] | dict | None = None,
            out_dir: str | Path | None = None) -> dict:
  """List the cells `run_file` would run, with their resolved cache settings; run nothing
  (nor the experiment's own checks, which may need checkpoints), write nothing."""
  base, cells = expand(path, overrides)
  check_params(load_experiment(base.experiment), cells)
  path_out = _out_path(base, out_dir)
  done = complete_rows(read_rows(path_out))[1]
  recs = [{**cell_record(c), "status": "done" if c.hash in done else "to run"} for c in cells]
  print(f"kvjax run --dry-run: {base.experiment}: {len(cells)} cells "
        f"({sum(r['status'] == 'done' for r in recs)} already in {path_out}); nothing run")
  print(format_table(recs))
  return {"experiment": base.experiment, "path": str(path_out), "cells": len(cells),
          "ran": 0, "records": recs}


def run_file(path: str | Path, overrides: list[str] | dict | None = None,
             out_dir: str | Path | None = None, progress: bool = True) -> dict:
  """Run every unfinished cell of a config; print a summary table; return a short report."""
  from tqdm import tqdm

  from kvjax import metrics

  base, cells = expand(path, overrides)
  name = base.experiment
  module = load_experiment(name)
  if not cells:
    raise KvjaxError("the grid expands to no cells; give every grid key at least one value")
  check_params(module, cells)
  check = getattr(module, "check", None)
  for cell in cells:  # host-side limits of every cell before anything runs
    if check is not None:
      try:
        check(cell.cfg)
      except KvjaxError as e:
        raise KvjaxError(f"grid cell {coords_str(cell.coords)}: {e}") from None
  path_out = _out_path(base, out_dir)
  path_out.parent.mkdir(parents=True, exist_ok=True)
  done = repair(path_out)
  todo = [c for c in cells if c.hash not in done]
  print(f"kvjax run: {name}: {len(cells)} cells, {len(cells) - len(todo)} already done, "
        f"{len(todo)} to run -> {path_out}", file=sys.stderr)
  bar = tqdm(todo, desc=name, unit="cell", disable=not progress or not todo, file=sys.stderr,
             dynamic_ncols=True)
  with path_out.open("a") as f:
    for cell in bar:
      bar.set_postfix_str(cell.label())
      try:
        rows = check_rows(name, module.run_cell(cell.cfg))
      except KvjaxError as e:
        raise KvjaxError(f"grid cell {coords_str(cell.coords)}: {e}") from None
      env = metrics.environment()
      setting = cell.cfg.param("setting", "")
      for j, row in enumerate(rows):
        variant = {**row["variant"], "setting": setting} if setting else row["variant"]
        full = {"experiment": name, "config_hash": cell.hash,
                "cell": {"index": cell.index, "of": len(cells), "row": j, "rows": len(rows),
                         "grid": cell.coords},
                "variant": variant, "workload": row["workload"],
                "metrics": row["metrics"], "config": cell.cfg.to_dict(), "env": env}
        f.write(json.dumps(clean(full), default=json_default) + "\n")
        f.flush()
      os.fsync(f.fileno())
  bar.close()
  hashes = {c.hash for c in cells}
  rows = [r for r in complete_rows(read_rows(path_out))[0] if r["config_hash"] in hashes]
  rows.sort(key=lambda r: (r["cell"]["index"], r["cell"]["row"]))
  summary = getattr(module, "summary", None)
  records = summary(rows) if summary else [flatten(r) for r in rows]
  for title, recs in (records if isinstance(records, dict) else {"": records}).items():
    print(f"\n{title}" if title else "")
    print(format_table(recs, drop_constant=summary is None))
  print(f"{len(rows)} rows in {path_out}", file=sys.stderr)
  return {"experiment": name, "path": str(path_out), "cells": len(cells), "ran": len(todo),
          "rows": len(rows)}
