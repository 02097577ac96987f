"""Grid expansion for `kvjax run`: experiments by name, a config's grid axes, paired
settings, and the cells they expand to (each cell's config composed from its layers).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
import pkgutil
import sys
from pathlib import Path

from kvjax import config as config_lib
from kvjax import registries  # noqa: F401  (config.validate then knows every registry's names)
from kvjax.errors import KvjaxError


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
  from kvjax.lab import experiments
  return sorted(m.name for m in pkgutil.iter_modules(experiments.__path__)
                if not m.name.startswith("_"))


def load_experiment(name: str):
  known = available_experiments()
  if not name:
    raise KvjaxError(f"the config names no experiment; add `experiment: NAME` ({', '.join(known)})")
  if name not in known:
    raise KvjaxError(f"unknown experiment '{name}'; available: {', '.join(known)}")
  return importlib.import_module(f"kvjax.lab.experiments.{name}")


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
  """The params mapping of a merged set of overrides (`params:` and `params.NAME` keys)."""
  params = items.get("params") or {}
  if not isinstance(params, dict):
    raise KvjaxError("params: must be a mapping of experiment options (name: value)")
  params = dict(params)
  for key, value in items.items():
    if not key.startswith("params."):
      continue
    name, _, sub = key[7:].partition(".")
    if not sub:
      params[name] = value
      continue
    # `--set params.settings.k8v4={...}` adds (or replaces) one paired setting
    if name != "settings":
      raise KvjaxError(f"'{key}': only params.settings.NAME reaches inside an option; "
                       f"set params.{name} whole")
    table = params.get("settings") or {}
    if not isinstance(table, dict):
      raise KvjaxError("params.settings must map setting names to overrides")
    params["settings"] = {**table, sub: value}
  return params


def check_params(module, cells: list) -> None:
  """Refuse experiment options the experiment does not read (its `PARAMS`; `setting` and
  `settings` are every experiment's): they would be accepted and have no effect."""
  known = getattr(module, "PARAMS", None)
  if known is None:
    return
  names = {k for cell in cells for k, _ in cell.cfg.params} - {"setting", "settings"}
  extra = sorted(names - set(known))
  if extra:
    name = module.__name__.rsplit(".", 1)[-1]
    raise KvjaxError(f"params.{extra[0]} is not an option of experiment {name}; it reads "
                     f"{', '.join(sorted(known)) or 'none'} (and setting, settings)")


def setting_overrides(params: dict) -> dict:
  """The overrides of the selected paired setting: `params.setting` names one entry of
  `params.settings` (name -> {dotted key: value}: cache/model/workload keys, or an
  experiment option `params.NAME` other than the setting itself); {} when none."""
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


MAX_CELLS = 100_000  # a grid's cells, counted from its axes before any is built


def expand(path: str | Path, overrides: list[str] | dict | None = None
           ) -> tuple[config_lib.Config, list[Cell]]:
  """Read a config file and return (base config, validated cells), nothing run yet."""
  # File-level errors (missing, malformed, unknown keys) come from here, one line each;
  # shape checks wait for the cells: a base may be valid only with each cell's values.
  config_lib.load(path, check=False)
  raw = config_lib.read_yaml(config_lib.shape_path(path)) or {}
  over = overrides if isinstance(overrides, dict) else config_lib.parse_set(overrides)
  axes, plain = _grid_axes(raw, over or {})
  file_items = config_lib.flat(raw)
  base = compose(file_items, {}, plain, check=False)
  count = math.prod(len(v) for v in axes.values())
  if count > MAX_CELLS:  # counted from the axes before any cell is built
    sizes = " x ".join(f"{len(v)} {k}" for k, v in axes.items())
    raise KvjaxError(f"the grid expands to {count:,} cells ({sizes}), more than the "
                     f"{MAX_CELLS:,} a run takes; split it into several configs or shorten "
                     "its axes")
  cells, seen = [], set()
  keys = list(axes)
  for combo in itertools.product(*(axes[k] for k in keys)):
    coords = dict(zip(keys, combo))
    try:
      cfg = compose(file_items, coords, plain)
      coords = _effective(coords, _merge(file_items, coords, plain))
    except KvjaxError as e:
      raise KvjaxError(f"grid cell {coords_str(coords)}: {e}") from None
    cell = Cell(len(cells), coords, cfg)
    if cell.hash not in seen:  # a value listed twice is one cell
      seen.add(cell.hash)
      cells.append(cell)
  table = _params_of({**file_items, **plain}).get("settings") or {}
  unused = sorted(set(table) - {c.cfg.param("setting", "") for c in cells}) \
      if isinstance(table, dict) else []
  if unused:
    print(f"kvjax run: note: no cell selects params.settings {', '.join(map(str, unused))}; "
          "select one with params.setting or a grid axis params.setting: [...]",
          file=sys.stderr)
  if "cache.codec" in axes and all("cache.codec" not in c.coords for c in cells):
    print("kvjax run: note: the grid's cache.codec axis has no effect here: explicit "
          "cache.k_codec and cache.v_codec beat cache.codec", file=sys.stderr)
  return base, cells


def coords_str(coords: dict) -> str:
  """A cell's grid coordinates as `(key=value, ...)`, for messages."""
  return "(" + ", ".join(f"{k}={v}" for k, v in coords.items()) + ")"
