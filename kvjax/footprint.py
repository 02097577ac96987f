"""Every count of bytes in kvjax: what a cache setting holds, the weights, a call's
temporaries, a compiled program's peak, and the one formatter of sizes for people.

    h = footprint.count(cfg, context)       # the cache of one sequence after `context` tokens
    h.bytes, h.per_token, h.asymptotic, h.bits_per_element, h.fields()
    footprint.param_bytes(cfg.model)        # the weights at model.param_dtype
    footprint.cache_bytes(cfg, batch, capacity), footprint.temp_bytes(cfg, batch, tokens, capacity)
    footprint.program_bytes(*compiled)      # XLA's memory analysis of compiled programs
    footprint.human(n)                      # 1.5 KiB

Checking those counts against the device's free memory is `kvjax.memory`; the `kvjax size`
report is `kvjax.lab.sizing`. Both only read these counts.

## The cache held

`count(cfg, context).bytes` is what the cache pytree of that setting holds for one sequence
(the sum of its leaves, `cache.tree_bytes`, divided by the batch): the layout's `closed_form_bytes` at the
capacity the cache is built with, so everything the tree holds is in it: codes, scales and
zeros, the full-precision residual window (`cache.residual`, allocated whole even before it
fills) and first tokens (`cache.keep_first`), the quantized history rounded up to whole key blocks, pages rounded up to whole
pages (a configured `cache.num_pages` pool is shared out evenly), a policy's budget in
place of the context (`cache.policy`: the compacted layouts) with its per-token state
(h2o's scores, `Policy.state_bytes_per_token`), and the int32 lengths / block tables.

`per_token` = bytes / context: what a user sees as "bytes per token" at that context.
`asymptotic` is the cost of one more stored token in the limit of a long context (K + V
codes and scales over all layers, plus the policy's state): what `per_token` tends to as the
window, the rounding and the fixed metadata amortise away (for a policy, per *held* token).
`bits_per_element` = 8 x per_token / (layers x 2 x KV heads x head_dim): bits per K/V
element all-in (scales, windows, state included; for a latent cache, per element of the
dense K/V it replaces).

A window holding more than a quarter of the tokens evaluated makes `per_token` far from
`asymptotic`; `window_warning` says so in one line. Users: `kvjax eval` and `kvjax size`,
the quality, long_context, latency, memory and roofline rows (the roofline's step bytes are
`count` at each step's live length), and, through `row_bytes` (which also reads rows
written before this count existed), `kvjax results`, the run summaries, the doc tables and
the plots' bytes axes.

## Weights, temporaries, programs

`param_bytes`: every weight of the model at `model.param_dtype`; `layer_param_bytes`: the
layers' share, which a layer loop over per-layer weights copies once more
(`kvjax.memory.split_bytes`). `cache_bytes`:
the layout's `closed_form_bytes` for `batch` x `capacity`. `temp_bytes`: the widest call's
temporaries (its docstring lists them). `program_bytes`: the peak a compiled program needs.
"""

from __future__ import annotations

import dataclasses
import functools

from kvjax.config import Config, ModelConfig
from kvjax.errors import KvjaxError

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
WINDOW_SHARE = 0.25  # a window holding more than this share of the tokens is warned about


@dataclasses.dataclass(frozen=True)
class Held:
  """Cache bytes of one sequence of a setting at one context (see the module docstring)."""

  context: int       # tokens the sequence has seen
  tokens: int        # tokens the cache keeps (a policy's budget, else the context)
  bytes: float       # what the cache tree holds for this sequence
  asymptotic: float  # bytes per stored token in the long-context limit
  elements: int      # K/V elements one token has across layers (L x 2 x K x D)
  layout: str        # the layout that holds the tokens

  @property
  def per_token(self) -> float:
    return self.bytes / self.context

  @property
  def bits_per_element(self) -> float:
    return 8 * self.per_token / self.elements

  def fields(self) -> dict:
    """The row / --json fields: `bytes_per_token` (held at this context),
    `bytes_per_token_asymptotic`, `bits_per_element` (all-in) and `held_bytes`."""
    return {"bytes_per_token": self.per_token, "bytes_per_token_asymptotic": self.asymptotic,
            "bits_per_element": self.bits_per_element, "held_bytes": self.bytes}


def layout_name(cfg: Config) -> str:
  """The layout that holds the tokens: a cache.policy's compacted one, else cache.layout."""
  from kvjax import cache
  return cache.built(cfg.cache).name


