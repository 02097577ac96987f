"""One prefill of a long prompt serving every cache setting of a grid: the prompt through
the fp32 cache once with its queries kept (`kvjax.lab.tasks.prefill_queries`, what the
long-context experiments memoize per prompt), then each setting's branch, its codec's
write of the prefix's K/V and its policy's compaction (`tasks.evict_prefix`). The grid
costs (prefill + the branches) / prefill prefills; the target is at most 1 + 0.1 N.

    python scripts/shared_prefill.py --model gguf:gemma3-270m --tokens 8192 \
        --out results/cpu/shared_prefill.jsonl

Compile excluded: each program runs once untimed first. One row per run.
"""

from __future__ import annotations

import argparse
import json
import time

SETTINGS = {
    "bf16": {"cache.codec": "bf16"},
    "int8": {"cache.codec": "int8"},
    "int4": {"cache.codec": "int4"},
    "int4_kch": {"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 32,
                 "cache.residual": 32},
    "int4_rot": {"cache.codec": "int4", "cache.group_size": 32, "cache.rotate": "hadamard"},
    "snapkv_25": {"cache.policy": "snapkv", "cache.ratio": 0.25},
    "snapkv_25_int4": {"cache.policy": "snapkv", "cache.ratio": 0.25, "cache.codec": "int4"},
    "h2o_25": {"cache.policy": "h2o", "cache.ratio": 0.25},
    "tova_25": {"cache.policy": "tova", "cache.ratio": 0.25},
    "knorm_50": {"cache.policy": "knorm", "cache.ratio": 0.5},
    "sinks_25": {"cache.policy": "sinks", "cache.ratio": 0.25},
}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", required=True)
  ap.add_argument("--tokens", type=int, required=True)
  ap.add_argument("--room", type=int, default=64, help="free slots after the prefix")
  ap.add_argument("--out", required=True)
  a = ap.parse_args()
  import jax

  from kvjax import config as config_lib
  from kvjax.decode import step
  from kvjax.io import sources
  from kvjax.lab import data, evaluate, metrics, tasks

  cfg, params, tok = sources.load(sources.parse(a.model))
  T = a.tokens
  ids = tok.encode(data.eval_text("shakespeare", val_fraction=1.0))[:T]
  params = step.prepare_params(cfg, params)
  ref = evaluate.reference_config(config_lib.replace(cfg, **{"cache.capacity": T}))

  def prefill():
    p = tasks.prefill_queries(ref, params, ids, T)
    jax.block_until_ready(p.q)
    return p

  prefill()  # compile
  t0 = time.perf_counter()
  prefix = prefill()
  prefill_s = time.perf_counter() - t0
  branches = {}
  for name, over in SETTINGS.items():
    c = config_lib.replace(cfg, **over)
    jax.block_until_ready(tasks.evict_prefix(c, prefix, a.room))  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(tasks.evict_prefix(c, prefix, a.room))
    branches[name] = time.perf_counter() - t0
  N = len(branches)
  cost = (prefill_s + sum(branches.values())) / prefill_s
  row = {"bench": "shared_prefill", "model": a.model, "tokens": T, "prefill_s": prefill_s,
         "branch_s": branches, "settings": N, "grid_cost_prefills": cost,
         "target_prefills": 1 + 0.1 * N, "largest_branch_fraction":
             max(branches.values()) / prefill_s, "env": metrics.environment()}
  with open(a.out, "a") as f:
    f.write(json.dumps(row) + "\n")
  print(f"{a.model} {T}: prefill {prefill_s:.1f} s; {N} settings' branches "
        f"{sum(branches.values()):.2f} s in all (largest {max(branches.values()):.2f} s); the grid "
        f"costs {cost:.3f} prefills (target {1 + 0.1 * N:.1f})")


if __name__ == "__main__":
  main()
