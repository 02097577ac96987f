"""A long prompt through a real model, one length per fresh process: the compile time of
the prefill program, its time (the first token's, sampling included), the process's peak
resident memory during the prefill against what the process held once the weights were
ready plus kvjax's closed forms of the cache and the prompt's temporaries, the peak while
the model was read beside kvjax's whole estimate (`kvjax.memory.estimate`: weights + cache
+ temporaries, plus the process's own resident bytes before the model), and the keys
each kind of layer reads in the prompt's pass against what its attention needs
(`attention.xla.keys_read`); the prefill's arithmetic rate against XLA's own float32 matmul
of 2048 x 2048 on this host (the FLOPs roof). The prompt is the named prose text,
tokenized, cut to T tokens.

    python scripts/long_prefill.py --model gguf:gemma3-270m --tokens 2048,8192,16384,32768 \
        --out results/cpu/long_prefill.jsonl [--set model.param_dtype=bfloat16]
        [--set workload.prefill_chunk=4096]

Resumable: a (model, overrides, tokens) row already in --out is not run again. Each length
runs in a child process (`--one`), so its peak is its own; rows are appended as each ends.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time


def _status(field: str) -> int:
  """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"no {field} in /proc/self/status")


def torch_prefill(model: str, ids, threads: int):
  """transformers' float32 model read from the same GGUF file: a function that runs its
  prefill of `ids` (the first token's logits only, as kvjax's prefill keeps), on `threads`
  threads; warmed up on a short prompt first."""
  import torch
  from transformers import AutoModelForCausalLM

  from kvjax.io import zoo

  path = zoo.resolve_gguf(model.split(":", 1)[1])
  torch.set_num_threads(threads)
  hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                            dtype="float32").eval()

  def run(x):
    with torch.inference_mode():
      return int(hf(torch.tensor([x]), use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
  run(ids[:256])
  return lambda: run(ids)


def one(model: str, overrides: list[str], T: int, repeats: int = 1, peer: bool = False) -> dict:
  """Measure one length in this process; returns its row."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from kvjax import cache as cache_lib, config as config_lib, decode, memory
  from kvjax.attention import xla
  from kvjax.decode import step
  from kvjax.footprint import param_bytes
  from kvjax.io import sources
  from kvjax.lab import data, metrics

  jax.numpy.zeros(1).block_until_ready()  # the runtime up before the baseline
  base_rss = _status("VmRSS")
  over = config_lib.parse_set(overrides) if overrides else {}
  src = sources.parse(model)
  cfg, params, tok = sources.load(src, over)
  if T > cfg.model.max_seq_len:
    raise SystemExit(f"{T} tokens exceed {model}'s context ({cfg.model.max_seq_len})")
  ids = tok.encode(data.eval_text("shakespeare", val_fraction=1.0))
  if len(ids) < T:
    raise SystemExit(f"the prose text has {len(ids)} tokens, fewer than {T}")
  tokens = jnp.asarray(np.asarray(ids[:T], np.int32)[None])
  lengths = jnp.asarray([T], jnp.int32)
  parts = memory.estimate(cfg, 1, T + 1, T, params=True, caches=1)
  params = step.prepare_params(cfg, params)
  jax.block_until_ready(params)
  gc.collect()
  load_peak, loaded_rss = _status("VmHWM"), _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:  # the peak from here on is the prefill's
    f.write("5")
  cache = cache_lib.init_cache(cfg, 1, T + 1)
  key = jax.random.PRNGKey(0)
  kw = step.statics(cfg, decode.Sampler())
  t0 = time.perf_counter()
  compiled = decode.prefill.lower(params, tokens, lengths, cache, key, **kw).compile()
  compile_s = time.perf_counter() - t0
  def run_once():  # a fresh cache each time (the program donates it)
    c = cache_lib.init_cache(cfg, 1, T + 1)
    t0 = time.perf_counter()
    first, _, out = compiled(params, tokens, lengths, c, key)
    jax.block_until_ready((first, out))
    return time.perf_counter() - t0, int(np.asarray(first)[0]), cache_lib.tree_bytes(out)

  del cache
  t, first, cache_bytes = run_once()
  times = [t]
  peak = _status("VmHWM")  # compile and one prefill, before the peer is read
  peer_fields, torch_times, torch_first = {}, [], None
  run_torch = torch_prefill(model, ids[:T], len(os.sched_getaffinity(0))) if peer else None
  for _ in range(repeats - 1 if not peer else repeats):  # interleaved with the peer's
    times.append(run_once()[0])
    if peer:
      t0 = time.perf_counter()
      torch_first = run_torch()
      torch_times.append(time.perf_counter() - t0)
  prefill_s = float(np.median(times))
  from kvjax.lab.experiments.roofline import DotProbe
  dot_flops = DotProbe(2048).measure()["f32"]  # XLA's float32 matmul on this host, now
  if peer:
    from kvjax.lab import intervals
    ratio, ci = intervals.paired_ratio(torch_times, times[1:])
    peer_fields = {"torch_prefill_s": float(np.median(torch_times)), "torch_times_s": torch_times,
                   "torch_first_token": torch_first, "speedup_vs_torch": ratio,
                   "speedup_vs_torch_ci": ci, "torch_threads": len(os.sched_getaffinity(0))}
  m = cfg.model
  band = m.sliding_window
  kinds = {"full": 0, **({"windowed": band} if band else {})}
  reads = {}
  for kind, W in kinds.items():
    need = sum(min(t + 1, W) if W else t + 1 for t in range(T))
    # a prompt prefilled in chunks reads the earlier chunks from the cache: not counted here
    chunked = 0 < cfg.workload.prefill_chunk < T
    reads[kind] = {"layers": sum(1 for i in range(m.n_layers) if m.window_of(i) == W),
                   "keys_read": None if chunked else xla.keys_read(T, W, band),
                   "keys_needed": need}
  estimate = sum(parts.values()) + base_rss
  # The prefill's own part: what the process held once the weights were ready, plus the
  # closed forms of the cache and the prompt's temporaries.
  # (the weights and their per-layer copy are in what it held)
  prefill_estimate = loaded_rss + sum(v for k, v in parts.items()
                                      if k not in ("params", "per-layer weights"))
  # Dense prefill arithmetic: 2 x the non-embedding weights x T, plus QK and PV over the
  # keys each layer reads as needed (the causal triangle, or each window's band).
  emb = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
  from kvjax.footprint import param_count
  flops = 2 * (param_count(m) - emb) * T + sum(
      4 * r["layers"] * m.n_heads * m.D * r["keys_needed"] for r in reads.values())
  return {"bench": "long_prefill", "model": model, "overrides": overrides, "tokens": T,
          "first_token": first, "compile_s": compile_s,
          "prefill_s": prefill_s, "prefill_times_s": times, "tokens_per_s": T / prefill_s,
          "flops": flops, "flops_per_s": flops / prefill_s, "dot_flops_per_s": dot_flops,
          "flops_roof_fraction": flops / prefill_s / dot_flops, **peer_fields,
          "prefill_peak_rss_bytes": peak, "rss_before_prefill_bytes": loaded_rss,
          "prefill_estimate_bytes": prefill_estimate,
          "prefill_peak_over_estimate": peak / prefill_estimate,
          "load_peak_rss_bytes": load_peak, "process_before_model_bytes": base_rss,
          "estimate_bytes": estimate, "estimate_parts": parts,
          "peak_over_estimate": max(peak, load_peak) / estimate,
          "weights_bytes": param_bytes(m), "cache_bytes": cache_bytes,
          "reads": reads, "param_dtype": m.param_dtype, "env": metrics.environment()}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", required=True)
  ap.add_argument("--tokens", required=True, help="comma-separated prompt lengths")
  ap.add_argument("--set", action="append", default=[], dest="overrides")
  ap.add_argument("--out", required=True)
  ap.add_argument("--repeats", type=int, default=1, help="timed prefills (compile excluded)")
  ap.add_argument("--torch", action="store_true",
                  help="also time transformers' float32 prefill of the same prompt, interleaved")
  ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args()
  lengths = [int(x) for x in a.tokens.split(",") if x]
  if a.one:
    print(json.dumps(one(a.model, a.overrides, lengths[0], a.repeats, a.torch)))
    return
  done = set()
  if os.path.exists(a.out):
    with open(a.out) as f:
      for line in f:
        r = json.loads(line)
        if r.get("bench") == "long_prefill":
          done.add((r["model"], tuple(r["overrides"]), r["tokens"], "torch_prefill_s" in r))
  for T in lengths:
    if (a.model, tuple(a.overrides), T, a.torch) in done:
      print(f"{a.model} {T}: in {a.out} already")
      continue
    cmd = [sys.executable, __file__, "--one", "--model", a.model, "--tokens", str(T),
           "--out", a.out, "--repeats", str(a.repeats), *(["--torch"] if a.torch else [])] + [f"--set={o}" for o in a.overrides]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
      sys.exit(f"{a.model} {T}: {res.stderr.strip().splitlines()[-1:]}")
    row = json.loads(res.stdout.strip().splitlines()[-1])
    with open(a.out, "a") as f:
      f.write(json.dumps(row) + "\n")
    gib = lambda k: row[k] / 2**30  # noqa: E731
    print(f"{a.model} {T:>6}: compile {row['compile_s']:.1f} s, prefill {row['prefill_s']:.1f} s "
          f"({row['tokens_per_s']:.0f} tok/s); prefill peak {gib('prefill_peak_rss_bytes'):.2f} "
          f"GiB vs {gib('prefill_estimate_bytes'):.2f} (x{row['prefill_peak_over_estimate']:.2f}); "
          f"load peak {gib('load_peak_rss_bytes'):.2f} GiB; kvjax's estimate "
          f"{gib('estimate_bytes'):.2f} GiB" + (f"; x{row['speedup_vs_torch']:.2f} torch's speed"
                                                if "speedup_vs_torch" in row else ""))


if __name__ == "__main__":
  main()
