"""`kvjax run FILE.yaml`: expand a config's grid into cells, run each cell, append rows.

A config names an `experiment:` (a module in the `experiments` package) and a `grid:` of
dotted config keys -> lists; their cartesian product is the set of cells. Keys may be
any config key (`model.n_kv_heads`, `cache.codec`, `workload.batch`, ...) or
`params.<name>` for experiment options, so a new codec or layout joins a grid by name,
with no code change. `--set key=value` overrides the base config; `--set` on a key the
grid sweeps pins it, and `--set grid.KEY=[a,b]` replaces (or adds) an axis.

Paired settings, for every experiment: `params.settings` maps a name to a bundle of
overrides (`k8v4: {cache.k_codec: int8, cache.v_codec: int4}`), and `params.setting`
(usually a grid axis) selects one per cell, so unlike settings sweep side by side instead of
as a cartesian product. A cell's config is composed from its layers (`compose`): the file
< grid coordinates < the selected setting < `--set`, merged into one set, so explicit
`cache.k_codec`/`cache.v_codec` from any layer beat `cache.codec` from any layer. Rows
record the composed config (what ran) and the setting's name in `variant.setting`.
`kvjax run FILE --dry-run` lists the cells with their resolved cache settings.

Results go to OUT/<experiment>.jsonl, one JSON row per line, flushed as written. A cell
is identified by the hash of its resolved config (grid removed) and counts as done only
when all of its rows are in the file, so a rerun skips finished cells, and a run killed
mid-cell leaves no half cell counted as done: on the next run, torn lines and partial
cells are dropped (the file is rewritten atomically) and that cell runs again.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math
import os
import pkgutil
import sys
from pathlib import Path
from typing import Any

import yaml

from kvjax import config as config_lib
from kvjax.errors import KvjaxError

# Metric columns of the summary table, in this order when present.
TABLE_METRICS = ("bytes_per_token", "cache_bytes", "closed_form_bytes", "max_concurrency",
                 "ttft_s", "tpot_s", "tokens_per_s", "speedup_vs_recompute", "peak_bytes",
                 "roofline_fraction", "ppl", "ppl_ref", "kl", "agreement", "recall",
                 "memory_utilization", "prefix_hit_rate")


@dataclasses.dataclass(frozen=True)
class Cell:
  index: int
  coords: dict           # grid key -> value for this cell
  cfg: config_lib.Config

  @property
  def hash(self) -> str:
    return self.cfg.hash()

  def label(self) -> str:
    return " ".join(f"{k.split('.')[-1]}={v}" for k, v in self.coords.items()) or "single cell"


# -- experiments ---------------------------------------------------------------------------
def available_experiments() -> list[str]:
  from kvjax import experiments
  return sorted(m.name for m in pkgutil.iter_modules(experiments.__path__)
                if not m.name.startswith("_"))


def load_experiment(name: str):
  known = available_experiments()
  if not name:
    raise KvjaxError(f"the config names no experiment; add `experiment: NAME` ({', '.join(known)})")
  if name not in known:
    raise KvjaxError(f"unknown experiment '{name}'; available: {', '.join(known)}")
  return importlib.import_module(f"kvjax.experiments.{name}")


# -- grid ------------------------------------------------------------------------------------
def _grid_axes(raw: dict, overrides: dict) -> tuple[dict, dict]:
  """(grid axes key -> values list, remaining plain overrides), in the YAML's key order."""
  axes: dict[str, list] = {}
  if "grid" in raw:
    grid = raw["grid"]
    if not isinstance(grid, dict) or not grid:
      raise KvjaxError("grid: is empty; list values per key (model.n_kv_heads: [8, 2, 1]) "
                       "or remove grid:")
    for key, values in grid.items():
      axes[str(key)] = values if isinstance(values, list) else [values]
  plain = {}
  for key, value in overrides.items():
    if key.startswith("grid."):
      axes[key[5:]] = value if isinstance(value, list) else [value]
    elif key in axes:
      del axes[key]  # --set on a swept key pins it
      plain[key] = value
    else:
      plain[key] = value
  known = set(config_lib.known_keys())
  for key, values in axes.items():
    if key not in known and not (key.startswith("params.") and len(key) > 7):
      raise KvjaxError(f"unknown grid key '{key}'; use a dotted config key (model.n_kv_heads, "
                       "cache.codec, workload.batch, ...) or params.NAME")
    if key in ("grid", "params", "experiment"):
      raise KvjaxError(f"grid key '{key}' cannot be swept; sweep its dotted sub-keys instead")
    if not values:
      raise KvjaxError(f"grid key '{key}' has no values; list at least one or remove it")
  return axes, plain


