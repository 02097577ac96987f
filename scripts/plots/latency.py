"""Plots of the `latency` experiment: TPOT and TTFT vs context, throughput vs batch, and
a bar chart of every variant x codec at the longest context (the quickstart view)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from plots import (BYTES, PLAIN, TOKENS, cache_label, codec_order, codec_style, legends,
                   log2_axis, save, subtitle, variant_color, variant_order)


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
          ls, mk = codec_style(c)
          # half the IQR either side, kept above zero on the log axis
          err = [min(p[2] / 2, 0.9 * p[1]) for p in pts]
          ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=err,
                      ls=ls, marker=mk, ms=4, color=variant_color(v), capsize=2)
    log2_axis(ax.xaxis, TOKENS)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PLAIN)
    ax.set_xlabel("context length (tokens in the cache)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"batch {b}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    legends(ax, variants, codecs, loc="upper left")
  fig.suptitle(f"{what} vs context (median, bars = IQR)  {subtitle(rows)}", fontsize=10)
  return save(fig, out_dir, f"latency_{metric[:-2]}_vs_context")


def _vs_batch(rows, out_dir):
  variants, codecs, _ = _lines(rows)
  ctx = max(r["workload"]["context"] for r in rows)
  sub = [r for r in rows if r["workload"]["context"] == ctx]
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for v in variants:
    for c in codecs:
      pts = sorted((r["workload"]["batch"], r["metrics"]["tokens_per_s"]) for r in sub
                   if r["variant"]["variant"] == v and cache_label(r) == c)
      if pts:
        ls, mk = codec_style(c)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=mk,
                color=variant_color(v))
  log2_axis(ax.xaxis, PLAIN)
  ax.set_yscale("log")
  ax.yaxis.set_major_formatter(PLAIN)
  ax.yaxis.set_minor_formatter(PLAIN)
  ax.set_xlabel("batch size (sequences)")
  ax.set_ylabel("decode throughput (new tokens / s)")
  ax.set_title(f"Decode throughput vs batch at context {ctx}\n{subtitle(rows)}", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  legends(ax, variants, codecs, loc="upper left")
  return save(fig, out_dir, "latency_throughput_vs_batch")


def _bars(rows, out_dir):
  """At the longest context and largest batch: TPOT relative to MHA-bf16, and bytes/token."""
  variants, codecs, _ = _lines(rows)
  ctx = max(r["workload"]["context"] for r in rows)
  b = max(r["workload"]["batch"] for r in rows if r["workload"]["context"] == ctx)
  sub = {(r["variant"]["variant"], cache_label(r)): r["metrics"] for r in rows
         if r["workload"]["context"] == ctx and r["workload"]["batch"] == b
         and r["variant"]["layout"] == "contiguous"} or \
      {(r["variant"]["variant"], cache_label(r)): r["metrics"] for r in rows
       if r["workload"]["context"] == ctx and r["workload"]["batch"] == b}
  ref_key = ("MHA", "bf16") if ("MHA", "bf16") in sub else next(iter(sub))
  ref = sub[ref_key]["tpot_s"]
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(9, 2.6 * len(codecs) + 4), 4.4))
  width = 0.8 / len(variants)
  for i, v in enumerate(variants):
    xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(codecs))]
    rel = [sub[(v, c)]["tpot_s"] / ref if (v, c) in sub else 0 for c in codecs]
    bpt = [sub[(v, c)]["bytes_per_token"] if (v, c) in sub else 0 for c in codecs]
    bars = a1.bar(xs, rel, width, color=variant_color(v), label=v)
    a1.bar_label(bars, labels=[f"{y:.2f}" for y in rel], fontsize=7, padding=1)
    bars = a2.bar(xs, bpt, width, color=variant_color(v), label=v)
    a2.bar_label(bars, labels=[f"{y:.0f}" for y in bpt], fontsize=7, padding=1)
  for ax in (a1, a2):
    ax.set_xticks(range(len(codecs)), codecs)
    ax.set_xlabel("cache codec")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
  a1.axhline(1, color="gray", lw=0.8)
  a1.set_ylabel(f"TPOT / TPOT of {ref_key[0]}-{ref_key[1]} ({ref * 1e3:.3g} ms)")
  a1.set_title("Decode time per token, relative (lower is faster)", fontsize=9)
  a2.set_yscale("log")
  a2.yaxis.set_major_formatter(BYTES)
  a2.set_ylabel("cache bytes per token (all layers, K + V)")
  a2.set_title("Cache bytes per token (lower fits more)", fontsize=9)
  fig.suptitle(f"Variants at context {ctx}, batch {b}  {subtitle(rows)}", fontsize=10)
  return save(fig, out_dir, "latency_variants")
