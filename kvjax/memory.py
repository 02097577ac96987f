"""Memory before allocation: what a command will allocate, checked against what the device has.

    memory.check_params(cfg)                        # before weights are created or read
    memory.check(cfg, batch, capacity, tokens)      # before a cache and programs are built

The estimate is a closed form, host-side, before anything is traced:

- params: every weight of the model at `model.param_dtype` (twice with `model.unrolled`,
  which splits the stacked weights into a second per-layer copy);
- cache: the layout's `closed_form_bytes` for `batch` x `capacity`, counted `caches`
  times (default twice: a fresh cache is built for each timed run while the previous one
  may still be referenced; once where a program donates its only cache);
- temporaries of the widest call (`temp_bytes`): the last token's logits, one layer's
  activations, the attention's widest tile of logits and one widened block of codes, for
  a prompt of `tokens` tokens (1: decode only; the whole capacity for the `none` layout,
  which recomputes the prefix).

The limit is what the device has free now: `memory_stats()` (bytes_limit - bytes_in_use)
on a GPU/TPU, MemAvailable from /proc/meminfo (else `os.sysconf`) for the CPU backend,
or `KVJAX_MEMORY_LIMIT` (bytes, or with a KiB/MiB/GiB/TiB suffix) when set. With a mesh
the estimate is spread evenly over its devices (an ideal lower bound). An estimate above
the limit is a one-line `KvjaxError` with both numbers; allocation failures that still
happen are caught by `kvjax.cli.main` as one line too.
"""

from __future__ import annotations

import os

from kvjax import envcheck
from kvjax.config import Config, ModelConfig
from kvjax.errors import KvjaxError

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_FIX = "lower the batch, cache.capacity or --max-new-tokens, or choose a smaller codec"


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
  n = param_count(m) * _ITEMSIZE[m.param_dtype]
  return 2 * n if m.scan_unroll >= m.n_layers > 1 else n


def cache_bytes(cfg: Config, batch: int, capacity: int) -> int:
  from kvjax import cache
  spec = cache.CacheSpec.from_config(cfg, batch, capacity)
  return cache.LAYOUTS[cfg.cache.layout].closed_form_bytes(spec)


def temp_bytes(cfg: Config, batch: int, tokens: int, capacity: int) -> int:
  """The widest call's temporaries, for a pass of `tokens` new tokens a sequence (a prompt;
  1: a decode step) over a cache of `capacity` slots, float32 unless said:

  - logits: each row's last token only, B x V (prefill and decode keep no others);
  - one layer's activations: B x T x (4E + 3F + 2HD);
  - the attention's widest tile, 4 x (logits, masked logits, probabilities and their cast
    to the dot's type, where the compiler fuses none of them): the new tokens read
    NEW_BLOCK queries at a time against the prompt's keys, B x H x min(T, 128) x T; a
    stored segment read by the CPU program in blocks of READ_CHUNK slots, B x H x T x
    min(S, 512), by the accelerator program in one block, NEW_BLOCK queries at a time,
    B x H x min(T, 128) x S;
  - one widened block of K and V codes (2 x B x K x C x D in the compute dtype; C the
    slots a block reads), in case the compiler does not fuse the convert into the dot.

  T is the whole capacity for the `none` layout, which recomputes the prefix."""
  from kvjax import codecs, step
  from kvjax.attention import xla
  m = step.resolved(cfg.model)
  none = cfg.cache.layout == "none"
  T = capacity if none else tokens
  S = 0 if none else capacity
  B, H, K, D, NB = batch, m.n_heads, m.n_kv_heads, m.D, xla.NEW_BLOCK
  logits = B * m.vocab_size
  acts = B * T * (4 * m.d_model + 3 * m.F + 2 * H * D)
  new = B * H * min(T, NB) * T
  if m.program == "accelerator":
    C, stored = S, B * H * min(T, NB) * S
  else:
    C = min(S, codecs.READ_CHUNK)
    stored = B * H * T * C
  widened = 2 * B * K * C * D * _ITEMSIZE[m.dtype]
  return 4 * (logits + acts + 4 * (new + stored)) + widened


def available_bytes() -> tuple[int | None, str]:
  """(free bytes, what they are) of the first device, or (None, why) when unknown."""
  limit = envcheck.memory_limit()  # (parsed by kvjax.envcheck, checked before JAX starts)
  if limit is not None:
    return limit, "KVJAX_MEMORY_LIMIT"
  import jax
  dev = jax.devices()[0]
  if dev.platform != "cpu":
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"free on {dev.device_kind}"
    return None, "device reports no memory_stats"
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024, "host RAM available"
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host RAM free"
  except (ValueError, OSError, AttributeError):
    return None, "host RAM unknown"


def _devices(cfg: Config) -> int:
  return cfg.mesh.data * cfg.mesh.model


def _refuse(what: str, parts: dict, limit: int, source: str, fix: str = _FIX) -> None:
  total = sum(parts.values())
  detail = " + ".join(f"{k} {human(v)}" for k, v in parts.items() if v)
  raise KvjaxError(f"not enough memory for {what}: about {human(total)} needed ({detail}), "
                   f"{human(limit)} available ({source}); {fix}")


def check_params(cfg: Config, what: str = "the model's weights") -> int:
  """Refuse before weights are created or read when they cannot fit; returns the bytes."""
  need = param_bytes(cfg.model) // max(cfg.mesh.model, 1)
  limit, source = available_bytes()
  if limit is not None and need > limit:
    _refuse(what, {"params": need}, limit, source,
            "choose a smaller model, a 16-bit model.param_dtype or more devices (mesh.model)")
  return need


def estimate(cfg: Config, batch: int, capacity: int, tokens: int,
             params: bool = False, caches: int = 2) -> dict:
  """Bytes per device by part: params (when not yet allocated), cache (x `caches`),
  temporaries."""
  n = _devices(cfg)
  parts = {"params": param_bytes(cfg.model) // max(cfg.mesh.model, 1) if params else 0,
           f"cache x{caches}": caches * cache_bytes(cfg, batch, capacity) // n,
           "temporaries": temp_bytes(cfg, batch, tokens, capacity) // n}
  return parts


def check_parts(parts: dict, what: str, fix: str = _FIX) -> int:
  """Refuse, in one line, bytes by part (`{"params": n, ...}`) over the free memory."""
  limit, source = available_bytes()
  if limit is not None and sum(parts.values()) > limit:
    _refuse(what, parts, limit, source, fix)
  return sum(parts.values())


def check_training(cfg: Config) -> int:
  """`check_parts` for a training run: the weights with their gradients and two Adam
  moments (4 x the weights), and one step's temporaries at train.batch x train.seq_len."""
  t = cfg.train
  return check_parts({"weights, gradients and Adam moments": 4 * param_bytes(cfg.model),
                      "temporaries": temp_bytes(cfg, t.batch, t.seq_len, t.seq_len)},
                     "this training run", "lower train.batch or train.seq_len, or choose a "
                     "smaller model")


def check(cfg: Config, batch: int, capacity: int, tokens: int, params: bool = False,
          what: str = "this request", caches: int = 2) -> int:
  """Refuse, in one line with the estimate and the limit, a request that cannot fit.

  `params=False` when the weights are already allocated (the free memory excludes them).
  Returns the estimate in bytes."""
  parts = estimate(cfg, batch, capacity, tokens, params, caches)
  limit, source = available_bytes()
  if limit is not None and sum(parts.values()) > limit:
    _refuse(what, parts, limit, source)
  return sum(parts.values())


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
