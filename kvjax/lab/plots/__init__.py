"""Plots of results rows: `kvjax plot RESULTS_DIR --out DIR` (and `kvjax.plot`).

The ground floor of kvjax: a plot reads results rows only (and kvjax.footprint's byte count,
kvjax.lab.intervals' Wilson interval), never runs a model. `plot_all` reads every *.jsonl under
a folder (kvjax.lab.plots.rows), groups rows by their `experiment`, and calls
`kvjax.lab.plots.<experiment>.plot(rows, out_dir) -> list[Path]` for each experiment that has a
plot module; the shared look (colour per codec family, marker per setting, line style per
model) is kvjax.lab.plots.style. Adding an experiment's plot is one module here named after it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from kvjax.errors import KvjaxError
from kvjax.lab.plots.rows import load_rows, scan_rows

__all__ = ["load_rows", "plot_all", "plot_module", "scan_rows"]


def plot_module(name: str):
  """`kvjax.lab.plots.<name>` when it is a plot module (has `plot`), else None."""
  try:
    module = importlib.import_module(f"kvjax.lab.plots.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"kvjax.lab.plots.{name}":  # the module exists but one of its imports is missing
      raise
    return None
  return module if callable(getattr(module, "plot", None)) else None


def _device(row: dict) -> str:
  """The device a row was measured on, as a folder name ("cpu", "gpu-nvidia-h200")."""
  env = row.get("env", {})
  backend, kind = str(env.get("backend", "unknown")), str(env.get("device_kind", ""))
  name = backend if kind in ("", backend) else f"{backend}-{kind}"
  return "".join(c if c.isalnum() else "-" for c in name.lower())


def _close_figures() -> None:
  """Close the figures a plot that failed half way left open."""
  pyplot = sys.modules.get("matplotlib.pyplot")
  if pyplot is not None:
    pyplot.close("all")


def plot_all(results_dir: str | Path, out_dir: str | Path, log=print) -> list[Path]:
  """Every plot the rows under `results_dir` support, written (PNG and SVG) into `out_dir`;
  the paths written. What was drawn goes to `log`, what was not (and why) to stderr. No
  folder, or no rows in it, is a one-line KvjaxError."""
  results_dir, out_dir = Path(results_dir), Path(out_dir)
  if not results_dir.is_dir():
    raise KvjaxError(f"no results folder {results_dir}; run `kvjax run CONFIG --out "
                     f"{results_dir}` first")
  groups, skipped = scan_rows(results_dir)
  if not groups and skipped:  # rows were found and refused: say where and why, once
    more = f" (and {len(skipped) - 1} more files)" if len(skipped) > 1 else ""
    raise KvjaxError(f"no readable results rows under {results_dir}: {skipped[0]}{more}")
  for line in skipped:
    print(f"kvjax plot: skipped {line}", file=sys.stderr)
  if not groups:
    raise KvjaxError(f"no results rows under {results_dir} (no *.jsonl of `kvjax run`); "
                     "name the folder `kvjax run --out` wrote")
  written, unread = [], []
  for name, rows in sorted(groups.items()):
    module = plot_module(name)
    if module is None:
      print(f"kvjax plot: skipped experiment '{name}' ({len(rows)} rows): no plot module "
            f"kvjax/lab/plots/{name}.py", file=sys.stderr)
      continue
    # Runs of different configs (say quickstart and latency), or of one config on different
    # devices, are never mixed in one plot: each gets its own subfolder (config/device).
    by_config: dict[str, list] = {}
    for row in rows:  # (kvjax.lab.rowfile: a config is an object, its name a name)
      by_config.setdefault((row.get("config") or {}).get("name") or name, []).append(row)
    for config_name in list(by_config):
      devices = {_device(r) for r in by_config[config_name]}
      if len(devices) > 1:
        for row in by_config.pop(config_name):
          by_config.setdefault(f"{config_name}/{_device(row)}", []).append(row)
    for config_name, sub in sorted(by_config.items()):
      where = out_dir / config_name if len(by_config) > 1 else out_dir
      try:
        paths = module.plot(sub, where)
      except (KeyError, TypeError, ValueError, IndexError, AttributeError,
              ZeroDivisionError) as e:  # rows of another shape (an older kvjax's, edited)
        _close_figures()
        first = (str(e).strip().splitlines() or [""])[0][:120]
        why = (f"kvjax/lab/plots/{name}.py cannot read the {len(sub)} {name} rows of "
               f"{config_name} ({type(e).__name__}: {first}); rows of another shape (an older "
               "kvjax's, or edited): rerun the experiment")
        unread.append(why)
        print(f"kvjax plot: skipped {name} ({config_name}): {why}", file=sys.stderr)
        continue
      if not paths:
        print(f"kvjax plot: skipped {name} ({config_name}): its {len(sub)} rows give "
              f"kvjax/lab/plots/{name}.py nothing to draw", file=sys.stderr)
        continue
      log(f"{name} ({config_name}): {len(sub)} rows -> {where}/: "
          + ", ".join(p.name for p in paths if p.suffix == ".png"))
      written += paths
  if unread and not written:  # nothing drawn because rows could not be read: not a success
    raise KvjaxError(f"no plot drawn: {unread[0]}")
  return written
