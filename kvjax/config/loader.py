"""Building a config: YAML files (or packaged model shapes by name; read strictly by
`kvjax.config.yamlfile`), `--set key=value` items and {dotted key: value} overrides, coerced to each field's type, resolved
(`cache.codec` -> K and V codecs) and validated (`kvjax.config.checks`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from kvjax.config import yamlfile
from kvjax.config.checks import validate
from kvjax.config.schema import SECTIONS, Config, field_type, known_keys
from kvjax.errors import KvjaxError


def _freeze(value: Any) -> Any:
  """Make YAML values hashable: dicts become sorted pair tuples, lists become tuples."""
  if isinstance(value, dict):
    return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


def _coerce(key: str, value: Any, typ: Any) -> Any:
  """Coerce a YAML or command-line value to a dataclass field's type, or fail clearly."""
  origin = typing.get_origin(typ)
  if origin in (typing.Union, types.UnionType):
    typ = [a for a in typing.get_args(typ) if a is not type(None)][0]
  try:
    if typ is bool:
      if isinstance(value, str):
        low = value.lower()
        if low in ("true", "1", "yes", "on"):
          return True
        if low in ("false", "0", "no", "off"):
          return False
        raise ValueError
      if isinstance(value, (bool, int)):
        return bool(value)
      raise ValueError
    if typ is int:
      if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError
      return int(value)
    if typ is float:
      if isinstance(value, bool):
        raise ValueError
      return float(value)
    if typ is str:
      if isinstance(value, (dict, list)):
        raise ValueError
      return "" if value is None else str(value)
    if typ is tuple:  # grid, params, model.rope_scaling: mappings (stored as sorted pairs)
      if value is None or value == "":
        return ()
      if isinstance(value, dict):
        return _freeze(value)
      if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return value  # already frozen (a config's own value, applied again)
      raise KvjaxError(f"config key '{key}' expects a mapping (name: value, ...), got "
                       f"{value!r}")
  except (TypeError, ValueError):
    pass
  raise KvjaxError(f"config key '{key}' expects {getattr(typ, '__name__', typ)}, got {value!r}")


def flat(data: dict | None) -> dict[str, Any]:
  """A YAML mapping of sections as {dotted key: value} (`model: {d_model: 64}` ->
  `model.d_model`); top-level keys (seed, params, grid, ...) stay as they are. `model:` may
  name a packaged shape (`model: smollm2-135m`, or `model: {shape: smollm2-135m,
  n_kv_heads: 1}` with keys that replace the shape's)."""
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise KvjaxError("config must be a YAML mapping of sections (model:, cache:, ...)")
  out: dict[str, Any] = {}
  for key, value in data.items():
    if key == "model" and (isinstance(value, str) or (isinstance(value, dict)
                                                      and "shape" in value)):
      value = shape_model(value)
    if key in SECTIONS:
      if value is None:
        continue
      if not isinstance(value, dict):
        raise KvjaxError(f"config section '{key}' must be a mapping")
      for sub, subval in value.items():
        out[f"{key}.{sub}"] = subval
    else:
      out[str(key)] = value
  return out


def from_dict(data: dict, check: bool = True) -> Config:
  """Build a Config from nested dicts (as read from YAML); unknown keys are errors."""
  return apply_overrides(Config(), flat(data), check)


def expand_codec(items: dict[str, Any]) -> dict[str, Any]:
  """The one codec precedence rule: `cache.codec` fills `cache.k_codec` and `cache.v_codec`
  only where they are not given explicitly in the same set of overrides (explicit K/V beat
  `cache.codec`). `load` and `kvjax run` merge every layer (YAML, grid, setting, --set) into
  one set first, so the rule holds across layers too."""
  if not items.get("cache.codec"):
    return dict(items)
  out = {k: v for k, v in items.items() if k != "cache.codec"}
  for key in ("cache.k_codec", "cache.v_codec"):
    out.setdefault(key, items["cache.codec"])
  return out


