"""Plot of the `compression` experiment.

  compression_dppl_vs_bytes: perplexity of the continuation through the cache over the
    uncompressed fp32 cache's (log scale, plain numbers), with its 95 % interval, against
    the cache bytes held per token seen, one line per method: each eviction policy across
    its ratios, quantization (codecs without eviction), the latent cache across ranks, and
    eviction + quantization pairs as their own points; each setting its own marker and
    legend entry; a panel per text.
    Lower left is better.
  compression_frontier_MODEL_TEXT: the Pareto front of one model on one text: perplexity
    over the original model's fp32 cache against the bytes held per token as a fraction of
    the same model's bf16 cache, every setting with its 95 % interval, its own marker and
    a legend entry naming its structure (full cache, fewer heads, latent, policy), a colour
    per codec family, the front (no other setting holds fewer bytes and loses less) drawn
    as a line through its settings, which the x label names. Rows written before intervals and
    `of_bf16` existed draw only the first figure.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvjax.lab.plots.style import (
    Look, bytes_per_token, cache_label, human_bytes, model_label, plain_log, save)


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
  look = Look(rows)
  texts = sorted({r["workload"].get("data", "text") for r in rows})
  fig, axes = plt.subplots(1, len(texts), figsize=(5 * len(texts) + 4, 5.2), squeeze=False)
  for ax, text in zip(axes[0], texts):
    mine = [r for r in rows if r["workload"].get("data", "text") == text]
    groups: dict[str, list] = {}
    for r in mine:
      groups.setdefault(method(r["variant"]), []).append(r)
    for name, rs in sorted(groups.items()):  # a thin line through each method's points
      rs = sorted(rs, key=lambda r: bytes_per_token(r))
      if len(rs) > 1:
        ax.plot([bytes_per_token(r) for r in rs],
                [r["metrics"]["ppl"] / r["metrics"]["ppl_ref"] for r in rs],
                color="grey", lw=0.7, zorder=0)
    for r in mine:  # each setting its own marker, its codec family's colour, its interval
      _point(ax, look, r, bytes_per_token(r), r["metrics"]["ppl"] / r["metrics"]["ppl_ref"],
             f"{cache_label(r)} ({method(r['variant'])})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_ticks(ax, [bytes_per_token(r) for r in mine], human_bytes)
    ax.set_xlabel("cache bytes held per token seen")
    ax.set_ylabel("perplexity / fp32 full cache's (95 % interval)")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_title(text, fontsize=9)
  _legend(axes[0][-1], [a for row in axes for a in row])
  models = sorted({model_label(r) for r in rows})
  w = rows[0]["workload"]
  fig.suptitle(f"compression: eviction, latent and quantization; {', '.join(models)}; "
               f"context {w['context']}, {w['continuation']} tokens scored", fontsize=9)
  paths = save(fig, Path(out_dir), "compression_dppl_vs_bytes")
  framed = [r for r in rows if "of_bf16" in r["metrics"] and r["metrics"].get("dppl_rel_ci95")]
  by: dict[tuple, list] = {}
  for r in framed:
    by.setdefault((r["variant"].get("model", "model"), r["workload"]["data"]), []).append(r)
  for (model, text), rs in sorted(by.items()):
    paths += frontier(rs, out_dir, f"compression_frontier_{_slug(model)}_{_slug(text)}")
  return paths


def _point(ax, look, r: dict, x: float, y: float, label: str) -> None:
  """One setting: its marker and colour (`Look`), and its Δppl interval when the row has one
  (as a ratio of perplexities: 1 + the interval's ends)."""
  ci = r["metrics"].get("dppl_rel_ci95")
  s = cache_label(r)
  kw = dict(color=look.color(s), ls="none", ms=6, label=label, **look.marker(s))
  if ci:
    ax.errorbar([x], [y], yerr=[[max(y - 1 - ci[0], 0)], [max(1 + ci[1] - y, 0)]],
                capsize=2, **kw)
  else:
    ax.plot([x], [y], **kw)


def _legend(ax, axes=None) -> None:
  """Every setting named once (over `axes`), beside `ax` (it hides no point), in two columns
  when long."""
  seen: dict = {}
  for a in axes or [ax]:
    for h, label in zip(*a.get_legend_handles_labels()):
      seen.setdefault(label, h)
  ax.legend(list(seen.values()), list(seen), fontsize=6.5, loc="upper left",
            bbox_to_anchor=(1.01, 1.0), ncol=2 if len(seen) > 16 else 1)


def _plain_ticks(ax, xs: list[float], fmt) -> None:
  """Plain-number y ticks on the log axis (`plain_log`) and, on a log-2 x axis spanning
  less than three octaves, the data's own extremes and a middle tick so that it reads."""
  plain_log(ax.yaxis)
  ax.xaxis.set_major_formatter(plt.FuncFormatter(fmt))
  lo, hi = min(xs), max(xs)
  if hi < 8 * lo:
    ax.set_xticks(sorted({lo, (lo * hi) ** 0.5, hi}) if hi > lo else [lo])
    ax.xaxis.set_minor_locator(plt.NullLocator())


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
  """Colour by codec family, a marker per setting (the house look, `Look`); each legend
  entry names the setting and its structure."""
  look = Look(rows)
  fig, ax = plt.subplots(figsize=(10 if len(rows) <= 16 else 13, 5.2))  # a legend beside
  for r in rows:
    _point(ax, look, r, r["metrics"]["of_bf16"], 1 + r["metrics"]["dppl_rel"],
           f"{cache_label(r)} ({structure(r['variant'])})")
  front = pareto(rows)
  ax.plot([r["metrics"]["of_bf16"] for r in front], [1 + r["metrics"]["dppl_rel"] for r in front],
          color="grey", lw=0.9, ls="--", label="Pareto front", zorder=0)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  _plain_ticks(ax, [r["metrics"]["of_bf16"] for r in rows], lambda x, _p=None: f"{x:.3g}")
  names = [r["variant"].get("setting", "?") for r in front]
  names = ",\n".join(", ".join(names[i:i + 4]) for i in range(0, len(names), 4))
  ax.set_xlabel("cache bytes held per token, as a fraction of the model's bf16 cache\n"
                f"the front, fewest bytes first: {names}")
  ax.set_ylabel("perplexity / fp32 cache's (95 % interval)")
  ax.axhline(1, color="grey", lw=0.8)
  _legend(ax)
  ax.get_legend().set_title(model_label(rows[0]), prop={"size": 8})
  w = rows[0]["workload"]
  ax.set_title(f"every way to shrink the cache: {w['data']}, context {w['context']}, "
               f"{w['continuation']} tokens scored x {w['batch']} windows", fontsize=9)
  return save(fig, Path(out_dir), stem)
