"""Plot of the `peer` experiment: kvjax vs transformers' caches on the same weights.

One panel per (metric, model vocabulary): bars of TPOT (decode, per token) and TTFT
(prefill + first token) for each peer, grouped by batch, log scale, whiskers = IQR.
Each transformers bar is labelled with its time relative to kvjax measured in the same
run (e.g. "9.1x" = nine times slower than kvjax), the number the protocol trusts on a
shared machine.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvjax.lab.plots.style import PLAIN, SPARSE, save, subtitle

PEER_ORDER = ("kvjax", "kvjax_nnscan", "kvjax_unrolled", "dynamic", "static", "quanto")
PEER_COLORS = {"kvjax": "#1f77b4", "kvjax_nnscan": "#aec7e8", "kvjax_unrolled": "#17becf",
               "dynamic": "#ff7f0e", "static": "#2ca02c", "quanto": "#9467bd"}
PEER_LABELS = {"kvjax": "kvjax (switched layer scan, the default)",
               "kvjax_nnscan": "kvjax (nn.scan over stacked params, the default before)",
               "kvjax_unrolled": "kvjax (layers unrolled, scan_unroll = n_layers)",
               "dynamic": "transformers DynamicCache",
               "static": "transformers StaticCache", "quanto": "transformers QuantizedCache (quanto int4)"}


def _vocab(row: dict) -> int:
  return row.get("config", {}).get("model", {}).get("vocab_size", 0)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  out_dir = Path(out_dir)
  vocabs = sorted({_vocab(r) for r in rows})
  metrics = [("tpot_s", "time per output token (ms)", "tpot_vs_kvjax"),
             ("ttft_s", "time to first token (ms)", "ttft_vs_kvjax")]
  fig, axes = plt.subplots(len(metrics), len(vocabs), figsize=(5.6 * len(vocabs) + 1, 8.6),
                           squeeze=False, layout="constrained")
  for col, vocab in enumerate(vocabs):
    sub = [r for r in rows if _vocab(r) == vocab]
    batches = sorted({r["workload"]["batch"] for r in sub})
    peers = [p for p in PEER_ORDER if any(r["variant"]["peer"] == p for r in sub)]
    width = 0.8 / max(len(peers), 1)
    for row_i, (metric, ylabel, ratio_key) in enumerate(metrics):
      ax = axes[row_i][col]
      for j, peer in enumerate(peers):
        xs, ys, errs, ratios = [], [], [], []
        for i, b in enumerate(batches):
          hit = [r for r in sub if r["variant"]["peer"] == peer and r["workload"]["batch"] == b]
          if not hit:
            continue
          m = hit[0]["metrics"]
          xs.append(i + (j - (len(peers) - 1) / 2) * width)
          ys.append(m[metric] * 1e3)
          errs.append(m.get(metric + "_iqr", 0.0) * 1e3 / 2)
          ratios.append(m.get(ratio_key))
        ax.bar(xs, ys, width, yerr=errs, color=PEER_COLORS[peer], capsize=2,
               label=PEER_LABELS[peer] if row_i == 0 and col == 0 else None)
        if peer != "kvjax":
          for x, y, e, q in zip(xs, ys, errs, ratios):
            if q:
              ax.text(x, (y + e) * 1.04, f"{q:.1f}x", ha="center", va="bottom", fontsize=7)
      ax.set_yscale("log")
      lo, hi = ax.get_ylim()
      ax.set_ylim(lo, hi * 1.3)  # room for the ratio above the tallest bar
      ax.yaxis.set_major_formatter(PLAIN)  # 6 and 0.4, not 6x10^0 and 4x10^-1
      ax.yaxis.set_minor_formatter(SPARSE)
      ax.set_xticks(np.arange(len(batches)), [f"batch {b}" for b in batches])
      ax.set_ylabel(ylabel)
      w = sub[0]["workload"]
      ax.set_title(f"vocab {vocab}, prompt {w['prompt_len']}, {w['gen_len']} new tokens, "
                   f"threads: {w['threads']}", fontsize=9)
      ax.grid(True, axis="y", which="both", alpha=0.3)
  fig.legend(loc="outside lower center", ncol=3 if len(vocabs) > 1 else 2, fontsize=8,
             frameon=False)
  fig.suptitle(f"kvjax vs transformers, same weights (median; labels = time / kvjax's)  "
               f"{subtitle(rows)}", fontsize=10)
  return save(fig, out_dir, "peer_decode_speed")
