"""paged_workload: what paging, prefix sharing and continuous batching buy on a request stream.

One cell = one attention variant x codec x layout at a fixed cache memory budget
(`params.budget_kib`, the same bytes for every codec, so smaller codecs hold more tokens).
A seeded synthetic stream (`stream`) is served to completion by `kvjax.lab.serve.engine.Engine`:

  - `contiguous`: every admitted request reserves `cache.capacity` token slots (max-length
    reservation), so the budget fixes the number of slots;
  - `paged`: the budget is a pool of `cache.page_size`-token pages allocated on demand;
    decode slots are `params.max_slots`. The cell is served twice, with the prefix cache
    on and off (two rows, `variant.prefix_cache`), to show the hit rate's effect.

Rows report `memory_utilization` (tokens held by running requests / token slots reserved
for them, averaged over engine steps; shared pages counted once), `max_concurrency`,
`mean_concurrency`, `tokens_per_s` (output tokens / wall time, compile excluded, median of
`params.serve_repeats` runs of the same stream),
`prefix_hit_rate`, `preemptions` and latencies in engine steps. With
`params.gather_bench`, paged cells also time decode through the block table against the
contiguous layout at the same batch and context (`gather_overhead` = paged / contiguous
time per output token, interleaved in one process, medians of repeats).

Time is counted in engine steps (arrivals too), so everything but wall-clock rates is
deterministic for a seed.
"""

from __future__ import annotations

import numpy as np

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab import experiments as ex
from kvjax.lab import metrics, timers
from kvjax.lab.serve import engine

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"arrival_rate", "bench_batch", "bench_context", "bench_repeats",
                    "budget_kib", "chunk", "gather_bench", "max_slots", "output_max",
                    "output_mean", "output_sigma", "prefill_rows", "prompt_max", "prompt_mean",
                    "prompt_sigma", "requests", "serve_repeats", "shared_fraction",
                    "system_len", "system_prompts"})


def stream(cfg: config_lib.Config) -> list[engine.Request]:
  """Seeded requests: Poisson arrivals, log-normal (right-skewed) prompt and output lengths,
  a share of prompts starting with one of a few common system prompts."""
  p = cfg.param
  rng = np.random.default_rng(cfg.seed)
  V, n = cfg.model.vocab_size, int(p("requests", 64))
  systems = [rng.integers(0, V, int(p("system_len", 32))).tolist()
             for _ in range(int(p("system_prompts", 4)))]

  def lognormal(mean, sigma, lo, hi, size):  # median chosen so the mean is `mean`
    x = rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, size)
    return np.clip(np.round(x), lo, hi).astype(int)

  prompt = lognormal(p("prompt_mean", 40), p("prompt_sigma", 0.8), 2, p("prompt_max", 128), n)
  output = lognormal(p("output_mean", 48), p("output_sigma", 0.8), 1, p("output_max", 128), n)
  arrival = np.floor(np.cumsum(rng.exponential(1 / p("arrival_rate", 1.0), n))).astype(int)
  shared = rng.random(n) < p("shared_fraction", 0.5)
  which = rng.integers(0, len(systems), n) if systems else np.zeros(n, int)
  out = []
  for i in range(n):
    head = systems[which[i]] if shared[i] and systems else []
    out.append(engine.Request(head + rng.integers(0, V, prompt[i]).tolist(), int(output[i]),
                              arrival=int(arrival[i])))
  return out