def _params_of(items: dict) -> dict:
  """The params mapping of a merged set of overrides (`params:` and `params.X` keys)."""
  params = items.get("params") or {}
  if not isinstance(params, dict):
    raise KvjaxError("params: must be a mapping of experiment options (name: value)")
  params = dict(params)
  params.update({k[7:]: v for k, v in items.items() if k.startswith("params.")})
  return params


def setting_overrides(params: dict) -> dict:
  """The overrides of the selected paired setting: `params.setting` names one entry of
  `params.settings` (name -> {dotted key: value}: cache/model/workload keys, or an
  experiment option `params.X` other than the setting itself); {} when none."""
  name = params.get("setting") or ""
  settings = params.get("settings") or {}
  if not name:
    return {}
  if not isinstance(settings, dict) or name not in settings:
    known = ", ".join(settings) if isinstance(settings, dict) and settings else "none defined"
    raise KvjaxError(f"unknown params.setting '{name}'; add it under params.settings "
                     f"(known: {known})")
  over = settings[name]
  if not isinstance(over, dict) or any(
      str(k) in ("params", "params.setting", "params.settings")
      or str(k).startswith(("grid", "experiment")) for k in over):
    raise KvjaxError(f"params.settings.{name} must map config keys to values, e.g. "
                     "{cache.k_codec: int8, cache.v_codec: int4}")
  return {str(k): v for k, v in over.items()}


def _merge(file_items: dict, coords: dict, pinned: dict) -> dict:
  """One cell's layers as one set of overrides (see `compose`), settings table dropped."""
  setting = setting_overrides(_params_of({**file_items, **coords, **pinned}))
  merged = {**file_items, **coords, **setting, **pinned}
  params = _params_of(merged)
  params.pop("settings", None)
  items = {k: v for k, v in merged.items() if not k.startswith("params.") and k != "grid"}
  items["params"] = params
  return items


def compose(file_items: dict, coords: dict, pinned: dict, check: bool = True
            ) -> config_lib.Config:
  """One cell's config from its layers, in this precedence (later wins on the same key):
  the file < the grid coordinates < the selected paired setting < --set (pinned). All layers
  are merged into one set before they are applied, so an explicit `cache.k_codec`/`v_codec`
  from any layer beats `cache.codec` from any layer. The settings table itself is dropped
  from the cell's params (the setting's name stays): the config is exactly what runs."""
  return config_lib.apply_overrides(config_lib.Config(), _merge(file_items, coords, pinned),
                                    check)


def _effective(coords: dict, items: dict) -> dict:
  """Coordinates minus a `cache.codec` value that explicit K and V codecs override."""
  if "cache.codec" in coords and {"cache.k_codec", "cache.v_codec"} <= set(items):
    return {k: v for k, v in coords.items() if k != "cache.codec"}
  return coords


def expand(path: str | Path, overrides: list[str] | dict | None = None
           ) -> tuple[config_lib.Config, list[Cell]]:
  """Read a config file and return (base config, validated cells), nothing run yet."""
  # File-level errors (missing, malformed, unknown keys) come from here, one line each;
  # shape checks wait for the cells: a base may be valid only with each cell's values.
  config_lib.load(path, check=False)
  raw = yaml.safe_load(Path(path).read_text()) or {}
  over = overrides if isinstance(overrides, dict) else config_lib.parse_set(overrides)
  axes, plain = _grid_axes(raw, over or {})
  file_items = config_lib.flat(raw)
  base = compose(file_items, {}, plain, check=False)
  cells, seen = [], set()
  keys = list(axes)
  for combo in itertools.product(*(axes[k] for k in keys)):
    coords = dict(zip(keys, combo))
    try:
      cfg = compose(file_items, coords, plain)
      coords = _effective(coords, _merge(file_items, coords, plain))
    except KvjaxError as e:
      raise KvjaxError(f"grid cell {_coords_str(coords)}: {e}") from None
    cell = Cell(len(cells), coords, cfg)
    if cell.hash not in seen:  # a value listed twice is one cell
      seen.add(cell.hash)
      cells.append(cell)
  if "cache.codec" in axes and all("cache.codec" not in c.coords for c in cells):
    print("kvjax run: note: the grid's cache.codec axis has no effect here: explicit "
          "cache.k_codec and cache.v_codec beat cache.codec", file=sys.stderr)
  return base, cells


def _coords_str(coords: dict) -> str:
  return "(" + ", ".join(f"{k}={v}" for k, v in coords.items()) + ")"


# -- results file -----------------------------------------------------------------------------
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


def _repair(path: Path) -> set[str]:
  """Drop torn lines and partial cells left by a killed run; return the done hashes."""
  if not path.is_file():
    return set()
  text = path.read_text()
  rows = read_rows(path)
  keep, done = complete_rows(rows)
  n_lines = sum(1 for line in text.splitlines() if line.strip())
  if len(keep) != n_lines or (text and not text.endswith("\n")):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, default=_json_default) + "\n" for r in keep))
    os.replace(tmp, path)  # atomic: a kill here leaves the old file or the new one
  return done


