"""The eviction runs' plots of the `long_context` experiment (rows with `variant.policy`,
configs/long_context_evict.yaml), drawn by kvjax.lab.plots.long_context:

  long_context_evict_accuracy_vs_bytes: accuracy against the prefix's bytes per prefix
    token, one panel per context length, one line per method: each policy over its ratios
    (fp32 cache, ending at the full fp32 cache), quantization of the whole cache (fp32,
    int8, int4), each policy combined with a codec, and GQA->MQA (mean-pooled) as a point.
  long_context_evict_accuracy_vs_context: accuracy against context length per method at a
    fixed fraction (half of each prefix) and at a fixed number of tokens (the budget of
    half the shortest context: the ratio whose budget is nearest to it at each length).
  long_context_evict_depth: accuracy per setting (rows) by context and depth of the fact
    (columns), passkey and needles together, each cell labelled right/asked.

Not a plot module of its own (no `plot`): `kvjax plot` finds it only through long_context.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab.plots.long_common import setting, title
from kvjax.lab.plots.texts import label_points
from kvjax.lab.plots.style import (
    BYTES, MARKERS, TOKENS, bytes_per_token, save, wilson_yerr)

METHOD_COLORS = {"window": "#ff7f0e", "sinks": "#2ca02c", "snapkv": "#1f77b4", "h2o": "#9467bd",
                 "tova": "#8c564b", "knorm": "#7f7f7f", "quantization": "#d62728",
                 "GQA→MQA": "#e377c2"}


def policy(r) -> str:
  return r["variant"].get("policy") or "full"


def method(r) -> str:
  """The line a row belongs to: a policy over its ratios (fp32 cache), a policy with a
  codec ("snapkv + codec"), quantization of the whole cache, or GQA->MQA."""
  v, pol = r["variant"], policy(r)
  if v.get("variant") == "MQA":
    return "GQA→MQA"
  if pol == "full":
    return "quantization"
  return pol if v["codec"] == "fp32" else f"{pol} + codec"


def _color(m: str) -> str:
  return METHOD_COLORS.get(m.replace(" + codec", ""), "#17becf")


def per_model(draw):
  """Rows of several models (a run over `params.models`) are drawn one model at a time, each
  into its own folder under `out_dir`: one model's cache settings per figure, never
  accuracies of different models pooled into one point. Such a run asks few queries a
  setting, so many settings share one accuracy and their names would overlap: its points
  go unnamed (the run's doc table names them)."""
  def drawn(rows, out_dir: Path, named: bool = True) -> list[Path]:
    models = sorted({r["variant"].get("model", "") for r in rows})
    if len(models) < 2:
      return draw(rows, out_dir, named)
    return [p for m in models
            for p in draw([r for r in rows if r["variant"].get("model", "") == m],
                          Path(out_dir) / m, False)]
  drawn.__name__, drawn.__doc__ = draw.__name__, draw.__doc__
  return drawn


def _cells(rows) -> dict:
  """(setting, context) -> {acc, n, right, bpt, held, method, policy, ratio, codec}."""
  out: dict = {}
  for r in rows:
    k = (setting(r), r["workload"]["context"])
    c = out.setdefault(k, {"right": 0.0, "n": 0, "bpt": [], "held": [], "method": method(r),
                           "policy": policy(r), "ratio": r["variant"].get("ratio") or 1.0,
                           "codec": r["variant"]["codec"]})
    c["right"] += r["metrics"]["accuracy"]
    c["n"] += 1
    c["bpt"].append(bytes_per_token(r))
    c["held"].append(r["metrics"].get("held_tokens", r["workload"].get("prefix_tokens", 0)))
  for c in out.values():
    c["acc"] = c["right"] / c["n"]
    c["bpt"], c["held"] = float(np.mean(c["bpt"])), float(np.mean(c["held"]))
  return out


def _full_fp32(cells, n):
  return next((c for (s, ctx), c in cells.items() if ctx == n and c["method"] == "quantization"
               and c["codec"] == "fp32"), None)


@per_model
def evict_accuracy_vs_bytes(rows, out_dir: Path, named: bool = True) -> list[Path]:
  cells = _cells(rows)
  contexts = sorted({n for _, n in cells})
  fig, axes = plt.subplots(1, len(contexts), figsize=(6.4 * len(contexts) + 1, 5.4),
                           squeeze=False, sharey=True, layout="constrained")
  methods = sorted({c["method"] for c in cells.values()})
  for ax, n in zip(axes[0], contexts):
    here = {s: c for (s, ctx), c in cells.items() if ctx == n}
    ref = _full_fp32(cells, n)
    labels: list = []
    for i, m in enumerate(methods):
      pts = [(c["bpt"], c["acc"], s, c) for s, c in here.items() if c["method"] == m]
      if ref is not None and m in METHOD_COLORS and m not in ("quantization", "GQA→MQA"):
        pts.append((ref["bpt"], ref["acc"], "", ref))  # every policy line ends at the full cache
      if not pts:
        continue
      pts.sort(key=lambda p: p[:3])
      # methods share their x (the same ratio): spread them a little so none hides another
      jit = 1 + 0.015 * (i - (len(methods) - 1) / 2)
      xs, ys = [p[0] * jit for p in pts], [p[1] for p in pts]
      ax.errorbar(xs, ys, yerr=wilson_yerr([p[3]["right"] for p in pts],
                                           [p[3]["n"] for p in pts]),
                  ls="none", color=_color(m), lw=0.6, capsize=1.5, alpha=0.5)
      style = dict(color=_color(m), label=m, marker=MARKERS[i % len(MARKERS)])  # one per method
      if m == "GQA→MQA":
        ax.plot(xs, ys, ls="none", ms=8, **style)
      elif m.endswith("+ codec"):
        ax.plot(xs, ys, ls="--", ms=7, **style)
      else:
        ax.plot(xs, ys, ls="-", ms=6, lw=2 if m == "quantization" else 1.5, **style)
      if m.endswith("+ codec") or m in ("quantization", "GQA→MQA"):
        labels += [(x, y, s, _color(m)) for x, y, (_, _, s, _) in zip(xs, ys, pts) if s]
    if named:
      label_points(ax, labels)
    if ref is not None:
      for frac, txt in ((0.5, "50 %"), (0.125, "12.5 %")):
        ax.axvline(frac * ref["bpt"], color="black", ls=":", lw=0.8)
        ax.text(frac * ref["bpt"], 1.07, f"{txt} of fp32", ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(BYTES)
    ax.set_ylim(-0.05, 1.12)
    ax.grid(True, alpha=0.3)
    asked = next(iter(here.values()))["n"]
    ax.set_title(f"{TOKENS(n)} tokens of context ({asked} queries per point)", fontsize=10)
    ax.set_xlabel("bytes the cache holds per prefix token (all layers, K + V, policy state in)")
  axes[0][0].set_ylabel("accuracy (exact digits)")
  handles, labels = axes[0][0].get_legend_handles_labels()
  for ax in axes[0][1:]:
    for h, lab in zip(*ax.get_legend_handles_labels()):
      if lab not in labels:
        handles.append(h)
        labels.append(lab)
  fig.legend(handles, labels, loc="outside right center", fontsize=8)
  fig.suptitle(title(rows) + ": accuracy vs bytes, by method\n(prefix compacted before the "
               "question; points spread a little in x where methods coincide; bars: Wilson "
               "95 % intervals)", fontsize=10)
  return save(fig, out_dir, "long_context_evict_accuracy_vs_bytes")


@per_model
def evict_accuracy_vs_context(rows, out_dir: Path, named: bool = True) -> list[Path]:
  cells = _cells(rows)
  contexts = sorted({n for _, n in cells})
  policies = sorted({c["policy"] for c in cells.values() if c["policy"] != "full"})
  plain = {k: c for k, c in cells.items() if c["codec"] == "fp32" and c["policy"] != "full"}
  half = [c for (s, n), c in plain.items() if c["ratio"] == 0.5 and n == contexts[0]]
  target = float(np.mean([c["held"] for c in half])) if half else None
  fig, axes = plt.subplots(1, 2, figsize=(12.4, 4.8), squeeze=False, sharey=True,
                           layout="constrained")
  for ax, mode in zip(axes[0], ("ratio", "tokens")):
    ref = [(n, _full_fp32(cells, n)) for n in contexts]
    ref = [(n, c) for n, c in ref if c is not None]
    if ref:
      ax.errorbar([n for n, _ in ref], [c["acc"] for _, c in ref], fmt="-s", color="black",
                  lw=2, capsize=2, label="full cache (fp32)",
                  yerr=wilson_yerr([c["right"] for _, c in ref], [c["n"] for _, c in ref]))
    for i, pol in enumerate(policies):
      jit = 1 + 0.015 * (i - (len(policies) - 1) / 2)  # policies often tie: spread them
      pts = []
      for n in contexts:
        cand = [c for (s, ctx), c in plain.items() if ctx == n and c["policy"] == pol]
        if mode == "ratio":
          cand = [c for c in cand if c["ratio"] == 0.5]
        elif target is not None:
          cand = [c for c in cand if abs(c["held"] - target) <= 0.15 * target]
        if cand:
          best = min(cand, key=lambda c: abs(c["held"] - (target or 0)))
          pts.append((n * jit, best["acc"], best["ratio"], best["right"], best["n"]))
      if pts:
        # at a fixed budget, the ratio each point kept is in its line's legend entry
        label = pol if mode == "ratio" else \
            f"{pol} (ratio {', '.join(f'{p[2]:g}' for p in pts)})"
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], fmt="-o", color=_color(pol),
                    label=label, capsize=1.5, elinewidth=0.6,
                    yerr=wilson_yerr([p[3] for p in pts], [p[4] for p in pts]))
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [TOKENS(n) for n in contexts])
    # one context stays one category: the axis spans a factor of 1.5 either side, so the
    # policies' small spread never reaches the panel's edges
    ax.set_xlim(contexts[0] / 1.5, contexts[-1] * 1.5)
    ax.set_xlabel("context (tokens)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(True, alpha=0.3)
  axes[0][0].set_title("half of each prefix kept (ratio 0.5)", fontsize=10)
  axes[0][1].set_title(f"a fixed budget of about {target:.0f} prefix tokens (legend: ratio)"
                       if target else "fixed budget: no ratio-0.5 rows", fontsize=10)
  axes[0][0].set_ylabel("accuracy (exact digits)")
  for ax, size in zip(axes[0], (8, 7)):
    if ax.get_legend_handles_labels()[0]:  # a panel with no line gets no empty legend
      ax.legend(fontsize=size)
  fig.suptitle(title(rows) + ": accuracy vs context at a fixed budget (bars: Wilson 95 % "
               "intervals)", fontsize=10)
  return save(fig, out_dir, "long_context_evict_accuracy_vs_context")


@per_model
def evict_depth(rows, out_dir: Path, named: bool = True) -> list[Path]:
  cells = _cells(rows)
  settings = sorted({s for s, _ in cells}, key=lambda s: (
      -max(c["bpt"] for (t, _), c in cells.items() if t == s), s))
  cols = sorted({(r["workload"]["context"], r["workload"]["depth"]) for r in rows})
  right = np.zeros((len(settings), len(cols)))
  asked = np.zeros_like(right)
  for r in rows:
    i = settings.index(setting(r))
    j = cols.index((r["workload"]["context"], r["workload"]["depth"]))
    right[i, j] += r["metrics"]["accuracy"]
    asked[i, j] += 1
  acc = np.where(asked > 0, right / np.maximum(asked, 1), np.nan)
  fig, ax = plt.subplots(figsize=(0.55 * len(cols) + 3.2, 0.28 * len(settings) + 1.6),
                         layout="constrained")
  im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
  for i in range(len(settings)):
    for j in range(len(cols)):
      if asked[i, j]:
        ax.text(j, i, f"{right[i, j]:g}/{asked[i, j]:g}", ha="center", va="center", fontsize=6.5)
  ax.set_yticks(range(len(settings)), settings, fontsize=7.5)
  ax.set_xticks(range(len(cols)), [f"{TOKENS(n)}\n{d:g}" for n, d in cols], fontsize=7)
  ax.set_xlabel("context (tokens) and depth of the fact")
  fig.colorbar(im, ax=ax, shrink=0.6, label="accuracy (passkey + needle)")
  ax.set_title(title(rows) + ": by setting (most bytes first), context and depth", fontsize=9)
  return save(fig, out_dir, "long_context_evict_depth")
