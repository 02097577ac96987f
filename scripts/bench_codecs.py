"""Decode time per token of every cache codec relative to bf16, per context length.

    python scripts/bench_codecs.py [--contexts 256,1024,4096] [--repeats 7] [--json OUT.jsonl]

One process, one model; each codec's decode loop (`--steps` greedy steps in one
`lax.scan`, cache donated) is compiled first (compile time excluded), then the codecs are
timed interleaved, round-robin, `--repeats` times, so machine noise hits all of them alike.
Reported: median seconds per token, its ratio to bf16's median in the same run, the IQR,
and the cache bytes measured from the pytree. The cache is filled to `context` tokens
(lengths set as data; the values do not change the work) and each timed call continues
where the previous one stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import decode
from kvjax import cache as cache_lib
from kvjax import config, metrics, model

VARIANTS = {
    "fp32": {"cache.codec": "fp32"}, "bf16": {"cache.codec": "bf16"},
    "fp16": {"cache.codec": "fp16"}, "fp8_e4m3": {"cache.codec": "fp8_e4m3"},
    "fp8_e5m2": {"cache.codec": "fp8_e5m2"}, "int8": {"cache.codec": "int8"},
    "int4": {"cache.codec": "int4"}, "int4_g32": {"cache.codec": "int4", "cache.group_size": 32},
    "int2": {"cache.codec": "int2"},
    "int2_kivi": {"cache.codec": "int2", "cache.k_axis": "channel", "cache.group_size": 32,
                  "cache.residual": 128},
    "k8v4": {"cache.k_codec": "int8", "cache.v_codec": "int4"},
}


def decode_loop(cfg, steps):
  net = model.Transformer(cfg.model)

  def run(params, cache, token_B):
    def step(carry, _):
      c, tok = carry
      logits, c = decode.forward(net, params, tok[:, None], c.lengths[:, None], c)
      nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
      return (c, nxt), nxt
    (cache, tok), _ = jax.lax.scan(step, (cache, token_B), None, length=steps)
    return cache, tok

  return jax.jit(run, donate_argnums=1)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", default="256,1024,4096")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--set", action="append", default=[], help="model overrides, key=value")
  ap.add_argument("--json", help="append one JSON row per (variant, context) here")
  args = ap.parse_args()
  base = {"model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 4,
          "model.n_layers": 4, "model.max_seq_len": 65536}
  base_cfg = config.load(None, {**base, **config.parse_set(args.set)})
  params = model.init_params(base_cfg.model, 0)
  names = args.variants.split(",")
  env = metrics.environment()
  print(f"# {env['device_kind']} x{env['device_count']}, jax {env['jax']}, "
        f"model L={base_cfg.model.n_layers} K={base_cfg.model.n_kv_heads} D={base_cfg.model.D}, "
        f"batch {args.batch}, {args.steps} steps/call, {args.repeats} interleaved repeats")
  print(f"{'context':>7} {'variant':>10} {'ms/token':>9} {'vs bf16':>8} {'iqr ms':>7} "
        f"{'cache MiB':>9} {'compile s':>9}")
  token = jnp.ones((args.batch,), jnp.int32)
  for ctx in [int(c) for c in args.contexts.split(",")]:
    capacity = ctx + args.steps * (args.repeats + 2)
    runs = {}
    for name in names:
      cfg = config.apply_overrides(base_cfg, VARIANTS[name])
      cache = cache_lib.init_cache(cfg, args.batch, capacity)
      cache = dataclasses.replace(cache, lengths=jnp.full((args.batch,), ctx, jnp.int32))
      nbytes = cache_lib.tree_bytes(cache)
      t0 = time.perf_counter()
      fn = decode_loop(cfg, args.steps).lower(params, cache, token).compile()
      compile_s = time.perf_counter() - t0
      cache, _ = jax.block_until_ready(fn(params, cache, token))  # warm-up
      runs[name] = {"fn": fn, "cache": cache, "bytes": nbytes, "compile_s": compile_s, "t": []}
    for _ in range(args.repeats):
      for name in names:
        r = runs[name]
        t0 = time.perf_counter()
        r["cache"], _ = jax.block_until_ready(r["fn"](params, r["cache"], token))
        r["t"].append((time.perf_counter() - t0) / args.steps)
    ref = metrics.summarize(runs["bf16"]["t"])["median"] if "bf16" in runs else None
    for name in names:
      s = metrics.summarize(runs[name]["t"])
      rel = s["median"] / ref if ref else float("nan")
      print(f"{ctx:>7} {name:>10} {s['median'] * 1e3:>9.3f} {rel:>8.2f} {s['iqr'] * 1e3:>7.3f} "
            f"{runs[name]['bytes'] / 2 ** 20:>9.2f} {runs[name]['compile_s']:>9.2f}")
      if args.json:
        with open(args.json, "a") as f:
          f.write(json.dumps({"variant": {"name": name, **VARIANTS[name]},
                              "workload": {"context": ctx, "batch": args.batch},
                              "metrics": {"tpot_s": s["median"], "tpot_s_iqr": s["iqr"],
                                          "tpot_vs_bf16": rel, "cache_bytes": runs[name]["bytes"]},
                              "env": env}) + "\n")
      runs[name]["cache"] = None
    del runs


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
