"""Decode throughput with the cache vs recomputing the prefix (layout `none`), and the cost
of build choices (layer scan vs unrolled). Ratios are measured in one run, interleaved.

    python scripts/bench_decode.py [--config configs/quickstart.yaml] [--contexts 128,512,1024]
        [--batches 1,8] [--steps 16] [--repeats 5] [--out results/bench_decode.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

from kvjax import config as config_lib
from kvjax import metrics, model, program


def _programs(cfg, params, B, ctx, steps):
  """AOT-compiled prefill and decode for one shape (a kvjax.program.Program on the params as
  given: stacked ones run the nn.scan program); returns (decode seconds of one run, compile_s)."""
  tokens = np.random.default_rng(0).integers(0, 256, (B, ctx)).astype(np.int32)
  lengths = np.full((B,), ctx, np.int32)
  jax.clear_caches()  # compile_s must not be a cache hit on an identical earlier program
  shape = program.Shape(B, ctx, ctx + steps + 1, steps)
  prog = program.Program(cfg, params, shape, prepare=False).compile(tokens, lengths)
  return (lambda: prog.run().decode_s), prog.compile_s


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/quickstart.yaml")
  ap.add_argument("--contexts", default="128,512,1024")
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default="results/bench_decode.jsonl")
  ap.add_argument("--set", action="append", default=[])
  ap.add_argument("--skip-layouts", action="store_true", help="only the scan vs unrolled part")
  args = ap.parse_args(argv)
  base = config_lib.load(args.config, args.set + ["cache.codec=fp32"])
  env = metrics.environment()
  rows = []
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)

  def record(row):
    row["env"] = env
    rows.append(row)
    with open(args.out, "a") as f:
      f.write(json.dumps(row) + "\n")

  # 1) cache vs recompute: tokens/s at each batch and context, layouts interleaved per repeat
  params = model.init_params(base.model, 0)
  for B in [] if args.skip_layouts else map(int, args.batches.split(",")):
    for ctx in map(int, args.contexts.split(",")):
      progs = {lay: _programs(config_lib.replace(base, **{"cache.layout": lay}), params, B, ctx,
                              args.steps)[0] for lay in ("contiguous", "none")}
      samples = {lay: [] for lay in progs}
      for fn in progs.values():
        fn()  # warm-up
      for _ in range(args.repeats):
        for lay, fn in progs.items():
          samples[lay].append(fn())
      med = {lay: metrics.summarize(s)["median"] for lay, s in samples.items()}
      tps = {lay: B * args.steps / m for lay, m in med.items()}
      record({"bench": "cache_vs_none", "batch": B, "context": ctx,
              "tokens_per_s_cache": tps["contiguous"], "tokens_per_s_none": tps["none"],
              "speedup": med["none"] / med["contiguous"]})
      print(f"B={B:<2} ctx={ctx:<5} cache {tps['contiguous']:9.1f} tok/s   none "
            f"{tps['none']:8.1f} tok/s   speedup {med['none'] / med['contiguous']:6.1f}x",
            flush=True)

  # 2) layer scan vs unrolled: compile time and decode step time (batch 1, middle context)
  ctx = sorted(map(int, args.contexts.split(",")))[len(args.contexts.split(",")) // 2]
  progs, compiles = {}, {}
  for name, unroll in (("scan", 1), ("unrolled", base.model.n_layers)):
    cfg = config_lib.replace(base, **{"model.scan_unroll": unroll})
    progs[name], compiles[name] = _programs(cfg, params, 1, ctx, args.steps)
  samples = {n: [] for n in progs}
  for fn in progs.values():
    fn()
  for _ in range(args.repeats):
    for n, fn in progs.items():
      samples[n].append(fn())
  tpot = {n: metrics.summarize(s)["median"] / args.steps for n, s in samples.items()}
  record({"bench": "scan_vs_unrolled", "context": ctx, "layers": base.model.n_layers,
          "compile_s": compiles, "tpot_s": tpot,
          "unrolled_over_scan_tpot": tpot["unrolled"] / tpot["scan"]})
  for n in progs:
    print(f"{n:9s} L={base.model.n_layers} compile {compiles[n]:5.2f} s   TPOT "
          f"{tpot[n] * 1e3:7.3f} ms", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