def asymptotic(cfg: Config) -> float:
  """Bytes one more stored token costs over all layers, long-context limit."""
  from kvjax import cache, codecs, policies
  m, c = cfg.model, cfg.cache
  own = cache.get(c.layout).asymptotic(cfg)  # a layout storing tokens otherwise says so
  if own is not None:
    return own
  k, v = codecs.for_role(c.k_codec, c, "k"), codecs.for_role(c.v_codec, c, "v")
  state = policies.get(c.policy).state_bytes_per_token(m.n_kv_heads)
  return _growing_layers(cfg) * (k.bytes_per_token(m.n_kv_heads, m.D)
                                 + v.bytes_per_token(m.n_kv_heads, m.D) + state)


def _growing_layers(cfg: Config) -> int:
  """Layers whose cache grows with the context: all but the sliding-window layers that the
  layout holds in rings (its `rings`)."""
  from kvjax import cache
  if not cfg.model.windowed:
    return cfg.model.n_layers
  spec = cache.CacheSpec.from_config(cfg, 1, 1 << 30)
  rg = cache.get(cfg.cache.layout).rings(spec)
  return cfg.model.n_layers if rg is None else len(rg.full)


def count(cfg: Config, context: int, batch: int = 1, capacity: int = 0) -> Held:
  """What one of `batch` sequences holds after `context` tokens; the cache is built for
  `max(capacity, cache.capacity, context)` tokens (a policy: for the tokens it keeps)."""
  from kvjax import cache, policies
  if context <= 0:
    raise KvjaxError(f"a context of {context} tokens holds nothing; use a positive context")
  kept = policies.held_tokens(cfg.cache, context)
  cap = kept if policies.evicts(cfg.cache) else max(capacity, cfg.cache.capacity, context)
  name = layout_name(cfg)
  spec = cache.CacheSpec.from_config(cfg, batch, cap)
  m = cfg.model
  return Held(context=context, tokens=kept,
              bytes=cache.LAYOUTS[name].closed_form_bytes(spec) / batch,
              asymptotic=asymptotic(cfg), elements=m.n_layers * 2 * m.n_kv_heads * m.D,
              layout=name)


def window_warning(cfg: Config, tokens: int) -> str | None:
  """One line when the residual window holds more than a quarter of `tokens`, else None."""
  R = cfg.cache.residual
  if not R or R <= WINDOW_SHARE * tokens:
    return None
  h = count(cfg, tokens)
  return (f"cache.residual={R} keeps {min(R, tokens)} of {tokens} tokens in full precision: "
          f"{h.per_token:,.0f} B/token held at {tokens} tokens against {h.asymptotic:,.0f} "
          f"B/token in the long-context limit; use at least {int(R / WINDOW_SHARE)} tokens "
          "to measure the quantized cache rather than its window")


# -- results rows of any vintage --------------------------------------------------------------
_CACHE_KEYS = ("layout", "k_codec", "v_codec", "k_axis", "group_size", "residual", "page_size",
               "policy", "budget", "ratio", "window", "sinks", "keep_first")


_CONFIGS: dict = {}


@functools.lru_cache(maxsize=None)
def _shape(name: str) -> Config:
  from kvjax import config as config_lib
  return config_lib.load(config_lib.shape_path(name))


def row_config(row: dict) -> Config | None:
  """The setting a kvjax results row records, on its model's packaged shape
  (`kvjax/shapes/<variant.model>.yaml`, with the row's KV heads), or None (a peer's row, a
  model without a packaged shape)."""
  import json
  key = json.dumps([row.get("variant"), row.get("config", {}).get("cache")], sort_keys=True,
                   default=str)
  if key not in _CONFIGS:  # building a config validates it: once per setting, not per row
    _CONFIGS[key] = _row_config(row)
  return _CONFIGS[key]


def _row_config(row: dict) -> Config | None:
  from kvjax import config as config_lib
  v = row.get("variant", {})
  if v.get("peer") or not v.get("model") or not config_lib.shape_path(v["model"]).is_file():
    return None
  cache = {f"cache.{k}": val for k, val in row.get("config", {}).get("cache", {}).items()
           if k in _CACHE_KEYS}
  cache.update({f"cache.{k}": v[k] for k in _CACHE_KEYS if v.get(k) is not None})
  cfg = _shape(v["model"])
  if v.get("kv_heads"):
    cache["model.n_kv_heads"] = v["kv_heads"]
  for key in ("latent_rank", "rope_pairs"):
    if v.get(key):
      cache[f"model.{key}"] = v[key]
  try:
    return config_lib.apply_overrides(cfg, cache, check=False)  # as recorded: it ran
  except KvjaxError:  # a setting this version no longer builds: the row's own fields stand
    return None


