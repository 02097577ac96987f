"""Plots of the `quality` experiment: the cost of each cache setting against its bytes.

  quality_dppl_vs_bytes: Δppl (%) vs measured cache bytes per token, one point per setting and
    model (colour = attention variant), labelled with the setting name; the good
    settings sit low and to the left.
  quality_kl: mean KL vs the fp32 cache per setting (log scale), bars per model.
  quality_recall (only when the rows hold recall, i.e. params.recall_contexts): recall
    accuracy vs context, one panel per model, one line per setting (dashed grey: the same
    model through the fp32 cache). configs/quality.yaml measures no recall.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from plots import save, variant_color, variant_order


def _setting(r) -> str:
  return r["variant"].get("setting") or r["variant"].get("codec", "?")


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  text = [r for r in rows if r["workload"].get("task") == "text"]
  recall = [r for r in rows if r["workload"].get("task") == "recall"]
  paths = []
  if text:
    paths += _dppl(text, out_dir) + _kl(text, out_dir)
  if recall:
    paths += _recall(recall, out_dir)
  return paths


def _variants(rows):
  return sorted({r["variant"]["variant"] for r in rows}, key=variant_order)


def _bpt(r) -> float:
  """Measured bytes per token (the pytree over batch x context), else the closed form."""
  m, w = r["metrics"], r["workload"]
  if "cache_bytes" in m and w.get("batch") and w.get("context"):
    return m["cache_bytes"] / (w["batch"] * w["context"])
  return m["bytes_per_token"]


def _dppl(rows, out_dir):
  fig, ax = plt.subplots(figsize=(8, 5.5))
  for v in _variants(rows):
    pts = [(_bpt(r), 100 * r["metrics"]["dppl_rel"], _setting(r))
           for r in rows if r["variant"]["variant"] == v]
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=variant_color(v), label=v, s=30)
    for x, y, name in pts:
      ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
  ax.set_xscale("log", base=2)
  ax.set_yscale("symlog", linthresh=0.1)
  ax.axhline(0, color="black", lw=0.8)
  for target, label in ((0.1, "int8 target 0.1%"), (1.0, "int4 target 1%"), (5.0, "int2 5%")):
    ax.axhline(target, color="gray", lw=0.6, ls=":")
    ax.text(ax.get_xlim()[1], target, label, fontsize=7, color="gray", ha="right", va="bottom")
  ax.set_xlabel(f"measured cache bytes per token at context {rows[0]['workload'].get('context')}"
                " (all layers, K+V, scales and residual window included)")
  ax.set_ylabel("Δ perplexity vs fp32 cache (%)")
  n = rows[0]["workload"]
  ax.set_title(f"Quality vs cache size, tokens fed one at a time through the cache\n"
               f"{n.get('batch')}×{n.get('context')} validation tokens, chunk {n.get('chunk')}",
               fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  return save(fig, out_dir, "quality_dppl_vs_bytes")


def _kl(rows, out_dir):
  variants = _variants(rows)
  settings = list(dict.fromkeys(_setting(r) for r in sorted(
      rows, key=lambda r: -_bpt(r))))
  fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(settings) + 2), 4.5))
  width = 0.8 / len(variants)
  x = np.arange(len(settings))
  for i, v in enumerate(variants):
    vals = []
    for s in settings:
      m = [r["metrics"]["kl"] for r in rows if r["variant"]["variant"] == v and _setting(r) == s]
      vals.append(max(m[0], 1e-9) if m else np.nan)
    ax.bar(x + i * width - 0.4 + width / 2, vals, width, color=variant_color(v), label=v)
  ax.set_yscale("log")
  ax.set_xticks(x, settings, rotation=45, ha="right", fontsize=8)
  ax.set_ylabel("mean KL(fp32 cache ‖ this cache), nats")
  ax.set_title("Next-token KL divergence from the fp32 cache", fontsize=10)
  ax.grid(True, axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  return save(fig, out_dir, "quality_kl")


def _recall(rows, out_dir):
  variants = _variants(rows)
  settings = list(dict.fromkeys(_setting(r) for r in rows))
  cmap = plt.get_cmap("viridis", max(len(settings), 2))
  fig, axes = plt.subplots(1, len(variants), figsize=(4.5 * len(variants), 4), squeeze=False,
                           sharey=True)
  for ax, v in zip(axes[0], variants):
    mine = [r for r in rows if r["variant"]["variant"] == v]
    ref = sorted({(r["workload"]["context"], r["metrics"]["recall_ref"]) for r in mine})
    ax.plot([p[0] for p in ref], [p[1] for p in ref], color="gray", ls="--", lw=2,
            label="fp32 cache")
    for i, s in enumerate(settings):
      pts = sorted((r["workload"]["context"], r["metrics"]["recall"]) for r in mine
                   if _setting(r) == s)
      if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1,
                color=cmap(i), label=s)
    n_pairs = mine[0]["workload"].get("n_pairs")
    if n_pairs:
      ax.axhline(1 / 64, color="red", lw=0.6, ls=":", label="chance (1/64)")
    ax.set_title(f"{v}", color=variant_color(v), fontsize=10)
    ax.set_xlabel("context length (tokens)")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
  axes[0][0].set_ylabel("associative-recall accuracy")
  axes[0][-1].legend(fontsize=7, loc="best")
  fig.suptitle("Recall vs context through each cache", fontsize=10)
  return save(fig, out_dir, "quality_recall")
