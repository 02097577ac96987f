"""Plot of the `compression` experiment.

  compression_dppl_vs_bytes: perplexity of the continuation through the cache over the
    uncompressed fp32 cache's (log scale), against the cache bytes held per token seen,
    one line per method: each eviction policy across its ratios, quantization (codecs
    without eviction), the latent cache across ranks, and eviction + quantization pairs
    as their own points. Lower left is better.
  compression_frontier_MODEL_TEXT: the Pareto front of one model on one text: perplexity
    over the original model's fp32 cache against the bytes held per token as a fraction of
    the same model's bf16 cache, every setting with its 95 % interval, one marker per
    structure (full cache, fewer heads, latent, policy) and a colour per codec family, the
    front (no other setting holds fewer bytes and loses less) drawn as a
    line through its settings, which the x label names. Rows written before intervals and
    `of_bf16` existed draw only the first figure.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvjax.lab.plots.style import (
    FAMILY_COLORS, MARKERS, bytes_per_token, codec_family, human_bytes, model_label, save)


def method(v: dict) -> str:
  codec = v["codec"]
  if v.get("latent_rank"):
    return "latent" if codec == "fp32" else f"latent + {codec}"
  if v.get("conversion"):
    return f"{v['variant']} (converted)" if codec == "fp32" else f"{v['variant']} + {codec}"
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
  paths = save(fig, Path(out_dir), "compression_dppl_vs_bytes")
  framed = [r for r in rows if "of_bf16" in r["metrics"] and r["metrics"].get("dppl_rel_ci95")]
  by: dict[tuple, list] = {}
  for r in framed:
    by.setdefault((r["variant"].get("model", "model"), r["workload"]["data"]), []).append(r)
  for (model, text), rs in sorted(by.items()):
    paths += frontier(rs, out_dir, f"compression_frontier_{_slug(model)}_{_slug(text)}")
  return paths


def _slug(name: str) -> str:
  return "".join(ch if ch.isalnum() else "_" for ch in str(name).removeprefix("gguf:"))


def pareto(rows: list[dict]) -> list[dict]:
  """The rows no other row beats on both bytes (`of_bf16`) and Δppl, fewest bytes first."""
  front, best = [], float("inf")
  for r in sorted(rows, key=lambda r: (r["metrics"]["of_bf16"], r["metrics"]["dppl_rel"])):
    if r["metrics"]["dppl_rel"] < best:
      front.append(r)
      best = r["metrics"]["dppl_rel"]
  return front


def structure(v: dict) -> str:
  """How a frontier setting shrinks the cache apart from its codec: fewer heads, a latent
  (fitted or the weights' SVD), a policy, or none ("full cache")."""
  parts = []
  if v.get("latent_rank"):
    parts.append("latent (fitted)" if v.get("conversion") else "latent (weights' SVD)")
  elif v.get("conversion"):
    parts.append(f"{v['variant']} (converted)")
  if v.get("policy", "full") != "full":
    parts.append(v["policy"])
  return " + ".join(parts) or "full cache"


def frontier(rows: list[dict], out_dir: Path, stem: str) -> list[Path]:
  """Colour by codec family (the house look), marker by structure."""
  shapes = {name: MARKERS[i % len(MARKERS)]
            for i, name in enumerate(sorted({structure(r["variant"]) for r in rows}))}
  groups: dict[tuple, list] = {}
  for r in rows:
    groups.setdefault((structure(r["variant"]), codec_family(r)), []).append(r)
  fig, ax = plt.subplots(figsize=(10, 5.2))
  for (shape, family), rs in sorted(groups.items()):
    xs = [r["metrics"]["of_bf16"] for r in rs]
    ys = [1 + r["metrics"]["dppl_rel"] for r in rs]
    lo = [y - (1 + r["metrics"]["dppl_rel_ci95"][0]) for y, r in zip(ys, rs)]
    hi = [(1 + r["metrics"]["dppl_rel_ci95"][1]) - y for y, r in zip(ys, rs)]
    ax.errorbar(xs, ys, yerr=[lo, hi], marker=shapes[shape], ls="none", capsize=2,
                color=FAMILY_COLORS[family], label=f"{shape}, {family or 'other'}")
  front = pareto(rows)
  ax.plot([r["metrics"]["of_bf16"] for r in front], [1 + r["metrics"]["dppl_rel"] for r in front],
          color="grey", lw=0.9, ls="--", label="Pareto front", zorder=0)
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _p=None: f"{x:g}"))
  names = ", ".join(r["variant"].get("setting", "?") for r in front)
  ax.set_xlabel("cache bytes held per token, as a fraction of the model's bf16 cache\n"
                f"the front, fewest bytes first: {names}")
  ax.set_yscale("log")
  ax.set_ylabel("perplexity / fp32 cache's (95 % interval)")
  ax.axhline(1, color="grey", lw=0.8)
  ax.legend(fontsize=7, title=model_label(rows[0]), title_fontsize=8, loc="upper left",
            bbox_to_anchor=(1.01, 1.0))  # beside the axes: it hides no point
  w = rows[0]["workload"]
  ax.set_title(f"every way to shrink the cache: {w['data']}, context {w['context']}, "
               f"{w['continuation']} tokens scored x {w['batch']} windows", fontsize=9)
  return save(fig, Path(out_dir), stem)
