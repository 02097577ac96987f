"""Plot of the `uptrain` experiment (the GQA paper's Table 1 at small scale).

  uptrain_recovery: validation perplexity per target (GQA-k, MQA) and method — converted
    only, converted + each uptraining fraction, trained from scratch — with the MHA
    model as a horizontal line. Lower is better; recovery is how far uptraining closes
    the gap between `converted` and `MHA`.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab.plots.style import save, variant_color, variant_order


def _label(r) -> str:
  v = r["variant"]
  if v["method"] == "uptrained":
    return f"+{100 * v['uptrain_fraction']:g}% uptrain"
  return v["method"]


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  mha = [r["metrics"]["ppl"] for r in rows if r["variant"]["method"] == "mha"]
  targets = sorted({r["variant"]["variant"] for r in rows if r["variant"]["method"] != "mha"},
                   key=variant_order)
  if not targets:
    return []
  order = ["converted"] + sorted({_label(r) for r in rows if r["variant"]["method"] == "uptrained"},
                                 key=lambda s: float(s[1:].split("%")[0])) + ["scratch"]
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  width = 0.8 / len(targets)
  x = np.arange(len(order))
  for i, t in enumerate(targets):
    vals = []
    for lab in order:
      m = [r["metrics"]["ppl"] for r in rows if r["variant"]["variant"] == t and _label(r) == lab]
      vals.append(m[-1] if m else np.nan)
    bars = ax.bar(x + i * width - 0.4 + width / 2, vals, width, color=variant_color(t), label=t)
    for b, val in zip(bars, vals):
      if np.isfinite(val):
        ax.text(b.get_x() + b.get_width() / 2, val, f"{val:.2f}", ha="center", va="bottom",
                fontsize=7)
  if mha:
    ax.axhline(mha[0], color=variant_color("MHA"), ls="--", lw=1.5,
               label=f"MHA (ppl {mha[0]:.2f})")
  finite = [r["metrics"]["ppl"] for r in rows if np.isfinite(r["metrics"]["ppl"])]
  lo, hi = min(finite), max(finite)
  ax.set_ylim(max(0.0, lo - 0.15 * (hi - lo) - 0.1), hi + 0.1 * (hi - lo) + 0.1)
  ax.set_xticks(x, order)
  ax.set_ylabel("validation perplexity (bytes, lower is better)")
  ax.set_title("MHA → GQA/MQA by mean-pooling K/V heads, then uptraining", fontsize=10)
  ax.grid(True, axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  return save(fig, out_dir, "uptrain_recovery")
