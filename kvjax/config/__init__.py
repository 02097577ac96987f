"""Configuration: frozen dataclasses, YAML loading, dotted overrides, host-side validation.

Every setting that changes a compiled shape or a code path lives here, so a config is
hashable and can be passed to `jax.jit` as a static argument. Shape letters used across
kvjax: B batch, T new tokens, S cache capacity, L layers, H query heads, K kv heads,
G = H // K query heads per kv head, D head_dim, E d_model, F d_ff, V vocab.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from kvjax.errors import KvjaxError

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 260          # V: 256 bytes + specials (kvjax.io.tokenizer.BYTE_VOCAB)
  d_model: int = 64              # E
  n_layers: int = 2              # L
  n_heads: int = 4               # H
  n_kv_heads: int = 4            # K: MHA when == H, MQA when 1, GQA between
  head_dim: int = 0              # D: 0 means d_model // n_heads
  d_ff: int = 0                  # F: 0 means the Llama rule round(8/3 * E) to a multiple of 8
  attention: str = "grouped"     # attention variant, from kvjax.attention.ATTENTIONS
  rope_theta: float = 10000.0
  rope_scaling: tuple = ()       # (("rope_type","llama3"), ("factor", 8.0), ...) as sorted pairs
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  tie_embeddings: bool = False
  dtype: str = "float32"         # activation / compute dtype
  param_dtype: str = "float32"
  scan_unroll: int = 1           # layers are scanned; >= n_layers: prefill, decode and serve
                                 # run them unrolled over per-layer weights (model.unrolled)
  max_seq_len: int = 4096        # longest position the model is meant for (RoPE tables, checks)
  latent_rank: int = 0           # > 0: rank-r K/V projections, cacheable as latents (kvjax.cache.latent)

  @property
  def D(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def F(self) -> int:
    if self.d_ff:
      return self.d_ff
    return 8 * ((int(round(8 * self.d_model / 3)) + 7) // 8)

  @property
  def G(self) -> int:
    return self.n_heads // self.n_kv_heads

  @property
  def variant(self) -> str:
    """MHA / GQA-<kv heads> / MQA, the name used in results and plots."""
    if self.n_kv_heads == self.n_heads:
      return "MHA"
    if self.n_kv_heads == 1:
      return "MQA"
    return f"GQA-{self.n_kv_heads}"


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  layout: str = "contiguous"     # none | contiguous | paged (kvjax.cache.LAYOUTS)
  codec: str = ""                # sets k_codec and v_codec when given
  k_codec: str = "fp32"
  v_codec: str = "fp32"
  capacity: int = 0              # S tokens per sequence; 0 means prompt + new tokens
  k_axis: str = "token"          # token | channel (per-channel key scales, KIVI)
  group_size: int = 0            # quantization group along head_dim (token axis) or tokens
  residual: int = 0              # full-precision window of recent tokens (KIVI's R)
  page_size: int = 16
  num_pages: int = 0             # paged pool size; 0 means enough for batch * capacity
  policy: str = "full"           # token eviction policy (kvjax.policies.POLICIES)
  budget: int = 0                # tokens kept per sequence (per layer and KV head); 0: unset
  ratio: float = 0.0             # alternative to budget: fraction of each prompt kept, (0, 1]
  sinks: int = 4                 # first tokens always kept by policy `sinks`
  window: int = 0                # recent (window/sinks/h2o) or snapkv observation window


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
  batch: int = 1
  prompt_len: int = 16
  gen_len: int = 16
  temperature: float = 0.0       # 0 means greedy
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int = -1               # stop token; -1 means none
  repeats: int = 5               # timing repeats (median reported)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  data: str = "stdlib"           # stdlib (Python's own sources and docs) | a text file or folder
  steps: int = 200
  batch: int = 16
  seq_len: int = 128
  lr: float = 3e-3
  min_lr_ratio: float = 0.1      # cosine decays to lr * min_lr_ratio
  warmup: int = 20
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  eval_every: int = 50
  eval_batches: int = 8
  checkpoint_every: int = 100
  log_every: int = 10
  recall_mix: float = 0.0        # fraction of each batch that is associative recall (kvjax.data)
  recall_pairs: int = 8          # key-value pairs (and queries) per recall sequence


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = 1
  model: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  cache: CacheConfig = CacheConfig()
  workload: WorkloadConfig = WorkloadConfig()
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  seed: int = 0
  tokenizer: str = "bytes"       # bytes | none | a path to tokenizer.json
  experiment: str = ""           # experiment name for `kvjax run`
  grid: tuple = ()               # ((dotted key, (values...)), ...) expanded by `kvjax run`
  params: tuple = ()             # experiment-specific options as sorted (key, value) pairs
  name: str = ""

  def to_dict(self) -> dict:
    return _to_plain(self)

  def hash(self) -> str:
    """12 hex digits identifying what runs: the config with every field that holds its
    default left out, so adding a new option (with a default that changes nothing) keeps
    the hash of every config, and every committed results row, as it was."""
    blob = json.dumps(_non_default(self), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]

  def param(self, key: str, default: Any = None) -> Any:
    return dict(self.params).get(key, default)


def _non_default(obj: Any) -> dict:
  """`to_dict` without the fields equal to their dataclass default (recursively)."""
  out = {}
  for f in dataclasses.fields(obj):
    val = getattr(obj, f.name)
    if dataclasses.is_dataclass(val):
      sub = _non_default(val)
      if sub:
        out[f.name] = sub
    elif val != f.default:
      out[f.name] = _to_plain(val) if f.name not in ("grid", "params", "rope_scaling") \
          else {k: _to_plain(v) for k, v in val}
  return out


def _to_plain(obj: Any) -> Any:
  if dataclasses.is_dataclass(obj):
    out = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    for key in ("grid", "params", "rope_scaling"):
      if key in out:
        out[key] = {k: _to_plain(v) for k, v in getattr(obj, key)}
    return out
  if isinstance(obj, tuple):
    return [_to_plain(v) for v in obj]
  return obj


def _freeze(value: Any) -> Any:
  """Make YAML values hashable: dicts become sorted pair tuples, lists become tuples."""
  if isinstance(value, dict):
    return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "workload": WorkloadConfig,
             "mesh": MeshConfig, "train": TrainConfig}
_FREEFORM = ("grid", "params", "model.rope_scaling")


def _field_type(cls: type, name: str) -> Any:
  hints = typing.get_type_hints(cls)
  return hints[name]


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
    if typ is tuple:
      return _freeze(value)
  except (TypeError, ValueError):
    pass
  raise KvjaxError(f"config key '{key}' expects {getattr(typ, '__name__', typ)}, got {value!r}")


def _known_keys() -> list[str]:
  keys = [f.name for f in dataclasses.fields(Config) if f.name not in _SECTIONS]
  for sec, cls in _SECTIONS.items():
    keys += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)]
  return keys


def flat(data: dict | None) -> dict[str, Any]:
  """A YAML mapping of sections as {dotted key: value} (`model: {d_model: 64}` ->
  `model.d_model`); top-level keys (seed, params, grid, ...) stay as they are."""
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise KvjaxError("config must be a YAML mapping of sections (model:, cache:, ...)")
  out: dict[str, Any] = {}
  for key, value in data.items():
    if key in _SECTIONS:
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
  sections = {name: {} for name in _SECTIONS}
  top: dict[str, Any] = {}
  for key, value in expand_codec(overrides).items():
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in [f.name for f in dataclasses.fields(Config)] \
        and parts[0] not in _SECTIONS:
      top[parts[0]] = _coerce(key, value, _field_type(Config, parts[0]))
    elif len(parts) == 2 and parts[0] in _SECTIONS and \
        parts[1] in [f.name for f in dataclasses.fields(_SECTIONS[parts[0]])]:
      sections[parts[0]][parts[1]] = _coerce(key, value, _field_type(_SECTIONS[parts[0]], parts[1]))
    else:
      raise KvjaxError(f"unknown config key '{key}'; known keys: {', '.join(_known_keys())}")
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
    try:
      out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
      out[key.strip()] = raw
  return out


SHAPES_DIR = Path(__file__).resolve().parent.parent / "shapes"  # package data


def shape_names() -> list[str]:
  """Real model shapes shipped inside the package (`kvjax/shapes/<name>.yaml`)."""
  return sorted(p.stem for p in SHAPES_DIR.glob("*.yaml"))


def shape_path(ref: str | Path) -> Path:
  """A config file path, or the packaged shape a bare name (`llama3-8b`) stands for."""
  path = Path(ref)
  if not path.is_file() and path.suffix == "" and path.name == str(ref) \
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
    if not path.is_file():
      raise KvjaxError(f"config file not found: {path}; name a YAML file or a packaged "
                       f"model shape ({', '.join(shape_names())})")
    try:
      data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
      mark = getattr(e, "problem_mark", None)
      where = f" at line {mark.line + 1}" if mark else ""
      raise KvjaxError(f"malformed YAML in {path}{where}: fix the syntax") from None
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


# Allowed range of every numeric field: (low, low included, high, high included); None is
# unbounded. Integer fields must hold ints, float fields finite numbers (no NaN / inf).
_POS, _NONNEG = (0, False, None, False), (0, True, None, False)
_RANGES = {
    "seed": (0, True, 2**63 - 1, True),
    "model.vocab_size": _POS, "model.d_model": _POS, "model.n_layers": _POS,
    "model.n_heads": _POS, "model.n_kv_heads": _POS, "model.head_dim": _NONNEG,
    "model.d_ff": _NONNEG, "model.rope_theta": _POS, "model.norm_eps": _POS,
    "model.scan_unroll": _POS, "model.max_seq_len": _POS, "model.latent_rank": _NONNEG,
    "cache.budget": _NONNEG, "cache.ratio": (0, True, 1, True), "cache.sinks": _NONNEG,
    "cache.window": _NONNEG,
    "cache.capacity": _NONNEG, "cache.group_size": _NONNEG, "cache.residual": _NONNEG,
    "cache.page_size": _POS, "cache.num_pages": _NONNEG,
    "workload.batch": _POS, "workload.prompt_len": _POS, "workload.gen_len": _NONNEG,
    "workload.temperature": _NONNEG, "workload.top_k": _NONNEG,
    "workload.top_p": (0, False, 1, True), "workload.eos_id": (-1, True, None, False),
    "workload.repeats": _POS,
    "mesh.data": _POS, "mesh.model": _POS,
    "train.steps": _POS, "train.batch": _POS, "train.seq_len": _POS, "train.lr": _POS,
    "train.min_lr_ratio": (0, True, 1, True), "train.warmup": _NONNEG,
    "train.weight_decay": _NONNEG, "train.b1": (0, True, 1, False),
    "train.b2": (0, True, 1, False), "train.grad_clip": _POS, "train.eval_every": _POS,
    "train.eval_batches": _POS, "train.checkpoint_every": _POS, "train.log_every": _POS,
    "train.recall_mix": (0, True, 1, True), "train.recall_pairs": _POS,
}
# What a zero or negative value of a field usually meant, for the message.
_DEFAULT_HINT = {"model.head_dim": " (0 picks d_model // n_heads)",
                 "model.d_ff": " (0 picks the Llama rule)",
                 "cache.capacity": " (0 means prompt + new tokens)",
                 "cache.ratio": " (the fraction of each prompt a policy keeps; 0 means "
                                "cache.budget sizes the cache)",
                 "cache.budget": " (0 means cache.ratio or no eviction)",
                 "model.latent_rank": " (0 means no latent cache)",
                 "workload.temperature": " (0 means greedy)",
                 "workload.top_k": " (0 means no top-k cut)",
                 "workload.eos_id": " (-1 means no stop token)"}


def _interval(rng: tuple) -> str:
  lo, lo_in, hi, hi_in = rng
  if hi is None:
    return f"{'>=' if lo_in else '>'} {lo}"
  return f"in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"


def check_number(key: str, value: Any, rng: tuple, integer: bool) -> None:
  """Raise a one-line KvjaxError unless `value` is a finite int/float inside `rng`."""
  kind = "an integer" if integer else "a finite number"
  ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
  if isinstance(value, bool) or not ok_type or not math.isfinite(value):
    raise KvjaxError(f"{key} must be {kind} {_interval(rng)}, got {value!r}; "
                     f"set {key} to such a value")
  lo, lo_in, hi, hi_in = rng
  if (lo is not None and (value < lo or (value == lo and not lo_in))) or \
      (hi is not None and (value > hi or (value == hi and not hi_in))):
    hint = _DEFAULT_HINT.get(key, "")
    raise KvjaxError(f"{key} must be {kind} {_interval(rng)}{hint}, got {value!r}; "
                     f"set {key} to such a value")


def _check_numbers(cfg: Config) -> None:
  for key, rng in _RANGES.items():
    if "." in key:
      sec, name = key.split(".")
      value, cls = getattr(getattr(cfg, sec), name), _SECTIONS[sec]
    else:
      name, value, cls = key, getattr(cfg, key), Config
    check_number(key, value, rng, _field_type(cls, name) is int)
  m, c, w = cfg.model, cfg.cache, cfg.workload
  scaling = dict(m.rope_scaling)
  for key, value in scaling.items():
    if key not in ("rope_type", "type"):
      check_number(f"model.rope_scaling.{key}", value, _POS, False)
  if scaling.get("rope_type", scaling.get("type")) == "llama3":
    low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if low is None or high is None or scaling.get("factor") is None \
        or scaling.get("original_max_position_embeddings") is None:
      raise KvjaxError("model.rope_scaling of type llama3 needs factor, low_freq_factor, "
                       "high_freq_factor and original_max_position_embeddings")
    if high <= low:
      raise KvjaxError(f"model.rope_scaling.high_freq_factor={high} must exceed "
                       f"low_freq_factor={low}; fix the rope scaling")
  if w.eos_id >= m.vocab_size:
    raise KvjaxError(f"workload.eos_id={w.eos_id} is outside the vocabulary [0, "
                     f"{m.vocab_size}); use a token id below model.vocab_size or -1 for none")
  if w.top_k > m.vocab_size:
    raise KvjaxError(f"workload.top_k={w.top_k} exceeds model.vocab_size={m.vocab_size}; "
                     "use at most the vocabulary size (0 means no cut)")
  if c.capacity and c.residual > c.capacity:
    raise KvjaxError(f"cache.residual={c.residual} exceeds cache.capacity={c.capacity}; "
                     f"use a window of at most {c.capacity} tokens or raise the capacity")


def validate(cfg: Config) -> Config:
  """Host-side checks with one-line messages that name the key, the value and the fix.

  Every numeric field is checked against `_RANGES` (type, finiteness, range) whatever
  built the config: YAML, `--set`, a checkpoint's config.yaml or an imported checkpoint's
  metadata, since all of them come through `apply_overrides`."""
  from kvjax import attention, cache, codecs, policies  # registries check their own config

  m, c = cfg.model, cfg.cache
  _check_numbers(cfg)
  if m.n_heads % m.n_kv_heads:
    raise KvjaxError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads="
                     f"{m.n_kv_heads}; choose n_kv_heads among the divisors of n_heads")
  if not m.head_dim and m.d_model % m.n_heads:
    raise KvjaxError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
                     "set model.head_dim explicitly")
  if m.D % 2:
    raise KvjaxError(f"head_dim={m.D} is odd; rotary embeddings need an even head_dim")
  for name in ("dtype", "param_dtype"):
    if getattr(m, name) not in DTYPES:
      raise KvjaxError(f"unknown model.{name} '{getattr(m, name)}'; use one of {', '.join(DTYPES)}")
  if m.attention not in attention.ATTENTIONS:
    raise KvjaxError(f"unknown attention '{m.attention}'; known: {', '.join(attention.ATTENTIONS)}")
  if c.layout not in cache.LAYOUTS:
    raise KvjaxError(f"unknown cache.layout '{c.layout}'; known: {', '.join(cache.LAYOUTS)}")
  for name in ("k_codec", "v_codec"):
    if getattr(c, name) not in codecs.CODECS:
      raise KvjaxError(f"unknown codec '{getattr(c, name)}' (cache.{name}); "
                       f"known: {', '.join(codecs.CODECS)}")
  if c.k_axis not in ("token", "channel"):
    raise KvjaxError(f"unknown cache.k_axis '{c.k_axis}'; use token or channel")
  for registry in (codecs, cache, attention, policies):
    registry.check(c, m)
  return cfg


def replace(cfg: Config, **dotted: Any) -> Config:
  """`replace(cfg, **{"model.n_kv_heads": 1})`: overrides by dotted key, validated."""
  return apply_overrides(cfg, dotted)
