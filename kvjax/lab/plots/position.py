"""Plots of the `position` experiment: how each cache setting's error grows with position.

  position_<model>: Δppl against the fp32 cache (%, top) and KL (nats, bottom, log scale)
    per position bucket, one line per cache setting with its 95 % interval as error bars,
    one column per text; one figure per model (its context and its head shape differ from
    the others').
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab.plots.style import Look, cache_label, model_label, save


def _kilo(n: int) -> str:
  return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  rows = [r for r in rows if r.get("workload", {}).get("task") == "text_by_position"]
  paths = []
  for model in sorted({r["variant"].get("model", "?") for r in rows}):
    mine = [r for r in rows if r["variant"].get("model", "?") == model]
    texts = sorted({r["workload"]["data"] for r in mine})
    look = Look(mine)
    fig, axes = plt.subplots(2, len(texts), figsize=(5.2 * len(texts), 7.4), squeeze=False,
                             sharex="col")
    for col, text in enumerate(texts):
      here = [r for r in mine if r["workload"]["data"] == text]
      buckets = sorted({tuple(r["workload"]["bucket"]) for r in here})
      settings = [s for s in look.settings if any(cache_label(r) == s for r in here)]
      for ax, key, scale in ((axes[0][col], "dppl_rel", 100.0), (axes[1][col], "kl", 1.0)):
        for i, s in enumerate(settings):
          by = {tuple(r["workload"]["bucket"]): r["metrics"] for r in here
                if cache_label(r) == s}
          xs = [j for j, b in enumerate(buckets) if b in by]
          y = np.array([scale * by[buckets[j]][key] for j in xs])
          ci = [by[buckets[j]].get(f"{key}_ci95") or [by[buckets[j]][key]] * 2 for j in xs]
          yerr = np.array([[max(y[k] - scale * c[0], 0), max(scale * c[1] - y[k], 0)]
                           for k, c in enumerate(ci)]).T
          # settings side by side within a bucket, so their intervals do not hide each other
          shift = (i - (len(settings) - 1) / 2) * 0.08
          ax.errorbar(np.asarray(xs) + shift, y, yerr=yerr, color=look.color(s), capsize=3,
                      lw=1.2, ms=5, label=s, **look.marker(s))
        ax.grid(True, axis="y", alpha=0.3)
      top, bottom = axes[0][col], axes[1][col]
      top.axhline(0, color="0.5", lw=0.8)
      top.set_ylabel("Δppl against the fp32 cache (%)")
      context = max(r["workload"]["context"] for r in here)
      top.set_title(f"{text}, first {context:,} tokens", fontsize=10)
      top.legend(fontsize=7, title="cache", title_fontsize=7)
      bottom.set_yscale("log")
      bottom.set_ylabel("KL(fp32 ‖ cache), nats")
      bottom.set_xticks(np.arange(len(buckets)), [f"{_kilo(a)}–{_kilo(b)}" for a, b in buckets])
      bottom.set_xlabel("positions (tokens of context read)")
    chunk = mine[0]["workload"]["chunk"]
    fig.suptitle(f"{model_label(mine[0])}: each setting's error by position, streamed "
                 f"{chunk} tokens a call", fontsize=10)
    paths += save(fig, out_dir, f"position_{model}".replace(":", "_").replace(".", "_"))
  return paths
