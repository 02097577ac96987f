"""Plots of the `latency` experiment: TPOT and TTFT vs context, throughput vs batch, and
a bar chart of every variant x codec at the longest context (the quickstart view)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import MultipleLocator

from kvjax.lab.plots.style import (
    BYTES, PLAIN, TOKENS, Look, bar_look, bytes_per_token, cache_label, codec_order, log2_axis,
    plain_log, save, subtitle, variant_order)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  paths = []
  if len({r["workload"]["context"] for r in rows}) > 1:
    paths += _vs_context(rows, out_dir, "tpot_s", "time per output token (ms)", "TPOT (decode)")
    paths += _vs_context(rows, out_dir, "ttft_s", "time to first token (ms)", "TTFT (prefill)")
  if len({r["workload"]["batch"] for r in rows}) > 1:
    paths += _vs_batch(rows, out_dir)
  return paths + _bars(rows, out_dir)


def _lines(rows):
  variants = sorted({r["variant"]["variant"] for r in rows}, key=variant_order)
  codecs = sorted({cache_label(r) for r in rows}, key=codec_order)
  layouts = sorted({r["variant"]["layout"] for r in rows})
  return variants, codecs, layouts


def _vs_context(rows, out_dir, metric, ylabel, what):
  variants, codecs, layouts = _lines(rows)
  look = Look(rows)
  batches = sorted({r["workload"]["batch"] for r in rows})[-3:]
  fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 4.4), squeeze=False)
  for ax, b in zip(axes[0], batches):
    for v in variants:
      for c in codecs:
        for lay in layouts:
          pts = sorted((r["workload"]["context"], r["metrics"][metric] * 1e3,
                        r["metrics"].get(metric + "_iqr", 0) * 1e3) for r in rows
                       if r["variant"]["variant"] == v and cache_label(r) == c
                       and r["workload"]["batch"] == b and r["variant"]["layout"] == lay)
          if not pts:
            continue
          # half the IQR either side, kept above zero on the log axis
          err = [min(p[2] / 2, 0.9 * p[1]) for p in pts]
          ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=err, capsize=2,
                      **look.style(v, c))
    log2_axis(ax.xaxis, TOKENS)
    ax.set_yscale("log")
    plain_log(ax.yaxis)
    ax.set_xlabel("context length (tokens in the cache)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"batch {b}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    look.legend(ax, loc="upper left")
  fig.suptitle(f"{what} vs context (median, bars = IQR)  {subtitle(rows)}", fontsize=10)
  return save(fig, out_dir, f"latency_{metric[:-2]}_vs_context")


def _vs_batch(rows, out_dir):
  variants, codecs, _ = _lines(rows)
  look = Look(rows)
  ctx = max(r["workload"]["context"] for r in rows)
  sub = [r for r in rows if r["workload"]["context"] == ctx]
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for v in variants:
    for c in codecs:
      pts = sorted((r["workload"]["batch"], r["metrics"]["tokens_per_s"]) for r in sub
                   if r["variant"]["variant"] == v and cache_label(r) == c)
      if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **look.style(v, c))
  log2_axis(ax.xaxis, PLAIN)
  ax.set_yscale("log")
  plain_log(ax.yaxis)
  ax.set_xlabel("batch size (sequences)")
  ax.set_ylabel("decode throughput (new tokens / s)")
  ax.set_title(f"Decode throughput vs batch at context {ctx}\n{subtitle(rows)}", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  look.legend(ax, loc="upper left")
  return save(fig, out_dir, "latency_throughput_vs_batch")


def _ratio(m: dict, ref: dict) -> tuple:
  """(low, ratio, high, verdict) of a row's TPOT against the reference's (kvjax.lab.figures):
  the paired interval when the row has one, else the ratio of medians with each median's
  IQR band (the low end: fastest against slowest)."""
  from kvjax.lab import figures
  p = figures.paired(m)
  if p is not None and p[1]:
    verdict = "reference" if m is ref else figures.verdict_ci(*p)
    return p[1][0], p[0], p[1][1], verdict
  (a0, a1), (b0, b1) = figures.iqr_band(m), figures.iqr_band(ref)
  y = m["tpot_s"] / ref["tpot_s"]
  verdict = "reference" if m is ref else figures.verdict_iqr(m, ref)
  return min(a0 / b1, y), y, max(a1 / max(b0, 1e-12), y), verdict


def _regime(rows) -> str:
  """Which regime the rows' decode steps measure (experiments.latency.regime)."""
  from kvjax.lab.experiments.latency import regime
  seen = sorted({regime(r["metrics"]) for r in rows})
  if seen == ["overhead"]:
    return "overhead-bound (far below the bytes roof: not a cache-bytes comparison)"
  return "regime: " + ", ".join(seen)


