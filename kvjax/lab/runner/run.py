"""Running a grid: `run_file` runs every unfinished cell and appends its rows, `dry_run`
lists the cells and their resolved cache settings without running anything.

Runs that share a folder never duplicate a row: a run claims a cell before running it and
re-reads the results under the results file's lock before it appends (kvjax.lab.claims),
so a second run takes only the cells nobody holds or has finished, then waits for the held
ones (running any whose holder ended without finishing). `--shard I/N` runs one part of the
grid into its own file (kvjax.lab.runner.shard); a cell counts as done when it is complete in
any of the experiment's files in the folder.

An experiment whose `run_cell` takes `scratch` gets a folder of its own per cell
(`OUT/.kvjax-partial/<cell hash>`) to save its state in as it goes, so a cell killed midway
resumes there; the folder is removed once the cell's rows are written.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from pathlib import Path

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab import rowfile
from kvjax.lab import claims
from kvjax.lab.runner import shard as shard_lib
from kvjax.lab.runner.grid import Cell, check_params, coords_str, expand, load_experiment
from kvjax.lab.runner.rows import check_rows, complete_rows, describe, encode, repair, scan, warn
from kvjax.lab.runner.table import flatten, format_table, identity, with_identity


PARTIAL_DIR = ".kvjax-partial"
CELL_CACHE_KEYS = ("k_codec", "v_codec", "k_axis", "group_size", "residual", "layout")


def _models_variant(cfg) -> str | None:
  """The variants of the real models a cell runs (`params.models`), from their shapes, not
  the config's placeholder `model:` section (which only sizes the checks); None when the
  cell names none, or one whose shape cannot be read without loading it."""
  from kvjax.config.schema import variant_name
  from kvjax.io import sources, zoo

  models = cfg.param("models", ())
  models = (models,) if isinstance(models, str) else tuple(models or ())
  names = []
  for spec in models:
    try:
      src = sources.parse(str(spec))
    except KvjaxError:
      return None
    if src.kind == "gguf" and src.ref in zoo.MODELS:
      names.append(variant_name(*zoo.MODELS[src.ref].heads))
    elif src.kind == "config":
      names.append(config_lib.load(src.ref).model.variant)
    else:
      return None
  return ", ".join(dict.fromkeys(names)) or None


def cell_record(cell: Cell, differs: dict | None = None, cfg=None,
                interleaved: str | None = None) -> dict:
  """What `--dry-run` lists for a cell: its grid coordinates, setting, resolved cache and
  `differs`, the other cache keys that differ between the cells (`table.identity`); for one
  of the cell's interleaved variants (`params.interleave`), that variant's name and cache."""
  cfg = cfg or cell.cfg
  c, m = cfg.cache, cfg.model
  rec = {"cell": cell.index}
  rec.update({k.split(".")[-1]: v for k, v in cell.coords.items()})
  if interleaved is not None:
    rec["interleaved"] = interleaved
  if cell.cfg.param("setting", ""):
    rec["setting"] = cell.cfg.param("setting")
  rec["variant"] = _models_variant(cfg) or m.variant
  rec.update({k: getattr(c, k) for k in CELL_CACHE_KEYS})
  shown = set(rec) | {"codec"}  # (the K and V codecs are there)
  rec.update({k: v for k, v in (differs or {}).items() if k not in shown})
  return rec


def _pairs(value) -> dict | None:
  """A mapping as a config holds it (a dict, or frozen to (key, value) pairs), or None."""
  if isinstance(value, dict):
    return dict(value)
  if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
    return dict(value)
  return None


def variant_records(cell: Cell, differs: dict | None = None) -> list[dict]:
  """`cell_record` of every variant the cell runs: one per `params.interleave` entry (the
  reference first, as the experiments order them), one per `params.caches` entry (each
  with its own cache's columns), else the cell itself."""
  caches = _pairs(cell.cfg.param("caches", None))
  if caches:
    out = []
    for name, over in caches.items():
      try:
        cfg = config_lib.apply_overrides(
            cell.cfg, {str(k): v for k, v in (_pairs(over) or {}).items()})
      except KvjaxError:
        return [cell_record(cell, differs)]  # the experiment's check names what is wrong
      rec = cell_record(cell, differs, cfg)
      out.append({**{k: v for k, v in rec.items() if k != "layout"}, "cache": str(name),
                  "policy": cfg.cache.policy, "layout": cfg.cache.layout})
    return out
  table = _pairs(cell.cfg.param("interleave", None))
  if not table:
    return [cell_record(cell, differs)]
  ref = cell.cfg.param("reference", None) or next(
      (n for n, o in table.items() if not o), next(iter(table)))
  names = sorted(table, key=lambda n: str(n) != str(ref))
  out = []
  for name in names:
    over = _pairs(table[name]) or {}
    cfg = config_lib.apply_overrides(cell.cfg, {str(k): v for k, v in over.items()})
    out.append(cell_record(cell, differs, cfg, interleaved=str(name)))
  return out


def _folder(base: config_lib.Config, out_dir) -> Path:
  return Path(out_dir) if out_dir else Path("results") / (base.name or base.experiment)


def merged_rows(folder: Path, experiment: str, quiet: tuple = ()) -> list[dict]:
  """The rows of every results file of `experiment` in `folder` (plain file, then shards),
  one warning line per file with corrupt lines except those in `quiet` (True: all)."""
  rows = []
  for path in shard_lib.results_files(folder, experiment):
    got = scan(path)
    if got.problems and quiet is not True and path not in quiet:
      warn(f"{path}: skipped {describe(got.problems)}; their cells count as not done")
    rows += got.rows
  return rows


def _done(folder: Path, experiment: str) -> set[str]:
  return complete_rows(merged_rows(folder, experiment, quiet=True))[1]


def _select(path, overrides, shard):
  shard = shard_lib.parse(shard)  # before anything is read
  base, cells = expand(path, overrides)
  module = load_experiment(base.experiment)
  check_params(module, cells)
  return shard, base, cells, module, shard_lib.select(cells, module, shard)


def dry_run(path: str | Path, overrides: list[str] | dict | None = None,
            out_dir: str | Path | None = None, shard: str | None = None) -> dict:
  """List the cells `run_file` would run (of one `--shard`), with their resolved cache
  settings; run nothing (nor the experiment's own checks, which may need checkpoints),
  write nothing."""
  shard, base, cells, _, mine = _select(path, overrides, shard)
  folder = _folder(base, out_dir)
  done = complete_rows(merged_rows(folder, base.experiment))[1]
  ids = identity([c.cfg.to_dict() for c in mine])
  recs = [{**rec, "status": "done" if c.hash in done else "to run"}
          for c, d in zip(mine, ids) for rec in variant_records(c, d)]
  part = f" shard {shard[0]}/{shard[1]}" if shard else ""
  runs = f", {len(recs)} variants" if len(recs) > len(mine) else ""
  print(f"kvjax run --dry-run: {base.experiment}{part}: {len(mine)} cells{runs} "
        f"({sum(c.hash in done for c in mine)} cells already in {folder}); nothing run")
  print(format_table(recs))
  return {"experiment": base.experiment, "path": str(folder / shard_lib.file_name(
      base.experiment, shard)), "cells": len(mine), "ran": 0, "records": recs}


def scratch(folder: Path, cell: Cell) -> Path:
  """The folder a cell may save its partial state in (see the module's doc)."""
  return Path(folder) / PARTIAL_DIR / cell.hash


def _drop_scratch(folder: Path, cell: Cell) -> None:
  shutil.rmtree(scratch(folder, cell), ignore_errors=True)
  try:
    (Path(folder) / PARTIAL_DIR).rmdir()  # only when no other cell's state is left
  except OSError:
    pass


def _run_cell(module, name: str, cell: Cell, n_cells: int, folder: Path) -> list[str]:
  """One cell's rows as results lines."""
  from kvjax.lab import metrics
  kw = {"scratch": scratch(folder, cell)} \
      if "scratch" in inspect.signature(module.run_cell).parameters else {}
  try:
    rows = check_rows(name, module.run_cell(cell.cfg, **kw))
  except KvjaxError as e:
    raise KvjaxError(f"grid cell {coords_str(cell.coords)}: {e}") from None
  env = metrics.environment()
  setting = cell.cfg.param("setting", "")
  lines = []
  for j, row in enumerate(rows):
    # the cell's setting names the row, unless the experiment named it (an interleaved
    # variant of a cell that a setting also chose: its name says which of the cell's rows)
    variant = {**row["variant"], "setting": setting} \
        if setting and not row["variant"].get("setting") else row["variant"]
    lines.append(encode({
        "experiment": name, "config_hash": cell.hash,
        "cell": {"index": cell.index, "of": n_cells, "row": j, "rows": len(rows),
                 "grid": cell.coords},
        "variant": variant, "workload": row["workload"], "metrics": row["metrics"],
        "config": cell.cfg.to_dict(), "env": env}))
  return lines


class _Appender:
  """The results file, opened for appending once and reopened when another run's repair has
  replaced it (a new inode), so no row goes to a file no longer in the folder. Called with
  the file's lock held."""

  def __init__(self, path: Path):
    self.path, self.f = path, None

  def write(self, lines: list[str]) -> None:
    if self.f is not None:
      try:
        same = os.stat(self.path).st_ino == os.fstat(self.f.fileno()).st_ino
      except FileNotFoundError:
        same = False
      if not same:
        self.close()
    if self.f is None:
      self.f = self.path.open("a")
    for line in lines:
      self.f.write(line + "\n")
      self.f.flush()
    os.fsync(self.f.fileno())

  def close(self) -> None:
    if self.f is not None:
      self.f, f = None, self.f
      f.close()


def _claim_and_run(module, name, cell, n_cells, folder: Path, out: _Appender,
                   wait: bool) -> str:
  """Run one cell under its claim: 'ran', 'done' (finished by another run) or 'held'."""
  with claims.claimed(folder, cell.hash, wait) as mine:
    if not mine:
      return "held"
    with claims.locked(folder, out.path.name):
      if cell.hash in _done(folder, name):
        _drop_scratch(folder, cell)
        return "done"
    lines = _run_cell(module, name, cell, n_cells, folder)
    with claims.locked(folder, out.path.name):  # re-read: append what nobody has written
      got = "done" if cell.hash in _done(folder, name) else "ran"
      if got == "ran":
        out.write(lines)
    _drop_scratch(folder, cell)
    return got


def _summary(module, name: str, rows: list[dict]):
  summary = getattr(module, "summary", None)
  if summary is not None:
    try:
      return summary(rows), False
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
      warn(f"the {name} summary cannot read these rows ({type(e).__name__}: {e}): a row of "
           "another shape (an older kvjax's, or corrupt); the plain table follows")
  return [flatten(r) for r in rows], True


def run_file(path: str | Path, overrides: list[str] | dict | None = None,
             out_dir: str | Path | None = None, progress: bool = True,
             shard: str | None = None) -> dict:
  """Run every unfinished cell of a config (of one `--shard` I/N); print a summary table;
  return a short report."""
  from tqdm import tqdm

  shard, base, cells, module, mine = _select(path, overrides, shard)
  name = base.experiment
  if not cells:
    raise KvjaxError("the grid expands to no cells; give every grid key at least one value")
  check = getattr(module, "check", None)
  for cell in cells:  # host-side limits of every cell before anything runs
    if check is not None:
      try:
        check(cell.cfg)
      except KvjaxError as e:
        raise KvjaxError(f"grid cell {coords_str(cell.coords)}: {e}") from None
  folder = _folder(base, out_dir)
  own = folder / shard_lib.file_name(name, shard)
  why = rowfile.file_problem(own)
  if why:  # a FIFO would block the append forever, a folder fail after the first cell
    raise KvjaxError(f"results file {own} {why}; remove or rename it, or choose another --out")
  folder.mkdir(parents=True, exist_ok=True)
  try:
    with claims.locked(folder, own.name):
      repair(own)
  finally:
    claims.tidy(folder)
  done = complete_rows(merged_rows(folder, name, quiet=(own,)))[1]
  todo = [c for c in mine if c.hash not in done]
  part = f" shard {shard[0]}/{shard[1]}: {len(mine)} of" if shard else ":"
  print(f"kvjax run: {name}{part} {len(cells)} cells, {len(mine) - len(todo)} already done, "
        f"{len(todo)} to run -> {own}", file=sys.stderr)
  estimate = getattr(module, "estimate", None)
  if estimate is not None and todo:  # a long run says how long before it starts
    said = estimate([c.cfg for c in todo])
    if said:
      print(f"kvjax run: {name}: {said}", file=sys.stderr)
  bar = tqdm(total=len(todo), desc=name, unit="cell", disable=not progress or not todo,
             file=sys.stderr, dynamic_ncols=True)
  ran, held, out = 0, [], _Appender(own)
  try:
    for cell in todo:
      bar.set_postfix_str(cell.label())
      got = _claim_and_run(module, name, cell, len(cells), folder, out, wait=False)
      held += [cell] if got == "held" else []
      ran += got == "ran"
      bar.update(int(got != "held"))
    if held:
      print(f"kvjax run: {len(held)} cells are being run by another process in {folder}; "
            "waiting for them (one whose run ends unfinished runs here)", file=sys.stderr)
    for cell in held:
      ran += _claim_and_run(module, name, cell, len(cells), folder, out, wait=True) == "ran"
      bar.update(1)
  finally:
    out.close()
    claims.tidy(folder)
  bar.close()
  hashes = {c.hash for c in mine}
  rows = [r for r in complete_rows(merged_rows(folder, name, quiet=True))[0]
          if r["config_hash"] in hashes]
  rows.sort(key=lambda r: (r["cell"]["index"], r["cell"]["row"]))
  records, plain = _summary(module, name, rows)
  for title, recs in (records if isinstance(records, dict) else {"": records}).items():
    recs = with_identity(recs, rows)  # every key that tells the cells apart, in front
    print(f"\n{title}" if title else "")
    print(format_table(recs, drop_constant=plain))
  from kvjax.lab import figures
  for line in figures.faults(rows):  # a roof fraction above 1 is a fault, said as one
    warn(line)
  files = [p for p in shard_lib.results_files(folder, name) if p.is_file()]
  print(f"{len(rows)} rows in {own}" if files == [own] else
        f"{len(rows)} rows of these cells in {folder} (its {len(files)} {name} files merged)",
        file=sys.stderr)
  return {"experiment": name, "path": str(own), "cells": len(mine), "ran": ran,
          "rows": len(rows)}