def _sizes(cfg: config_lib.Config) -> dict:
  budget = cfg.param_int("budget_kib", 1024) * 1024
  bpt = ex.bytes_per_token(cfg)
  S, page = cfg.cache.capacity or 256, cfg.cache.page_size
  return {"budget_bytes": budget, "bytes_per_token": bpt, "max_len": S,
          "contiguous_slots": min(int(budget // (S * bpt)), cfg.param_int("max_slots", 32)),
          "num_pages": int(budget // (page * bpt)), "max_slots": cfg.param_int("max_slots", 32)}


def check(cfg: config_lib.Config) -> None:
  s = _sizes(cfg)
  ex.check_context(cfg, s["max_len"])
  if cfg.cache.layout not in ("contiguous", "paged"):
    raise KvjaxError(f"paged_workload compares cache.layout contiguous and paged, got "
                     f"'{cfg.cache.layout}'")
  if cfg.cache.layout == "contiguous" and s["contiguous_slots"] < 1:
    raise KvjaxError(f"params.budget_kib={s['budget_bytes'] // 1024} holds no {s['max_len']}-token "
                     "reservation; raise the budget or lower cache.capacity")
  p = cfg.param
  if p("prompt_max", 128) + p("system_len", 32) + p("output_max", 128) > s["max_len"]:
    raise KvjaxError("system_len + prompt_max + output_max exceed cache.capacity (the longest "
                     "request must fit one reservation); raise cache.capacity")


def _serve(cfg, params, sizes, prefix_cache: bool) -> dict:
  paged = cfg.cache.layout == "paged"
  if paged:
    cfg = config_lib.replace(cfg, **{"cache.num_pages": sizes["num_pages"]})
  slots = sizes["max_slots"] if paged else sizes["contiguous_slots"]
  e = engine.Engine(cfg, params, slots=slots, max_len=sizes["max_len"],
                    chunk=cfg.param_int("chunk", 32),
                    prefill_rows=cfg.param_int("prefill_rows", 2), prefix_cache=prefix_cache)
  e.warmup()
  runs = [e.run(stream(cfg)) for _ in range(cfg.param_int("serve_repeats", 3))]
  stats = runs[-1]  # scheduling is deterministic: only wall time differs between repeats
  rate = metrics.summarize([r["tokens_per_s"] for r in runs])
  stats.update({"tokens_per_s": rate["median"], "tokens_per_s_iqr": rate["iqr"],
                "wall_s": metrics.summarize([r["wall_s"] for r in runs])["median"],
                "serve_repeats": len(runs)})
  stats["slots"] = slots
  stats["cache_bytes"] = metrics.tree_bytes(e.backend.cache)
  stats["token_capacity"] = (sizes["num_pages"] * cfg.cache.page_size if paged
                             else slots * sizes["max_len"])
  return stats


def _gather_bench(cfg, params) -> dict:
  """Decode time per token through the block table vs contiguous, interleaved."""
  B, ctx = cfg.param_int("bench_batch", 8), cfg.param_int("bench_context", 192)
  tokens, lengths = ex.prompts(cfg, B, ctx - 16)
  clocks = {lay: timers.DecodeTimer(config_lib.replace(cfg, **{"cache.layout": lay,
                                                                "cache.num_pages": 0}),
                                     params, tokens, lengths, steps=15, capacity=ctx)
            for lay in ("contiguous", "paged")}
  m = metrics.bench_interleaved(clocks, repeats=cfg.param_int("bench_repeats", 3))
  return {"tpot_s": m["paged"]["tpot_s"], "tpot_s_iqr": m["paged"]["tpot_s_iqr"],
          "tpot_s_contiguous": m["contiguous"]["tpot_s"],
          "gather_overhead": m["paged"]["tpot_s"] / m["contiguous"]["tpot_s"],
          "bench_batch": B, "bench_context": ctx}


def run_cell(cfg: config_lib.Config) -> list[dict]:
  params = ex.random_params(cfg.model, cfg.seed)
  sizes = _sizes(cfg)
  p = cfg.param
  workload = {"requests": int(p("requests", 64)), "arrival_rate": p("arrival_rate", 1.0),
              "prompt_mean": p("prompt_mean", 40), "output_mean": p("output_mean", 48),
              "shared_fraction": p("shared_fraction", 0.5), "system_len": p("system_len", 32),
              "budget_bytes": sizes["budget_bytes"], "max_len": sizes["max_len"],
              "page_size": cfg.cache.page_size, "chunk": int(p("chunk", 32)),
              "prefill_rows": int(p("prefill_rows", 2))}
  paged = cfg.cache.layout == "paged"
  bench = _gather_bench(cfg, params) if paged and p("gather_bench", True) else {}
  rows = []
  for prefix in ((True, False) if paged else (False,)):
    m = _serve(cfg, params, sizes, prefix)
    m.update(bench if prefix else {})
    m["bytes_per_token"] = sizes["bytes_per_token"]
    rows.append({"variant": ex.variant(cfg, prefix_cache=prefix), "workload": workload,
                 "metrics": m})
  return rows


def summary(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    v, m = r["variant"], r["metrics"]
    out.append({"variant": v["variant"], "codec": ex.cache_name(v), "layout": v["layout"],
                "prefix": v.get("prefix_cache", False), "slots": m["slots"],
                "token_capacity": m["token_capacity"],
                "memory_utilization": m["memory_utilization"],
                "max_concurrency": m["max_concurrency"],
                "mean_concurrency": m["mean_concurrency"], "tokens_per_s": m["tokens_per_s"],
                "prefix_hit_rate": m["prefix_hit_rate"], "preemptions": m["preemptions"],
                "steps": m["steps"], "latency_steps": m["mean_latency_steps"],
                "gather_overhead": m.get("gather_overhead", "")})
  return out
