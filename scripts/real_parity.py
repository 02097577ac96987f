"""Each named real model against transformers' load of the same GGUF file, at the sizes
the models issue sets (the suite runs the same checks on shorter windows):

  - greedy tokens through kvjax's fp32 cache (prefill + decode) equal transformers' on
    three prompts (`--greedy` tokens each; Gemma 3's third prompt is long enough that the
    decode crosses its 512-token window);
  - teacher-forced perplexity through the cache (`--chunk` tokens a step) within 1e-3
    relative on `--seqs` x `--tokens` stdlib tokens;
  - the exact MHA twin (`convert.expand`) gives the original's logits within 1e-5 of their
    largest magnitude.

    python scripts/real_parity.py --out results/cpu/real_parity.jsonl

One row per model (its checks and figures), environment recorded; exit 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--models", nargs="+", default=["gemma3-270m", "qwen2.5-coder-0.5b", "smollm2-135m"])
  ap.add_argument("--tokens", type=int, default=1024)
  ap.add_argument("--seqs", type=int, default=2)
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--greedy", type=int, default=32)
  ap.add_argument("--out", type=Path, default=None, help="append one JSON row per model")
  args = ap.parse_args(argv)

  import real_models as rm
  from conftest import kvjax_side, transformers_side
  from kvjax.lab import data, metrics
  from kvjax.lab import convert

  env, ok = metrics.environment(), True
  for name in args.models:
    t0 = time.time()
    cfg, params, tok = kvjax_side(name)
    ref_tok, ref_model = transformers_side(name)
    row = {"model": name, "variant": cfg.model.variant, "tokens": args.tokens,
           "seqs": args.seqs, "chunk": args.chunk, "greedy_tokens": args.greedy}
    rm.tokenizer_ids_equal(tok, ref_tok)
    rel, ppl, ref = rm.perplexity_through_the_cache(cfg, params, tok, ref_model, args.tokens,
                                                    args.seqs, args.chunk)
    row.update(ppl=ppl, ppl_transformers=ref, ppl_rel_diff=rel, ppl_ok=bool(rel < 1e-3))
    long = tok.encode(data.eval_text("stdlib")[:8000])[:520 - args.greedy // 2]
    prompts = [tok.encode(p) for p in rm.PROMPTS] + [long]
    try:
      rm.greedy_equal(cfg, params, ref_model, prompts, args.greedy)
      row["greedy_ok"] = True
    except AssertionError as e:
      row["greedy_ok"], row["greedy_mismatch"] = False, str(e)[:300]
    ids = np.asarray([tok.encode(rm.PROMPTS[0])])
    want = rm.logits(cfg, params, ids)
    mha_cfg, mha = convert.expand(cfg, params, cfg.model.n_heads)
    err = float(np.abs(rm.logits(mha_cfg, mha, ids) - want).max() / np.abs(want).max())
    row.update(mha_twin_rel_err=err, mha_twin_ok=bool(err < 1e-5), seconds=time.time() - t0,
               env=env)
    ok &= row["ppl_ok"] and row["greedy_ok"] and row["mha_twin_ok"]
    print(f"{name:20s} {row['variant']:6s} ppl {ppl:.4f} vs {ref:.4f} (rel {rel:.1e}) "
          f"greedy {'equal' if row['greedy_ok'] else 'DIFFER'} ({len(prompts)} x {args.greedy}) "
          f"MHA twin rel {err:.1e}", flush=True)
    if args.out:
      args.out.parent.mkdir(parents=True, exist_ok=True)
      with open(args.out, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    del params, ref_model
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
