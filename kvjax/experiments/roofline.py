"""roofline: how close decode runs to the memory-bandwidth limit, per variant and codec.

Decode is memory-bound: a step cannot be faster than the bytes it must read (every
weight matrix once, plus each sequence's live K/V with its codec's scales) divided by
the memory bandwidth. This experiment times `workload.gen_len - 1` compiled decode steps
from a cache already holding `workload.prompt_len` tokens per sequence, `workload.repeats`
times, and right before each repeat measures the bandwidth (a large streaming reduction,
`params.bandwidth_mib` MiB, median of 3 passes). It reports

  roofline_fraction = median over repeats of (step_bytes / bandwidth_i) / tpot_i

with `tpot_s`, the byte counts and the achieved bandwidth. The cache is filled by setting
its lengths (contents are zeros: decode speed does not depend on values), so no prefill
is timed and a cell at 8k context costs seconds, not minutes. The embedding table is not
counted (a step gathers B rows of it) unless it is tied to the lm_head.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import config as config_lib
from kvjax import experiments as ex
from kvjax import metrics, program
from kvjax.errors import KvjaxError

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"bandwidth_mib"})


def capacity(cfg: config_lib.Config) -> int:
  w = cfg.workload
  return cfg.cache.capacity or w.prompt_len + max(w.gen_len, 2)


def check(cfg: config_lib.Config) -> None:
  ex.check_context(cfg, capacity(cfg))
  ex.check_memory(cfg, cfg.workload.batch, capacity(cfg), cfg.workload.prompt_len)
  mib = cfg.param("bandwidth_mib", 512)
  if not isinstance(mib, int) or isinstance(mib, bool) or mib < 1:
    raise KvjaxError(f"params.bandwidth_mib must be a whole number of MiB >= 1, got {mib!r}; "
                     "512 suits a CPU, 4096 a GPU")


class Bandwidth:
  """Bytes/s of a compiled sum over a `mib` MiB float32 array (read once per pass)."""

  def __init__(self, mib: int):
    n = mib * 2 ** 20 // 4
    self.nbytes = n * 4
    self._x = jax.block_until_ready(jnp.ones((n,), jnp.float32))
    self._sum = jax.jit(jnp.sum).lower(self._x).compile()
    jax.block_until_ready(self._sum(self._x))  # warm-up

  def measure(self, passes: int = 3) -> float:
    """Median over `passes` timed passes."""
    return self.nbytes / metrics.time_call(lambda: self._sum(self._x), repeats=passes,
                                           warmup=0)["median"]


def step_bytes(cfg: config_lib.Config, params, batch: int, live: float) -> dict:
  """Bytes one decode step must read: weights (embedding only if tied) + live K/V."""
  weights = metrics.tree_bytes(params)
  if not cfg.model.tie_embeddings:
    weights -= metrics.tree_bytes(params["embed_tokens"])
  kv = batch * live * ex.bytes_per_token(cfg)
  return {"weight_bytes": weights, "kv_bytes": kv, "step_bytes": weights + kv}


class FilledDecode:
  """Compiled decode of `steps` tokens from a cache that already holds `context` tokens
  (a `kvjax.program.Program` of prompt width 0)."""

  def __init__(self, cfg, params, batch: int, context: int, steps: int, cap: int,
               prepare: bool = True):
    """`prepare=False` runs the params as given (stacked: the nn.scan program)."""
    self.steps = steps
    shape = program.Shape(batch, 0, cap, steps, context=context)
    self.program = program.Program(cfg, params, shape, prepare=prepare).compile()

  def once(self) -> float:
    return self.program.run().decode_s / self.steps


def run_cell(cfg: config_lib.Config) -> list[dict]:
  w = cfg.workload
  params = ex.random_params(cfg.model, cfg.seed)
  steps = max(w.gen_len - 1, 1)
  timer = FilledDecode(cfg, params, w.batch, w.prompt_len, steps, capacity(cfg))
  meter = Bandwidth(cfg.param("bandwidth_mib", 512))
  timer.once()  # warm-up
  # Each repeat measures the bandwidth right before its decode and pairs the two: a slow
  # phase of a shared machine (seconds long) slows both, and their ratio stands.
  bws, ts = [], []
  for _ in range(w.repeats):
    bws.append(meter.measure())
    ts.append(timer.once())
  del meter
  t = metrics.summarize(ts)
  live = w.prompt_len + (steps + 1) / 2  # tokens held, averaged over the timed steps
  m = step_bytes(cfg, params, w.batch, live)
  bw = statistics.median(bws)
  fractions = metrics.summarize([m["step_bytes"] / b / s for b, s in zip(bws, ts)])
  m.update({"tpot_s": t["median"], "tpot_s_iqr": t["iqr"], "tpot_s_min": t["min"],
            "repeats": t["n"], "bandwidth_Bps": bw, "ideal_s": m["step_bytes"] / bw,
            "roofline_fraction": fractions["median"],
            "roofline_fraction_iqr": fractions["iqr"],
            "achieved_Bps": m["step_bytes"] / t["median"],
            "tokens_per_s": w.batch / t["median"], "bytes_per_token": ex.bytes_per_token(cfg),
            "kv_fraction": m["kv_bytes"] / m["step_bytes"]})
  return [{
      "variant": ex.variant(cfg),
      "workload": {"batch": w.batch, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                   "context": w.prompt_len, "capacity": capacity(cfg), "decode_steps": steps},
      "metrics": m,
  }]


def summary(rows: list[dict]) -> list[dict]:
  """One line per cell, with decode time relative to the same variant's bf16 cache."""
  ref = {(r["variant"]["variant"], r["workload"]["batch"], r["workload"]["context"]):
         r["metrics"]["tpot_s"] for r in rows if r["variant"]["codec"] == "bf16"}
  out = []
  for r in rows:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    base = ref.get((v["variant"], w["batch"], w["context"]))
    out.append({"variant": v["variant"], "codec": ex.cache_name(v), "batch": w["batch"],
                "context": w["context"], "tpot_ms": m["tpot_s"] * 1e3,
                "roofline_fraction": m["roofline_fraction"],
                "achieved_GBps": m["achieved_Bps"] / 1e9,
                "bandwidth_GBps": m["bandwidth_Bps"] / 1e9,
                "tpot_vs_bf16": m["tpot_s"] / base if base else float(np.nan)})
  return out
