"""Prefill (TTFT without sampling overhead) of kvjax against transformers' forward pass on
the same shape, in one process, interleaved (medians; compile excluded): kvjax with the
prompt read in query blocks (`attention.xla.NEW_BLOCK`, the default) and as one block (the
program before the switched layer loop), and torch's `model(ids, logits_to_keep=1)` with `--threads`
threads (XLA is pinned to as many cores). Random weights: speed does not depend on them.

    python scripts/bench_prefill.py [--config configs/peer.yaml] [--set model.vocab_size=32000]
        [--batch 8] [--tokens 512] [--repeats 5] [--threads 1] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np

from kvjax import config as config_lib
from kvjax import decode, model
from kvjax.attention import xla as attention_xla
from kvjax.decode import generate
from kvjax.decode import step
from kvjax.lab import metrics


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="configs/peer.yaml")
  ap.add_argument("--set", action="append", default=[], dest="overrides")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=512)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--threads", type=int, default=1)
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  import torch
  import transformers

  cores = sorted(os.sched_getaffinity(0))[:a.threads]
  os.sched_setaffinity(0, cores)
  torch.set_num_threads(len(cores))
  cfg = config_lib.load(a.config, a.overrides)
  m, B, T = cfg.model, a.batch, a.tokens
  params = step.prepare_params(cfg, model.init_params(m, 0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.vocab_size, (B, T)), jnp.int32)
  lengths = jnp.full((B,), T, jnp.int32)

  progs, default_block = {}, attention_xla.NEW_BLOCK
  for label, block in (("blocked", default_block), ("one_block", T)):
    attention_xla.NEW_BLOCK = block  # read when the program is traced, inside compile()
    c = config_lib.replace(cfg, seed=block)  # a config of its own: traced afresh
    progs[label] = generate.Compiled(c, params, generate.Shape(B, T, T + 8)).compile(tokens, lengths)
  attention_xla.NEW_BLOCK = default_block

  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.F,
      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
      num_key_value_heads=m.n_kv_heads, head_dim=m.D, rms_norm_eps=m.norm_eps,
      tie_word_embeddings=m.tie_embeddings, max_position_embeddings=m.max_seq_len,
      rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta})).eval()
  ids = torch.tensor(np.asarray(tokens), dtype=torch.long)

  def torch_prefill():
    with torch.inference_mode():
      hf(ids, use_cache=True, logits_to_keep=1).logits.argmax(-1)

  torch_prefill()
  times, firsts = {k: [] for k in [*progs, "torch"]}, {}
  for _ in range(a.repeats):
    for label, prog in progs.items():
      run = prog.run()  # a fresh cache outside the timed region; prefill only (no decode steps)
      times[label].append(run.prefill_s)
      firsts[label] = np.asarray(run.first)
    t0 = time.perf_counter()
    torch_prefill()
    times["torch"].append(time.perf_counter() - t0)

  ref = float(np.median(times["torch"]))
  same = bool((firsts["blocked"] == firsts["one_block"]).all())
  rows = []
  for label, ts in times.items():
    t = metrics.summarize(ts)
    row = {"bench": "prefill", "program": label, "config": a.config, "overrides": a.overrides,
           "batch": B, "tokens": T, "threads": len(cores), "prefill_s": t["median"],
           "prefill_s_iqr": t["iqr"], "repeats": t["n"], "vs_torch": t["median"] / ref,
           "compile_s": progs[label].compile_s if label in progs else None,
           "same_first_tokens": same, "env": metrics.environment()}
    rows.append(row)
    print(f"{label:>10}  {t['median'] * 1e3:9.1f} ms (IQR {t['iqr'] * 1e3:.1f})  "
          f"x{row['vs_torch']:.2f} torch")
  if a.out:
    with open(a.out, "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
