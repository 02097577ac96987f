"""Do the quality intervals cover a rerun on other text? Disjoint sets of windows of one
named text, each evaluated as `kvjax eval` would (B windows of M tokens streamed through
the cache beside the fp32 cache, `chunk` tokens a call), each set's 95 % intervals by every
method of `kvjax.lab.intervals` (`METHODS`), and how often they hold the pooled estimate
over all sets (Δppl and KL as ratios of sums over every window).

    python scripts/interval_coverage.py --model gguf:smollm2-135m --text stdlib \
        --codecs int8,int4 --sets 20 --windows 4 --tokens 512 \
        --out results/real_models/interval_coverage.jsonl

The windows are `sets x windows` evenly spaced windows of the text, dealt into the sets
two ways (`ASSIGN`): `drawn`, a seeded random deal, each set a fresh draw of windows
from the whole text as a rerun with other windows would be; `stretch`, set j the windows
j·B .. j·B + B − 1, each set one stretch of the text, as a rerun on another document
would be. One row per (model, text, codec, assignment, method): the coverage of Δppl and
KL with its Wilson interval over sets, the median interval width, the pooled estimate,
and every set's estimate and interval. The per-window terms are kept in `--cache`
(default checkpoints/interval_coverage/) so the analysis reruns without the model; a
(model, text) already in the rows file is skipped (resume).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvjax, whichever is installed


def pooled(terms: list[tuple]) -> dict:
  """Δppl and KL over every window of every set: ratios of sums."""
  nll = np.concatenate([t[0] for t in terms])
  ref = np.concatenate([t[1] for t in terms])
  kl = np.concatenate([t[2] for t in terms])
  return {"dppl_rel": float(np.expm1(np.mean(nll) - np.mean(ref))),
          "kl": float(np.mean(kl))}


ASSIGN = ("drawn", "stretch")


def deal(window_terms: tuple, sets: int, how: str, deals: int = 1) -> list[list[tuple]]:
  """The per-window terms ([N, m] arrays, N = sets x B windows) dealt into `sets` sets:
  once in text order (`stretch`), or `deals` seeded random deals (`drawn`)."""
  N = window_terms[0].shape[0]
  orders = [np.arange(N)] if how == "stretch" else \
      [np.random.default_rng(seed).permutation(N) for seed in range(deals)]
  return [[tuple(a[idx] for a in window_terms) for idx in np.array_split(o, sets)]
          for o in orders]


def rows_for(deals: list[list[tuple]], base: dict, resamples: int) -> list[dict]:
  """One row per interval method: how often a set's interval holds the pooled estimate,
  over every set of every deal."""
  from kvjax.lab import intervals

  whole = pooled(deals[0])
  terms = [t for one in deals for t in one]
  points = [pooled([t]) for t in terms]
  out = []
  for method in intervals.METHODS:
    cis = [intervals.quality_ci(*t, n_resamples=resamples, method=method) for t in terms]
    m = {"sets": len(deals[0]), "deals": len(deals)}
    for name in ("dppl_rel", "kl"):
      ci = [c[f"{name}_ci95"] for c in cis]
      hits = sum(lo <= whole[name] <= hi for lo, hi in ci)
      m[f"{name}_pooled"] = whole[name]
      m[f"{name}_coverage"] = hits / len(ci)
      m[f"{name}_coverage_ci95"] = intervals.wilson(hits, len(ci))
      m[f"{name}_width_median"] = float(np.median([hi - lo for lo, hi in ci]))
      m[f"{name}_sets"] = [p[name] for p in points]
      m[f"{name}_set_ci95"] = ci
    out.append({**base, "variant": {**base["variant"], "method": method}, "metrics": m})
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", required=True, help="gguf:NAME, hf:DIR or checkpoint:DIR")
  ap.add_argument("--text", default="stdlib", help="a named text (stdlib, shakespeare)")
  ap.add_argument("--codecs", default="int8,int4", help="comma-separated cache codecs")
  ap.add_argument("--sets", type=int, default=20)
  ap.add_argument("--windows", type=int, default=4, help="windows per set (B)")
  ap.add_argument("--tokens", type=int, default=512, help="tokens per window (M)")
  ap.add_argument("--chunk", type=int, default=64, help="tokens per streamed call")
  ap.add_argument("--resamples", type=int, default=2000)
  ap.add_argument("--deals", type=int, default=10, help="random deals of the windows")
  ap.add_argument("--set-sizes", default="",
                  help="windows per set to analyse (default: --windows), e.g. 2,4,8: the "
                       "same sets x windows windows dealt into sets of each size")
  ap.add_argument("--cache", default=str(ROOT / "checkpoints" / "interval_coverage"),
                  help="folder of the per-window terms (an .npz per model, text and codec)")
  ap.add_argument("--out", required=True)
  a = ap.parse_args()
  from kvjax import config as config_lib
  from kvjax import memory
  from kvjax.errors import KvjaxError
  from kvjax.io import sources
  from kvjax.lab import data, evaluate, lockstep, metrics

  try:
    if min(a.sets, a.windows) < 2 or a.tokens < 2 or a.chunk < 1 or a.resamples < 100:
      raise KvjaxError("--sets and --windows must be >= 2, --tokens >= 2, --chunk >= 1 and "
                       "--resamples >= 100")
    out = Path(a.out)
    done = set()
    for i, line in enumerate(out.read_text().splitlines() if out.exists() else (), 1):
      try:
        r = json.loads(line) if line.strip() else None
        if r is not None:
          done.add((r["variant"]["model"], r["workload"]["data"]))
      except (ValueError, KeyError, TypeError) as e:
        raise KvjaxError(f"{out} line {i} is not a coverage row ({type(e).__name__}: {e}); "
                         "remove it or write to another --out") from None
    src = sources.parse(a.model)
    if (src.name, a.text) in done:
      print(f"interval_coverage: {src.name} on {a.text} already in {out}; nothing to do")
      return
    cfg, params, tok = sources.load(src)
    text = data.eval_text(a.text, what="--text")
    ids = evaluate.text_windows(tok, text, a.tokens, a.sets * a.windows,
                                ("--tokens", "--sets x --windows", "--text"))
    codecs = [c for c in a.codecs.split(",") if c]
    sizes = [int(x) for x in a.set_sizes.split(",") if x] or [a.windows]
    if any(b < 2 or b > a.sets * a.windows // 2 for b in sizes):
      raise KvjaxError("each --set-sizes entry must be >= 2 and leave at least two sets")
    cfg = config_lib.apply_overrides(cfg, {"cache.capacity": a.tokens})  # a window's slots,
    tcfgs = {c: config_lib.apply_overrides(cfg, {"cache.codec": c}) for c in codecs}  # not 32k
    ref_cfg = evaluate.reference_config(cfg)
    memory.check_parts({"caches": 2 * sum(memory.cache_bytes(x, a.windows, a.tokens)
                                          for x in (ref_cfg, *tcfgs.values()))},
                       "this coverage run")
  except KvjaxError as e:
    print(f"interval_coverage: error: {e}", file=sys.stderr)
    sys.exit(2)
  keep = Path(a.cache)
  keep.mkdir(parents=True, exist_ok=True)
  files = {c: keep / f"{src.name}_{a.text}_{c}_{a.sets}x{a.windows}x{a.tokens}_c{a.chunk}.npz"
           for c in codecs}
  if not all(f.exists() for f in files.values()):
    # the batches done so far, kept after each: a killed run resumes at its next batch
    partial = keep / f"{src.name}_{a.text}_{'-'.join(codecs)}_{a.sets}x{a.windows}x" \
                     f"{a.tokens}_c{a.chunk}.partial.npz"
    parts, first = {c: [] for c in codecs}, 0
    if partial.exists():
      try:
        with np.load(partial) as z:
          first = int(z["batches"])
          parts = {c: [tuple(z[f"{c}_{k}"] for k in range(4))] for c in codecs}
        print(f"interval_coverage: resuming after batch {first}/{a.sets} ({partial})",
              file=sys.stderr)
      except (OSError, ValueError, KeyError) as e:
        print(f"interval_coverage: warning: {partial} cannot be resumed ({e}); starting "
              "over", file=sys.stderr)
        parts, first = {c: [] for c in codecs}, 0
    t0 = time.perf_counter()
    for j in range(first, a.sets):  # a set's windows in one batch; terms kept per window
      got = lockstep.terms(tcfgs, ref_cfg, params,
                           ids[j * a.windows:(j + 1) * a.windows], a.chunk)
      for c in codecs:
        parts[c] = [tuple(np.concatenate(x) for x in zip(*parts[c], got[c]))]
      tmp = partial.with_name(partial.name + ".tmp.npz")
      np.savez(tmp, batches=j + 1, **{f"{c}_{k}": parts[c][0][k] for c in codecs
                                      for k in range(4)})
      os.replace(tmp, partial)
      took = time.perf_counter() - t0
      left = took / (j + 1 - first) * (a.sets - j - 1)
      print(f"interval_coverage: batch {j + 1}/{a.sets} ({took:.0f} s; about "
            f"{left / 60:.0f} min left)", file=sys.stderr)
    for c in codecs:
      nll, ref, kl, agree = parts[c][0]
      np.savez_compressed(files[c], nll=nll, ref=ref, kl=kl, agree=agree)
    partial.unlink()
  env = metrics.environment()
  rows = []
  for c in codecs:
    z = np.load(files[c])
    window_terms = (z["nll"], z["ref"], z["kl"], z["agree"])
    N = window_terms[0].shape[0]
    for B in sizes:
      for how in ASSIGN:
        base = {"experiment": "interval_coverage",
                "variant": {"model": src.name, "codec": c, "assign": how},
                "workload": {"data": a.text, "windows": B, "tokens": a.tokens,
                             "chunk": a.chunk, "protocol": "streamed",
                             "reference": "fp32 cache", "resamples": a.resamples,
                             "sets": N // B},
                "env": env}
        rows += rows_for(deal(tuple(x[:N // B * B] for x in window_terms), N // B, how,
                              a.deals), base, a.resamples)
  out.parent.mkdir(parents=True, exist_ok=True)
  with out.open("a") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  for r in rows:
    m = r["metrics"]
    print(f"{src.name} {a.text} {r['variant']['codec']:5s} B={r['workload']['windows']} "
          f"{r['variant']['assign']:7s} {r['variant']['method']:9s} "
          f"Δppl coverage {m['dppl_rel_coverage']:.2f} "
          f"(width {100 * m['dppl_rel_width_median']:.2f} points)  "
          f"KL coverage {m['kl_coverage']:.2f}")


if __name__ == "__main__":
  main()
