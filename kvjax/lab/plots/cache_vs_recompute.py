"""Plots of `cache_vs_recompute`: decode time per token vs position with and without the
cache (log-log, fitted slopes), the speedup, and the total time to generate N tokens."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt

from kvjax.lab.plots.style import LAYOUT_COLORS, PLAIN, TOKENS, log2_axis, save, subtitle


def _series(rows):
  out: dict[str, list] = {}
  for r in rows:
    m = r["metrics"]
    out.setdefault(r["variant"]["layout"], []).append(
        (r["workload"]["position"], m["tpot_s"], m.get("tpot_s_iqr", 0.0),
         m.get("speedup_vs_recompute")))
  return {k: sorted(v) for k, v in out.items()}


def _slope(xs, ys) -> float:
  """Least-squares slope in log-log space: the growth exponent of time vs position."""
  if len(xs) < 2:
    return float("nan")
  lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
  mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
  den = sum((a - mx) ** 2 for a in lx)
  return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def _log_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
  """The look the three figures share: log2 token axis, log y axis in plain numbers, grid."""
  log2_axis(ax.xaxis, TOKENS)
  ax.set_yscale("log")
  ax.yaxis.set_major_formatter(PLAIN)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  series = _series(rows)
  paths = []

  fig, ax = plt.subplots(figsize=(6.8, 4.6))
  for lay, pts in series.items():
    xs, ys = [p[0] for p in pts], [p[1] * 1e3 for p in pts]
    half = len(xs) // 2  # the growth exponent over the longer half of the positions
    k = _slope(xs[half:], ys[half:])
    err = [min(p[2] * 1e3 / 2, 0.9 * y) for p, y in zip(pts, ys)]
    ax.errorbar(xs, ys, yerr=err, marker="o", ms=4, capsize=2,
                color=LAYOUT_COLORS.get(lay, "C4"), ls="--" if lay == "none" else "-",
                label=f"{'recompute (none)' if lay == 'none' else lay}: ~ p^{k:.2f}")
  _log_axes(ax, "position p (tokens already in the sequence)", "decode time per token (ms)",
            f"Decode time per token vs position: cache vs recompute\n{subtitle(rows)}")
  ax.legend(fontsize=8, title="layout: fitted growth (upper half)", title_fontsize=8)
  paths += save(fig, out_dir, "cache_vs_recompute_tpot")

  cached = {k: v for k, v in series.items() if k != "none"}
  if cached:
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for lay, pts in cached.items():
      pts = [p for p in pts if p[3]]
      ax.plot([p[0] for p in pts], [p[3] for p in pts], marker="o",
              color=LAYOUT_COLORS.get(lay, "C4"), label=lay)
      if pts:
        ax.annotate(f"{pts[-1][3]:.0f}x", (pts[-1][0], pts[-1][3]), textcoords="offset points",
                    xytext=(-10, 6), fontsize=9)
    ax.axhline(1, color="gray", lw=0.8)
    _log_axes(ax, "position p (tokens already in the sequence)",
              "speedup: recompute time / cached time per token",
              f"What the KV cache buys per decode step (measured interleaved)\n{subtitle(rows)}")
    ax.legend(fontsize=8)
    paths += save(fig, out_dir, "cache_vs_recompute_speedup")

  fig, ax = plt.subplots(figsize=(6.8, 4.6))
  for lay, pts in series.items():
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    # Total time to generate N tokens from position ~0: trapezoid sum of the per-token
    # time over positions, the first point extended back to position 0.
    tot, acc, prev = [], xs[0] * ys[0], (xs[0], ys[0])
    tot.append(acc)
    for x, y in zip(xs[1:], ys[1:]):
      acc += (x - prev[0]) * (y + prev[1]) / 2
      prev = (x, y)
      tot.append(acc)
    k = _slope(xs[len(xs) // 2:], tot[len(xs) // 2:])
    ax.plot(xs, tot, marker="o", ms=4, color=LAYOUT_COLORS.get(lay, "C4"),
            ls="--" if lay == "none" else "-",
            label=f"{'recompute (none)' if lay == 'none' else lay}: ~ N^{k:.2f}")
  _log_axes(ax, "tokens generated N", "total decode time (s, integrated per-token time)",
            f"Total time to generate N tokens: recompute vs KV cache\n{subtitle(rows)}")
  ax.legend(fontsize=8, title="layout: fitted growth (upper half)", title_fontsize=8)
  paths += save(fig, out_dir, "cache_vs_recompute_total")
  return paths
