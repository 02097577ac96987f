"""budget: decode throughput at a memory budget, where a smaller cache pays in concurrency.

A quantized or evicted cache holds fewer bytes per sequence, so more sequences fit in the
same memory, and a decode step serves all of them. Per cell (a codec, policy or setting):

  batch  = the largest B <= `params.max_batch` whose weights + cache (x2, as every run
           allocates a fresh one beside the last) + temporaries, as `kvjax.memory`
           estimates them for B sequences of `workload.prompt_len` + `gen_len` tokens,
           fit in `params.budget` (e.g. "2GiB"; GiB/MiB are powers of 1024);
  tokens_per_s = batch / TPOT, TPOT timed as the `roofline` experiment times it: compiled
           decode steps from a cache already holding `prompt_len` tokens per sequence,
           `workload.repeats` repeats after a warm-up.

The rows carry the per-repeat throughputs and a 95 % interval of their median (a bootstrap
over repeats, `scipy.stats.bootstrap`), so two settings' throughputs are told apart only
where their intervals separate. `tokens_per_s_vs_ref` is the ratio to the cell whose cache
setting is `params.reference` (default bf16), with the interval of the ratio of medians
(the two cells' repeats resampled independently).
"""

from __future__ import annotations

import numpy as np

from kvjax import config as config_lib
from kvjax import footprint, memory
from kvjax.errors import KvjaxError
from kvjax.lab import experiments as ex
from kvjax.lab import intervals, metrics, sizing
from kvjax.lab.experiments import roofline

PARAMS = frozenset({"budget", "max_batch", "reference"})


def _budget(cfg: config_lib.Config) -> int:
  value = cfg.param("budget", None)
  if value is None:
    raise KvjaxError("budget needs params.budget, the memory to fill (e.g. 2GiB)")
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if value <= 0:
      raise KvjaxError(f"params.budget must be positive, got {value}")
    return int(value)
  try:
    return sizing.parse_bytes(value)[0]
  except KvjaxError:
    raise KvjaxError(f"params.budget '{value}' needs a number and a unit, e.g. 2GiB or 2GB") \
        from None


capacity = roofline.capacity  # a filled decode's slots: the one rule, the roofline's


def need(cfg: config_lib.Config, batch: int) -> int:
  """Bytes a cell at `batch` sequences needs, weights included (`kvjax.memory`)."""
  return sum(memory.estimate(cfg, batch, capacity(cfg), 1, params=True).values())


def largest_batch(cfg: config_lib.Config) -> int:
  """The largest batch whose estimate fits the budget (0: not even one sequence)."""
  budget, top = _budget(cfg), cfg.param("max_batch", 256)
  lo, hi = 0, top
  while lo < hi:  # need() grows with the batch: bisect for the last one that fits
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if need(cfg, mid) <= budget else (lo, mid - 1)
  return lo


def check(cfg: config_lib.Config) -> None:
  top = cfg.param("max_batch", 256)
  if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= 65536:
    raise KvjaxError(f"params.max_batch must be a whole number in [1, 65536], got {top!r}")
  ex.check_context(cfg, capacity(cfg))
  b = largest_batch(cfg)
  if b == 0:
    raise KvjaxError(f"params.budget={cfg.param('budget')} does not hold the weights and one "
                     f"sequence of {capacity(cfg)} tokens ({footprint.human(need(cfg, 1))}); raise "
                     "the budget or shorten workload.prompt_len")
  ex.check_memory(cfg, b, capacity(cfg), 1)


def run_cell(cfg: config_lib.Config) -> list[dict]:
  w = cfg.workload
  batch = largest_batch(cfg)
  params = ex.random_params(cfg.model, cfg.seed)
  steps = max(w.gen_len - 1, 1)
  timer = roofline.FilledDecode(cfg, params, batch, w.prompt_len, steps, capacity(cfg))
  timer.once()  # warm-up
  ts = [timer.once() for _ in range(w.repeats)]
  tps = [batch / t for t in ts]
  t = metrics.summarize(ts)
  m = {"batch": batch, "budget_bytes": _budget(cfg), "need_bytes": need(cfg, batch),
       "tpot_s": t["median"], "tpot_s_iqr": t["iqr"], "repeats": t["n"],
       "tokens_per_s": float(np.median(tps)), "tokens_per_s_ci95": intervals.median_ci(tps),
       "tokens_per_s_samples": tps, **footprint.count(cfg, w.prompt_len).fields()}
  return [{"variant": ex.variant(cfg),
           "workload": {"batch": batch, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                        "context": w.prompt_len, "capacity": capacity(cfg),
                        "decode_steps": steps},
           "metrics": m}]


def ratio_ci(num: list[float], den: list[float]) -> list[float]:
  """95 % bootstrap interval of median(num) / median(den), the two resampled apart."""
  from scipy import stats
  a, b = np.asarray(num, float), np.asarray(den, float)
  r = stats.bootstrap((a, b), lambda x, y: np.median(x) / np.median(y), confidence_level=0.95,
                      n_resamples=2000, method="percentile", random_state=0)
  return [float(r.confidence_interval.low), float(r.confidence_interval.high)]


def summary(rows: list[dict]) -> list[dict]:
  """One line per cell: the batch that fits, its throughput with its interval, and the
  ratio to the reference setting's throughput."""
  ref_name = (rows[0].get("config", {}).get("params", {}) or {}).get("reference", "bf16") \
      if rows else "bf16"
  ref = next((r for r in rows if ex.cache_name(r["variant"]) == ref_name), None)
  out = []
  for r in rows:
    m = r["metrics"]
    line = {"variant": r["variant"]["variant"], "cache": ex.cache_name(r["variant"]),
            "context": r["workload"]["context"], "batch": m["batch"],
            "bytes_per_token": m.get("bytes_per_token"), "tpot_ms": m["tpot_s"] * 1e3,
            "tokens_per_s": m["tokens_per_s"],
            "ci95": "[{:.0f}, {:.0f}]".format(*m["tokens_per_s_ci95"])}
    if ref is not None:
      s, rs = m["tokens_per_s_samples"], ref["metrics"]["tokens_per_s_samples"]
      line["vs_ref"] = m["tokens_per_s"] / ref["metrics"]["tokens_per_s"]
      line["vs_ref_ci95"] = "[{:.2f}, {:.2f}]".format(*ratio_ci(s, rs))
    out.append(line)
  return out