def apply_overrides(cfg: Config, overrides: dict[str, Any], check: bool = True) -> Config:
  """Apply {dotted key: value} overrides with type coercion, then resolve and validate
  (`check=False` defers validation: a grid's base may be valid only per cell). Explicit
  `cache.k_codec`/`cache.v_codec` beat `cache.codec` given with them (`expand_codec`)."""
  sections = {name: {} for name in SECTIONS}
  top: dict[str, Any] = {}
  for key, value in expand_codec(overrides).items():
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in [f.name for f in dataclasses.fields(Config)] \
        and parts[0] not in SECTIONS:
      top[parts[0]] = _coerce(key, value, field_type(Config, parts[0]))
    elif len(parts) == 2 and parts[0] in SECTIONS and \
        parts[1] in [f.name for f in dataclasses.fields(SECTIONS[parts[0]])]:
      sections[parts[0]][parts[1]] = _coerce(key, value, field_type(SECTIONS[parts[0]], parts[1]))
    else:
      raise KvjaxError(f"unknown config key '{key}'; known keys: {', '.join(known_keys())}")
  new = dataclasses.replace(
      cfg, **top, **{sec: dataclasses.replace(getattr(cfg, sec), **vals)
                     for sec, vals in sections.items() if vals})
  return validate(resolve(new)) if check else resolve(new)


def parse_set(items: list[str] | None) -> dict[str, Any]:
  """Parse `--set key=value` items; values are read as YAML scalars (`4`, `1e-5`, `true`)."""
  out: dict[str, Any] = {}
  for item in items or []:
    if "=" not in item:
      raise KvjaxError(f"--set expects key=value, got '{item}'")
    key, raw = item.split("=", 1)
    if not raw.strip():  # `cache.codec=` once emptied the codec and ran fp32
      raise KvjaxError(f"--set {item} gives {key.strip() or 'the key'} no value; write "
                       "key=value, or drop the item to keep the config's value")
    try:
      out[key.strip()] = yamlfile.parse(raw, f"--set {item}")
    except yamlfile.SyntaxProblem:  # (a duplicate key or an alias cycle is still refused)
      if raw.strip()[0] in "{\"'&*!|>%@`":  # meant as YAML (`x={`, `x="a`), never a name
        raise
      out[key.strip()] = raw  # not YAML: the text itself (a file name, a codec name)
  return out


SHAPES_DIR = Path(__file__).resolve().parent.parent / "shapes"  # package data


def shape_names() -> list[str]:
  """Real model shapes shipped inside the package (`kvjax/shapes/<name>.yaml`)."""
  return sorted(p.stem for p in SHAPES_DIR.glob("*.yaml"))


def shape_model(value: str | dict) -> dict[str, Any]:
  """The `model:` section a packaged shape name stands for, with any other keys given
  beside `shape:` replacing the shape's."""
  name = value if isinstance(value, str) else value["shape"]
  if not isinstance(name, str) or not (SHAPES_DIR / f"{name}.yaml").is_file():
    raise KvjaxError(f"model: {name!r} is not a packaged model shape; use one of "
                     f"{', '.join(shape_names())} or give the model's keys")
  model = dict((yamlfile.read(SHAPES_DIR / f"{name}.yaml") or {}).get("model") or {})
  extra = {} if isinstance(value, str) else {k: v for k, v in value.items() if k != "shape"}
  return {**model, **extra}


def shape_path(ref: str | Path) -> Path:
  """A config file path, or the packaged shape a bare name (`llama3-8b`) stands for."""
  path = Path(ref)
  if not path.is_file() and path.suffix not in (".yaml", ".yml") and path.name == str(ref) \
      and (SHAPES_DIR / f"{ref}.yaml").is_file():
    return SHAPES_DIR / f"{ref}.yaml"
  return path


def load(path: str | Path | None, overrides: list[str] | dict | None = None,
         check: bool = True) -> Config:
  """Load a YAML config file (or defaults when path is None) and apply --set overrides
  (a --set key replaces the file's; `cache.k_codec`/`v_codec` from either beat
  `cache.codec` from either)."""
  data: dict = {}
  if path is not None:
    path = shape_path(path)
    if not path.exists():  # (a folder or a FIFO: named by yamlfile.read)
      raise KvjaxError(f"config file not found: {path}; name a YAML file or a packaged "
                       f"model shape ({', '.join(shape_names())})")
    data = yamlfile.read(path) or {}
  items = overrides if isinstance(overrides, dict) else parse_set(overrides)
  # One set of overrides: the file's keys, then --set; explicit K/V codecs beat cache.codec
  # wherever each comes from.
  return apply_overrides(Config(), {**flat(data), **(items or {})}, check)


def resolve(cfg: Config) -> Config:
  """Fill derived fields: `cache.codec` sets both K and V codecs."""
  cache = cfg.cache
  if cache.codec:
    cache = dataclasses.replace(cache, k_codec=cache.codec, v_codec=cache.codec, codec="")
  return dataclasses.replace(cfg, cache=cache)


def replace(cfg: Config, **dotted: Any) -> Config:
  """`replace(cfg, **{"model.n_kv_heads": 1})`: overrides by dotted key, validated."""
  return apply_overrides(cfg, dotted)
