"""Plots of the `long_context` experiment (retrieval through the cache).

  long_context_heatmap: one panel per cache setting (most bytes first), depth of the fact
    (rows) x context length (columns), accuracy over tasks and seeds, each cell labelled
    "right/asked".
  long_context_accuracy_vs_bytes: accuracy over every query of a context length against
    the setting's closed-form cache bytes per token, one line per context length, points
    labelled with their setting; beside it (when fp32 rows are present), the fraction of
    queries whose first number written equals the fp32 cache's, which separates what the
    codec changes from what the model cannot do at any precision.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from plots import BYTES, TOKENS, save


def _setting(r) -> str:
  return r["variant"].get("setting") or r["variant"]["codec"]


def _settings(rows) -> list[str]:
  bpt = {}
  for r in rows:
    bpt[_setting(r)] = r["metrics"]["bytes_per_token"]
  return sorted(bpt, key=lambda s: (-bpt[s], s))


def _title(rows) -> str:
  r = rows[0]
  model = r["variant"].get("model", "")
  tasks = sorted({x["workload"]["task"] for x in rows})
  return f"{model}: {', '.join(tasks)} through the cache"


def heatmap(rows, out_dir: Path) -> list[Path]:
  settings = _settings(rows)
  depths = sorted({r["workload"]["depth"] for r in rows})
  contexts = sorted({r["workload"]["context"] for r in rows})
  n = len(settings)
  cols = min(n, 4)
  nrows = -(-n // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols + 1.2, 2.3 * nrows + 0.8),
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
          ax.text(b, a, f"{right[a, b]:g}/{asked[a, b]:g}", ha="center", va="center",
                  fontsize=8)
    bpt = next(r["metrics"]["bytes_per_token"] for r in rows if _setting(r) == s)
    ax.set_title(f"{s} ({BYTES(bpt)}/token)", fontsize=9)
    ax.set_xticks(range(len(contexts)), [TOKENS(c) for c in contexts], fontsize=8)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
    if i % cols == 0:
      ax.set_ylabel("depth of the fact")
    if i // cols == nrows - 1:
      ax.set_xlabel("context (tokens)")
  for j in range(n, nrows * cols):
    axes[j // cols][j % cols].axis("off")
  fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy")
  fig.suptitle(_title(rows) + ": accuracy by depth and context", fontsize=10)
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
  fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.6), squeeze=False)
  cmap = plt.get_cmap("viridis")
  for k, n in enumerate(contexts):
    xs, acc, same, labels = [], [], [], []
    for s in settings:
      sel = [r for r in rows if _setting(r) == s and r["workload"]["context"] == n]
      if sel:
        xs.append(sel[0]["metrics"]["bytes_per_token"])
        acc.append(np.mean([r["metrics"]["accuracy"] for r in sel]))
        hits = [_first_number(r["metrics"]["output"]) == ref[_query(r)] for r in sel
                if _query(r) in ref]
        same.append(np.mean(hits) if hits else np.nan)
        labels.append(s)
    order = np.argsort(xs)
    color = cmap(0.85 * k / max(len(contexts) - 1, 1))
    asked = len([r for r in rows if r["workload"]["context"] == n]) // max(len(settings), 1)
    for ax, ys in zip(axes[0], (acc, same)):
      ax.plot(np.array(xs)[order], np.array(ys)[order], "-o", color=color,
              label=f"{TOKENS(n)} tokens ({asked} queries per setting)")
      if k == 0:
        for x, y, lab in zip(xs, ys, labels):
          ax.annotate(lab, (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
  for ax in axes[0]:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(BYTES)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("cache bytes per token (all layers, K + V, closed form)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  axes[0][0].set_ylabel("accuracy (exact digits)")
  axes[0][0].set_title("accuracy", fontsize=10)
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
  return heatmap(rows, out_dir) + accuracy_vs_bytes(rows, out_dir)
