"""One decode step's attention over one layer's cache: the Pallas kernel vs XLA `grouped`.

    python scripts/bench_pallas.py OUT.jsonl [--contexts 4096,8192,16384,32768]
        [--batches 1,8] [--codecs bf16,int8,int4] [--repeats 20] [--budget 300]

On a GPU: Llama-3-8B attention (32 query heads, 8 kv heads, head_dim 128, bf16 queries),
a cache of `context` tokens per sequence, all live. Each cell is compiled ahead of time
(excluded), run once, then timed `--repeats` times; the median is reported with the bytes
the step must read (the K and V storage of the live tokens, codes and scales: what
`cache.tree_bytes` counts) and the achieved bytes/s. Every pallas row also carries its max
|pallas - grouped| on the same inputs (the kernel's first check on real hardware). Then a
small sweep of the kernel's knobs (BLOCK, ROW_MIN, SPLITS) at the longest context. For
bf16 and int8 each cell also times JAX's own kernel, `jax.experimental.pallas.ops.gpu.
paged_attention` (impl `jax_paged`), on the same data laid out as its pages (16 tokens,
sequence-contiguous page tables), with its max |difference| from the cache-only
reference. It attends over the stored tokens only (no new token, no merge with other
segments), so it does a little less than the other two rows.
A cell that fails writes its error and the next one runs; rows are flushed one by one.

Off GPU it runs a smoke configuration (tiny heads and contexts, Pallas interpret mode) and
says so: it checks the script, not the hardware.
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

from kvjax import attention, codecs  # noqa: E402
from kvjax import cache as cache_lib  # noqa: E402
from kvjax.attention import pallas as pa  # noqa: E402

GPU = {"heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
       "contexts": "4096,8192,16384,32768", "batches": "1,8", "repeats": 20}
SMOKE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "float32",
         "contexts": "80", "batches": "1,2", "repeats": 2}
SWEEP = [{"BLOCK": 32}, {"BLOCK": 128}, {"ROW_MIN": 1}, {"ROW_MIN": 1, "BLOCK": 128},
         {"SPLITS": 32}]


def _cell(shape, codec_name, B, S, key):
  """Inputs of one decode step: the new token's q/k/v and one layer's encoded cache."""
  H, K, D, dt = shape["heads"], shape["kv_heads"], shape["head_dim"], jnp.dtype(shape["dtype"])
  codec = codecs.get(codec_name)
  ks = jax.random.split(key, 5)
  enc = jax.jit(lambda k: codec.encode(jax.random.normal(k, (B, K, S, D), jnp.float32)))
  k_enc, v_enc = enc(ks[0]), enc(ks[1])
  q = jax.random.normal(ks[2], (B, 1, H, D), dt)
  kn, vn = (jax.random.normal(k, (B, 1, K, D), dt) for k in ks[3:])
  pos = jnp.full((B, 1), S, jnp.int32)
  return codec, (q, kn, vn, pos, k_enc, v_enc, jnp.int32(S))


def _step(impl, codec, S):
  def run(q, kn, vn, pos, k_enc, v_enc, live):
    mask = jnp.arange(S)[None, :] < live
    seg = cache_lib.Segment(k_enc, v_enc, jnp.broadcast_to(mask, (q.shape[0], S)), codec,
                            codec, live=live)
    return attention.ATTENTIONS[impl](q, kn, vn, pos, [seg]).astype(jnp.float32)
  return jax.jit(run)


def _time(fn, args, repeats):
  compiled = fn.lower(*args).compile()
  out = jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _emit(out_f, row: dict) -> None:
  """Flush one row to OUT.jsonl and print its line."""
  out_f.write(json.dumps(row) + "\n")
  out_f.flush()
  rate = f"{row['bytes_per_s'] / 1e9:8.1f} GB/s" if "bytes_per_s" in row else row["error"]
  print(f"  {row['impl']:<9} {row['codec']:<6} B={row['batch']:<2} S={row['context']:<6} "
        + (f"{row['median_s'] * 1e6:9.1f} us " if "median_s" in row else "") + rate, flush=True)


def _bench(out_f, shape, codec_name, B, S, repeats, settings, base, want=None):
  """Time one implementation on one cell; returns (row, output)."""
  codec, args = _cell(shape, codec_name, B, S, jax.random.PRNGKey(B * 7 + S))
  nbytes = cache_lib.tree_bytes(args[4]) + cache_lib.tree_bytes(args[5])
  impl = "grouped" if settings is None else "pallas"
  row = {**base, "impl": impl, "codec": codec_name, "batch": B, "context": S,
         "read_bytes": nbytes}
  got = None
  try:
    old = {k: getattr(pa, k) for k in (settings or {})}
    for k, v in (settings or {}).items():
      setattr(pa, k, v)
    if settings is not None:
      row["settings"] = {k: getattr(pa, k) for k in ("BLOCK", "SPLITS", "ROW_BLOCK", "ROW_MIN",
                                                     "NUM_WARPS", "NUM_STAGES")}
    try:
      med, got = _time(_step(impl, codec, S), args, repeats)
    finally:
      for k, v in old.items():
        setattr(pa, k, v)
    row.update(median_s=med, bytes_per_s=nbytes / med)
    if want is not None:
      row["max_abs_diff_vs_grouped"] = float(jnp.max(jnp.abs(got - want)))
  except Exception as e:  # noqa: BLE001  a failing cell is data; the next one runs
    row["error"] = _error(e)
  _emit(out_f, row)
  return row, got


# -- jax.experimental.pallas.ops.gpu.paged_attention: JAX's own kernel, the yardstick
JAX_CODECS = ("bf16", "int8")  # its pages: float, or int8 with one scale per token and head


def jax_paged_inputs(codec, q_B1HD, k_enc, v_enc, page: int):
  """One layer's stored K/V ([B, K, S, D] codec storage) laid out the way JAX's paged
  kernel reads it: pages [K, B*S/page, page, D], per-token scales [K, B*S/page, page] (int8),
  sequence b owning pages [b*S/page, (b+1)*S/page). q comes back [B, H, D], pre-scaled by
  head_dim^-0.5 (the kernel does not scale)."""
  B, K, S, D = k_enc["codes"].shape if isinstance(k_enc, dict) else k_enc.shape
  if S % page:
    raise ValueError(f"context {S} is not a whole number of {page}-token pages")
  n = S // page

  def pages(a):  # [B, K, S, ...] -> [K, B * n, page, ...]
    return jnp.swapaxes(a, 0, 1).reshape(K, B * n, page, *a.shape[3:])

  if isinstance(k_enc, dict):  # int8: codes + per-token scales, in their stored bf16
    from kvjax.codecs import quant
    kp, vp = pages(k_enc["codes"]), pages(v_enc["codes"])
    ks, vs = (pages(codecs.load_bits(e["scale"], quant.SCALE_DTYPE))[..., 0]
              for e in (k_enc, v_enc))
  else:
    kp, vp = (pages(codec.decode(e, q_B1HD.dtype)) for e in (k_enc, v_enc))
    ks = vs = None
  tables = jnp.arange(B * n, dtype=jnp.int32).reshape(B, n)
  q = (q_B1HD[:, 0].astype(jnp.float32) * D ** -0.5).astype(q_B1HD.dtype)
  return q, kp, vp, tables, jnp.full((B,), S, jnp.int32), ks, vs


def jax_paged_step(n_pages: int, interpret: bool):
  """JAX's kernel with splits / compute blocks that divide a sequence's `n_pages`."""
  from jax.experimental.pallas.ops.gpu import paged_attention as jpa
  splits = next(k for k in (16, 8, 4, 2, 1) if n_pages % k == 0)
  per_block = next(c for c in (8, 4, 2, 1) if (n_pages // splits) % c == 0)

  def run(q, kp, vp, tables, lengths, ks, vs):
    return jpa.paged_attention(q, kp, vp, tables, lengths, ks, vs, k_splits=splits,
                               pages_per_compute_block=per_block,
                               interpret=interpret).astype(jnp.float32)
  return jax.jit(run)


def cache_only_reference(codec, q_B1HD, k_enc, v_enc):
  """Attention of the new query over the stored tokens alone (what JAX's kernel computes):
  dequantized K/V, one softmax, float32. [B, H, D]."""
  k, v = codec.decode(k_enc, jnp.float32), codec.decode(v_enc, jnp.float32)
  B, K, S, D = k.shape
  q = q_B1HD[:, 0].astype(jnp.float32).reshape(B, K, -1, D) * D ** -0.5
  p = jax.nn.softmax(jnp.einsum("bkgd,bksd->bkgs", q, k), axis=-1)
  return jnp.einsum("bkgs,bksd->bkgd", p, v).reshape(B, -1, D)


def _bench_jax(out_f, shape, codec_name, B, S, repeats, base, interpret, page=16):
  """JAX's paged kernel on the same cell's data, checked against the cache-only reference."""
  codec, args = _cell(shape, codec_name, B, S, jax.random.PRNGKey(B * 7 + S))
  q, _, _, _, k_enc, v_enc, _ = args
  row = {**base, "impl": "jax_paged", "codec": codec_name, "batch": B, "context": S,
         "read_bytes": cache_lib.tree_bytes(k_enc) + cache_lib.tree_bytes(v_enc),
         "page_size": page}
  try:
    inputs = jax_paged_inputs(codec, q, k_enc, v_enc, page)
    med, got = _time(jax_paged_step(S // page, interpret), inputs, repeats)
    row.update(median_s=med, bytes_per_s=row["read_bytes"] / med,
               max_abs_diff_vs_reference=float(jnp.max(jnp.abs(
                   got - cache_only_reference(codec, q, k_enc, v_enc)))))
  except Exception as e:  # noqa: BLE001  a failing cell is data; the next one runs
    row["error"] = _error(e)
  _emit(out_f, row)
  return row


def sweep_plan(path: str, gpu: bool) -> dict:
  """The cells ([codec, batch, context]) and kernel settings of a sweep file; off GPU its
  first cell shrunk to the smoke shape and its first two settings."""
  import yaml
  plan = yaml.safe_load(Path(path).read_text())
  unknown = {k for st in plan["settings"] for k in st if not hasattr(pa, k)}
  if unknown:
    raise SystemExit(f"bench_pallas: {path}: no kernel setting {sorted(unknown)}")
  cells = [tuple(c) for c in plan["cells"]]
  if not gpu:
    cells, plan["settings"] = [(cells[0][0], 1, 80)], plan["settings"][:2]
  return {**plan, "cells": cells}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("out", metavar="OUT.jsonl")
  ap.add_argument("--contexts")
  ap.add_argument("--batches")
  ap.add_argument("--codecs", default="bf16,int8,int4")
  ap.add_argument("--repeats", type=int)
  ap.add_argument("--budget", type=float, default=300.0, help="seconds; no new cell after")
  ap.add_argument("--sweep", metavar="FILE.yaml", help="time only the cells and kernel "
                  "settings this file lists (configs/accel/pallas_sweep.yaml)")
  ap.add_argument("--no-sweep", action="store_true", help="skip the built-in knob sweep")
  args = ap.parse_args()
  gpu = jax.default_backend() == "gpu"
  shape = GPU if gpu else SMOKE
  if not gpu:
    print(f"bench_pallas: no GPU (backend {jax.default_backend()}): smoke run, tiny shapes in "
          "Pallas interpret mode; it checks the script, its numbers say nothing about a GPU")
  contexts = [int(c) for c in (args.contexts or shape["contexts"]).split(",")]
  batches = [int(b) for b in (args.batches or shape["batches"]).split(",")]
  repeats = args.repeats or shape["repeats"]
  from kvjax.lab import metrics
  env = metrics.environment()
  base = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
          "smoke": not gpu, "heads": shape["heads"], "kv_heads": shape["kv_heads"],
          "head_dim": shape["head_dim"], "q_dtype": shape["dtype"], "jax": jax.__version__,
          "jaxlib": env["jaxlib"], "platform_version": env["platform_version"]}
  deadline = time.monotonic() + args.budget
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  with open(args.out, "a") as f:
    cells = [(c, B, S) for S in contexts for B in batches for c in args.codecs.split(",")]
    sweep = [(s, ("int8", B, max(contexts))) for B in batches for s in SWEEP] if gpu else \
        [(SWEEP[2], ("int8", batches[0], max(contexts)))]  # smoke: one setting once
    if args.no_sweep:
      sweep = []
    if args.sweep:  # the listed cells' XLA baselines, then every setting on every cell
      plan = sweep_plan(args.sweep, gpu)
      cells, sweep = plan["cells"], [(st, c) for c in plan["cells"] for st in plan["settings"]]
      repeats = plan.get("repeats", repeats)
    wants = {}
    for settings, cell in [(None, cell) for cell in cells] + sweep:
      if time.monotonic() > deadline:
        print(f"bench_pallas: budget of {args.budget:.0f} s spent; stopping")
        break
      if settings is None:  # the XLA baseline, the kernel with its defaults, JAX's kernel
        _, wants[cell] = _bench(f, shape, *cell, repeats, None, base)
        if args.sweep:
          continue
        _bench(f, shape, *cell, repeats, {}, base, wants.get(cell))
        if cell[0] in JAX_CODECS:
          _bench_jax(f, shape, *cell, repeats, base, interpret=not gpu)
        continue
      _bench(f, shape, *cell, repeats, settings, base, wants.get(cell))
  return 0


if __name__ == "__main__":
  sys.exit(main())
