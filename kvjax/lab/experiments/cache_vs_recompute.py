"""cache_vs_recompute: what the KV cache buys, as decode time per token vs position.

Without a cache (layout `none`) every new token reruns the model over the whole prefix:
the work for token p grows with p (and attention with p^2), so generating N tokens costs
O(N^2). With a cache (layout `contiguous`) a step runs the model on one token and reads
p stored K/V: near-constant per token until the cache reads dominate, O(N) in total.

One cell = one position p (`workload.prompt_len`): each layout in `params.layouts`
prefills p tokens into a buffer of capacity p + steps + 1 and decodes `params.steps`
tokens; the step time is the time per token at position ~p. Layout `none` recomputes
over its whole buffer capacity each step, which is why capacity tracks p. The layouts
are timed interleaved in the same cell, so their ratio (`speedup_vs_recompute`, on the
cached rows) shares the machine's noise.
"""

from __future__ import annotations

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab import experiments as ex
from kvjax.lab import metrics, timers

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"layouts", "steps"})


def _steps(cfg: config_lib.Config) -> int:
  return cfg.param_int("steps", 4)


def check(cfg: config_lib.Config) -> None:
  layouts = cfg.param("layouts", ["none", "contiguous"])
  if "none" not in layouts or len(layouts) < 2:
    raise KvjaxError("params.layouts must list `none` and at least one cached layout")
  if _steps(cfg) < 1:
    raise KvjaxError(f"params.steps must be >= 1, got {_steps(cfg)}")
  S = cfg.workload.prompt_len + _steps(cfg) + 1
  ex.check_context(cfg, S)
  for layout in layouts:
    lcfg = config_lib.apply_overrides(cfg, {"cache.layout": layout})
    ex.check_memory(lcfg, cfg.workload.batch, S, cfg.workload.prompt_len)


def run_cell(cfg: config_lib.Config) -> list[dict]:
  w = cfg.workload
  steps = _steps(cfg)
  S = w.prompt_len + steps + 1
  params = ex.random_params(cfg.model, cfg.seed)
  tokens, lengths = ex.prompts(cfg, w.batch, w.prompt_len)
  cfgs = {lay: config_lib.apply_overrides(cfg, {"cache.layout": lay})
          for lay in cfg.param("layouts", ["none", "contiguous"])}
  clocks = {lay: timers.DecodeTimer(c, params, tokens, lengths, steps=steps, capacity=S)
            for lay, c in cfgs.items()}
  res = metrics.bench_interleaved(clocks, repeats=w.repeats)
  rows = []
  for lay, m in res.items():
    m["tokens_per_s"] = w.batch / m["tpot_s"]
    if lay != "none":
      m["speedup_vs_recompute"] = res["none"]["tpot_s"] / m["tpot_s"]
    rows.append({
        "variant": ex.variant(cfgs[lay]),
        "workload": {"position": w.prompt_len, "capacity": S, "batch": w.batch,
                     "decode_steps": steps},
        "metrics": m,
    })
  return rows


def summary(rows: list[dict]) -> list[dict]:
  by_pos: dict = {}
  for r in rows:
    rec = by_pos.setdefault(r["workload"]["position"], {"position": r["workload"]["position"]})
    lay = r["variant"]["layout"]
    rec[f"tpot_{lay}_s"] = r["metrics"]["tpot_s"]
    if "speedup_vs_recompute" in r["metrics"]:
      rec[f"speedup_{lay}"] = r["metrics"]["speedup_vs_recompute"]
  return [by_pos[p] for p in sorted(by_pos)]
