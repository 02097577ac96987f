"""What XLA:CPU gives the pieces of a decode step: the throughput that bounds a quantized read.

    python scripts/bench_xla_cpu.py [--repeats 9] [--json OUT.jsonl]

A quantized cache only makes decode faster where reading its fewer bytes is what a step
waits for. On XLA:CPU a dot reads its operands as whole buffers, so int8/int4 codes (and
bf16 bits) are first widened to float32 in a separate fusion; this measures what that
costs next to the reads it saves. All in one process, every case compiled first (compile
excluded), then timed interleaved round-robin, `--repeats` times; medians.

  stream/<dtype>   one pass over 96 Mi elements stored as <dtype> (a sum, the widening to
                   float32 fused in): GB/s of the stored bytes; per element, time relative
                   to bf16's (`vs_bf16`): what reading one cached value costs
  matvec/fp32      x[1, 576] @ W[576, 1536], 30 different W (SmolLM2's MLP, weights cold):
                   GB/s of W
  attend/<codec>   one decode step's attention read of every layer of SmolLM2-135M's cache
                   shape (30 layers, 3 KV heads x 64, GQA-3), batch 8, 4,096 tokens, through
                   `attention.xla.attend_segment` as the model calls it: GB/s of the
                   stored K/V bytes, and time relative to bf16's
  attend_split/<codec>  the same read with each layer's K/V in its own buffer and the
                   layers unrolled (`Segment`, not the stacked store's `LayerSegment`): what
                   per-layer cache buffers would give, with no slicing of a stacked store
  attend_pv_split/<codec>  `attend` with the values read as G matvecs too (the form
                   `codecs.per_head` keeps for head_dim >= 128; at this head_dim 64 the
                   values are one GEMM): `vs_attend` is its time over `attend`'s
  attend_b1/<codec>, attend_b1_pv_split/<codec>  the same two at batch 1, 1,024 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax import codecs
from kvjax.attention import base as attn_base, xla  # noqa: E402
from kvjax.cache import base as cache_base  # noqa: E402
from kvjax.codecs import base as codecs_base  # noqa: E402
from kvjax.lab import metrics  # noqa: E402

L, B, K, G, S, D = 30, 8, 3, 3, 4096, 64  # SmolLM2-135M's attention, batch 8 x 4k


def _stream_cases():
  n = 96 * 1024 * 1024  # elements
  x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32)
  stored = {"fp32": x, "bf16": x.astype(jnp.bfloat16),
            "int8": (x * 30).astype(jnp.int8), "uint8": (x * 30 + 128).astype(jnp.uint8)}
  cases = {}
  for name, a in stored.items():
    cases[f"stream/{name}"] = (jax.jit(lambda a: jnp.sum(a.astype(jnp.float32))), (a,), a.nbytes)
  return cases


def _matvec_case():
  ws = [jax.random.normal(jax.random.PRNGKey(i), (576, 1536)) for i in range(30)]
  x = jax.random.normal(jax.random.PRNGKey(99), (1, 576))
  f = jax.jit(lambda x, ws: sum(jnp.sum(x @ w) for w in ws))
  return {"matvec/fp32": (f, (x, ws), sum(w.nbytes for w in ws))}


def _pv_split(step, *args):
  """`step` compiled with the values read as G matvecs too (`codecs.per_head`'s rule for
  head_dim >= 128), for the in-run comparison with the rule as it is."""
  rule = codecs_base.per_head
  codecs_base.per_head = lambda G, D, read="qk": rule(G, D, "qk")
  try:  # traced and compiled under the patched rule; a fresh function, because jit
    # reuses a trace of the same function object made under the rule as it is
    return jax.jit(lambda *a: step(*a)).lower(*args).compile()
  finally:
    codecs_base.per_head = rule


def _attend_cases(B: int = B, S: int = S, kind: str = "attend", split: bool = True):
  f32 = jnp.float32
  q = jax.random.normal(jax.random.PRNGKey(0), (L, B, K, G, 1, D), f32)
  x = jax.random.normal(jax.random.PRNGKey(1), (L, B, K, S, D), f32)
  cases = {}
  for name in ("fp32", "bf16", "int8", "int4"):
    c = codecs.get(name)
    ke, ve = jax.jit(c.encode)(x), jax.jit(c.encode)(x * 0.5)

    def step(q, ke, ve, c=c):
      def body(acc, layer):
        seg = cache_base.LayerSegment(ke, ve, jnp.ones((B, S), bool), c, c,
                                      live=jnp.int32(S), layer=layer)
        st = (jnp.full((B, K, G, 1), attn_base.MASKED, f32), jnp.zeros((B, K, G, 1), f32),
              jnp.zeros((B, K, G, 1, D), f32))
        _, s, o = xla.attend_segment(q[layer], seg, st)
        return acc + jnp.sum(o / s[..., None]), None
      return jax.lax.scan(body, jnp.float32(0), jnp.arange(L))[0]
    nbytes = sum(a.nbytes for a in jax.tree.leaves((ke, ve)))
    cases[f"{kind}/{name}"] = (jax.jit(step).lower(q, ke, ve).compile(), (q, ke, ve), nbytes)
    if name != "int4":  # int4's values at head_dim 64 are not read through dot_pv
      cases[f"{kind}_pv_split/{name}"] = (_pv_split(step, q, ke, ve), (q, ke, ve), nbytes)
    if not split:
      continue

    def split_step(q, kes, ves, c=c):
      acc = jnp.float32(0)
      for layer in range(L):
        seg = cache_base.Segment(kes[layer], ves[layer], jnp.ones((B, S), bool), c, c,
                                 live=jnp.int32(S))
        st = (jnp.full((B, K, G, 1), attn_base.MASKED, f32), jnp.zeros((B, K, G, 1), f32),
              jnp.zeros((B, K, G, 1, D), f32))
        _, s, o = xla.attend_segment(q[layer], seg, st)
        acc = acc + jnp.sum(o / s[..., None])
      return acc
    kes = [jax.tree.map(lambda a, i=i: a[i], ke) for i in range(L)]  # own buffers
    ves = [jax.tree.map(lambda a, i=i: a[i], ve) for i in range(L)]
    cases[f"attend_split/{name}"] = (jax.jit(split_step), (q, kes, ves), nbytes)
  return cases


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=9)
  ap.add_argument("--json", help="append one JSON row per case to this file")
  args = ap.parse_args()
  if args.repeats < 1:
    ap.error(f"--repeats must be >= 1, got {args.repeats}")
  cases = {**_stream_cases(), **_matvec_case(), **_attend_cases(),
           **_attend_cases(1, 1024, "attend_b1", split=False)}
  for f, a, _ in cases.values():  # compile and warm up
    jax.block_until_ready(f(*a))
  times = {name: [] for name in cases}
  for _ in range(args.repeats):
    for name, (f, a, _) in cases.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*a))
      times[name].append(time.perf_counter() - t0)
  env = metrics.environment()
  med = {name: statistics.median(ts) for name, ts in times.items()}
  rows = []
  for name, (_, _, nbytes) in cases.items():
    row = {"bench": "xla_cpu", "case": name, "bytes": nbytes, "median_s": med[name],
           "GBps": nbytes / med[name] / 1e9, "repeats": args.repeats, "env": env}
    kind = name.split("/")[0]
    if kind.endswith("_pv_split"):
      row["vs_attend"] = med[name] / med[f"{kind.removesuffix('_pv_split')}/{name.split('/')[1]}"]
    elif kind in ("attend", "attend_b1", "attend_split", "stream"):
      row["vs_bf16"] = med[name] / med[f"{kind}/bf16"]
    rows.append(row)
    extra = f"  {row['vs_bf16']:.2f}x bf16" if "vs_bf16" in row else \
        f"  {row['vs_attend']:.2f}x attend" if "vs_attend" in row else ""
    print(f"{name:18s} {med[name] * 1e3:9.2f} ms  {row['GBps']:6.1f} GB/s{extra}")
  if args.json:
    with open(args.json, "a") as fh:
      for row in rows:
        fh.write(json.dumps(row) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
