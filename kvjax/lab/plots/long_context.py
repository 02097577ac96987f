"""Plots of the `long_context` experiment (retrieval through the cache).

  long_context_heatmap: one panel per cache setting (most bytes first), depth of the fact
    (rows) x context length (columns), accuracy over tasks and seeds, each cell labelled
    "right/asked".
  long_context_accuracy_vs_bytes: accuracy over every query of a context length against
    the bytes the setting's cache holds for the prefix per prefix token (`kvjax.footprint`:
    a residual window and scales in), one line per context length, points
    labelled with their setting; beside it (when fp32 rows are present), the fraction of
    queries whose first number written equals the fp32 cache's, which separates what the
    codec changes from what the model cannot do at any precision.

The accuracy plots draw each point's Wilson 95 % interval (its count right of the
queries asked, `kvjax.lab.intervals.wilson`), from the per-query rows of any vintage.

Rows with eviction policies (`variant.policy`, configs/long_context_evict.yaml) get their
own three plots instead (kvjax.lab.plots.long_context_evict).
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab.plots import long_context_evict as evict
from kvjax.lab.plots.long_common import setting as _setting
from kvjax.lab.plots.long_common import settings as _settings
from kvjax.lab.plots.long_common import title as _title
from kvjax.lab.plots.texts import label_points
from kvjax.lab.plots.style import (
    BYTES, MARKERS, TOKENS, bytes_per_token, save, wilson_yerr)


def heatmap(rows, out_dir: Path) -> list[Path]:
  settings = _settings(rows)
  depths = sorted({r["workload"]["depth"] for r in rows})
  contexts = sorted({r["workload"]["context"] for r in rows})
  n = len(settings)
  cols = min(n, 4)
  nrows = -(-n // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(2.9 * cols + 1.6, 2.5 * nrows + 1.0),
                           squeeze=False, layout="constrained")
  im = None
  for i, s in enumerate(settings):
    ax = axes[i // cols][i % cols]
    right = np.zeros((len(depths), len(contexts)))
    asked = np.zeros_like(right)
    for r in rows:
      if _setting(r) == s:
        a, b = depths.index(r["workload"]["depth"]), contexts.index(r["workload"]["context"])
        right[a, b] += r["metrics"]["accuracy"]
        asked[a, b] += 1
    acc = np.where(asked > 0, right / np.maximum(asked, 1), np.nan)
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    for a in range(len(depths)):
      for b in range(len(contexts)):
        if asked[a, b]:
          dark = acc[a, b] < 0.15 or acc[a, b] > 0.85
          ax.text(b, a, f"{right[a, b]:g}/{asked[a, b]:g}", ha="center", va="center",
                  fontsize=8, color="white" if dark else "black")
    by_ctx = {r["workload"]["context"]: bytes_per_token(r) for r in rows if _setting(r) == s}
    lo, hi = by_ctx[min(by_ctx)], by_ctx[max(by_ctx)]  # held: a window's share falls
    held = f"{BYTES(lo)}/token" if round(lo) == round(hi) else \
        f"{BYTES(lo)} → {BYTES(hi)}/token ({TOKENS(min(by_ctx))} → {TOKENS(max(by_ctx))})"
    ax.set_title(f"{s}\n{held}", fontsize=8.5)
    ax.set_xticks(range(len(contexts)), [TOKENS(c) for c in contexts], fontsize=8)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
    if i % cols == 0:
      ax.set_ylabel("depth of the fact")
    if i // cols == nrows - 1 or i + cols >= n:
      ax.set_xlabel("context (tokens)")
  for j in range(n, nrows * cols):
    axes[j // cols][j % cols].axis("off")
  fig.colorbar(im, ax=axes, shrink=0.8, fraction=0.03, pad=0.01, label="accuracy (right / asked)")
  fig.suptitle(_title(rows) + "\naccuracy by depth and context; settings from most to "
               "fewest bytes held per prefix token", fontsize=10)
  return save(fig, out_dir, "long_context_heatmap")


def _first_number(text: str):
  m = re.search(r"\d+", text)
  return m.group(0) if m else None


def _query(r) -> tuple:
  w = r["workload"]
  return (r["variant"].get("model"), w["context"], w["task"], w["depth"], w.get("seed"),
          w.get("key"))


def accuracy_vs_bytes(rows, out_dir: Path) -> list[Path]:
  settings = _settings(rows)
  contexts = sorted({r["workload"]["context"] for r in rows})
  ref = {_query(r): _first_number(r["metrics"]["output"]) for r in rows
         if _setting(r) == "fp32" and "output" in r["metrics"]}
  panels = 2 if ref else 1
  fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.8), squeeze=False,
                           layout="constrained")
  cmap = plt.get_cmap("viridis")
  for k, n in enumerate(contexts):
    xs, acc, same, labels, right, asked = [], [], [], [], [], []
    for s in settings:
      sel = [r for r in rows if _setting(r) == s and r["workload"]["context"] == n]
      if sel:
        xs.append(bytes_per_token(sel[0]))
        right.append(sum(r["metrics"]["accuracy"] for r in sel))
        asked.append(len(sel))
        acc.append(right[-1] / asked[-1])
        hits = [_first_number(r["metrics"]["output"]) == ref[_query(r)] for r in sel
                if _query(r) in ref]
        same.append(np.mean(hits) if hits else np.nan)
        labels.append(s)
    order = np.argsort(xs)
    color = cmap(0.85 * k / max(len(contexts) - 1, 1))
    per = len([r for r in rows if r["workload"]["context"] == n]) // max(len(settings), 1)
    for ax, ys in zip(axes[0], (acc, same)):
      ax.plot(np.array(xs)[order], np.array(ys)[order], "-", color=color,
              label=f"{TOKENS(n)} tokens ({per} queries per setting)")
      for x, y, lab in zip(xs, ys, labels):  # a marker per setting (kvjax.lab.plots.style)
        ax.plot(x, y, ls="none", ms=6, color=color, marker=MARKERS[settings.index(lab)
                                                                 % len(MARKERS)])
      if k == 0:
        label_points(ax, [(x, y, lab, "black") for x, y, lab in zip(xs, ys, labels)])
    err = wilson_yerr(right, asked)  # the accuracy's Wilson 95 % interval
    axes[0][0].errorbar(xs, acc, yerr=err, ls="none", color=color, lw=0.8, capsize=2,
                        alpha=0.7)
  for ax in axes[0]:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(BYTES)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("cache bytes held per prefix token (all layers, K + V, window and scales in)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  axes[0][0].set_ylabel("accuracy (exact digits)")
  axes[0][0].set_title("accuracy (bars: Wilson 95 % intervals)", fontsize=10)
  if panels == 2:
    axes[0][1].set_ylabel("fraction of answers equal to fp32's")
    axes[0][1].set_title("same answer as the fp32 cache (first number written)", fontsize=10)
  fig.suptitle(_title(rows) + ": accuracy vs cache bytes", fontsize=10)
  return save(fig, out_dir, "long_context_accuracy_vs_bytes")


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  rows = [r for r in rows if "accuracy" in r.get("metrics", {})]
  if not rows:
    return []
  if any(evict.policy(r) != "full" for r in rows):  # an eviction run: its own plots
    return (evict.evict_accuracy_vs_bytes(rows, out_dir)
            + evict.evict_accuracy_vs_context(rows, out_dir) + evict.evict_depth(rows, out_dir))
  return heatmap(rows, out_dir) + accuracy_vs_bytes(rows, out_dir)
