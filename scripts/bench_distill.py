"""Speed of one `kvjax convert --method distill` step: tokens per second of the training,
on this machine, at a real model's shape with random weights (speed does not depend on
the weights' values).

    python scripts/bench_distill.py OUT.jsonl [--shape smollm2-135m] [--kv-heads 1]
        [--batch 2] [--seq-len 512] [--steps 8] [--budget SECONDS]

The teacher is the shape as packaged (kvjax/shapes/NAME.yaml); the student the same shape
with --kv-heads K/V heads (a KV-head conversion, what distill trains). Each step is the
distillation's own jitted step (`kvjax.lab.convert.distill._fns`): both forward passes, the
chunked float32 KL, the backward pass through the student's attention, and Adam. The first
step (the compile) is not timed; each later one is timed to its result on the host. The
row carries the median step's seconds with its 95 % bootstrap interval, tokens per second
(batch x seq_len over the median step), the platform and `kvjax.lab.metrics.environment()`.
The run stops early, keeping the steps timed so far, when --budget seconds have passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
  ap = argparse.ArgumentParser(description="tokens per second of one distillation step")
  ap.add_argument("out", help="JSONL file the row is appended to")
  ap.add_argument("--shape", default="smollm2-135m")
  ap.add_argument("--kv-heads", type=int, default=1)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--steps", type=int, default=8, help="timed steps (after the compile)")
  ap.add_argument("--budget", type=float, default=600.0, help="seconds, compile included")
  args = ap.parse_args()
  if min(args.kv_heads, args.batch, args.seq_len, args.steps) < 1 or not args.budget > 0:
    print("bench_distill: --kv-heads, --batch, --seq-len, --steps and --budget must be "
          "positive", file=sys.stderr)
    return 2

  import jax
  import jax.numpy as jnp
  import numpy as np

  from kvjax import config as config_lib
  from kvjax.lab import intervals, metrics
  from kvjax.lab.convert import distill
  from kvjax.errors import KvjaxError
  from kvjax.lab.experiments import load_shape
  from kvjax.model.transformer import init_params

  t_start = time.perf_counter()
  try:
    teacher_cfg = load_shape(args.shape)
    student_cfg = config_lib.apply_overrides(teacher_cfg, {"model.n_kv_heads": args.kv_heads})
    distill.check(student_cfg.model, teacher_cfg.model)
  except KvjaxError as e:
    print(f"bench_distill: {e}", file=sys.stderr)
    return 2
  teacher = init_params(teacher_cfg.model, seed=0)
  student = init_params(student_cfg.model, seed=1)
  theta = {n: {leaf: jnp.array(a, jnp.float32) for leaf, a in student["layers"][n].items()}
           for n in distill.TRAINED}
  opt, step_fn, _ = distill._fns(student_cfg.model, teacher_cfg.model, 1.0)
  opt_state = opt.init(theta)
  rng = np.random.default_rng(0)
  vocab = teacher_cfg.model.vocab_size
  times = []
  for i in range(args.steps + 1):
    if i and time.perf_counter() - t_start > args.budget:
      break
    tokens = jnp.asarray(rng.integers(0, vocab, (args.batch, args.seq_len), dtype=np.int32))
    t0 = time.perf_counter()
    theta, opt_state, loss = step_fn(theta, opt_state, student, teacher, tokens,
                                     jnp.float32(1e-4))
    float(loss)
    if i:
      times.append(time.perf_counter() - t0)
  if not times:
    print("bench_distill: the budget ended before a timed step; raise --budget",
          file=sys.stderr)
    return 2
  median = float(np.median(times))
  ci = intervals.median_ci(times)
  tokens = args.batch * args.seq_len
  row = {"bench": "distill_speed", "shape": args.shape, "kv_heads": args.kv_heads,
         "teacher_kv_heads": teacher_cfg.model.n_kv_heads, "batch": args.batch,
         "seq_len": args.seq_len, "steps_timed": len(times),
         "step_s": median, "step_s_ci": ci,
         "tokens_per_s": tokens / median, "tokens_per_s_ci": [tokens / ci[1], tokens / ci[0]],
         "platform": jax.devices()[0].platform, "device": jax.devices()[0].device_kind,
         "environment": metrics.environment()}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  with open(args.out, "a") as f:
    f.write(json.dumps(row) + "\n")
  print(f"distill step at {args.shape} (kv {teacher_cfg.model.n_kv_heads}->{args.kv_heads}), "
        f"batch {args.batch} x {args.seq_len}: {median:.3f} s [{ci[0]:.3f}, {ci[1]:.3f}], "
        f"{tokens / median:,.0f} tokens/s on {row['device']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
