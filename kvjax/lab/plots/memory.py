"""Plots of the `memory` experiment: cache bytes vs context (measured vs closed form),
bytes per token per variant and codec, and max concurrency of real model shapes."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from kvjax.lab.plots.style import (
    BYTES, TOKENS, Look, bar_look, bytes_per_token, cache_label, codec_order, log2_axis, save,
    subtitle, variant_color, variant_order)


def _keys(rows):
  variants = sorted({r["variant"]["variant"] for r in rows}, key=variant_order)
  codecs = sorted({cache_label(r) for r in rows}, key=codec_order)
  return variants, codecs


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  sized = [r for r in rows if r["workload"].get("part") == "cache_bytes"]
  fits = [r for r in rows if r["workload"].get("part") == "max_concurrency"]
  paths = []
  if sized:
    paths += _bytes_vs_context(sized, out_dir) + _bytes_per_token(sized, out_dir)
  if fits:
    paths += _concurrency(fits, out_dir)
  return paths


def _bytes_vs_context(rows, out_dir):
  variants, codecs = _keys(rows)
  look = Look(rows)
  fig, ax = plt.subplots(figsize=(8.5, 5), layout="constrained")
  for v in variants:
    for c in codecs:
      pts = sorted((r["workload"]["context"], r["metrics"]["closed_form_bytes"],
                    r["metrics"]["cache_bytes"], r["workload"]["measured"]) for r in rows
                   if r["variant"]["variant"] == v and cache_label(r) == c)
      if not pts:
        continue
      kw = look.style(v, c)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=kw["ls"], color=kw["color"], lw=1.4)
      for x, _, y, how in pts:  # measured: filled if allocated, hollow if abstract pytree
        ax.plot(x, y, marker=kw["marker"], ms=6, color=kw["color"],
                mfc=kw["mfc"] if how == "allocated" else "none", ls="none")
  log2_axis(ax.xaxis, TOKENS)
  log2_axis(ax.yaxis, BYTES, every=2)
  batch = rows[0]["workload"]["batch"]
  ax.set_xlabel("context length (tokens per sequence)")
  ax.set_ylabel(f"KV-cache size (bytes, batch {batch})")
  ax.set_title(f"KV-cache bytes vs context: lines closed form, markers measured pytree\n"
               f"{subtitle(rows)}", fontsize=10)
  ax.grid(True, which="major", alpha=0.3)
  extra = [Line2D([], [], color="gray", marker="o", ls="none", label="allocated"),
           Line2D([], [], color="gray", marker="o", mfc="none", ls="none",
                  label="abstract (eval_shape)")]
  look.legend(ax, loc="upper left", extra=extra)
  return save(fig, out_dir, "memory_bytes_vs_context")


def _bytes_per_token(rows, out_dir):
  """Bytes the cache held per token at the longest context measured (kvjax.footprint), a group
  per model, a bar per setting (colour: codec family)."""
  ctx = max(r["workload"]["context"] for r in rows)
  here = [r for r in rows if r["workload"]["context"] == ctx]
  look, style = Look(here), bar_look(here)
  per = {(r["variant"]["variant"], cache_label(r)): bytes_per_token(r) for r in here}
  fig, ax = plt.subplots(figsize=(min(14.0, max(6.5, 0.45 * len(per) + 3)), 4.6), layout="constrained")
  width = 0.8 / len(look.settings)
  for i, c in enumerate(look.settings):
    xs = [j + (i - (len(look.settings) - 1) / 2) * width for j in range(len(look.models))]
    ys = [per.get((v, c), 0) for v in look.models]
    bars = ax.bar(xs, ys, width, label=c, **style[c])
    ax.bar_label(bars, labels=[f"{y:.0f}" if y else "" for y in ys], fontsize=7, padding=1)
  ax.set_xticks(range(len(look.models)), [look.names[v] for v in look.models], fontsize=8)
  ax.set_ylabel(f"bytes held per token at context {TOKENS(ctx)}\n(all layers, K + V)")
  ax.set_yscale("log")
  ax.set_ylim(top=max(per.values()) * 3)
  ax.set_title(f"KV-cache bytes per token by model and setting\n{subtitle(rows)}",
               fontsize=10)
  ax.legend(fontsize=7.5, title="cache setting", title_fontsize=7.5)
  ax.grid(True, axis="y", alpha=0.3)
  return save(fig, out_dir, "memory_bytes_per_token")


def _concurrency(rows, out_dir):
  """A heatmap per real model shape: rows = attention variant x cache codec, columns =
  context, each cell the number of sequences that fit (printed; colour on a log scale)."""
  import numpy as np
  from matplotlib.colors import LogNorm

  shapes = list(dict.fromkeys(r["variant"]["model"] for r in rows))
  variants, codecs = _keys(rows)
  contexts = sorted({r["workload"]["context"] for r in rows})
  per_shape = {shape: [(v, c) for v in variants for c in codecs
                       if any(r["variant"]["model"] == shape and r["variant"]["variant"] == v
                              and cache_label(r) == c for r in rows)] for shape in shapes}
  n_lines = max(len(lines) for lines in per_shape.values())
  ncol = min(len(shapes), 2)
  nrow = (len(shapes) + ncol - 1) // ncol
  fig, axes = plt.subplots(nrow, ncol, squeeze=False,
                           figsize=(0.75 * len(contexts) * ncol + 3.2,
                                    0.24 * n_lines * nrow + 1.4 * nrow + 0.4))
  top = max(max(r["metrics"]["max_concurrency"] for r in rows), 2)
  norm = LogNorm(vmin=1, vmax=top)
  cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
  for ax, shape in zip(axes.flat, shapes):
    lines = per_shape[shape]
    sub = {(r["variant"]["variant"], cache_label(r), r["workload"]["context"]):
           r["metrics"]["max_concurrency"] for r in rows if r["variant"]["model"] == shape}
    grid = np.array([[sub.get((v, c, ctx), np.nan) for ctx in contexts] for v, c in lines],
                    dtype=float)
    ax.imshow(np.ma.masked_less(grid, 1), cmap=cmap, norm=norm, aspect="auto")
    for i in range(len(lines)):
      for j in range(len(contexts)):
        n = grid[i, j]
        if not np.isnan(n):
          light = n >= 1 and norm(n) < 0.6
          ax.text(j, i, f"{int(n):,}", ha="center", va="center", fontsize=7,
                  color="white" if light else "black")
    for i in range(1, len(lines)):  # a rule between attention variants
      if lines[i][0] != lines[i - 1][0]:
        ax.axhline(i - 0.5, color="white", lw=2)
    ax.set_xticks(range(len(contexts)), [TOKENS(c) for c in contexts], fontsize=8)
    ax.set_yticks(range(len(lines)), [f"{v}  {c}" for v, c in lines], fontsize=7)
    for tick, (v, _) in zip(ax.get_yticklabels(), lines):
      tick.set_color(variant_color(v))
    r0 = next(r for r in rows if r["variant"]["model"] == shape)
    weights = sorted({r["metrics"]["weight_bytes"] / 2 ** 30 for r in rows
                      if r["variant"]["model"] == shape})
    span = f"{weights[0]:.1f}" if f"{weights[0]:.1f}" == f"{weights[-1]:.1f}" else \
        f"{weights[0]:.1f}-{weights[-1]:.1f}"
    ax.set_title(f"{shape}: {r0['workload']['budget_gib']:g} GiB budget, "
                 f"{span} GiB weights", fontsize=9)
    ax.set_xlabel("context (tokens per sequence)", fontsize=8)
  for ax in axes.flat[len(shapes):]:
    ax.set_visible(False)
  fig.suptitle("Concurrent sequences that fit: floor((budget - weights) / cache bytes per "
               "sequence)\nclosed form; grey = none fits; MHA / the shape's own GQA / MQA; "
               "weights by variant", fontsize=10)
  fig.tight_layout()
  return save(fig, out_dir, "memory_max_concurrency")
