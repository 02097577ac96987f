"""Plots of the `roofline` experiment: the roof fraction decode reaches (kvjax.lab.figures: the
one roof fraction, a bar above 1 labelled FAULT, not a result), and TPOT, vs context, one figure per batch size (kvjax.lab.plots.style's look: colour
per codec family, marker per setting, line style per model). Rows of a single context are
drawn as bars instead, the fraction and the TPOT ratio to the model's largest cache
printed on each."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab import figures
from kvjax.lab.plots.style import (
    PLAIN, TOKENS, Look, bytes_per_token, cache_label, log2_axis, save, subtitle)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  paths = []
  for b in sorted({r["workload"]["batch"] for r in rows}):
    sub = [r for r in rows if r["workload"]["batch"] == b]
    one = len({r["workload"]["context"] for r in sub}) == 1
    paths += (_bars if one else _figure)(sub, out_dir, b)
  return paths


def _reads(rows) -> list[str]:
  """Attention reads of the rows, the native CPU read first."""
  return sorted({r["variant"].get("attention", "") for r in rows},
                key=lambda a: (a != "native", a))


def _bandwidth(rows) -> float:
  return sorted(r["metrics"]["bandwidth_Bps"] for r in rows)[len(rows) // 2] / 1e9


def _figure(rows, out_dir, batch):
  look = Look(rows)
  # Rows of several attention reads (the native CPU read and the XLA read) are told apart
  # by opacity: the first read (native before grouped) solid, the others faded.
  attns = _reads(rows)
  fig, (a_frac, a_tpot) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
  for v in look.models:
    for c in look.settings:
      for i, att in enumerate(attns):
        pts = sorted((r["workload"]["context"], _frac(r),
                      r["metrics"]["tpot_s"] * 1e3) for r in rows
                     if r["variant"]["variant"] == v and cache_label(r) == c
                     and r["variant"].get("attention", "") == att)
        if not pts:
          continue
        x, kw = [p[0] for p in pts], dict(look.style(v, c), alpha=1.0 if i == 0 else 0.35)
        a_frac.plot(x, [p[1] for p in pts], **kw)
        a_tpot.plot(x, [p[2] for p in pts], **kw)
  a_frac.axhline(1.0, color="black", lw=0.8, alpha=0.5)
  a_frac.set_ylim(0, max(1.05, max(_frac(r) for r in rows) * 1.05))
  a_frac.set_ylabel("roof fraction (roof time / step time)")
  a_frac.set_title(f"fraction of the roof ({_bandwidth(rows):.3g} GB/s measured; above 1: a "
                   "probe or timing fault)", fontsize=9)
  a_tpot.set_yscale("log")
  a_tpot.yaxis.set_major_formatter(PLAIN)
  a_tpot.yaxis.set_minor_formatter(PLAIN)
  a_tpot.set_ylabel("time per output token (ms)")
  a_tpot.set_title("TPOT (decode step)", fontsize=9)
  for ax in (a_frac, a_tpot):
    log2_axis(ax.xaxis, TOKENS)
    ax.set_xlabel("context length (tokens in the cache)")
    ax.grid(True, which="both", alpha=0.3)
  extra = [plt.Line2D([], [], color="gray", alpha=1.0 if i == 0 else 0.35, lw=2,
                      label=f"attention={a}") for i, a in enumerate(attns)] \
      if len(attns) > 1 else None
  look.legend(a_tpot, loc="upper left", extra=extra, bbox_to_anchor=(1.02, 1.0))
  fig.suptitle(f"Decode vs the memory-bandwidth roofline, batch {batch}  {subtitle(rows)}",
               fontsize=10)
  return save(fig, out_dir, f"roofline_b{batch}")


def _bars(rows, out_dir, batch):
  """One context: a bar per (model, setting, read), the roofline fraction printed on the
  left, the TPOT and its ratio to the same model's largest cache (same read) on the right."""
  look, attns = Look(rows), _reads(rows)
  keys = [(v, c, a) for v in look.models for c in sorted(
      look.settings, key=lambda c: -max([bytes_per_token(r) for r in rows
                                         if cache_label(r) == c] or [0]))
          for a in attns if any(_match(r, v, c, a) for r in rows)]
  metric = {k: next(r["metrics"] for r in rows if _match(r, *k)) for k in keys}
  ref = {}
  for v, c, a in keys:  # the first setting of a model (most bytes) is its reference
    ref.setdefault((v, a), metric[(v, c, a)]["tpot_s"])
  x = np.arange(len(keys))
  fig, (a_frac, a_tpot) = plt.subplots(1, 2, figsize=(max(9.0, 0.9 * len(keys) + 3), 4.8),
                                       layout="constrained")
  colors = [look.color(c) for _, c, _ in keys]
  hatch = ["" if attns.index(a) == 0 else "//" for _, _, a in keys]
  frac = [figures.roof_fraction(metric[k]) or 0.0 for k in keys]
  tpot = [metric[k]["tpot_s"] * 1e3 for k in keys]
  for ax, ys in ((a_frac, frac), (a_tpot, tpot)):
    bars = ax.bar(x, ys, 0.7, color=colors, hatch=hatch, edgecolor="white", lw=0.5)
    labels = [f"{y:.2f}" if y <= 1 else "FAULT" for y in ys] if ax is a_frac else \
        [_ratio_label(metric[k], ref[(k[0], k[2])]) for k in keys]
    ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
    ax.set_xticks(x, [_tick(look, k, attns) for k in keys], rotation=45, ha="right", fontsize=7.5)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(0, max(ys) * 1.15 if ax is a_tpot else max(1.05, max(ys) * 1.15))
    ax.set_xlim(-0.5 - max(0, 3 - len(keys)) / 2, len(keys) - 0.5 + max(0, 3 - len(keys)) / 2)
  a_frac.axhline(1.0, color="black", lw=0.8, alpha=0.5)
  a_frac.set_ylabel("roof fraction (roof time / step time)")
  a_frac.set_title(f"fraction of the roof ({_bandwidth(rows):.3g} GB/s measured; above 1: a "
                   "probe or timing fault)", fontsize=9)
  a_tpot.set_ylabel("time per output token (ms)")
  a_tpot.set_title("TPOT; labels: ratio to the reference (paired where timed in turn; ≈: "
                   "not told apart)", fontsize=9)
  ctx = rows[0]["workload"]["context"]
  fig.suptitle(f"Decode vs the memory-bandwidth roofline, batch {batch}, context {TOKENS(ctx)}"
               f"  {subtitle(rows)}", fontsize=10)
  return save(fig, out_dir, f"roofline_b{batch}")


def _ratio_label(m: dict, ref_tpot: float) -> str:
  """A bar's speed label: the row's paired ratio where it has one (≈ when its interval holds
  1), else the ratio of medians to the model's largest cache."""
  p = figures.paired(m)
  if p is None:
    return f"{m['tpot_s'] / ref_tpot:.2f}x"
  verdict = figures.verdict_ci(*p)
  return "ref" if p == (1.0, [1.0, 1.0]) else f"{p[0]:.2f}x" if verdict != APART else "≈"


APART = figures.APART[2]


def _frac(r) -> float:
  """The row's one roof fraction (kvjax.lab.figures), 0 for a row without one."""
  return figures.roof_fraction(r["metrics"]) or 0.0


def _match(r, v, c, a) -> bool:
  return (r["variant"]["variant"] == v and cache_label(r) == c
          and r["variant"].get("attention", "") == a)


def _tick(look, key, attns) -> str:
  v, c, a = key
  parts = [c] + ([look.names[v]] if len(look.models) > 1 else []) + \
      ([f"attention={a}"] if len(attns) > 1 else [])
  return "\n".join(parts) if len(parts) < 3 else f"{parts[0]}, {parts[2]}\n{parts[1]}"
