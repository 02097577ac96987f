"""Plots of the `roofline` experiment: fraction of the memory-bandwidth limit reached by
decode, and TPOT, vs context; one colour per attention variant, one line style per codec
(the scheme of every kvjax plot). One figure per batch size."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from plots import (PLAIN, TOKENS, cache_label, codec_order, codec_style, legends, log2_axis,
                   save, subtitle, variant_color, variant_order)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  paths = []
  for b in sorted({r["workload"]["batch"] for r in rows}):
    paths += _figure([r for r in rows if r["workload"]["batch"] == b], out_dir, b)
  return paths


def _figure(rows, out_dir, batch):
  variants = sorted({r["variant"]["variant"] for r in rows}, key=variant_order)
  codecs = sorted({cache_label(r) for r in rows}, key=codec_order)
  # Rows of several attention reads (the native CPU read and the XLA read) are told apart
  # by opacity: the first read (native before grouped) solid, the others faded.
  attns = sorted({r["variant"].get("attention", "") for r in rows},
                 key=lambda a: (a != "native", a))
  fig, (a_frac, a_tpot) = plt.subplots(1, 2, figsize=(11, 4.4))
  for v in variants:
    for c in codecs:
      for i, att in enumerate(attns):
        pts = sorted((r["workload"]["context"], r["metrics"]["roofline_fraction"],
                      r["metrics"]["tpot_s"] * 1e3) for r in rows
                     if r["variant"]["variant"] == v and cache_label(r) == c
                     and r["variant"].get("attention", "") == att)
        if not pts:
          continue
        ls, mk = codec_style(c)
        x, kw = [p[0] for p in pts], dict(ls=ls, marker=mk, ms=4, color=variant_color(v),
                                          alpha=1.0 if i == 0 else 0.35)
        a_frac.plot(x, [p[1] for p in pts], **kw)
        a_tpot.plot(x, [p[2] for p in pts], **kw)
  bw = sorted(r["metrics"]["bandwidth_Bps"] for r in rows)[len(rows) // 2] / 1e9
  a_frac.axhline(1.0, color="black", lw=0.8, alpha=0.5)
  a_frac.set_ylim(0, max(1.05, max(r["metrics"]["roofline_fraction"] for r in rows) * 1.05))
  a_frac.set_ylabel("roofline fraction (ideal time / step time)")
  a_frac.set_title(f"fraction of the bandwidth limit ({bw:.3g} GB/s measured)", fontsize=9)
  a_tpot.set_yscale("log")
  a_tpot.yaxis.set_major_formatter(PLAIN)
  a_tpot.yaxis.set_minor_formatter(PLAIN)
  a_tpot.set_ylabel("time per output token (ms)")
  a_tpot.set_title("TPOT (decode step)", fontsize=9)
  for ax in (a_frac, a_tpot):
    log2_axis(ax.xaxis, TOKENS)
    ax.set_xlabel("context length (tokens in the cache)")
    ax.grid(True, which="both", alpha=0.3)
  legends(a_tpot, variants, codecs, loc="upper left")
  if len(attns) > 1:
    a_frac.legend(handles=[plt.Line2D([], [], color="gray", alpha=1.0 if i == 0 else 0.35,
                                      lw=2, label=f"attention={a}") for i, a in enumerate(attns)],
                  fontsize=8, loc="upper right")
  fig.suptitle(f"Decode vs the memory-bandwidth roofline, batch {batch}  {subtitle(rows)}",
               fontsize=10)
  return save(fig, out_dir, f"roofline_b{batch}")
