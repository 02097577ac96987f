"""What sharding costs on CPU: TTFT/TPOT of one config on several meshes, timed interleaved.

    python scripts/bench_sharding.py [--devices 4] [--meshes 1x1,1x4,2x2,4x1] [--json OUT]
                                     [--set key=value ...]

Forces `--devices` host CPU devices (XLA_FLAGS, before JAX starts); per mesh, one
kvjax.decode.generate.Compiled lays params, prompts and cache out on it (kvjax.decode.sharding) and compiles
the default prefill + decode once; the timed repeats then round-robin over the meshes so
they share the machine's noise (the timing protocol of kvjax.lab.metrics). Ratios to 1x1 are
what to read: forced CPU devices share the same cores, so a mesh only adds partitioning and
collective overhead here; on real devices the same program splits the work. Prints one
JSON row per mesh; `same_tokens_as_first` compares every greedy token with the first mesh's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--meshes", default="1x1,1x4,2x2,4x1")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--json", metavar="OUT", help="also write the rows to this JSONL file")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")

  import numpy as np

  from kvjax import config as config_lib
  from kvjax.lab import metrics
  from kvjax import model
  from kvjax.decode import generate, sharding

  base = {"model.d_model": 256, "model.n_layers": 4, "model.n_heads": 8, "model.n_kv_heads": 8,
          "cache.codec": "bf16", "workload.batch": 4, "workload.prompt_len": 128,
          "workload.gen_len": 17}
  cfg = config_lib.apply_overrides(config_lib.Config(), {**base, **config_lib.parse_set(args.set)})
  w = cfg.workload
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (w.batch, w.prompt_len), dtype=np.int32)
  lengths = np.full((w.batch,), w.prompt_len, np.int32)
  params0 = model.init_params(cfg.model, cfg.seed)
  steps, S = w.gen_len - 1, w.prompt_len + w.gen_len
  shape = generate.Shape(w.batch, w.prompt_len, S, steps)

  runs = {}
  for item in args.meshes.split(","):
    d, m = (int(x) for x in item.lower().split("x"))
    c = config_lib.apply_overrides(cfg, {"mesh.data": d, "mesh.model": m})
    # params, prompts and every cache laid out on the mesh (kvjax.decode.sharding), programs compiled
    prog = generate.Compiled(c, params0, shape).compile(tokens, lengths)
    runs[item] = {"cfg": c, "prog": prog, "ttft": [], "tpot": [], "tokens": None}

  for i in range(args.repeats + 1):  # first round is the warm-up
    for name, r in runs.items():
      run = r["prog"].run()
      if i:
        r["ttft"].append(run.prefill_s)
        r["tpot"].append(run.decode_s / steps)
      r["tokens"] = run.tokens().tolist()
      r["per_device"] = sharding.measured_device_bytes(run.cache)

  ref = next(iter(runs.values()))
  rows = []
  for name, r in runs.items():
    ttft, tpot = metrics.summarize(r["ttft"]), metrics.summarize(r["tpot"])
    rows.append({"mesh": name, "variant": r["cfg"].model.variant, "batch": w.batch,
                 "prompt_len": w.prompt_len, "ttft_s": ttft["median"], "ttft_s_iqr": ttft["iqr"],
                 "tpot_s": tpot["median"], "tpot_s_iqr": tpot["iqr"],
                 "ttft_vs_first": ttft["median"] / metrics.summarize(ref["ttft"])["median"],
                 "tpot_vs_first": tpot["median"] / metrics.summarize(ref["tpot"])["median"],
                 "compile_s": r["prog"].compile_s, "cache_bytes_per_device": r["per_device"],
                 "same_tokens_as_first": r["tokens"] == ref["tokens"],
                 "env": metrics.environment()})
  for row in rows:
    print(json.dumps(row))
  if args.json:
    with open(args.json, "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  sys.exit(main())
