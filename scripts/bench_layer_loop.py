"""Decode step time and compile time of the three layer loops at one shape, in one process,
interleaved (medians over repeats; compile excluded from the step times):

  switched  the default: per-layer weights, projections picked by lax.switch (no copy);
  nnscan    nn.scan over stacked params (the default before the switched loop: copies every
            weight matrix each step);
  unrolled  a Python layer loop (model.scan_unroll = n_layers).

The cache is filled to `--context` tokens by length (zeros: speed does not depend on
values), so no prefill is timed. Each program's compiled temporary bytes are reported
too (the copies show there). Extra `--set key=value` overrides apply to every program
(e.g. model.param_dtype=bfloat16); `--variant label:key=value,...` adds a switched
program with its own overrides.

    python scripts/bench_layer_loop.py [--config smollm2-135m]
        [--batch 1] [--context 128] [--steps 16] [--repeats 7] [--programs switched,nnscan,unrolled]
        [--set KEY=VALUE ...] [--variant LABEL:KEY=VALUE,...] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from kvjax import config as config_lib
from kvjax import metrics, model, program


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="kvjax/shapes/smollm2-135m.yaml")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--context", type=int, default=128)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--programs", default="switched,nnscan,unrolled")
  ap.add_argument("--set", action="append", default=[], dest="overrides")
  ap.add_argument("--variant", action="append", default=[])
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  base = config_lib.load(a.config, a.overrides)
  B, steps = a.batch, a.steps
  # decode only, from a cache filled to `--context` tokens by length: a program of width 0
  shape = program.Shape(B, 0, a.context + steps + 1, steps, context=a.context)

  plans = [(p, p, {}) for p in a.programs.split(",") if p]
  for v in a.variant:
    label, _, over = v.partition(":")
    plans.append((label, "switched", dict(kv.split("=", 1) for kv in over.split(",") if kv)))

  params_by_dtype, progs = {}, {}
  for label, kind, over in plans:
    if kind == "unrolled":
      over = {**over, "model.scan_unroll": base.model.n_layers}
    cfg = config_lib.apply_overrides(base, over) if over else base
    if cfg.model not in params_by_dtype:
      params_by_dtype[cfg.model] = model.init_params(cfg.model, 0)
    # nnscan: the stacked params as they are; the others are prepared (split per layer once)
    prog = program.Program(cfg, params_by_dtype[cfg.model], shape, prepare=kind != "nnscan")
    progs[label] = prog.compile()
  first = {label: prog.run().tokens() for label, prog in progs.items()}

  times = {label: [] for label in progs}
  for _ in range(a.repeats):
    for label, prog in progs.items():
      times[label].append(prog.run().decode_s / steps)

  first_label = next(iter(progs))
  ref = float(np.median(times[first_label]))
  env = metrics.environment()
  rows = []
  for label, prog in progs.items():
    t = metrics.summarize(times[label])
    compile_s, temp = prog.compile_s, prog.dec.memory_analysis().temp_size_in_bytes
    row = {"bench": "layer_loop", "program": label, "config": a.config,
           "overrides": a.overrides, "batch": B, "context": a.context, "steps": steps,
           "tpot_s": t["median"], "tpot_s_iqr": t["iqr"], "repeats": t["n"],
           "vs_first": t["median"] / ref, "compile_s": compile_s, "temp_bytes": temp,
           "same_tokens_as_first": bool((first[label] == first[first_label]).all()),
           "cores": len(os.sched_getaffinity(0)), "env": env}
    rows.append(row)
    print(f"{label:>10}  {t['median'] * 1e3:8.2f} ms/step (IQR {t['iqr'] * 1e3:.2f})  "
          f"x{row['vs_first']:.2f}  compile {compile_s:5.1f} s  temp {temp / 1e6:7.2f} MB  "
          f"same tokens: {row['same_tokens_as_first']}")
  if a.out:
    with open(a.out, "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
