"""Plots of the `quality` experiment: the cost of each cache setting against its bytes.

  quality_dppl_vs_bytes: Δppl (%) per setting, settings ordered by measured cache bytes per
    token (in their labels), one dot per model (colour = attention variant); a linear axis
    cut at 5 %, larger values printed beside an arrow.
  quality_kl: mean KL vs the fp32 cache per setting (log scale), bars per model; the fp32
    reference itself (KL 0) is not drawn.
  Both draw each row's 95 % interval (`dppl_rel_ci95`, `kl_ci95`, drawn as the row's
  `ci_method` says: kvjax.lab.intervals) where the row has one; older rows are drawn without.
  quality_recall (only when the rows hold recall, i.e. params.recall_contexts): recall
    accuracy vs context, one panel per model, one line per setting (dashed grey: the same
    model through the fp32 cache). configs/quality.yaml measures no recall.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab import intervals
from kvjax.lab.plots.texts import label_points
from kvjax.lab.plots.style import (
    FAMILY_COLORS, HATCHES, Look, bytes_per_token, cache_label, save, variant_color,
    variant_order)


def _setting(r) -> str:
  return cache_label(r)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  text = [r for r in rows if r["workload"].get("task") == "text"]
  recall = [r for r in rows if r["workload"].get("task") == "recall"]
  paths = []
  texts = list(dict.fromkeys(r["workload"].get("data", "") for r in text))
  for t in texts:  # one pair of figures per evaluation text (code, prose): never two texts'
    part = [r for r in text if r["workload"].get("data", "") == t]  # points on one row
    tag = f"_{t}" if len(texts) > 1 else ""
    paths += _dppl(part, out_dir, tag) + _kl(part, out_dir, tag)
  if recall:
    paths += _recall(recall, out_dir)
  return paths


def _reference(rows) -> str:
  """What the rows are held to (`workload.reference`: the fp32 cache unless the run set
  params.reference)."""
  refs = sorted({r["workload"].get("reference", "fp32 cache") for r in rows})
  return " / ".join(refs)


def family_handles(look, patch: bool = False, only=None) -> list:
  """One legend entry per codec family the figure's (drawn) settings use, in its colour."""
  from matplotlib.lines import Line2D
  from matplotlib.patches import Patch
  fams = list(dict.fromkeys(look.family[s] for s in look.settings
                            if only is None or s in only))
  return [Patch(facecolor=FAMILY_COLORS.get(f, FAMILY_COLORS[""]), label=f or "other")
          if patch else Line2D([], [], marker="s", ls="none", ms=7,
                               color=FAMILY_COLORS.get(f, FAMILY_COLORS[""]), label=f or "other")
          for f in fams]


def _variants(rows):
  return sorted({r["variant"]["variant"] for r in rows}, key=variant_order)


def _bpt(r) -> float:
  """Bytes the cache held per token at the row's context (`plots.bytes_per_token`)."""
  return bytes_per_token(r)


CAP = 5.0  # Δppl (%) axis limit; larger values are drawn at the edge with their value


def _ci_words(rows) -> str:
  return intervals.describe(r["metrics"].get("ci_method", "blocks") for r in rows
                            if "dppl_rel_ci95" in r["metrics"])


def _text_note(rows, tag: str) -> str:
  return f", text: {rows[0]['workload'].get('data')}" if tag else ""


def _dppl(rows, out_dir, tag: str = ""):
  """One line per setting (sorted by bytes per token, bytes in the label), one dot per
  model (marker; colour: the setting's codec family): names never collide, and the axis is
  linear (no symlog bend at 0)."""
  variants = _variants(rows)
  look = Look(rows)
  shape = {v: "osD^vP"[i % 6] for i, v in enumerate(variants)}
  settings = sorted({_setting(r) for r in rows},
                    key=lambda s: (-max(_bpt(r) for r in rows if _setting(r) == s), s))
  fig, ax = plt.subplots(figsize=(9.5, max(0.5 * len(settings) + 1.6, 3.4)))
  offsets = {v: (i - (len(variants) - 1) / 2) * 0.3 for i, v in enumerate(variants)}
  beyond = []  # points past the axis: their values, placed once the figure is laid out
  for y, s in enumerate(settings):
    for r in rows:
      if _setting(r) != s:
        continue
      v, val = r["variant"]["variant"], 100 * r["metrics"]["dppl_rel"]
      x = min(val, CAP + 0.3)
      ci = r["metrics"].get("dppl_rel_ci95")
      if ci and val <= CAP:  # the whole 95 % interval: past the axis edge it is cut by the
        lo, hi = 100 * ci[0], 100 * ci[1]  # axis and `save` draws an arrow there, no cap
        ax.errorbar(x, y + offsets[v], xerr=[[max(x - lo, 0)], [max(hi - x, 0)]], ls="none",
                    lw=1, capsize=2.5, color=look.color(s))
      if val > CAP:  # the point itself beyond the axis: an arrow at the edge, its value
        ax.plot(x, y + offsets[v], marker=">", ms=6, ls="none", color=look.color(s),
                clip_on=False)
        beyond.append((x, y + offsets[v], f"{val:+.1f}", look.color(s)))
      else:
        ax.plot(x, y + offsets[v], marker=shape[v], ms=6, ls="none", color=look.color(s))
  labels = []
  for s in settings:
    bpt = {r["variant"]["variant"]: round(_bpt(r)) for r in rows if _setting(r) == s}
    labels.append(f"{s}  ({'/'.join(str(bpt[v]) if v in bpt else '-' for v in variants)} "
                  "B/token)")
  ax.set_yticks(range(len(settings)), labels, fontsize=8)
  for tick, s in zip(ax.get_yticklabels(), settings):
    tick.set_color(look.color(s))
  ax.set_ylim(len(settings) - 0.5, -0.5)  # a whole row per setting (most bytes on top), so
  # one setting's models never reach the panel's edges
  lo = min(-0.5, min(100 * r["metrics"]["dppl_rel"] for r in rows) - 0.2)
  ax.set_xlim(lo, CAP + 0.3)  # points past CAP sit on the edge as arrows
  ax.axvline(0, color="black", lw=0.8)
  ax.axvline(1.0, color="gray", lw=0.8, ls=":")  # named in the x label, not over a bar
  label_points(ax, beyond)
  n = rows[0]["workload"]
  bars = any("dppl_rel_ci95" in r["metrics"] for r in rows)
  ref = _reference(rows)
  ax.set_xlabel(f"Δ perplexity vs the {ref} (%; dotted: 1 %), axis cut at {CAP + 0.3:g} % "
                "(arrows: a point or interval beyond it, the point's value beside)"
                + (f"; bars: 95 % intervals ({_ci_words(rows)})" if bars else ""))
  ax.set_title(f"Quality vs cache size: settings from most to fewest measured bytes per token\n"
               f"(per model: {'/'.join(look.names[v] for v in variants)}); {n.get('batch')}×{n.get('context')} "
               f"validation tokens per model, fed {n.get('chunk')} at a time{_text_note(rows, tag)}",
               fontsize=9)
  ax.grid(True, axis="x", alpha=0.3)
  from matplotlib.lines import Line2D
  ax.legend(handles=[Line2D([], [], marker=shape[v], ls="none", color="#555555",
                            label=look.names[v]) for v in variants] + family_handles(look),
            fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
            title="marker: model; colour: codec family", title_fontsize=7.5)
  return save(fig, out_dir, "quality_dppl_vs_bytes" + tag)