def row_tokens(row: dict) -> int | None:
  """Tokens a row's cache was measured or is counted at: context (+ continuation) of a text
  row; the prefix (else the prompt, else the context) of a long-context query; None when
  the row names no context."""
  w = row.get("workload", {})
  if w.get("task") == "text" and w.get("context"):
    return w["context"] + w.get("continuation", 0)
  return w.get("prefix_tokens") or w.get("prompt_tokens") or w.get("context")


_ROWS: dict = {}


def row_bytes(row: dict) -> dict:
  """`bytes_per_token` (held at the row's context), `bytes_per_token_asymptotic` and
  `bits_per_element` of a results row, whenever it was written: its own fields when written
  through `count`; else the measured `cache_bytes` over batch x tokens where the row has
  them, else `count` of the setting it records (`row_config`) at `row_tokens`. The
  asymptote of an older kvjax row without a packaged shape is its `bytes_per_token` (then
  the codec's closed form); a peer's is None, and so are bits without a shape."""
  m, w = row.get("metrics", {}), row.get("workload", {})
  if "bytes_per_token_asymptotic" in m:
    return {k: m.get(k) for k in ("bytes_per_token", "bytes_per_token_asymptotic",
                                  "bits_per_element")}
  import json
  key = json.dumps([row.get("variant"), row.get("config", {}).get("cache"), row_tokens(row),
                    w.get("task") == "text" and w.get("batch"), m.get("cache_bytes"),
                    m.get("bytes_per_token")], sort_keys=True, default=str)
  if key not in _ROWS:  # a results file repeats one setting over many queries
    _ROWS[key] = _row_bytes(row)
  return dict(_ROWS[key])


def _row_bytes(row: dict) -> dict:
  m, w = row.get("metrics", {}), row.get("workload", {})
  cfg, T = row_config(row), row_tokens(row)
  if not T:  # nothing to count at: the row's own figure, as written
    return {"bytes_per_token": m.get("bytes_per_token"),
            "bytes_per_token_asymptotic": m.get("bytes_per_token"), "bits_per_element": None}
  if m.get("cache_bytes") and w.get("batch") and w.get("task") == "text":
    per_token = m["cache_bytes"] / (w["batch"] * T)
  elif cfg is not None:
    per_token = count(cfg, T).per_token
  else:
    per_token = m.get("bytes_per_token")
  limit = asymptotic(cfg) if cfg is not None else (
      None if row.get("variant", {}).get("peer") else m.get("bytes_per_token"))
  shape = cfg
  if shape is None and row.get("variant", {}).get("model"):
    from kvjax import config as config_lib
    name = row["variant"]["model"]
    shape = _shape(name) if config_lib.shape_path(name).is_file() else None
  bits = None
  if shape is not None and per_token is not None:
    kv = row.get("variant", {}).get("kv_heads") or shape.model.n_kv_heads
    bits = 8 * per_token / (shape.model.n_layers * 2 * kv * shape.model.D)
  return {"bytes_per_token": per_token, "bytes_per_token_asymptotic": limit,
          "bits_per_element": bits}


