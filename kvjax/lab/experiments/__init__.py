"""Experiments run by `kvjax run FILE.yaml`: one module per experiment name.

Each module defines `run_cell(cfg) -> list[dict]` (rows with `variant`, `workload` and
`metrics` dicts; the runner adds the rest) and may define `check(cfg)`, host-side limits
checked for every cell before any cell runs, and `summary(rows) -> list[dict]`, the
flat records of the table printed at the end, and `share_key(cfg)`, equal for cells that
share work (`kvjax run --shard` keeps them in one part), and `estimate(cfgs)`, a line saying
how long the cells left will take here, printed before a run starts. The helpers below are what several
experiments share; the experiment runner (`kvjax.lab.runner`) finds them by name.
"""

from __future__ import annotations

import functools

import numpy as np

from kvjax import attention, config as config_lib
from kvjax.decode import step
from kvjax.errors import KvjaxError



@functools.lru_cache(maxsize=2)
def random_params(model_cfg: config_lib.ModelConfig, seed: int):
  """Random weights: speed and memory do not depend on their values. Cached across cells."""
  from kvjax import model
  return model.init_params(model_cfg, seed)


def prompts(cfg: config_lib.Config, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Full-length random prompts [B, T] and their lengths [B] (seeded by cfg.seed)."""
  rng = np.random.default_rng(cfg.seed)
  tokens = rng.integers(0, cfg.model.vocab_size, size=(batch, length), dtype=np.int32)
  return tokens, np.full((batch,), length, np.int32)


def variant(cfg: config_lib.Config, **extra) -> dict:
  """What identifies the cache variant in a results row (`rotate`, `keep_first` and `clip`
  only where set, so rows without them read as they always did)."""
  m, c = step.resolved(cfg.model), cfg.cache
  codec = c.k_codec if c.k_codec == c.v_codec else f"K{c.k_codec}/V{c.v_codec}"
  mods = {**({"rotate": c.rotate} if c.rotate != "none" else {}),
           **({"keep_first": c.keep_first} if c.keep_first else {}),
           **({"clip": c.clip} if c.clip != "none" else {}),
           **({"latent_rank": m.latent_rank} if m.latent_rank else {}),
           **({"rope_pairs": m.rope_pairs} if m.rope_pairs else {})}
  return {"variant": m.variant, "attention": attention.resolve(m.attention, m.program),
          "program": m.program, "heads": m.n_heads,
          "kv_heads": m.n_kv_heads, "k_codec": c.k_codec, "v_codec": c.v_codec, "codec": codec,
          "layout": c.layout, **mods, **extra}


def cache_name(variant: dict) -> str:
  """A row's cache in a summary table: the paired setting's name, else its codec(s), so two
  settings of one codec never share (or overwrite) a column or a line."""
  return variant.get("setting") or variant["codec"]


def bytes_per_token(cfg: config_lib.Config) -> float:
  """The codecs' bytes for one stored token across all layers (K + V, codec metadata in):
  a sizing figure (how many tokens a budget holds), not what a cache holds at a context,
  which `kvjax.footprint.count` reports (a residual window, rounding, policy state, lengths).

  Codecs are bound to their role (`for_role`), so group sizes and per-channel keys count.
  """
  from kvjax import codecs
  from kvjax import footprint
  m, c = cfg.model, cfg.cache
  if c.layout == "latent":
    return footprint.asymptotic(cfg)
  k, v = codecs.for_role(c.k_codec, c, "k"), codecs.for_role(c.v_codec, c, "v")
  return m.n_layers * (k.bytes_per_token(m.n_kv_heads, m.D)
                       + v.bytes_per_token(m.n_kv_heads, m.D))


def load_shape(name: str) -> config_lib.Config:
  """A real model shape: a packaged one by name (`kvjax/shapes/<name>.yaml`), or a path to
  such a file."""
  path = config_lib.shape_path(name)
  if not path.is_file():
    known = ", ".join(config_lib.shape_names())
    raise KvjaxError(f"unknown model shape '{name}'; use one of {known} or a path to a YAML file")
  return config_lib.load(path)


def check_int_params(cfg: config_lib.Config, spec: dict) -> None:
  """Each `params.NAME` of `spec` ({name: (default, lowest allowed)}) an integer in
  [lowest, int32 max], one line naming the option: checked before any weight is read."""
  for name, (default, low) in spec.items():
    value = cfg.param(name, default)
    config_lib.check_number(f"params.{name}", value, (low, True, 2**31 - 1, True), True)


def check_context(cfg: config_lib.Config, tokens: int) -> None:
  if tokens > cfg.model.max_seq_len:
    raise KvjaxError(f"{tokens} tokens exceed model.max_seq_len={cfg.model.max_seq_len}; "
                     "raise model.max_seq_len or shorten the context")


def check_memory(cfg: config_lib.Config, batch: int, capacity: int, tokens: int,
                 caches: int = 2) -> None:
  """A cell's weights + cache + temporaries must fit the device (kvjax.memory), checked
  for every cell before any runs rather than failing in XLA halfway through a sweep."""
  from kvjax import memory
  memory.check(cfg, batch, capacity, tokens, params=True, what="this cell", caches=caches)


def mapping(value) -> dict | None:
  """A YAML mapping as the config holds it (frozen to sorted (key, value) pairs), or None."""
  if isinstance(value, dict):
    return dict(value)
  if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
    return dict(value)
  return None


def caches(cfg: config_lib.Config, example: str) -> dict[str, dict]:
  """`params.caches`: name -> {cache.* key: value} (an empty mapping: the model's own cache),
  in the file's order; one line naming the fix where it is missing or maps other keys."""
  raw = cfg.param("caches", None)
  table = mapping(raw) if raw else None
  if not table:
    raise KvjaxError(f"{cfg.experiment} needs params.caches: a mapping of names to cache "
                     f"overrides, e.g. {example}")
  out = {}
  for name, over in table.items():
    over = {} if over in (None, (), {}) else mapping(over)
    if over is None or any(not str(k).startswith("cache.") for k in over):
      raise KvjaxError(f"params.caches.{name} must map cache.* keys to values")
    out[str(name)] = {str(k): v for k, v in over.items()}
  return out


def interleaved(cfg: config_lib.Config) -> dict:
  """name -> the cell's config with that variant's overrides (`params.interleave`), the
  reference (`params.reference`, else the variant without overrides, else the first by
  name) first."""
  raw = cfg.param("interleave", None)
  if not raw:
    return {}
  table = mapping(raw)
  if table is None:
    raise KvjaxError("params.interleave must map a variant name to config overrides, e.g. "
                     "{window_50: {cache.policy: window, cache.ratio: 0.5}}")
  out = {}
  for name, over in table.items():
    over = {} if over in (None, (), {}) else mapping(over)
    if over is None or any(str(k).startswith("params") for k in over):
      raise KvjaxError(f"params.interleave.{name} must map cache/model keys to values")
    out[str(name)] = config_lib.apply_overrides(cfg, {str(k): v for k, v in over.items()})
  ref = cfg.param("reference", None) or next(
      (str(n) for n, o in table.items() if o in (None, (), {})), next(iter(out)))
  if ref not in out:
    raise KvjaxError(f"params.reference '{ref}' is not a variant of params.interleave "
                     f"({', '.join(out)})")
  return {ref: out[ref], **{n: c for n, c in out.items() if n != ref}}
