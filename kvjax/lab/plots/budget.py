"""Plot of the `budget` experiment: decode throughput at one memory budget per cache
setting, as bars with their 95 % intervals, the batch that fits and the ratio to the first
setting printed on each bar."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvjax.lab.plots.style import Look, bar_look, cache_label, codec_order, save, subtitle


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  rows = sorted(rows, key=lambda r: (r["variant"]["variant"], codec_order(cache_label(r))))
  look, style = Look(rows), bar_look(rows)  # colour: codec family
  fig, ax = plt.subplots(figsize=(min(14.0, max(5.0, 1.1 * len(rows) + 2)), 4.6),
                         layout="constrained")
  for i, r in enumerate(rows):
    m = r["metrics"]
    lo, hi = m["tokens_per_s_ci95"]
    ax.bar(i, m["tokens_per_s"], **style[cache_label(r)])
    ax.errorbar(i, m["tokens_per_s"], yerr=[[m["tokens_per_s"] - lo], [hi - m["tokens_per_s"]]],
                color="black", capsize=4, lw=1)
    ratio = m["tokens_per_s"] / rows[0]["metrics"]["tokens_per_s"]
    ax.text(i, hi, f"B={m['batch']}\n{ratio:.2f}x", ha="center", va="bottom", fontsize=8)
  many = len(look.models) > 1
  ax.set_xticks(range(len(rows)), [cache_label(r) + (f"\n{look.names[r['variant']['variant']]}"
                                                     if many else "") for r in rows],
                rotation=45 if len(rows) > 6 else 0, ha="right" if len(rows) > 6 else "center",
                fontsize=8)
  ax.set_ylabel("decode tokens/s at the budget (95 % interval)")
  budget = rows[0]["metrics"]["budget_bytes"] / 2 ** 30
  ctx = rows[0]["workload"]["context"]
  ax.set_title(f"{budget:.3g} GiB budget, {ctx} tokens per sequence: largest batch B that "
               f"fits; ratio: throughput / {cache_label(rows[0])}'s",
               fontsize=9)
  ax.set_ylim(0, max(r["metrics"]["tokens_per_s_ci95"][1] for r in rows) * 1.25)
  ax.grid(True, axis="y", alpha=0.3)
  fig.suptitle(f"Throughput at a memory budget: {', '.join(look.names[v] for v in look.models)}"
               f"  {subtitle(rows)}", fontsize=10)
  return save(fig, Path(out_dir), "budget_throughput")
