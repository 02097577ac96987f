"""Plot of the `compression` experiment.

  compression_dppl_vs_bytes: perplexity of the continuation through the cache over the
    uncompressed fp32 cache's (log scale), against the cache bytes held per token seen,
    one line per method: each eviction policy across its ratios, quantization (codecs
    without eviction), the latent cache across ranks, and eviction + quantization pairs
    as their own points. Lower left is better.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvjax.plots.style import MARKERS, bytes_per_token, human_bytes, model_label, save


def method(v: dict) -> str:
  codec = v["codec"]
  if v.get("latent_rank"):
    return "latent"
  if v.get("policy", "full") != "full":
    return v["policy"] if codec == "fp32" else f"{v['policy']} + {codec}"
  return "quantization"


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
  rows = [r for r in rows if r["workload"].get("task") == "text"]
  if not rows:
    return []
  groups: dict[str, list] = {}
  for r in rows:
    groups.setdefault(method(r["variant"]), []).append(r)
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  for i, (name, rs) in enumerate(sorted(groups.items())):  # a marker per method
    rs = sorted(rs, key=lambda r: bytes_per_token(r))
    xs = [bytes_per_token(r) for r in rs]
    ys = [r["metrics"]["ppl"] / r["metrics"]["ppl_ref"] for r in rs]
    ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], ls="-" if len(rs) > 1 else "none",
            label=name)
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(plt.FuncFormatter(human_bytes))
  ax.set_xlabel("cache bytes held per token seen")
  ax.set_yscale("log")
  ax.set_ylabel("perplexity / fp32 full cache's")
  ax.axhline(1, color="grey", lw=0.8)
  ax.legend(fontsize=8)
  models = sorted({model_label(r) for r in rows})
  w = rows[0]["workload"]
  ax.set_title(f"compression: eviction, latent and quantization — {', '.join(models)}, "
               f"context {w['context']}, {w['continuation']} tokens scored", fontsize=9)
  return save(fig, Path(out_dir), "compression_dppl_vs_bytes")
