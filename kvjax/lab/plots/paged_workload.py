"""Plots of the `paged_workload` experiment: per attention variant x codec, contiguous
max-length reservation vs paging (prefix cache on / off) at one memory budget:
memory utilization (with the vLLM paper's ranges), concurrency, throughput and the
steps needed to serve the stream; and the gather path's decode cost vs contiguous."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab.plots.style import (
    LAYOUT_COLORS, cache_label, codec_order, save, subtitle, variant_order)

SERVERS = [("contiguous", False, "contiguous (reserve max length)", LAYOUT_COLORS["contiguous"]),
           ("paged", False, "paged", "#98df8a"),
           ("paged", True, "paged + prefix cache", LAYOUT_COLORS["paged"])]


def _groups(rows):
  keys = {(r["variant"]["variant"], cache_label(r)) for r in rows}
  return sorted(keys, key=lambda k: (variant_order(k[0]), codec_order(k[1])))


def _find(rows, group, layout, prefix):
  for r in rows:
    v = r["variant"]
    if (v["variant"], cache_label(r)) == group and v["layout"] == layout and \
        bool(v.get("prefix_cache", False)) == prefix:
      return r["metrics"]
  return None


def _bars(ax, rows, groups, metric, scale=1.0, fmt="{:.0f}", marker=None):
  width = 0.8 / len(SERVERS)
  x = np.arange(len(groups))
  for i, (layout, prefix, label, color) in enumerate(SERVERS):
    ms = [_find(rows, g, layout, prefix) for g in groups]
    if not any(ms):
      continue
    ys = [m[metric] * scale if m else np.nan for m in ms]
    pos = x - 0.4 + width * (i + 0.5)
    bars = ax.bar(pos, ys, width, color=color, label=label, edgecolor="black", lw=0.4)
    ax.bar_label(bars, [fmt.format(y) if not np.isnan(y) else "" for y in ys], fontsize=6)
    if marker:
      ax.plot(pos, [m[marker] if m else np.nan for m in ms], "k_", ms=9, mew=1.5)
  ax.set_xticks(x, [f"{v}\n{c}" for v, c in groups], fontsize=8)
  ax.grid(True, axis="y", alpha=0.3)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  groups = _groups(rows)
  w = rows[0]["workload"]
  fig, axes = plt.subplots(2, 2, figsize=(max(9, 2.2 * len(groups) + 3), 8))
  ax = axes[0, 0]
  _bars(ax, rows, groups, "memory_utilization", 100)
  ax.axhspan(20, 38, color="#1f77b4", alpha=0.08, label="vLLM paper: reservation 20-38%")
  ax.axhline(96, color="#2ca02c", ls=":", lw=1, label="vLLM paper: paging ~96%")
  ax.set_ylim(0, 135)
  ax.set_yticks(range(0, 101, 20))
  ax.set_ylabel("memory utilization (%)\nlive tokens / reserved slots")
  ax.legend(fontsize=7, loc="upper center", ncol=2)
  ax = axes[0, 1]
  _bars(ax, rows, groups, "mean_concurrency", fmt="{:.1f}", marker="max_concurrency")
  ax.set_ylabel("requests running together\n(bar: mean over steps, dash: max)")
  ax = axes[1, 0]
  _bars(ax, rows, groups, "tokens_per_s")
  ax.set_ylabel("output tokens / s (wall clock)")
  ax = axes[1, 1]
  _bars(ax, rows, groups, "steps")
  ax.set_ylabel("engine steps to serve the stream\n(deterministic; lower is better)")
  for g_i, g in enumerate(groups):
    m = _find(rows, g, "paged", True)
    if m:
      ax.annotate(f"hit {m['prefix_hit_rate']:.0%}", (g_i + 0.27, 0), xytext=(0, 3),
                  textcoords="offset points", ha="center", fontsize=6, rotation=90, color="white")
  fig.suptitle(f"Serving {w['requests']} requests at a {w['budget_bytes'] / 1024:.0f} KiB cache "
               f"budget (max length {w['max_len']}, page {w['page_size']})  {subtitle(rows)}",
               fontsize=10)
  paths = save(fig, out_dir, "paged_workload")
  return paths + _gather(rows, groups, out_dir)


def _gather(rows, groups, out_dir):
  pts = [(g, _find(rows, g, "paged", True)) for g in groups]
  pts = [(g, m) for g, m in pts if m and "gather_overhead" in m]
  if not pts:
    return []
  fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(pts) + 2), 3.8))
  x = np.arange(len(pts))
  bars = ax.bar(x, [m["gather_overhead"] for _, m in pts], 0.6, color=LAYOUT_COLORS["paged"],
                edgecolor="black", lw=0.4)
  ax.bar_label(bars, [f"{m['gather_overhead']:.2f}x" for _, m in pts], fontsize=7)
  ax.axhline(1, color="black", lw=0.8)
  ax.set_xticks(x, [f"{v}\n{c}" for (v, c), _ in pts], fontsize=8)
  ax.set_ylabel("decode time per token\npaged (gather) / contiguous")
  m = pts[0][1]
  ax.set_title(f"block-table gather cost: batch {m['bench_batch']}, context {m['bench_context']}"
               f"  {subtitle(rows)}", fontsize=9)
  ax.grid(True, axis="y", alpha=0.3)
  return save(fig, out_dir, "paged_workload_gather")
