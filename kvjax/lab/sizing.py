"""`kvjax size`: what a cache setting holds at a context, and with `--budget` how many
sequences fit in a memory budget, in closed form (`report`, the command's whole result).

    sequences = floor((budget - weight bytes) / cache bytes of one sequence)

Weights count at the dtype they are stored in (`model.param_dtype`; for a Hugging Face
folder, config.json's `torch_dtype`/`dtype`). A sequence's cache is what its layout
reserves for `seq_len` tokens with the chosen K/V codecs, scales, residual window, whole
pages and metadata included (`kvjax.footprint.count`; a policy: its budget and state). Not
counted: activations and temporaries (a long prefill's attention and MLP buffers are
large), logits, and the runtime's own overhead.
"""

from __future__ import annotations

import dataclasses
import re

from kvjax import config as config_lib
from kvjax.errors import ArgError, KvjaxError

UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
NOT_COUNTED = ("activations and temporaries (a long prefill's are large), logits, "
               "allocator/runtime overhead")
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
             "torch.float32": "float32", "torch.bfloat16": "bfloat16",
             "torch.float16": "float16"}


def parse_bytes(text: str) -> tuple[int, str]:
  """'80GiB' -> (85899345920, 'GiB = 2^30 bytes'); GB/MB/KB/TB are powers of 1000."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
  unit = m and m.group(2).lower()
  if not m or unit not in UNITS:
    raise ArgError("budget", f"{{arg}} '{text}' needs a number and a unit, e.g. 80GiB or "
                   "80GB (units: B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = of "
                   "1024)")
  if len(m.group(1)) > 24:  # a float of hundreds of digits is infinity, then an overflow
    raise ArgError("budget", f"{{arg}} '{str(text)[:40]}' has too many digits; give e.g. 80GiB")
  n = int(float(m.group(1)) * UNITS[unit])
  if n <= 0:
    raise ArgError("budget", f"{{arg}} must be positive, got '{text}'")
  if n > 2**60:
    raise ArgError("budget", f"{{arg}} '{text}' is more than 1 EiB, more than any machine; "
                   "give the memory of one device, e.g. 80GiB")
  name = {k.lower(): k for k in ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")}[unit]
  power = "2^" + str({"kib": 10, "mib": 20, "gib": 30, "tib": 40}[unit]) if unit.endswith("ib") \
      else "10^" + str({"b": 0, "kb": 3, "mb": 6, "gb": 9, "tb": 12}[unit])
  return n, f"{name} = {power} bytes"


def hf_param_dtype(hf: dict) -> tuple[str, str]:
  """(stored dtype, where it was read) of a Hugging Face config.json dict."""
  for key in ("torch_dtype", "dtype"):
    value = hf.get(key)
    if value is None:
      continue
    if not isinstance(value, str) or value not in HF_DTYPES:
      raise KvjaxError(f"config.json {key} {value!r} is not a dtype kvjax counts weights in "
                       f"({', '.join(sorted(set(HF_DTYPES.values())))}); fix it in "
                       "config.json, or remove it to count float32")
    return HF_DTYPES[value], f"config.json {key}"
  return "float32", "float32 assumed: config.json names no torch_dtype"


def seq_bytes(cfg: config_lib.Config, seq_len: int) -> int:
  """Cache bytes one sequence of `seq_len` tokens holds (`kvjax.footprint`: the reservation with
  its window, scales and metadata; a policy's budget and state)."""
  from kvjax import footprint
  return int(round(footprint.count(cfg, seq_len).bytes))


def fit(budget: int, weight_bytes: int, per_seq: int) -> int:
  free = budget - weight_bytes
  return int(free // per_seq) if free > 0 else 0


def compared_codecs() -> list[str]:
  """The codecs `--budget` compares next to the chosen one, each at whole-head scales:
  every registered codec (`kvjax.registries`), so a codec added as a module is compared."""
  from kvjax import registries
  return registries.names("codec")


def budget_report(cfg: config_lib.Config, seq_len: int, batch: int, budget: int,
                  weight_bytes: int | None) -> dict:
  """Sequences of `seq_len` tokens that fit in `budget` bytes after the weights."""
  weights = weight_bytes or 0
  per_seq = seq_bytes(cfg, seq_len)
  others = {}
  for name in compared_codecs():
    c = dataclasses.replace(cfg.cache, codec="", k_codec=name, v_codec=name, k_axis="token",
                            group_size=0, residual=0)
    others[name] = fit(budget, weights, seq_bytes(dataclasses.replace(cfg, cache=c), seq_len))
  need = weights + batch * per_seq
  return {
      "budget_bytes": budget, "weight_bytes": weight_bytes, "seq_bytes": per_seq,
      "free_bytes": budget - weights, "max_sequences": fit(budget, weights, per_seq),
      "max_sequences_by_codec": others, "batch_bytes": need, "batch_fits": need <= budget,
      "counted": ("weights at their stored dtype, " if weight_bytes is not None else "")
      + f"the KV cache reserved for all {seq_len} tokens of each sequence (codec scales, "
      "residual window and metadata included)",
      "not_counted": NOT_COUNTED + ("" if weight_bytes is not None else
                                    "; weights (no model given: use --config or --hf)"),
  }


DEFAULT_CODEC = "bf16"  # the common serving dtype, for every way of naming the model
CODEC_KEYS = ("cache.codec", "cache.k_codec", "cache.v_codec")


def of_source(src) -> tuple[config_lib.Config, str, dict]:
  """A model source's (`kvjax.io.sources.Source`) config without reading its weights, the
  dtype its weights load in and why, and the dotted items its own config file sets (a
  codec it names is kept; otherwise `size` assumes DEFAULT_CODEC)."""
  from kvjax.io import sources
  if src.kind == "hf":
    from kvjax.io import hf
    dtype, why = hf_param_dtype(hf.read_hf_config(src.ref))
    return hf.load_config(src.ref, {"model.param_dtype": dtype}), f"{dtype} ({why})", {}
  if src.kind == "gguf":
    cfg = sources.load_config(src)
    return cfg, f"{cfg.model.param_dtype} (dequantized from the GGUF file)", {}
  if src.kind == "checkpoint":  # (the cache it was trained with is not the one sized)
    cfg = sources.load_config(src)
    return cfg, f"{cfg.model.param_dtype} (the checkpoint's)", {}
  cfg = config_lib.load(src.ref or None)  # refuses a bad file, so reading it again succeeds
  items = config_lib.flat(config_lib.read_yaml(config_lib.shape_path(src.ref)) or {}) \
      if src.ref else {}
  return cfg, f"{cfg.model.param_dtype} (model.param_dtype)", items


def names_codec(*item_sets: dict) -> bool:
  """Whether any of these dotted items names a cache codec."""
  return any(k in items for items in item_sets for k in CODEC_KEYS)


def sized(cfg: config_lib.Config) -> config_lib.Config:
  """`cfg` as `size` counts it: the layout stands in for what it holds (`Layout.sized_as`:
  `none` as the contiguous K/V it recomputes), and the cache reserves exactly the context
  asked for, whatever cache.capacity says."""
  from kvjax import cache
  layout = cache.get(cfg.cache.layout)
  c = dataclasses.replace(cfg.cache, layout=layout.sized_as or layout.name, capacity=0)
  return dataclasses.replace(cfg, cache=c)


def report(cfg: config_lib.Config, seq_len: int, batch: int, named: bool = False,
           notes: list[str] = (), param_dtype: str | None = None,
           budget: str | None = None) -> dict:
  """`kvjax size`'s result for a validated config: bytes one sequence holds at `seq_len`
  (`kvjax.footprint`: window, scales, policy state and pages in), the total for `batch`, bytes
  per device under cfg.mesh (`sharding.size_report`), and with `budget` ("80GiB") what
  fits. `named`: the model came from a file or folder (its weights are counted, and a
  `seq_len` beyond its max_seq_len is warned about)."""
  from kvjax import cache, footprint
  from kvjax.decode import sharding
  if seq_len <= 0 or batch <= 0:
    raise KvjaxError("--seq-len and --batch must be positive")
  m, warnings = cfg.model, []
  if named and seq_len > m.max_seq_len:
    warnings.append(f"--seq-len {seq_len} exceeds this model's max_seq_len "
                    f"{m.max_seq_len}: sized anyway, but the model is not meant for it")
  cfg = sized(cfg)
  h = footprint.count(cfg, seq_len, batch=batch)
  if footprint.window_warning(cfg, seq_len):
    warnings.append(footprint.window_warning(cfg, seq_len))
  c = cfg.cache
  out = {
      **h.fields(),  # bytes_per_token: held at seq_len; and the long-context limit
      "total_bytes": int(round(h.bytes * batch)),
      "layers": m.n_layers, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.D,
      "seq_len": seq_len, "batch": batch, "variant": m.variant,
      "max_seq_len": m.max_seq_len if named else None,
      "k_codec": c.k_codec, "v_codec": c.v_codec, "layout": cache.get(h.layout).name,
      "k_axis": c.k_axis, "group_size": c.group_size, "residual": c.residual,
      "keep_first": c.keep_first, "rotate": c.rotate, "clip": c.clip, "notes": list(notes),
      "warnings": warnings, "policy": c.policy, "held_tokens": h.tokens,
      **sharding.size_report(cfg, batch, h.tokens, with_params=named),
  }
  if param_dtype:
    out["param_dtype"] = param_dtype
  if budget:
    if out["devices"] > 1:
      raise KvjaxError("--budget sizes one device; drop the mesh.* overrides (or divide the "
                       "model yourself) to size a single device")
    n, unit = parse_bytes(budget)
    out["budget"] = {"text": budget, "unit": unit,
                     **budget_report(cfg, h.tokens, batch, n, out.get("param_bytes"))}
  return out
