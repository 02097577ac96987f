"""Plot of the `budget` experiment: decode throughput at one memory budget per cache
setting, as bars with their 95 % intervals, the batch that fits printed on each bar."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvjax.plots.style import cache_label, codec_order, save, subtitle, variant_color


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  rows = sorted(rows, key=lambda r: (r["variant"]["variant"], codec_order(cache_label(r))))
  fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(rows) + 2), 4.4))
  for i, r in enumerate(rows):
    m = r["metrics"]
    lo, hi = m["tokens_per_s_ci95"]
    ax.bar(i, m["tokens_per_s"], color=variant_color(r["variant"]["variant"]), alpha=0.85)
    ax.errorbar(i, m["tokens_per_s"], yerr=[[m["tokens_per_s"] - lo], [hi - m["tokens_per_s"]]],
                color="black", capsize=4, lw=1)
    ax.text(i, hi, f"B={m['batch']}", ha="center", va="bottom", fontsize=8)
  ax.set_xticks(range(len(rows)), [cache_label(r) for r in rows])
  ax.set_ylabel("decode tokens/s at the budget (95 % interval)")
  budget = rows[0]["metrics"]["budget_bytes"] / 2 ** 30
  ctx = rows[0]["workload"]["context"]
  ax.set_title(f"{budget:.3g} GiB budget, {ctx} tokens per sequence: largest batch that fits",
               fontsize=9)
  ax.set_ylim(0, max(r["metrics"]["tokens_per_s_ci95"][1] for r in rows) * 1.15)
  ax.grid(True, axis="y", alpha=0.3)
  fig.suptitle(f"Throughput at a memory budget  {subtitle(rows)}", fontsize=10)
  return save(fig, Path(out_dir), "budget_throughput")