def _kl(rows, out_dir, tag: str = ""):
  """KL per setting (most bytes first) on a log axis, its value printed on the bar; one bar
  per model (hatch) and setting (colour: codec family). The fp32 cache is the reference
  (KL exactly 0) and has no bar."""
  variants = _variants(rows)
  look = Look(rows)
  names = {v: look.names[v] for v in variants}
  settings = [s for s in dict.fromkeys(_setting(r) for r in sorted(rows, key=lambda r: -_bpt(r)))
              if any(r["metrics"]["kl"] > 0 for r in rows if _setting(r) == s)]
  kl = {(r["variant"]["variant"], _setting(r)): r["metrics"] for r in rows
        if r["metrics"]["kl"] > 0}
  present = [[v for v in variants if (v, s) in kl] for s in settings]  # bars side by side
  width = 0.8 / max(len(p) for p in present)
  n_bars = sum(len(p) for p in present)
  fig, ax = plt.subplots(figsize=(min(15.0, max(7.0, 0.3 * n_bars + 0.3 * len(settings) + 2)),
                                  5.0), layout="constrained")
  x = np.arange(len(settings))
  for j, (s, here) in enumerate(zip(settings, present)):
    for i, v in enumerate(here):
      m = kl[(v, s)]
      val, ci = m["kl"], m.get("kl_ci95")  # the 95 % interval as an error bar where it is
      err = [[max(val - ci[0], 0)], [max(ci[1] - val, 0)]] if ci else None
      bar = ax.bar(j + (i - (len(here) - 1) / 2) * width, val, width, color=look.color(s),
                   hatch=HATCHES[variants.index(v) % len(HATCHES)], edgecolor="white", lw=0.5,
                   yerr=err, error_kw=dict(lw=0.8, capsize=2))
      ax.bar_label(bar, labels=[f"{val:.1e}"], fontsize=6, rotation=90, padding=2)
  ax.set_yscale("log")
  top = np.nanmax([r["metrics"]["kl"] for r in rows if r["metrics"]["kl"] > 0])
  ax.set_ylim(top=top * 30)
  ax.set_xticks(x, settings, rotation=45, ha="right", fontsize=8)
  for tick, s in zip(ax.get_xticklabels(), settings):
    tick.set_color(look.color(s))
  ax.set_ylabel(f"mean KL({_reference(rows)} ‖ this cache), nats")
  bars = any("kl_ci95" in r["metrics"] for r in rows)
  ax.set_title(f"Next-token KL divergence from the {_reference(rows)}, settings from most to fewest "
               f"bytes per token{_text_note(rows, tag)}\n(fp32 itself, KL 0, not drawn; no bar: "
               "not run on that model"
               + (f"; error bars: 95 % intervals, {_ci_words(rows)}" if bars else "")
               + ")", fontsize=9)
  ax.grid(True, axis="y", alpha=0.3)
  if len(variants) > 1:
    from matplotlib.patches import Patch
    hs = [Patch(facecolor="#999999", edgecolor="white", hatch=HATCHES[i], label=names[v])
          for i, v in enumerate(variants)] + family_handles(look, patch=True, only=settings)
    fig.legend(handles=hs, fontsize=8, loc="outside lower center", ncol=min(6, len(hs)),
               title="hatch: model; bar colour: codec family", title_fontsize=7.5)
  else:
    ax.text(0.01, 0.98, names[variants[0]], transform=ax.transAxes, va="top", fontsize=8)
  return save(fig, out_dir, "quality_kl" + tag)


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
