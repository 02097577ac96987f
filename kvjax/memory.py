"""Memory before allocation: what a command will allocate, checked against what the device has.

    memory.check_params(cfg)                        # before weights are created or read
    memory.check(cfg, batch, capacity, tokens)      # before a cache and programs are built

The estimate is a closed form, host-side, before anything is traced, from `kvjax.footprint`'s
counts:

- params: every weight of the model at `model.param_dtype`, when not yet allocated;
- per-layer weights: the second copy of the layers' weights that a layer loop over
  per-layer weights makes (`step.layer_loop`: switch, the CPU default, or unrolled;
  `step.prepare_params` splits them once) while the caller keeps the stacked ones
  (`split_bytes`);
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
from kvjax.config import Config
from kvjax.footprint import cache_bytes, human, layer_param_bytes, param_bytes, temp_bytes
from kvjax.errors import KvjaxError

_FIX = "lower the batch, cache.capacity or --max-new-tokens, or choose a smaller codec"


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


def split_bytes(cfg: Config) -> int:
  """The per-layer copy of the layers' weights the program's layer loop makes (switch and
  unrolled loops run on weights split per layer; nn.scan on the stacked ones): 0 or
  `footprint.layer_param_bytes`, per device."""
  from kvjax.decode import step
  if step.resolved(cfg.model).layer_loop == "scan":
    return 0
  return layer_param_bytes(cfg.model) // max(cfg.mesh.model, 1)


def estimate(cfg: Config, batch: int, capacity: int, tokens: int,
             params: bool = False, caches: int = 2) -> dict:
  """Bytes per device by part: params (when not yet allocated), their per-layer copy
  (`split_bytes`), cache (x `caches`), temporaries."""
  n = _devices(cfg)
  parts = {"params": param_bytes(cfg.model) // max(cfg.mesh.model, 1) if params else 0,
           "per-layer weights": split_bytes(cfg),
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