# -- weights, temporaries, programs -------------------------------------------------------
def human(n: float, fmt: str = ".1f") -> str:
  """Bytes as `1.5 KiB`, `12.0 GiB` (powers of 1024, `fmt` for the number); below 1 KiB,
  `512 B`. The one formatter of sizes for people (`kvjax size`, errors, result tables)."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{int(n)} B" if unit == "B" else f"{n:{fmt}} {unit}"
    n /= 1024
  return str(n)


def param_count(m: ModelConfig) -> int:
  """Weights of the Llama-style model (`kvjax.model`), from the config alone."""
  E, F, V, H, K, D = m.d_model, m.F, m.vocab_size, m.n_heads, m.n_kv_heads, m.D
  layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * F + 2 * E
  if m.qkv_bias:
    layer += H * D + 2 * K * D
  return m.n_layers * layer + V * E * (1 if m.tie_embeddings else 2) + E


def param_bytes(m: ModelConfig) -> int:
  """Every weight of the model once, at `model.param_dtype`."""
  return param_count(m) * _ITEMSIZE[m.param_dtype]


def layer_param_bytes(m: ModelConfig) -> int:
  """The layers' weights alone (no embeddings, head or final norm): what a layer loop over
  per-layer weights copies out of the stacked params (`memory.split_bytes`)."""
  outside = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.d_model
  return (param_count(m) - outside) * _ITEMSIZE[m.param_dtype]


def cache_bytes(cfg: Config, batch: int, capacity: int, layout: str | None = None) -> int:
  """The closed form of what `batch` x `capacity` slots of cfg's cache hold, in cfg's
  layout or the one named."""
  from kvjax import cache
  spec = cache.CacheSpec.from_config(cfg, batch, capacity)
  return cache.LAYOUTS[layout or cfg.cache.layout].closed_form_bytes(spec)


def temp_bytes(cfg: Config, batch: int, tokens: int, capacity: int) -> int:
  """The widest call's temporaries, for a pass of `tokens` new tokens a sequence (a prompt;
  1: a decode step) over a cache of `capacity` slots, float32 unless said:

  - logits: each row's last token only, B x V (prefill and decode keep no others);
  - one layer's activations: per token, the residual stream and the attention's output
    projection (2E), the queries with their grouped and blocked copies and the attention's
    output (4HD), the keys and values with theirs (4KD) and the RoPE tables (4D); and the
    MLP's gate, up and gated products (3F) for the tokens of one block of a long prompt's
    MLP (`model.layers.MLP_ROWS`);
  - the new K and V of every layer, stacked by the layer loop before the layout writes
    them: 2 x L x B x T x K x D in the compute dtype;
  - the attention's widest tile, 4 x (logits, masked logits, probabilities and their cast
    to the dot's type, where the compiler fuses none of them): a prompt's block of Cq
    queries against Ck of its own keys (`attention.xla.prompt_blocks`; T x T when the
    prompt is one block) and, in the same block, against a stored segment: READ_CHUNK
    slots at a time in the CPU program, all S in the accelerator program's one block;
  - one widened block of K and V codes (2 x B x K x C x D in the compute dtype; C the
    slots a block reads), in case the compiler does not fuse the convert into the dot.

  T is the whole capacity for a layout that recomputes the prefix (`Layout.recomputes`), and
  at most `workload.prefill_chunk` for a prompt prefilled in chunks (whose scan also carries
  a second B x V of logits)."""
  from kvjax import cache, codecs
  from kvjax.attention import base, xla
  m = cfg.model
  none = cache.get(cfg.cache.layout).recomputes
  T = capacity if none else tokens
  chunk = cfg.workload.prefill_chunk
  chunked = bool(chunk) and not none and T > chunk
  T = chunk if chunked else T
  S = 0 if none else capacity
  B, H, K, D, L = batch, m.n_heads, m.n_kv_heads, m.D, m.n_layers
  Cq, Ck = xla.prompt_blocks(T, m.sliding_window)
  Cq, Ck = (T, T) if T <= Cq else (Cq, Ck)
  itemsize = _ITEMSIZE[m.dtype]
  logits = B * m.vocab_size * (2 if chunked else 1)
  from kvjax.model import layers
  acts = B * T * (2 * m.d_model + 4 * H * D + 4 * K * D + 4 * D) + \
      B * min(T, layers.MLP_ROWS) * 3 * m.F
  new_kv = 2 * L * B * T * K * D * itemsize
  new = B * H * Cq * Ck
  C = S if base.program(m.program) == "accelerator" else min(S, codecs.READ_CHUNK)
  stored = B * H * Cq * C
  widened = 2 * B * K * C * D * itemsize
  return 4 * (logits + acts + 4 * (new + stored)) + widened + new_kv


def program_bytes(*compiled) -> int | None:
  """Peak memory the compiled programs need, the largest of (arguments + outputs + temps
  - donated aliases) over the programs, from XLA's memory analysis. Per program, so it
  does not carry over between cells the way a device's process-wide peak counter does."""
  peaks = []
  for prog in compiled:
    try:
      ma = prog.memory_analysis()
    except Exception:  # some backends do not implement it
      return None
    if ma is None:
      return None
    peaks.append(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                 - ma.alias_size_in_bytes)
  return int(max(peaks)) if peaks else None
