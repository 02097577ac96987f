"""Cache axis order for the decode read: heads before tokens ([B, K, S, D], kvjax's cache)
vs tokens before heads ([B, S, K, D], the order new K/V come out of the projections).

    python scripts/bench_axis_order.py [--repeats 11] [--json OUT.jsonl]

One layer's blockwise decode read, written out here because `attention.grouped` only
reads [B, K, S, D] (the same scheme: blocks of `codecs.READ_CHUNK` tokens up to the live
length, online softmax, codes widened per block),
over fp32, bf16 and int8 storage, for a few (B, K, S, D) shapes. Both orders are compiled
first and timed interleaved in one process; reported: medians and the ratio [B,S,K,D] /
[B,K,S,D]. The write side is not timed: a decode step writes one token per sequence.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import codecs
from kvjax.lab import metrics

SHAPES = [(1, 4, 4096, 64), (4, 4, 8192, 128), (4, 8, 8192, 32)]  # (B, K, S, D)
ORDERS = {"BKSD": ("bkd,bksd->bks", "bks,bksd->bkd", 2),
          "BSKD": ("bkd,bskd->bks", "bks,bskd->bkd", 1)}


def widen(a):
  if a.dtype == jnp.uint16:  # bf16 stored as bits, as the cache does
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16).astype(jnp.float32)
  return a.astype(jnp.float32)


def read(order: str, C: int):
  qk, pv, axis = ORDERS[order]

  def f(q_BKD, k, v, live):
    B, K, D = q_BKD.shape

    def block(i, st):
      m, s, acc = st
      kb = jax.lax.dynamic_slice_in_dim(k, i * C, C, axis=axis)
      vb = jax.lax.dynamic_slice_in_dim(v, i * C, C, axis=axis)
      l_BKC = jnp.where(i * C + jnp.arange(C) < live, jnp.einsum(qk, q_BKD, widen(kb)), -1e30)
      m_new = jnp.maximum(m, l_BKC.max(-1))
      p, corr = jnp.exp(l_BKC - m_new[..., None]), jnp.exp(m - m_new)
      return m_new, s * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum(pv, p, widen(vb))

    st = (jnp.full((B, K), -1e30), jnp.zeros((B, K)), jnp.zeros((B, K, D)))
    _, s, acc = jax.lax.fori_loop(0, (live + C - 1) // C, block, st)
    return acc / s[..., None]
  return jax.jit(f)


def storage(x, dtype: str):
  if dtype == "bf16":
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  if dtype == "int8":
    return jnp.clip(jnp.round(x * 40), -127, 127).astype(jnp.int8)
  return x


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=11)
  ap.add_argument("--json", help="append one JSON row per (shape, dtype) here")
  args = ap.parse_args()
  env, rng, C = metrics.environment(), np.random.default_rng(0), codecs.READ_CHUNK
  print(f"# {env['device_kind']} x{env['device_count']}, jax {env['jax']}, blocks of {C}, "
        f"{args.repeats} interleaved repeats")
  rows = []
  for B, K, S, D in SHAPES:
    x_BKSD = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32)
    q_BKD = jnp.asarray(rng.normal(size=(B, K, D)), jnp.float32)
    live = jnp.int32(S - 100)
    runs = {}
    for dtype in ("fp32", "bf16", "int8"):
      base = storage(x_BKSD, dtype)
      for order in ORDERS:
        kv = base if order == "BKSD" else jnp.swapaxes(base, 1, 2)
        f = read(order, C)
        runs[(dtype, order)] = (f, kv, jax.block_until_ready(f(q_BKD, kv, kv, live)))
      np.testing.assert_allclose(runs[(dtype, "BKSD")][2], runs[(dtype, "BSKD")][2],
                                 rtol=1e-4, atol=1e-4)
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
      for key, (f, kv, _) in runs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(q_BKD, kv, kv, live))
        times[key].append(time.perf_counter() - t0)
    for dtype in ("fp32", "bf16", "int8"):
      a, b = (float(np.median(times[(dtype, o)])) for o in ORDERS)
      print(f"B{B} K{K} S{S} D{D} {dtype:>4}: [B,K,S,D] {a * 1e3:7.3f} ms   "
            f"[B,S,K,D] {b * 1e3:7.3f} ms   ratio {b / a:.2f}")
      rows.append({"shape": {"B": B, "K": K, "S": S, "D": D, "live": S - 100}, "dtype": dtype,
                   "metrics": {"bksd_s": a, "bskd_s": b, "bskd_vs_bksd": b / a,
                               "repeats": args.repeats}, "env": env})
  if args.json:
    with open(args.json, "a") as fh:
      for r in rows:
        fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