def _json_default(x: Any) -> Any:
  if hasattr(x, "tolist"):  # numpy / jax scalars and arrays
    return x.tolist()
  return str(x)


def _clean(value: Any) -> Any:
  """NaN/inf are not JSON; write them as null."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _clean(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_clean(v) for v in value]
  return value


def _check_rows(name: str, rows: Any) -> list[dict]:
  if not isinstance(rows, list) or not rows:
    raise KvjaxError(f"experiment '{name}' returned no rows for a cell; run_cell must return "
                     "a non-empty list of dicts")
  for row in rows:
    if not isinstance(row, dict) or not all(isinstance(row.get(k), dict)
                                            for k in ("variant", "workload", "metrics")):
      raise KvjaxError(f"experiment '{name}' returned a row without variant/workload/metrics "
                       "dicts; fix its run_cell")
  return rows


# -- run ---------------------------------------------------------------------------------------
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
  load_experiment(base.experiment)
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
  check = getattr(module, "check", None)
  for cell in cells:  # host-side limits of every cell before anything runs
    if check is not None:
      try:
        check(cell.cfg)
      except KvjaxError as e:
        raise KvjaxError(f"grid cell {_coords_str(cell.coords)}: {e}") from None
  path_out = _out_path(base, out_dir)
  path_out.parent.mkdir(parents=True, exist_ok=True)
  done = _repair(path_out)
  todo = [c for c in cells if c.hash not in done]
  print(f"kvjax run: {name}: {len(cells)} cells, {len(cells) - len(todo)} already done, "
        f"{len(todo)} to run -> {path_out}", file=sys.stderr)
  bar = tqdm(todo, desc=name, unit="cell", disable=not progress or not todo, file=sys.stderr,
             dynamic_ncols=True)
  with path_out.open("a") as f:
    for cell in bar:
      bar.set_postfix_str(cell.label())
      try:
        rows = _check_rows(name, module.run_cell(cell.cfg))
      except KvjaxError as e:
        raise KvjaxError(f"grid cell {_coords_str(cell.coords)}: {e}") from None
      env = metrics.environment()
      setting = cell.cfg.param("setting", "")
      for j, row in enumerate(rows):
        variant = {**row["variant"], "setting": setting} if setting else row["variant"]
        full = {"experiment": name, "config_hash": cell.hash,
                "cell": {"index": cell.index, "of": len(cells), "row": j, "rows": len(rows),
                         "grid": cell.coords},
                "variant": variant, "workload": row["workload"],
                "metrics": row["metrics"], "config": cell.cfg.to_dict(), "env": env}
        f.write(json.dumps(_clean(full), default=_json_default) + "\n")
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


# -- summary table -----------------------------------------------------------------------------
def flatten(row: dict, all_metrics: bool = False) -> dict:
  """Variant and workload fields, then the known metrics (`TABLE_METRICS`), as one flat
  record; with `all_metrics`, every other scalar metric after them (`kvjax results`)."""
  rec = {}
  for section in ("variant", "workload"):
    for k, v in row.get(section, {}).items():
      if not isinstance(v, (dict, list)):
        rec[k] = v
  metrics = row.get("metrics", {})
  for k in TABLE_METRICS:
    if metrics.get(k) is not None:
      rec[k] = metrics[k]
  if all_metrics:
    for k, v in metrics.items():
      if k not in rec and not isinstance(v, (dict, list)):
        rec[k] = v
  return rec


def _human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
    n /= 1024
  return str(n)


def _is_seconds(key: str) -> bool:
  return key.endswith("_s") and not key.endswith("per_s")


def _cell_text(key: str, v: Any) -> str:
  if v is None:
    return "-"
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return str(v)
  if key.endswith("bytes"):
    return _human_bytes(v)
  if _is_seconds(key):
    return f"{v * 1e3:,.0f}" if v * 1e3 >= 1e4 else f"{v * 1e3:.4g}"
  if abs(v) >= 1e4:
    return f"{v:,.0f}"
  return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_table(records: list[dict], drop_constant: bool = False) -> str:
  """A plain aligned text table; with `drop_constant`, non-metric columns that never vary
  are dropped (the generic table of an experiment without its own `summary`)."""
  if not records:
    return "(no rows)"
  keys: list[str] = []
  for rec in records:
    keys += [k for k in rec if k not in keys]
  if drop_constant and len(records) > 1:
    metric_like = set(TABLE_METRICS)
    keys = [k for k in keys if k in metric_like or len({str(r.get(k)) for r in records}) > 1]
  heads = [k[:-2] + "_ms" if _is_seconds(k) else k for k in keys]
  body = [[_cell_text(k, rec.get(k)) for k in keys] for rec in records]
  widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(heads)]
  line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
  return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(r) for r in body])