def _bars(rows, out_dir):
  """At the longest context and largest batch: TPOT relative to MHA-bf16 (the ratio printed
  on each bar), and the bytes the cache held per token there (kvjax.footprint). A group of bars
  per model, one bar per setting (colour: codec family; hatch: the setting within it)."""
  variants, codecs, _ = _lines(rows)
  ctx = max(r["workload"]["context"] for r in rows)
  b = max(r["workload"]["batch"] for r in rows if r["workload"]["context"] == ctx)
  here = [r for r in rows if r["workload"]["context"] == ctx and r["workload"]["batch"] == b]
  here = [r for r in here if r["variant"]["layout"] == "contiguous"] or here
  sub = {(r["variant"]["variant"], cache_label(r)): r for r in here}
  ref_key = ("MHA", "bf16") if ("MHA", "bf16") in sub else next(iter(sub))
  ref = sub[ref_key]["metrics"]["tpot_s"]
  look, style = Look(here), bar_look(here)
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(9, 1.2 * len(sub) + 4), 4.6),
                               layout="constrained")
  width = 0.8 / len(look.settings)
  ref_m = sub[ref_key]["metrics"]
  for i, c in enumerate(look.settings):
    xs = [j + (i - (len(look.settings) - 1) / 2) * width for j in range(len(look.models))]
    got = [sub.get((v, c)) for v in look.models]
    rel, err, said = [], [[], []], []
    for r in got:  # the ratio with its spread, named only where it tells the two apart
      lo, y, hi, verdict = _ratio(r["metrics"], ref_m) if r else (0, 0, 0, "")
      rel.append(y)
      err[0].append(max(y - lo, 0))
      err[1].append(max(hi - y, 0))
      said.append("" if not y else f"{y:.2f}x" if verdict in ("faster", "slower")
                  else "ref" if verdict == "reference" else "≈")
    bpt = [bytes_per_token(r) if r else 0 for r in got]
    bars = a1.bar(xs, rel, width, label=c, yerr=err, error_kw=dict(lw=0.8, capsize=2),
                  **style[c])
    a1.bar_label(bars, labels=said, fontsize=7, padding=1)
    bars = a2.bar(xs, bpt, width, label=c, **style[c])
    a2.bar_label(bars, labels=[BYTES(y) if y else "" for y in bpt], fontsize=6.5, padding=1)
  for ax in (a1, a2):
    ax.set_xticks(range(len(look.models)), [look.names[v] for v in look.models], fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
  fig.legend(*a1.get_legend_handles_labels(), fontsize=7.5, title="cache setting",
             title_fontsize=7.5, loc="outside right center")
  a1.axhline(1, color="gray", lw=0.8)
  a1.set_ylim(0, max(_ratio(r["metrics"], ref_m)[2] for r in here) * 1.2)
  a1.set_ylabel(f"TPOT / TPOT of {ref_key[0]} {ref_key[1]} ({ref * 1e3:.3g} ms)")
  a1.set_title(f"Decode time per token, relative (lower is faster); {_regime(here)}\n"
               "bars: 95 % interval (paired) or IQR band; ≈: not told apart from the "
               "reference", fontsize=8)
  top = max(bytes_per_token(r) for r in here) * 1.2
  a2.set_ylim(0, top)  # linear: bars start at 0; ticks at whole powers of two of bytes
  a2.yaxis.set_major_locator(MultipleLocator(2 ** math.floor(math.log2(max(top / 5, 1)))))
  a2.yaxis.set_major_formatter(BYTES)
  a2.set_ylabel(f"cache bytes held per token at context {ctx}")
  a2.set_title("Cache bytes per token (lower fits more)", fontsize=9)
  fig.suptitle(f"Settings at context {ctx}, batch {b}  {subtitle(rows)}", fontsize=10)
  return save(fig, out_dir, "latency_variants")
