"""Plots of the `ruler` experiment: each cache's score against the bytes it holds.

  ruler_<model>: one row of panels per context length, one column per task family; each
    cache at (its bytes per prompt token as a share of a bf16 cache's, its mean score with
    the Wilson 95 % interval over questions); filled markers read the question-blind
    protocol, open ones the question-aware. A family is plotted over the tasks whose fp32
    cache scores at least the calibration threshold (`calibration.family_rows`), its title saying
    how many; one with none is plotted whole and titled "beyond the model". One figure per
    model (their contexts and head shapes differ).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab import intervals
from kvjax.lab.plots.style import Look, cache_label, model_label, save
from kvjax.lab.tasks import calibration


def _bf16_bytes(rows: list[dict]) -> float:
  """A bf16 cache's bytes per token: half of the fp32 rows' (their K/V in 4 bytes)."""
  fp32 = [r["metrics"]["bytes_per_token"] for r in rows if cache_label(r) == "fp32"]
  return 0.5 * float(np.mean(fp32)) if fp32 else float("nan")


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  rows = [r for r in rows if "family" in r.get("workload", {})]
  paths = []
  for model in sorted({r["variant"].get("model", "?") for r in rows}):
    mine = [r for r in rows if r["variant"].get("model", "?") == model]
    contexts = sorted({r["workload"]["context"] for r in mine})
    families = list(dict.fromkeys(r["workload"]["family"] for r in mine))
    look = Look(mine)
    # the codec palette gives every fp32-coded policy one colour: one colour a cache here
    names = sorted({cache_label(r) for r in mine})
    color = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    fig, axes = plt.subplots(len(contexts), len(families),
                             figsize=(4.6 * len(families), 3.6 * len(contexts)), squeeze=False)
    for i, n in enumerate(contexts):
      for j, fam in enumerate(families):
        ax, whole = axes[i][j], [r for r in mine if r["workload"]["context"] == n
                                 and r["workload"]["family"] == fam]
        here, calibrated = calibration.family_rows(whole)
        k, m = (len({r["workload"]["task"] for r in x}) for x in (here, whole))
        bf16 = _bf16_bytes(here)
        groups: dict = {}
        for r in here:
          groups.setdefault((cache_label(r), r["variant"].get("protocol", "blind")), []).append(r)
        for (s, protocol), rs in sorted(groups.items()):
          t = intervals.shares([r["metrics"]["score"] for r in rs])
          x = float(np.mean([r["metrics"]["bytes_per_token"] for r in rs])) / bf16
          lo, hi = t["score_ci95"]
          mark = look.marker(s)
          if protocol == "aware":
            mark = {**mark, "mfc": "none"}
          ax.errorbar([x], [t["score"]], yerr=[[t["score"] - lo], [hi - t["score"]]],
                      color=color[s], capsize=3, ms=6, ls="none",
                      label=f"{s} ({protocol})", **mark)
        n_q = len({(r["workload"]["task"], r["workload"]["sample"], r["workload"]["key"])
                   for r in here})
        tasks = f", {k} of {m} tasks" if calibrated and k < m else ""
        ax.set_title(f"{fam}, {n:,} tokens ({n_q} questions{tasks})"
                     + (": beyond the model" if calibrated is False else ""), fontsize=9)
        ax.set_xlim(0, 2.1)  # fp32 at 2: twice bf16's bytes
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("bytes per prompt token / bf16 cache's")
        ax.set_ylabel("score (share of expected strings)")
    axes[0][-1].legend(fontsize=6, title="cache (protocol)", title_fontsize=7,
                       loc="lower right")
    fig.suptitle(f"{model_label(mine[0])}: RULER-style score against bytes held; filled: "
                 "question-blind, open: question-aware", fontsize=10)
    paths += save(fig, out_dir, f"ruler_{model}".replace(":", "_").replace(".", "_"))
  return paths
