"""Write the tables of docs/experiments.md from the committed results rows, so a claim in
the docs cannot drift from its rows.

    python scripts/doc_tables.py            # rewrite the generated blocks in place
    python scripts/doc_tables.py --check    # exit 1 if a block differs from its rows

A generated block sits between `<!-- doc_tables:NAME begin -->` and
`<!-- doc_tables:NAME end -->`; everything outside the markers is left alone. Blocks:

  quality   results/quality.jsonl: Δppl and KL per cache setting and model, the models and
            token counts they rest on, and which settings stay within 1 % Δppl.
  real      results/real/quality.jsonl: the real model (SmolLM2-135M) per cache setting,
            ordered by bytes per token, with transformers' quantized cache beside it and
            the best kvjax setting at each bit width against it.
  evict     results/real/evict/long_context.jsonl: passkey and needle accuracy through each
            eviction policy, codec and their combinations, by bytes per token, with the two
            targets (needles at 50 % of the fp32 bytes, the best combination at 12.5 %).
  evict_speed  results/cpu/compression_speed/latency.jsonl: decode step time per policy
            and codec at ~4k tokens, relative to the full fp32 cache.
  paired    results/cpu/roofline_smollm2_paired/roofline.jsonl: every codec's decode step
            against bf16's in the same (batch, context) cells, with its interval and the
            fraction of the binding roof.
  codec_speed  results/cpu/codec_speed/latency.jsonl: every codec's decode step against
            bf16's per read and context at a small MHA shape, with its interval.
  layer_bits  results/real/layer_bits.jsonl: SmolLM2's Δppl with K and V codecs chosen per
            layer (scripts/layer_bits.py), with bits per element and intervals.
  tasks100  results/real/long_context_100/long_context.jsonl: needle accuracy per cache
            setting and context at the calibrated size (100 queries a cell), with Wilson
            intervals, and which settings the intervals tell apart from fp32.
  evict100  results/real/evict_100/long_context.jsonl: the same table for the eviction
            policies at 512 tokens (100 needle queries a cell).
  sinks100  results/real/sinks_100/long_context.jsonl: the same for sinks with 4 and with
            1 kept token, and window, on passkey prompts at 1,024 tokens.
  models    results/real_models/quality.jsonl: the same settings on Gemma 3, Qwen2.5 and
            SmolLM2, on code and prose, and which model loses more to each from the intervals.
  parity    results/cpu/real_parity.jsonl: each real model against transformers
            (scripts/real_parity.py): perplexity, greedy tokens, the MHA twin.
  mla_speed results/cpu/mla_speed_{smollm2,qwen}/roofline.jsonl: the latent served as MLA
            (absorbed) against bf16, MQA and the up-projecting latent (docs/frontier.md).
  convert   results/real_models/convert_smollm2/quality.jsonl: SmolLM2 made an MQA by
            pooling, alignment and fitting (configs/convert_smollm2.yaml).
  shrink    results/real_models/frontier_{smollm2,qwen,gemma3}/compression.jsonl: the frontier
            of every way to shrink the cache (configs/frontier_*.yaml): at 1/2 ... 1/16 of
            bf16's bytes, which setting keeps the lowest Δppl, and whether it is told apart.
  shrink_speed  (docs/frontier.md) the same frontier rows beside each setting's passkey
            accuracy (results/real_models/frontier_passkey/) and decode step at batch 8 x 4k
            against bf16's (results/cpu/frontier_speed_{smollm2,qwen,gemma3}/roofline.jsonl,
            configs/frontier_speed_*.yaml).
  long_prefill  (docs/long_prompts.md) results/cpu/long_prefill.jsonl: a long prompt's
            prefill per model and length (scripts/long_prefill.py): compile and prefill
            time, peak memory against the estimate, keys read per kind of layer, and
            transformers' prefill of the same prompt.
  long_speed  (docs/long_prompts.md) results/cpu/long_speed_{qwen,gemma3}/roofline.jsonl:
            the decode step at 8k-32k tokens per setting against bf16's, with the cache's
            share of the bytes and the binding roof (configs/long_speed_*.yaml).
  position  (docs/long_prompts.md) results/real_models/position/position.jsonl: each
            setting's Δppl and KL per position bucket on one long document per text
            (configs/position.yaml).
  ruler     (docs/long_context.md) results/real_models/ruler_{qwen,gemma3,smollm2}/
            ruler.jsonl: per model and context, each cache and protocol's score per task
            family with Wilson intervals, its bytes against bf16's, and the best setting
            per bytes band (configs/ruler_*.yaml).
  kvpress   (docs/long_context.md) results/real_models/kvpress_peer/peer.jsonl: kvpress's
            presses against kvjax's policies on the same prompts: Jaccard of the kept
            sets, with kvpress's scoring rule on kvjax's keys, and both scores
            (scripts/kvpress_peer.py).
  gpu       (docs/gpu.md) results/gpu/h200/: the last device run (scripts/device_check.sh):
            device and versions, each decode step against the copy bandwidth it probed,
            Gemma's hybrid against its full variant, the distillation step against the
            CPU's, the Pallas read against XLA's, and the GPU test stage.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvjax, whichever is installed
from kvjax import footprint  # noqa: E402  (the one count of cache bytes)
from kvjax.lab import intervals  # noqa: E402
from kvjax.lab.tasks import calibration  # noqa: E402  (the suite's one calibration rule)

DOC = ROOT / "docs" / "experiments.md"
SOURCES = {"quality": ROOT / "results" / "quality.jsonl",
           "real": ROOT / "results" / "real" / "quality.jsonl",
           "evict": ROOT / "results" / "real" / "evict" / "long_context.jsonl",
           "evict_speed": ROOT / "results" / "cpu" / "compression_speed" / "latency.jsonl",
           "paired": ROOT / "results" / "cpu" / "roofline_smollm2_paired" / "roofline.jsonl",
           "paired_intel": ROOT / "results" / "cpu" / "roofline_smollm2_paired_intel" / "roofline.jsonl",
           "codec_speed": ROOT / "results" / "cpu" / "codec_speed" / "latency.jsonl",
           "layer_bits": ROOT / "results" / "real" / "layer_bits.jsonl",
           "frontier": ROOT / "results" / "real" / "quality.jsonl",
           "tasks100": ROOT / "results" / "real" / "long_context_100" / "long_context.jsonl",
           "evict100": ROOT / "results" / "real" / "evict_100" / "long_context.jsonl",
           "sinks100": ROOT / "results" / "real" / "sinks_100" / "long_context.jsonl",
           "models": ROOT / "results" / "real_models" / "quality.jsonl",
           "parity": ROOT / "results" / "cpu" / "real_parity.jsonl",
           "convert": ROOT / "results" / "real_models" / "convert_smollm2" / "quality.jsonl",
           "shrink": tuple(ROOT / "results" / "real_models" / f"frontier_{m}" / "compression.jsonl"
                           for m in ("smollm2", "qwen", "gemma3")),
           "lc_models": tuple(ROOT / "results" / "real" / f / "long_context.jsonl"
                              for f in ("long_context_models", "long_context_gemma3_base"))}
SOURCES["shrink_speed"] = SOURCES["shrink"] + tuple(
    ROOT / "results" / "cpu" / f"frontier_speed_{m}" / "roofline.jsonl"
    for m in ("smollm2", "qwen", "gemma3")) + (
    ROOT / "results" / "real_models" / "frontier_passkey" / "long_context.jsonl",)
GPU = ROOT / "results" / "gpu" / "h200"
SOURCES["gpu"] = tuple(GPU / f"{n}.jsonl" for n in (
    "roofline_llama3_8b", "roofline_smollm2_b8", "roofline_qwen", "roofline_gemma3",
    "distill_speed", "gpu_tests")) + (
    ROOT / "results" / "cpu" / "distill_speed.jsonl",)
DOCS = {"gpu": ROOT / "docs" / "gpu.md",  # every other block lives in DOC
        "shrink_speed": ROOT / "docs" / "frontier.md"}
MODEL_ORDER = ("MHA", "GQA-2", "GQA-4", "GQA-8", "MQA")
LIMIT = 1.0  # the Δppl (%) that the "within" sentence tests


def _rows(path: Path | tuple) -> list[dict]:
  if isinstance(path, tuple):  # a block written from several runs' rows
    return [r for one in path for r in _rows(one)]
  rows = []
  if not path.exists():  # not run yet: its table says so
    return rows
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def _ci_method(rows: list[dict]) -> str:
  """How the rows' quality intervals were drawn (rows before `ci_method` was recorded
  resampled 32-token blocks alone)."""
  return intervals.describe(r.get("metrics", {}).get("ci_method", "blocks") for r in rows)


def _signed(v: float) -> str:
  if v == 0:
    return "0 %"
  text = f"{v:+.3g}" if abs(v) >= 10 else f"{v:+.2g}"
  return text.replace("-", "−") + " %"


def _kl(v: float) -> str:
  if v == 0:
    return "0"
  return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'' if m.group(1) == '+' else '-'}{m.group(2)}",
                f"{v:.2g}")


def _ci(ci, fmt=None) -> str:
  """' [lo, hi]' of a 95 % interval in a table cell ('' for rows written without one)."""
  if not ci:
    return ""
  f = fmt or (lambda v: _signed(v).removesuffix(" %"))
  return " [" + ", ".join(f(v) for v in ci) + "]"


def _pct_ci(m: dict) -> str:
  """A row's Δppl interval in percent, as the Δppl column prints its point."""
  ci = m.get("dppl_rel_ci95")
  return _ci([100 * v for v in ci] if ci else None)


def _wilson_text(right: float, n: int) -> str:
  lo, hi = intervals.wilson(round(right), n)
  return f"[{lo:.2f}, {hi:.2f}]"


def _apart(a: list | None, b: list | None) -> str:
  """How two 95 % intervals relate, for a sentence that compares two numbers."""
  return "separated" if intervals.separated(a, b) else "overlapping: not told apart"


def describe(variant: dict) -> str:
  """What a setting is, from the row: codec(s), key axis, group size, residual window, first
  tokens kept, rotation."""
  k, v = variant["k_codec"], variant["v_codec"]
  parts = [k if k == v else f"K {k} / V {v}"]
  if variant.get("k_axis") == "channel":
    parts.append("channel keys")
  if variant.get("group_size"):
    parts.append(f"groups of {variant['group_size']}")
  if variant.get("residual"):
    parts.append(f"R={variant['residual']}")
  if len(parts) == 1 and k == v and k.startswith(("int", "nf")):
    parts.append("per token, whole head")
  if variant.get("keep_first"):
    parts.append(f"first {variant['keep_first']} kept")
  if variant.get("rotate"):
    parts.append(f"{variant['rotate']} rotation")
  if variant.get("clip"):
    parts.append(f"{variant['clip']} clipping")
  return ", ".join(parts)


def quality_table(rows: list[dict]) -> str:
  text = [r for r in rows if r["experiment"] == "quality" and r["workload"].get("task") == "text"]
  if not text:
    raise SystemExit("doc_tables: no quality text rows; run `kvjax run configs/quality.yaml`")
  models = sorted({r["variant"]["variant"] for r in text},
                  key=lambda m: MODEL_ORDER.index(m) if m in MODEL_ORDER else 99)
  settings = list(dict.fromkeys(r["variant"]["setting"] for r in text))
  cell = {(r["variant"]["setting"], r["variant"]["variant"]): r for r in text}
  head = "| setting | " + " | ".join(f"{m} Δppl | {m} KL" for m in models) + " |"
  lines = [head, "|" + "---|" * (1 + 2 * len(models))]
  for s in settings:
    desc = describe(next(r for r in text if r["variant"]["setting"] == s)["variant"])
    vals = []
    for m in models:
      r = cell.get((s, m))
      vals += [_signed(100 * r["metrics"]["dppl_rel"]) + _pct_ci(r["metrics"]),
               _kl(r["metrics"]["kl"]) + _ci(r["metrics"].get("kl_ci95"), _kl)] if r \
          else ["not run", ""]
    lines.append(f"| `{s}` ({desc}) | " + " | ".join(vals) + " |")
  # what every number rests on
  ckpts = {}
  for r in text:
    ckpts[r["variant"]["variant"]] = (r["variant"].get("model"), r["workload"]["batch"],
                                      r["workload"]["context"], r["workload"].get("chunk"))
  rests = "; ".join(f"{m}: checkpoint `{c[0]}`, {c[1]} × {c[2]} = {c[1] * c[2]} validation "
                    f"tokens fed {c[3]} at a time" for m, c in
                    ((m, ckpts[m]) for m in models))
  within, over, sure = [], [], []
  for s in settings:
    got = [(m, 100 * cell[(s, m)]["metrics"]["dppl_rel"], cell[(s, m)]["metrics"])
           for m in models if (s, m) in cell]
    bad = [(m, v, mt) for m, v, mt in got if v > LIMIT]
    if s == "fp32":
      continue
    if bad:
      over.append(f"`{s}` (" + ", ".join(f"{m} {_signed(v)}{_pct_ci(mt)}" for m, v, mt in bad)
                  + ")")
      above = [m for m, _, mt in bad if mt.get("dppl_rel_ci95")
               and 100 * mt["dppl_rel_ci95"][0] > LIMIT]
      if above:
        sure.append(f"`{s}` ({', '.join(above)})")
    else:
      within.append(f"`{s}`" + ("" if len(got) == len(models) else
                                f" (run on {', '.join(m for m, _, _ in got)} only)"))
  return "\n".join(lines) + (
      f"\n\nRows: `results/quality.jsonl` ({rests}). KL in nats; Δppl = ppl / ppl of the "
      f"fp32 cache − 1; in brackets the 95 % interval ({_ci_method(rows)}, "
      f"`kvjax.lab.intervals`).\n\nWithin {LIMIT:g} % Δppl (point estimate) on every "
      f"model that ran them: " + ", ".join(within) + f". Above {LIMIT:g} % on at least one "
      f"model: " + ", ".join(over) + f". Of those, the whole interval lies above {LIMIT:g} % "
      f"for: " + (", ".join(sure) or "none") + ".")


def _bits(variant: dict) -> int | None:
  """Bits of the K and V codes when both are the same integer width, else None."""
  names = {variant["k_codec"].removeprefix("quanto-"), variant["v_codec"].removeprefix("quanto-")}
  if len(names) == 1 and next(iter(names)).startswith("int"):
    return int(next(iter(names))[3:])
  return None


def _held(r: dict) -> dict:
  """A row's bytes as `kvjax.footprint` counts them: held at its context, the long-context
  limit, bits per element all-in."""
  return footprint.row_bytes(r)


def _bpt(r: dict) -> float:
  return _held(r)["bytes_per_token"]


def real_table(rows: list[dict]) -> str:
  text = [r for r in rows if r["experiment"] == "quality" and r["workload"].get("task") == "text"]
  if not text:
    raise SystemExit("doc_tables: no real-model rows; run "
                     "`kvjax run configs/real_quality.yaml --out results/real`")
  full = max(_bpt(r) for r in text)
  w = text[0]["workload"]
  lines = [f"| setting | what | bytes/token held at {w['context']:,} | bits/element all-in | "
           "bytes/token, long context | of fp32 | Δppl | KL | agreement |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(text, key=lambda r: (-_bpt(r), r["variant"]["setting"])):
    v, m, h = r["variant"], r["metrics"], _held(r)
    what = ("transformers QuantizedCache (quanto), " + f"residual {v.get('residual')}"
            if v.get("peer") else describe(v))
    if v.get("variant") == "MQA":
      what = "GQA-3 → MQA, mean-pooled K/V heads (no uptraining), " + what
    limit = h["bytes_per_token_asymptotic"]
    limit = "—" if limit is None else ("same" if round(limit) == round(h["bytes_per_token"])
                                       else f"{limit:,.0f}")
    lines.append(f"| `{v['setting']}` | {what} | {h['bytes_per_token']:,.0f} | "
                 f"{h['bits_per_element']:.2f} | {limit} | "
                 f"{h['bytes_per_token'] / full:.1%} | {_signed(100 * m['dppl_rel'])}"
                 f"{_pct_ci(m)} | {_kl(m['kl'])}{_ci(m.get('kl_ci95'), _kl)} | "
                 f"{m['agreement']:.3f}{_ci(m.get('agreement_ci95'), '{:.3f}'.format)} |")
  model = text[0]["variant"].get("model")
  out = "\n".join(lines) + (
      f"\n\nRows: `results/real/quality.jsonl`: model `{model}`, {w['batch']} × {w['context']} = "
      f"{w['batch'] * w['context']:,} tokens of `{w['data']}` validation text fed "
      f"{w['chunk']} at a time. Each row's reference is the same model through an fp32 cache "
      "(transformers' unquantized dynamic cache for the transformers rows). Bytes/token held "
      f"is what the cache held after the {w['context']:,} tokens of a window divided by them "
      "(`kvjax.footprint`: the measured cache tree, codes, scales, the full-precision residual "
      "window R and lengths included; for the transformers rows, every tensor its cache "
      "held, its residual window included); bits/element all-in = 8 × that / (30 layers × 2 × "
      "KV heads × 64); the long-context column is what one more token costs once the window "
      "and rounding amortise away (— for quanto, whose layout kvjax does not model).")
  peers = [r for r in text if r["variant"].get("peer")]
  own = [r for r in text if not r["variant"].get("peer") and r["variant"].get("variant") != "MQA"]
  for p in sorted(peers, key=lambda r: -_bits(r["variant"])):
    bits = _bits(p["variant"])
    same = [r for r in own if _bits(r["variant"]) == bits]
    if not same:
      continue
    best = min(same, key=lambda r: abs(r["metrics"]["dppl_rel"]))
    pd, bd = 100 * p["metrics"]["dppl_rel"], 100 * best["metrics"]["dppl_rel"]
    ratio = f"{abs(pd) / abs(bd):.1f}× smaller |Δppl|" if bd else "no Δppl at all"
    pb, bb = _held(p), _held(best)
    more = bb["bytes_per_token"] / pb["bytes_per_token"] - 1
    out += (f"\n\nAt {bits} bits, kvjax's best setting `{best['variant']['setting']}` "
            f"({describe(best['variant'])}) costs {_signed(bd)} holding "
            f"{bb['bytes_per_token']:,.0f} B/token ({bb['bits_per_element']:.2f} bits/element); "
            f"transformers' quanto int{bits} costs {_signed(pd)} holding "
            f"{pb['bytes_per_token']:,.0f} B/token ({pb['bits_per_element']:.2f} bits), both "
            f"windows counted: {ratio} for kvjax, at {abs(more):.0%} "
            f"{'more' if more > 0 else 'fewer'} bytes.")
    pc, bc = p["metrics"].get("dppl_rel_ci95"), best["metrics"].get("dppl_rel_ci95")
    if pc and bc:  # a difference is called one only where the intervals separate
      out += (f" The 95 % intervals of Δppl,{_pct_ci(best['metrics'])} % and"
              f"{_pct_ci(p['metrics'])} %, are {_apart(pc, bc)}.")
    cheaper = [r for r in own if _bpt(r) <= pb["bytes_per_token"]]
    if cheaper:
      c = min(cheaper, key=lambda r: abs(r["metrics"]["dppl_rel"]))
      ch = _held(c)
      out += (f" At no more bytes than quanto int{bits} holds, the best kvjax setting is "
              f"`{c['variant']['setting']}` ({describe(c['variant'])}): "
              f"{_signed(100 * c['metrics']['dppl_rel'])} holding {ch['bytes_per_token']:,.0f} "
              f"B/token ({ch['bits_per_element']:.2f} bits).")
  return out


# The low-bit frontier's targets on the real_quality windows: (bits all-in at most, the
# Δppl aimed for, which settings compete). "rot4": per-token whole-head int4 in a rotated
# basis, the one setting the first target names.
FRONTIER = ((4.5, 0.010, "rot4"), (3.0, 0.05, "any"), (4.5, 0.005, "any"), (5.0, 0.0025, "any"))


def _per_token_rotated_int4(v: dict) -> bool:
  return (v["k_codec"] == v["v_codec"] == "int4" and bool(v.get("rotate"))
          and not v.get("group_size") and not v.get("residual") and not v.get("keep_first")
          and v.get("k_axis", "token") == "token")


def frontier_table(rows: list[dict]) -> str:
  """The best kvjax setting at each bits budget (all-in, held at the rows' context) against
  its target: the point estimate decides "met"; the runner-up is named with whether the
  two intervals are apart, so a "best" that the noise cannot tell from the next is said."""
  text = [r for r in rows if r["experiment"] == "quality" and r["workload"].get("task") == "text"
          and not r["variant"].get("peer") and r["variant"].get("variant") != "MQA"]
  lines = ["| bits/element all-in at most | competing | best setting | what | bits | Δppl | "
           "target | met | runner-up |", "|---|---|---|---|---|---|---|---|---|"]
  for budget, target, which in FRONTIER:
    pool = [r for r in text if round(_held(r)["bits_per_element"], 2) <= budget  # as printed
            and (which == "any" or _per_token_rotated_int4(r["variant"]))]
    pool.sort(key=lambda r: abs(r["metrics"]["dppl_rel"]))
    if not pool:
      continue
    best, m = pool[0], pool[0]["metrics"]
    runner = "—"
    if len(pool) > 1:
      n = pool[1]
      runner = (f"`{n['variant']['setting']}` {_signed(100 * n['metrics']['dppl_rel'])} "
                f"({_apart(m.get('dppl_rel_ci95'), n['metrics'].get('dppl_rel_ci95'))})")
    lines.append(
        f"| {budget:g} | {'per-token int4, rotated' if which == 'rot4' else 'every setting'} | "
        f"`{best['variant']['setting']}` | {describe(best['variant'])} | "
        f"{_held(best)['bits_per_element']:.2f} | {_signed(100 * m['dppl_rel'])}{_pct_ci(m)} | "
        f"≤ {_signed(100 * target)} | {'yes' if m['dppl_rel'] <= target else '**no**'} | "
        f"{runner} |")
  return "\n".join(lines) + (
      "\n\nRows: `results/real/quality.jsonl` (the table above), kvjax's own settings; bits "
      "all-in as in that table (held at the windows' length: windows, scales and first tokens "
      "counted). Δppl with its paired-bootstrap 95 % interval; *met* is the point estimate "
      "against the target; the runner-up is the next-best setting in the same budget, and "
      "whether its Δppl interval and the best's are apart.")


def _ratio_text(r: float) -> str:
  return {0.5: "half", 0.25: "a quarter", 0.125: "an eighth", 0.75: "three quarters",
          0.875: "seven eighths"}.get(r, f"{r:g}")


def describe_evict(v: dict, of: str = "the prefix") -> str:
  """A long_context setting: policy (its ratio of the prefix, sinks/window), codec, heads."""
  parts = []
  pol = v.get("policy") or "full"
  if pol != "full":
    extra = {"sinks": f", {v.get('sinks')} sinks", "snapkv": f", window {v.get('window')}",
             "h2o": f", recent {v.get('window')}"}.get(pol, "")
    keep = f"{_ratio_text(v['ratio'])} of {of}" if v.get("ratio") else \
        f"{v.get('budget')} tokens"
    parts.append(f"{pol}, {keep}{extra}")
  if v.get("variant") == "MQA":
    parts.append("GQA-3 → MQA, mean-pooled K/V heads (no uptraining)")
  codec = v["k_codec"] if v["k_codec"] == v["v_codec"] else f"K {v['k_codec']} / V {v['v_codec']}"
  if codec != "fp32" or not parts:
    parts.append(codec if pol != "full" else f"{codec}, every token")
  return "; ".join(parts)


def _frac(right: float, n: int) -> str:
  return f"{right:g}/{n}"


def _evict_cells(rows: list[dict]) -> tuple[list[str], list[int], dict, dict]:
  """(settings, contexts, (setting, context, task) -> [right, n], setting -> summary)."""
  settings = list(dict.fromkeys(r["variant"]["setting"] for r in rows))
  contexts = sorted({r["workload"]["context"] for r in rows})
  cell: dict = {}
  info: dict = {}
  for r in rows:
    s = r["variant"]["setting"]
    for key in ((s, r["workload"]["context"], r["workload"]["task"]),
                (s, r["workload"]["context"], "*"), (s, "*", r["workload"]["task"]),
                (s, "*", "*")):
      c = cell.setdefault(key, [0.0, 0])
      c[0] += r["metrics"]["accuracy"]
      c[1] += 1
    i = info.setdefault(s, {"variant": r["variant"], "bpt": []})
    i["bpt"].append(_bpt(r))
  for i in info.values():
    i["bpt"] = sum(i["bpt"]) / len(i["bpt"])
  return settings, contexts, cell, info


def _first_number(text: str):
  m = re.search(r"\d+", text)
  return m.group(0) if m else None


def _same_as_fp32(rows: list[dict]) -> dict[str, list[bool]]:
  """Per setting, for each of its queries: whether its first number written equals the fp32
  cache's on the same query (context, task, depth, key, seed)."""
  qkey = lambda r: (r["workload"]["context"], r["workload"]["task"], r["workload"]["depth"],  # noqa: E731
                    r["workload"].get("key"), r["workload"].get("seed"))
  ref = {qkey(r): _first_number(r["metrics"]["output"]) for r in rows
         if r["variant"]["setting"] == "fp32"}
  same: dict = {}
  for r in rows:
    same.setdefault(r["variant"]["setting"], []).append(
        _first_number(r["metrics"]["output"]) == ref.get(qkey(r)))
  return same


def evict_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["experiment"] == "long_context"]
  if not rows:
    raise SystemExit("doc_tables: no eviction rows; run `kvjax run "
                     "configs/long_context_evict.yaml --out results/real/evict`")
  settings, contexts, cell, info = _evict_cells(rows)
  tasks = sorted({r["workload"]["task"] for r in rows}, key=lambda t: t != "passkey")
  full = info["fp32"]["bpt"]
  same = _same_as_fp32(rows)
  order = sorted(settings, key=lambda s: (-round(info[s]["bpt"]), settings.index(s)))
  head = ("| setting | what | bytes/token | of fp32 | " + " | ".join(
      f"{n // 1024}k" for n in contexts) + " | " + " | ".join(tasks) +
      " | all | all, 95 % interval | same as fp32 |")
  lines = [head, "|" + "---|" * (7 + len(contexts) + len(tasks))]
  for s in order:
    i = info[s]
    vals = [_frac(*cell[(s, n, "*")]) for n in contexts] + \
        [_frac(*cell[(s, "*", t)]) for t in tasks] + [_frac(*cell[(s, "*", "*")]),
                                                      _wilson_text(*cell[(s, "*", "*")])]
    lines.append(f"| `{s}` | {describe_evict(i['variant'])} | {i['bpt']:,.0f} | "
                 f"{i['bpt'] / full:.1%} | " + " | ".join(vals) +
                 f" | {sum(same[s])}/{len(same[s])} |")
  w = rows[0]["workload"]
  depths = sorted({r["workload"]["depth"] for r in rows})
  per = cell[("fp32", contexts[0], "*")][1]
  out = "\n".join(lines) + (
      f"\n\nRows: `results/real/evict/long_context.jsonl`, model "
      f"`{rows[0]['variant'].get('model')}`, {w['template']} template, {w['gen_len']} answer "
      f"tokens decoded greedily. Per context and setting {per} queries: passkey at depths "
      f"{', '.join(f'{d:g}' for d in depths)} (one prompt each) and one needle prompt with "
      f"{len(depths)} needles at those depths, each asked. bytes/token: the bytes the cache "
      "holds for the prefix per prefix token (`kvjax.footprint`: the kept tokens' codes and "
      "scales, a policy's per-token state and the cache's counters, averaged over the "
      "prompts); the question and answer tokens are not counted. "
      "\"same as fp32\": queries whose first number written equals the fp32 cache's; the "
      "interval is Wilson's 95 % interval of the accuracy over every query of the setting.")
  # the targets
  niah = "niah" if "niah" in tasks else tasks[-1]

  def acc(s, task="*"):
    right, n = cell[(s, "*", task)]
    return right / n

  def pick(cands):
    return max(cands, key=lambda s: (acc(s, niah), acc(s), info[s]["bpt"]))

  half = [s for s in settings if s != "fp32" and info[s]["bpt"] <= 0.51 * full]
  if half:
    best = pick([s for s in half if (info[s]["variant"].get("policy") or "full") != "full"]
                or half)
    ok = all(cell[(best, n, niah)][0] == cell[("fp32", n, niah)][0] for n in contexts)
    ci_best, ci_ref = (intervals.wilson(round(cell[(x, "*", niah)][0]), cell[(x, "*", niah)][1])
                       for x in (best, "fp32"))
    key = (acc(best, niah), acc(best))
    ties = [s for s in half if s != best and (acc(s, niah), acc(s)) == key
            and (info[s]["variant"].get("policy") or "full") != "full"]
    tied = f", tied with {', '.join(f'`{s}`' for s in ties)}" if ties else ""
    out += (f"\n\n**At 50 % of the fp32 bytes** (51 % or less: a ratio's budget rounds up), "
            f"the eviction setting with the most needles (then the most queries) "
            f"is `{best}` ({describe_evict(info[best]['variant'])}, "
            f"{info[best]['bpt'] / full:.1%}{tied}): needles " + ", ".join(
                f"{_frac(*cell[(best, n, niah)])} at {n // 1024}k" for n in contexts)
            + " against the full fp32 cache's " + ", ".join(
                f"{_frac(*cell[('fp32', n, niah)])}" for n in contexts)
            + (". It keeps the needle accuracy of the full cache" if ok else
               ". It does not keep the needle accuracy of the full cache"
               if intervals.separated(ci_best, ci_ref) else
               ". Its needle count differs from the full cache's, but the Wilson 95 % "
               f"intervals over both contexts overlap ({_wilson_text(*cell[(best, '*', niah)])}"
               f" against {_wilson_text(*cell[('fp32', '*', niah)])}): no difference is shown"))
    hits = {s: sorted((r["workload"]["context"], r["workload"]["depth"]) for r in rows
                      if r["variant"]["setting"] == s and r["workload"]["task"] == niah
                      and r["metrics"]["accuracy"]) for s in ("fp32", best)}
    where = "; ".join(f"{n // 1024}k: " + (", ".join(f"{d:g}" for c, d in hits[best] if c == n)
                                           or "none") for n in contexts)
    out += (f", on {'the same' if hits[best] == hits['fp32'] else 'other'} needles "
            f"(depths right: {where}).")
    q = [s for s in half if (info[s]["variant"].get("policy") or "full") == "full"]
    if q:
      bq = pick(q)
      out += (f" Without eviction, `{bq}` ({info[bq]['bpt'] / full:.1%} of the bytes) finds "
              + ", ".join(f"{_frac(*cell[(bq, n, niah)])}" for n in contexts) + " needles.")
  eighth = [s for s in settings if info[s]["bpt"] <= 0.13 * full]
  combo = [s for s in eighth if (info[s]["variant"].get("policy") or "full") != "full"
           and info[s]["variant"]["k_codec"] != "fp32"]
  if combo:
    best = max(combo, key=lambda s: (acc(s), acc(s, niah), info[s]["bpt"]))
    out += (f"\n\n**At 12.5 % of the fp32 bytes** (13 % or less), the best combination of "
            f"eviction and quantization is `{best}` ({describe_evict(info[best]['variant'])}, "
            f"{info[best]['bpt'] / full:.1%}): {_frac(*cell[(best, '*', '*')])} queries right "
            f"({', '.join(f'{_frac(*cell[(best, n, chr(42))])} at {n // 1024}k' for n in contexts)}"
            f"; Wilson 95 % {_wilson_text(*cell[(best, '*', '*')])}), against "
            f"{_frac(*cell[('fp32', '*', '*')])} for the full fp32 cache "
            f"({_wilson_text(*cell[('fp32', '*', '*')])}, "
            + _apart(intervals.wilson(round(cell[(best, '*', '*')][0]), cell[(best, '*', '*')][1]),
                     intervals.wilson(round(cell[('fp32', '*', '*')][0]),
                                      cell[('fp32', '*', '*')][1])) + ")"
            + "".join(f" and {_frac(*cell[(q, '*', '*')])} for `{q}` alone "
                      f"({info[q]['bpt'] / full:.1%} of the bytes)" for q in settings
                      if (info[q]["variant"].get("policy") or "full") == "full"
                      and info[q]["variant"].get("variant") != "MQA"
                      and 0.13 * full < info[q]["bpt"] <= 0.15 * full) + ". "
            "Every setting at 13 % or less: " + ", ".join(
                f"`{s}` {_frac(*cell[(s, '*', '*')])}" for s in
                sorted(eighth, key=lambda s: -info[s]["bpt"])) + ".")
  return out


def _reference(rows: list[dict]) -> dict:
  """The first row timed against itself: a ratio of exactly 1 (the median of x / x) and,
  where the rows carry one, the interval [1, 1]."""
  return next(r for r in rows if r["metrics"]["tpot_vs_ref"] == 1.0
              and r["metrics"].get("tpot_vs_ref_ci95", [1.0, 1.0]) == [1.0, 1.0])


def evict_speed_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["experiment"] == "latency" and "tpot_vs_ref" in r["metrics"]]
  if not rows:
    raise SystemExit("doc_tables: no step-time rows; run `kvjax run "
                     "configs/compression_speed.yaml --out results/cpu/compression_speed`")
  ref = _reference(rows)
  lines = ["| variant | what | cache bytes | decode step | vs fp32 | interquartile range | "
           "prefill (one run) |", "|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: -r["metrics"]["cache_bytes"]):
    v, m = r["variant"], r["metrics"]
    lines.append(f"| `{v['setting']}` | {describe_evict(v, 'the prompt')} | "
                 f"{m['cache_bytes'] / 2**20:,.1f} MiB | {1e3 * m['tpot_s']:.1f} ms | "
                 f"{m['tpot_vs_ref']:.2f}×{_ci(m.get('tpot_vs_ref_ci95'), '{:.2f}'.format)} | "
                 f"{1e3 * m['tpot_s_iqr']:.1f} ms | "
                 f"{m['ttft_s']:.1f} s |")
  w, env = ref["workload"], ref["env"]
  out = "\n".join(lines) + (
      f"\n\nRows: `results/cpu/compression_speed/latency.jsonl`. SmolLM2-135M's shape "
      f"({ref['config']['model']['n_layers']} layers, GQA-3, fp32 weights, random values), "
      f"batch {w['batch']}, a {w['prompt_len']:,}-token prompt, {w['decode_steps']} decode "
      f"steps per repeat, medians of {ref['metrics']['repeats']} repeats timed round-robin "
      f"over the variants in one process; `vs fp32` is the median of the per-repeat ratios, "
      f"with a bootstrap 95 % interval over the repeats where the rows have one. "
      f"{env['cpu_count']} CPU cores ({env['backend']}); the host's state when they were "
      f"written: {_notes('results/cpu/compression_speed/latency.jsonl')}.")
  return out


def paired_table(rows: list[dict],
                 path: str = "results/cpu/roofline_smollm2_paired/roofline.jsonl") -> str:
  """One line per setting, one column per (batch, context) cell: step time, the median of the
  per-repeat ratios to the reference's step with its interval, and the fraction of the
  binding roof (b: bytes bind, f: FLOPs bind). `path` is the rows' file, as the doc names it."""
  rows = [r for r in rows if r["experiment"] == "roofline" and "tpot_vs_ref" in r["metrics"]]
  if not rows:
    raise SystemExit("doc_tables: no paired roofline rows; run `kvjax run "
                     "configs/roofline_smollm2_paired.yaml --out results/cpu/roofline_smollm2_paired`")
  cells = sorted({(r["workload"]["batch"], r["workload"]["context"]) for r in rows})
  by = {(r["variant"]["setting"], r["workload"]["batch"], r["workload"]["context"]): r
        for r in rows}
  ref = _reference(rows)["variant"]["setting"]
  settings = sorted({r["variant"]["setting"] for r in rows}, key=lambda s: (s != ref, s))
  last = cells[-1]
  lines = [f"| setting | bits/elt at {last[1] // 1024}k | "
           + " | ".join(f"batch {b} × {c // 1024}k" for b, c in cells) + " |",
           "|---|---|" + "---|" * len(cells)]
  for s in settings:
    out = []
    for b, c in cells:
      r = by.get((s, b, c))
      if r is None:
        out.append("not run")
        continue
      m = r["metrics"]
      out.append(f"{1e3 * m['tpot_s']:.1f} ms, {m['tpot_vs_ref']:.2f}×"
                 f"{_ci(m.get('tpot_vs_ref_ci95'), '{:.2f}'.format)} "
                 f"({m['roof_fraction']:.2f} {m['bound'][0]})")
    bits = by.get((s, *last), {}).get("metrics", {}).get("bits_per_element")
    lines.append(f"| {s} | {'' if bits is None else f'{bits:.1f}'} | " + " | ".join(out) + " |")
  env = rows[0]["env"]
  bw = [r["metrics"]["bandwidth_Bps"] / 1e9 for r in rows]
  return "\n".join(lines) + (
      f"\n\nRows: `{path}`, {rows[0]['metrics']['repeats']} repeats per cell, "
      f"ratios to `{ref}`. {env['cpu_count']} CPU cores"
      f"{' of ' + env['cpu_model'] if env.get('cpu_model') else ''}: bandwidth probe "
      f"{min(bw):.1f}–{max(bw):.1f} GB/s; the host's state when they were written: "
      f"{_notes(path)}.")


def _notes(path: str) -> str:
  """The NOTES.md beside a rows file, which holds what a doc does not: the commit the rows
  were written at, the host's load, the run's story (docs/*.md name neither)."""
  parts = Path(path).parts
  return f"`{'/'.join(parts[:2])}/NOTES.md`" if len(parts) > 2 else "`results/NOTES.md`"


_READS = {"native": "native", "grouped": "grouped (XLA)"}


def codec_speed_table(rows: list[dict]) -> str:
  """One line per (read, context), one column per setting but the reference: the median of
  the per-repeat ratios to the reference's step, with its interval; the reference's own
  step time and binding roof in the last two columns."""
  rows = [r for r in rows if r["experiment"] == "latency" and "tpot_vs_ref" in r["metrics"]]
  if not rows:
    raise SystemExit("doc_tables: no codec step-time rows; run `kvjax run "
                     "configs/codec_speed.yaml --out results/cpu/codec_speed`")
  ref = _reference(rows)["variant"]["setting"]
  settings = list(dict.fromkeys(r["variant"]["setting"] for r in rows if
                                r["variant"]["setting"] != ref))
  keys = list(dict.fromkeys((r["variant"]["attention"], r["workload"]["context"]) for r in rows))
  keys.sort(key=lambda k: (list(_READS).index(k[0]) if k[0] in _READS else len(_READS), k[1]))
  by = {(r["variant"]["attention"], r["workload"]["context"], r["variant"]["setting"]): r
        for r in rows}
  ctx = lambda c: f"{c // 1024}k" if c % 1024 == 0 else f"{c}"  # noqa: E731
  lines = ["| read, context | " + " | ".join(settings) + f" | {ref} step | {ref} bound |",
           "|---|" + "---|" * (len(settings) + 2)]
  for a, c in keys:
    cells = []
    for s in settings:
      r = by.get((a, c, s))
      cells.append("not run" if r is None else f"{r['metrics']['tpot_vs_ref']:.2f}"
                   f"{_ci(r['metrics'].get('tpot_vs_ref_ci95'), '{:.2f}'.format)}")
    m = by[(a, c, ref)]["metrics"]
    lines.append(f"| {_READS.get(a, a)}, {ctx(c)} | " + " | ".join(cells) +
                 f" | {1e3 * m['tpot_s']:.2f} ms | {m.get('bound', '?')} |")
  env = rows[0]["env"]
  path = "results/cpu/codec_speed/latency.jsonl"
  return "\n".join(lines) + (
      f"\n\nRows: `{path}`, "
      f"{rows[0]['metrics']['repeats']} repeats per cell; each cell is the median of the "
      f"per-repeat ratios to `{ref}`, in brackets its bootstrap 95 % interval. "
      f"{env['cpu_count']} CPU cores; the host's state when they were written: {_notes(path)}.")


def _layers(text: str) -> str:
  a, _, b = text.partition("-")
  return f"layer {a}" if not b or a == b else f"layers {a}–{b}"


def describe_layer_bits(v: dict) -> str:
  kind, _, arg = v["setting"].partition(":")
  base = f"{v['base']}" + (" (rotated)" if v.get("rotate", "none") != "none" else "")
  return {"all4": f"{base} on every layer, K and V",
          "k4": f"{base} keys only, values float32",
          "v4": f"{base} values only, keys float32",
          "only": f"{base} on {_layers(arg)} only, float32 elsewhere",
          "k8": f"all4, keys of {_layers(arg)} in int8",
          "kv8": f"all4, keys and values of {_layers(arg)} in int8"}.get(kind, v["setting"])


def layer_bits_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["experiment"] == "layer_bits"]
  if not rows:
    raise SystemExit("doc_tables: no layer_bits rows; run the commands of "
                     "results/real/layer_bits.jsonl in results/MANIFEST.yaml")
  lines = ["| setting | what | bits/elt | Δppl |", "|---|---|---|---|"]
  for r in rows:
    m = r["metrics"]
    lines.append(f"| {r['variant']['setting']} | {describe_layer_bits(r['variant'])} | "
                 f"{m['bits_per_element']:.2f} | {_signed(100 * m['dppl_rel'])}{_pct_ci(m)} |")
  w = rows[0]["workload"]
  return "\n".join(lines) + (
      f"\n\nRows: `results/real/layer_bits.jsonl`, {w['model']}, {w['seqs']} × "
      f"{w['tokens']:,} {w['text']} tokens fed {w['chunk']} per step; Δppl = ppl / ppl of the "
      f"fp32 cache − 1, in brackets its paired-bootstrap 95 % interval.")


def _what(r: dict) -> str:
  """A task row's cache in words: its codec (channel keys, group, residual window) and its
  policy with the kept fraction."""
  v, c = r["variant"], r["config"]["cache"]
  codec = v["k_codec"] if v["k_codec"] == v["v_codec"] else \
      f"K {v['k_codec']} / V {v['v_codec']}"
  if v.get("k_axis") == "channel":
    codec += f", channel keys, g{v.get('group_size')}"
  codec += f", R={v['residual']}" if v.get("residual") else ""
  if c.get("policy", "full") == "full":
    return codec
  knob = {"sinks": f", {c['sinks']} sink{'s' * (c['sinks'] != 1)}",
          "snapkv": f", window {c['window']}", "h2o": f", window {c['window']}"}
  return f"{codec}, {c['policy']} keeping {c['ratio']:.0%}{knob.get(c['policy'], '')}"


def _queries(rows: list[dict], per: int) -> str:
  """The queries of a cell in words: the task(s), their facts and depths."""
  tasks = sorted({r["workload"]["task"] for r in rows})
  depths = sorted({r["workload"]["depth"] for r in rows})
  at = ", ".join(f"{d:g}" for d in depths)
  if tasks == ["niah"]:
    return (f"{per} queries per context and setting: needle prompts with {len(depths)} needles "
            f"(depths {at}), each asked, the other its distractor")
  if tasks == ["passkey"]:
    return f"{per} queries per context and setting: passkey prompts at depths {at}"
  return f"{per} queries per context and setting: {', '.join(tasks)} at depths {at}"


def calibrated_table(rows: list[dict], path: str, config: str) -> str:
  """Accuracy per setting and context at 100 queries a cell, with Wilson intervals, bytes
  held, agreement with fp32's first number, and which settings the intervals tell apart
  from the fp32 cache's."""
  rows = [r for r in rows if r["experiment"] == "long_context"]
  if not rows:
    raise SystemExit(f"doc_tables: no rows in {path}; run `kvjax run {config} --out "
                     f"{path.rsplit('/', 1)[0]}`")
  settings, contexts, cell, info = _evict_cells(rows)
  same = _same_as_fp32(rows)
  order = sorted(settings, key=lambda s: (-round(info[s]["bpt"]), settings.index(s)))
  bpt: dict = {}  # (setting, context) -> bytes held per prefix token, averaged over prompts
  first: dict = {}
  for r in rows:
    bpt.setdefault((r["variant"]["setting"], r["workload"]["context"]), []).append(_bpt(r))
    first.setdefault(r["variant"]["setting"], r)

  lines = ["| setting | what | bytes/token at " + " / ".join(f"{n:,}" for n in contexts) + " | "
           + " | ".join(f"{n:,} tokens: right, 95 % interval" for n in contexts)
           + " | same first number as fp32 |",
           "|" + "---|" * (4 + len(contexts))]
  for s in order:
    vals = [f"{_frac(*cell[(s, n, '*')])} {_wilson_text(*cell[(s, n, '*')])}" for n in contexts]
    held_ = " / ".join(f"{sum(bpt[(s, n)]) / len(bpt[(s, n)]):,.0f}" for n in contexts)
    lines.append(f"| `{s}` | {_what(first[s])} | {held_} | "
                 + " | ".join(vals) + f" | {sum(same[s])}/{len(same[s])} |")
  apart = []
  for n in contexts:
    ref_ci = intervals.wilson(round(cell[("fp32", n, "*")][0]), cell[("fp32", n, "*")][1])
    for s in order:
      if s != "fp32" and intervals.separated(
          intervals.wilson(round(cell[(s, n, "*")][0]), cell[(s, n, "*")][1]), ref_ci):
        apart.append(f"`{s}` at {n:,}")
  w = rows[0]["workload"]
  per = cell[("fp32", contexts[0], "*")][1]
  out = "\n".join(lines) + (
      f"\n\nRows: `{path}`, model `{rows[0]['variant'].get('model')}`, {w['template']} "
      f"template, {w['gen_len']} answer tokens decoded greedily; {_queries(rows, per)}. "
      "bytes/token: what the cache holds for the prefix per prefix token at each context "
      "(`kvjax.footprint`, a residual window's float32 tokens included), as in the eviction table. ")
  out += ("Intervals apart from the fp32 cache's at the same context: " + ", ".join(apart) + "."
          if apart else "No setting's interval is apart from the fp32 cache's at any context: "
          "at this size no setting's difference from fp32 is told apart.")
  return out


def tasks100_table(rows: list[dict]) -> str:
  return calibrated_table(rows, "results/real/long_context_100/long_context.jsonl",
                          "configs/long_context_100.yaml")


def evict100_table(rows: list[dict]) -> str:
  return calibrated_table(rows, "results/real/evict_100/long_context.jsonl",
                          "configs/long_context_evict_100.yaml")


def sinks100_table(rows: list[dict]) -> str:
  return calibrated_table(rows, "results/real/sinks_100/long_context.jsonl",
                          "configs/long_context_sinks_100.yaml")


MODELS = (("gemma3-270m", "Gemma 3 (MQA)"), ("qwen2.5-coder-0.5b", "Qwen2.5 (GQA-2)"),
          ("smollm2-135m", "SmolLM2 (GQA-3)"))
TEXTS = (("stdlib", "code"), ("shakespeare", "prose"))


def models_table(rows: list[dict]) -> str:
  """One line per setting: Δppl with its interval per model and text, then which model
  loses more to the same setting where the intervals tell them apart."""
  rows = [r for r in rows if r.get("workload", {}).get("task") == "text"]
  if not rows:
    return "(no rows yet: `kvjax run configs/real_quality_models.yaml --out results/real_models`)"
  cell = {(r["variant"]["setting"], r["variant"].get("model"), r["workload"].get("data")): r
          for r in rows}
  settings = list(dict.fromkeys(r["variant"]["setting"] for r in rows))
  head = ["setting", "bits / element"] + [f"{m} {t}" for _, m in MODELS for _, t in TEXTS]
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  verdicts = []
  for s in settings:
    any_row = next(r for k, r in cell.items() if k[0] == s)
    bits = sorted({f"{r['metrics']['bits_per_element']:.2f}" for k, r in cell.items() if k[0] == s})
    line = [f"{s}: {describe(any_row['variant'])}", " / ".join(bits)]
    for name, _ in MODELS:
      for text, _ in TEXTS:
        r = cell.get((s, name, text))
        line.append("—" if r is None else
                    _signed(100 * r["metrics"]["dppl_rel"]) + _pct_ci(r["metrics"]))
    out.append("| " + " | ".join(line) + " |")
    for text, what in TEXTS:
      got = [(label, cell[(s, name, text)]["metrics"]) for name, label in MODELS
             if (s, name, text) in cell]
      if len(got) < 2:
        continue
      worst = max(got, key=lambda g: g[1]["dppl_rel"])
      apart = [label for label, m in got if label != worst[0]
               and intervals.separated(m.get("dppl_rel_ci95"), worst[1].get("dppl_rel_ci95"))]
      verdicts.append(f"- {s}, {what}: {worst[0]} loses most ("
                      f"{_signed(100 * worst[1]['dppl_rel'])}); its interval is apart from "
                      + (", ".join(apart) if apart else "no other model's: not told apart")
                      + (" and overlaps the rest" if apart and len(apart) < len(got) - 1 else ""))
  n = {(r["workload"].get("batch"), r["workload"].get("context")) for r in rows}
  windows = ", ".join(f"{b} x {c:,}" for b, c in sorted(n))
  return "\n".join(out) + (f"\n\nEach cell: Δppl against the same model's fp32 cache on the "
                           f"same tokens ({windows} tokens per text), 95 % paired-bootstrap "
                           "interval. Which model loses more, from the intervals:\n\n"
                           + "\n".join(verdicts))


def parity_table(rows: list[dict]) -> str:
  """scripts/real_parity.py: each real model against transformers' GGUF load."""
  out = ["| model | heads | perplexity through kvjax's cache | transformers | relative gap | "
         "greedy tokens | MHA twin's logits |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    greedy = f"equal, 3 prompts x {r['greedy_tokens']}" if r["greedy_ok"] else "DIFFER"
    out.append(f"| {r['model']} | {r['variant']} | {r['ppl']:.4f} | {r['ppl_transformers']:.4f} "
               f"| {r['ppl_rel_diff']:.1e} | {greedy} | {r['mha_twin_rel_err']:.1e} of the "
               "largest |")
  if rows:
    r = rows[0]
    out.append(f"\nPerplexity on {r['seqs']} x {r['tokens']:,} stdlib tokens, {r['chunk']} "
               "tokens a step through kvjax's fp32 cache, against transformers' teacher-forced "
               "loss (targets: gap < 1e-3, greedy tokens equal, twin < 1e-5).")
  return "\n".join(out)


CONVERSIONS = {"mqa_pool": "mean-pooled K/V heads (no calibration)",
               "mqa_align": "aligned (exact rotations and orthogonal maps), then pooled",
               "mqa_fit": "aligned, pooled, each layer's q/k/v fitted",
               "mqa_fit_mix": "the same, fitted on code and prose (half each)",
               "mqa_distill": "`mqa_fit_mix` distilled end to end on the original's "
                              "next-token distributions (KL, attention projections only)"}


def _times(r: float) -> str:
  return f"{r:,.0f}" if r >= 100 else f"{r:.1f}" if r >= 10 else f"{r:.2f}"


def convert_table(rows: list[dict]) -> str:
  """configs/convert_smollm2.yaml: one line per conversion, the perplexity ratio to the
  original model (1 + Δppl) with its interval on code and on prose."""
  rows = [r for r in rows if r.get("workload", {}).get("task") == "text"]
  if not rows:
    return ("(no rows yet: `kvjax run configs/convert_smollm2.yaml --out "
            "results/real_models/convert_smollm2`)")
  cell = {(r["variant"]["setting"], r["workload"].get("data")): r for r in rows}
  settings = list(dict.fromkeys(r["variant"]["setting"] for r in rows))
  out = ["| conversion | KV heads | bytes/token held | code: ppl ratio [95 %] | "
         "prose: ppl ratio [95 %] | recipe |", "|---|---|---|---|---|---|"]
  for s in settings:
    any_row = next(r for k, r in cell.items() if k[0] == s)
    line = [f"`{s}`: {CONVERSIONS.get(s, s)}", str(any_row["variant"]["kv_heads"]),
            f"{any_row['metrics']['bytes_per_token']:,.0f}"]
    for text, _ in TEXTS:
      r = cell.get((s, text))
      if r is None:
        line.append("—")
        continue
      m = r["metrics"]
      lo, hi = m["dppl_rel_ci95"]
      line.append(f"{_times(m['ppl'] / m['ppl_ref'])}× [{_times(1 + lo)}, {_times(1 + hi)}] "
                  f"(ppl {m['ppl']:,.1f} vs {m['ppl_ref']:.2f})")
    line.append(any_row["variant"].get("recipe", "") or "—")
    out.append("| " + " | ".join(line) + " |")
  n = {(r["workload"].get("batch"), r["workload"].get("context")) for r in rows}
  windows = ", ".join(f"{b} x {c:,}" for b, c in sorted(n))
  return "\n".join(out) + (f"\n\nEach ratio: the converted model's perplexity over the "
                           f"original's (fp32 cache both) on the same held-out tokens "
                           f"({windows} per text), with the 95 % paired-bootstrap interval.")


SHRINK_BUDGETS = (0.5, 0.25, 0.125, 0.0625)  # of the model's bf16 cache bytes per token


def _what_shrinks(r: dict) -> str:
  """A frontier setting in words: the structure (converted heads, latent, policy) and codec
  (key axis, groups and window from the row's cache config where its variant lacks them)."""
  cache = r.get("config", {}).get("cache", {})
  v = {**{k: cache[k] for k in ("k_axis", "group_size", "residual") if k in cache},
       **r["variant"]}
  parts = []
  if v.get("conversion"):
    parts.append(f"{v['variant']} ({v['conversion']})" if not v.get("latent_rank")
                 else f"latent rank {v['latent_rank']} ({v['conversion']})")
  elif v.get("latent_rank"):
    parts.append(f"latent rank {v['latent_rank']} (weights SVD)")
  if v.get("policy", "full") != "full":
    parts.append(f"{v['policy']} keeping {_ratio_text(v['ratio'])} of the context")
  parts.append(describe(v))
  return "; ".join(parts)


def shrink_table(rows: list[dict]) -> str:
  """Per model and text: at each fraction of bf16's bytes, the setting with the lowest Δppl,
  and whether the runner-up's interval is apart from the winner's."""
  rows = [r for r in rows if "of_bf16" in r["metrics"] and r["metrics"].get("dppl_rel_ci95")]
  out = ["| model | text | at most of bf16's bytes | winner | what | of bf16 | Δppl | KL | "
         "runner-up | apart? |", "|---|---|---|---|---|---|---|---|---|---|"]
  by: dict = {}
  for r in rows:
    by.setdefault((r["variant"].get("model", "?"), r["workload"]["data"]), []).append(r)
  for (model, text), rs in sorted(by.items()):
    for budget in SHRINK_BUDGETS:
      pool = sorted((r for r in rs if r["metrics"]["of_bf16"] <= budget),
                    key=lambda r: r["metrics"]["dppl_rel"])
      if not pool:
        out.append(f"| {model} | {text} | {budget:g} | none this small | | | | | | |")
        continue
      w, m = pool[0], pool[0]["metrics"]
      runner, apart = "—", "—"
      if len(pool) > 1:
        n = pool[1]["metrics"]
        runner = f"`{pool[1]['variant']['setting']}` {_signed(100 * n['dppl_rel'])}{_pct_ci(n)}"
        apart = "yes" if intervals.separated(m["dppl_rel_ci95"], n["dppl_rel_ci95"]) else \
            "**no**: overlapping"
      out.append(f"| {model} | {text} | {budget:g} | `{w['variant']['setting']}` | "
                 f"{_what_shrinks(w)} | {m['of_bf16']:.3f} | "
                 f"{_signed(100 * m['dppl_rel'])}{_pct_ci(m)} | {_kl(m['kl'])} | {runner} | "
                 f"{apart} |")
  shapes = sorted({(r["workload"]["batch"], r["workload"]["context"],
                    r["workload"]["continuation"]) for r in rows})
  how = ", ".join(f"{b} windows of {c:,} tokens of context then {n} scored"
                  for b, c, n in shapes)
  return "\n".join(out) + (
      f"\n\nEach setting read {how}, per text. *of bf16*: the cache bytes held per token "
      "seen, over the same model's bf16 cache at the same length (a policy compacts the "
      "context once, so the scored tokens are all kept). Δppl against the original model's "
      "fp32 cache with its paired-bootstrap 95 % interval; *apart* says whether the winner's "
      "and the runner-up's intervals separate.")


def _cache_key(r: dict, who: str) -> tuple:
  """A row's model (or converted checkpoint) and cache setting, whatever the setting's name."""
  c = r.get("config", {}).get("cache", {})
  return (who, *(str(c.get(k)) for k in ("k_codec", "v_codec", "k_axis", "group_size",
                                           "residual", "rotate", "clip", "policy", "ratio")))


def shrink_speed_table(rows: list[dict]) -> str:
  """Per model, each frontier setting's bytes and Δppl on both texts beside its decode step
  time at batch 8 x 4k against bf16's (configs/frontier_speed_*.yaml, interleaved)."""
  quality = [r for r in rows if r["experiment"] == "compression" and "of_bf16" in r["metrics"]]
  # a speed config frontier_speed_X times the settings of the frontier config frontier_X
  speed = {(r["config"]["name"].replace("frontier_speed_", "frontier_"),
            r["variant"]["setting"]): r for r in rows if r["experiment"] == "roofline"}
  passkey: dict = {}
  for r in rows:
    if r["experiment"] == "long_context":
      tally = passkey.setdefault(_cache_key(r, r["variant"]["model"]), [0, 0])
      tally[0] += r["metrics"]["accuracy"]
      tally[1] += 1
  out = ["| model | setting | of bf16 | Δppl code | Δppl prose | passkey at 1k | decode step "
         "vs bf16 | step | held tokens | roof fraction |", "|---|---|---|---|---|---|---|---|---|---|"]
  cells: dict = {}
  for r in quality:
    key = (r["variant"].get("model", "?"), r["config"]["name"], r["variant"]["setting"])
    cells.setdefault(key, {})[r["workload"]["data"]] = r
  order = lambda kv: (kv[0][0], -next(iter(kv[1].values()))["metrics"]["of_bf16"], kv[0][2])  # noqa: E731
  for (model, name, setting), by_text in sorted(cells.items(), key=order):
    any_row = next(iter(by_text.values()))
    dppl = []
    for text in ("stdlib", "shakespeare"):
      m = by_text.get(text, {}).get("metrics")
      dppl.append(f"{_signed(100 * m['dppl_rel'])}{_pct_ci(m)}" if m else "—")
    conv = any_row["config"].get("params", {}).get("converted")
    pk = passkey.get(_cache_key(any_row, Path(conv).name if conv else model))
    dppl.append(f"{_frac(*pk)} {_wilson_text(*pk)}" if pk else "—")
    t = speed.get((name, setting))
    if t is None:
      timed = ["not timed", "", "", ""]
    else:
      m, w = t["metrics"], t["workload"]
      ratio = "1 (reference)" if setting == "bf16" else \
          f"{m['tpot_vs_ref']:.2f}×{_ci(m.get('tpot_vs_ref_ci95'), lambda v: f'{v:.2f}')}"
      frac = m.get("roof_fraction")
      timed = [ratio, f"{1e3 * m['tpot_s']:.1f} ms", f"{w.get('held', w['context']):,}",
               f"{frac:.2f} ({m.get('bound', '?')})" if frac is not None and frac <= 1 else
               "—"]
    out.append(f"| {model} | `{setting}` | {any_row['metrics']['of_bf16']:.3f} | "
               + " | ".join(dppl + timed) + " |")
  shapes = sorted({(r["workload"]["batch"], r["workload"]["context"]) for r in speed.values()})
  how = ", ".join(f"batch {b} x {c:,} tokens of context" for b, c in shapes) or "not yet run"
  hosts = sorted({f"{r['env']['cpu_count']} CPU cores"
                  + (f" of {r['env']['cpu_model']}" if r["env"].get("cpu_model") else "")
                  for r in speed.values() if r.get("env")})
  how += f" on {' and '.join(hosts)}" if hosts else ""
  return "\n".join(out) + (
      "\n\nQuality: the frontier rows above (Δppl against the fp32 cache, 95 % paired-"
      "bootstrap interval). Passkey: right of 10 (5 depths x 2 seeds, 1,024-token prompts in "
      "the model's chat template) with the Wilson 95 % interval "
      "(results/real_models/frontier_passkey; — where the setting was not asked). "
      f"Speed: {how}, every setting of one model timed in turn in each "
      "repeat from a cache filled by length (random weights of the setting's shape), the "
      "ratio to bf16's step the median of per-repeat ratios with its 95 % bootstrap interval; "
      "a policy is timed as the cache it leaves (*held tokens*). *roof fraction*: the "
      "binding roof's time over the measured step (— where a probe read above 1).")


def lc_models_table(rows: list[dict]) -> str:
  """Retrieval per model (a line) and cache setting (a column), each prompt in the model's
  own chat template: right answers in all with the Wilson interval, per task, the bytes
  held per prefix token, and '*' where the interval is apart from the model's fp32 one."""
  rows = [r for r in rows if r["experiment"] == "long_context"]
  path = "results/real/long_context_models/long_context.jsonl"
  if not rows:
    raise SystemExit(f"doc_tables: no rows in {path}; run `kvjax run "
                     "configs/long_context_models.yaml --out results/real/long_context_models`")
  cell: dict = {}
  for r in rows:
    v = r["variant"]
    # a prompt other than the model's own chat template names its line
    model = v["model"] if r["workload"]["template"] == "model" else \
        f"{v['model']} ({r['workload']['template']} prompt)"
    c = cell.setdefault((model, v["setting"]), {"r": r, "bpt": [], "all": [0, 0]})
    c["bpt"].append(_bpt(r))
    for tally in (c.setdefault(r["workload"]["task"], [0, 0]), c["all"]):
      tally[0] += r["metrics"]["accuracy"]
      tally[1] += 1
  tasks = sorted({r["workload"]["task"] for r in rows})
  settings = list(dict.fromkeys(r["variant"]["setting"] for r in rows))
  lines = ["| model | variant | " + " | ".join(f"`{s}`" for s in settings) + " |",
           "|" + "---|" * (2 + len(settings))]
  for model in sorted({m for m, _ in cell}):
    ref = cell.get((model, "fp32"))
    ref_ci = intervals.wilson(round(ref["all"][0]), ref["all"][1]) if ref else None
    vals = []
    for s in settings:
      c = cell.get((model, s))
      if c is None:
        vals.append("not run")
        continue
      ci = intervals.wilson(round(c["all"][0]), c["all"][1])
      star = "*" if s != "fp32" and ref_ci and intervals.separated(ci, ref_ci) else ""
      vals.append(f"{_frac(*c['all'])}{star} {_wilson_text(*c['all'])} ("
                  + ", ".join(f"{t} {_frac(*c[t])}" for t in tasks if t in c)
                  + f"; {sum(c['bpt']) / len(c['bpt']):,.0f} B)")
    variant = next(c["r"]["variant"]["variant"] for (m, _), c in cell.items() if m == model)
    lines.append(f"| {model} | {variant} | "
                 + " | ".join(vals) + " |")
  w = rows[0]["workload"]
  return "\n".join(lines) + (
      f"\n\nRows: `{path}`, {w['context']:,}-token prompts in each model's own chat template "
      f"(`{w['template']}`), and `results/real/long_context_gemma3_base/long_context.jsonl`: "
      "Gemma 3 270M, a base model, prompted as one (`base`: no turns, no instructions); "
      f"{w['gen_len']} answer tokens decoded greedily. Each cell: right "
      "in all with the Wilson 95 % interval (* where it is apart from the same model's fp32 "
      "cache's), right per task, and the bytes the cache holds per prefix token "
      "(`kvjax.footprint`).")


BUILDERS = {"quality": quality_table, "real": real_table, "evict": evict_table,
            "evict_speed": evict_speed_table, "paired": paired_table,
            "paired_intel": lambda rows: paired_table(
                rows, "results/cpu/roofline_smollm2_paired_intel/roofline.jsonl"),
            "codec_speed": codec_speed_table, "layer_bits": layer_bits_table,
            "tasks100": tasks100_table, "evict100": evict100_table,
            "sinks100": sinks100_table, "frontier": frontier_table, "models": models_table,
            "parity": parity_table, "convert": convert_table, "shrink": shrink_table,
            "lc_models": lc_models_table, "shrink_speed": shrink_speed_table}


def gpu_table(rows: list[dict]) -> str:
  """docs/gpu.md's run: versions, the decode steps, the hybrid, distill, Pallas, tests."""
  roof = [r for r in rows if r.get("experiment") == "roofline"]
  env = roof[0]["env"]
  out = [f"Device: {env['device_kind']} x {env['device_count']}, JAX {env['jax']} / jaxlib "
         f"{env['jaxlib']} ({env['platform_version']}), Python {env['python']}, "
         f"{env['cpu_count']} host cores; rows of {env['time'][:10]}.", "",
         "**Decode step, batch 8 x 8,184 tokens held, bf16 weights, random weights** "
         "(`roofline`; median of 5 repeats x 7 steps, IQR; copy = the streaming copy "
         "bandwidth probed before each repeat):", "",
         "| model | cache | step (ms) | IQR | weights GB | cache GB | cache share | "
         "of copy bandwidth | step / bf16's |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  names = {"GQA-8": "Llama-3-8B shape", "GQA-3": "SmolLM2-135M", "GQA-2": "Qwen2.5-Coder-0.5B"}
  plain = [r for r in roof if not r["variant"].get("setting")]
  for r in plain:
    m, v = r["metrics"], r["variant"]
    ref = next(x for x in plain if x["variant"]["variant"] == v["variant"]
               and x["variant"]["codec"] == "bf16")["metrics"]["tpot_s"]
    out.append(f"| {names.get(v['variant'], v['variant'])} | {v['codec']} | "
               f"{m['tpot_s'] * 1e3:.2f} | {m['tpot_s_iqr'] * 1e3:.2f} | "
               f"{m['weight_bytes'] / 1e9:.2f} | {m['kv_bytes'] / 1e9:.2f} | "
               f"{m['kv_bytes'] / m['step_bytes']:.0%} | {m['copy_fraction']:.2f} | "
               f"{m['tpot_s'] / ref:.2f} |")
  hyb = [r for r in roof if r["variant"].get("setting") == "hybrid"]
  if hyb:
    out += ["", "**Gemma 3 270M's hybrid cache against its full variant** (same cells, "
            "interleaved per repeat; ratio of steps with its 95 % interval):", "",
            "| cache | full step (ms) | hybrid step (ms) | hybrid / full | its bytes / full's |",
            "|---|---:|---:|---:|---:|"]
    for r in hyb:
      full = next(x for x in roof if x["variant"].get("setting") == "full"
                  and x["variant"]["codec"] == r["variant"]["codec"])
      m, f = r["metrics"], full["metrics"]
      lo, hi = m["tpot_vs_ref_ci95"]
      out.append(f"| {r['variant']['codec']} | {f['tpot_s'] * 1e3:.2f} | {m['tpot_s'] * 1e3:.2f} | "
                 f"{m['tpot_vs_ref']:.3f} [{lo:.3f}, {hi:.3f}] | "
                 f"{m['step_bytes'] / f['step_bytes']:.2f} |")
  dist = {r["platform"]: r for r in rows if r.get("bench") == "distill_speed"}
  if {"gpu", "cpu"} <= set(dist):
    g, c = dist["gpu"], dist["cpu"]
    out += ["", f"**One distillation step** (`scripts/bench_distill.py`, {g['shape']}, "
            f"GQA-{g['teacher_kv_heads'] // g['kv_heads']} teacher, MQA student, batch "
            f"{g['batch']} x {g['seq_len']}): GPU {g['tokens_per_s']:,.0f} tokens/s "
            f"[{g['tokens_per_s_ci'][0]:,.0f}, {g['tokens_per_s_ci'][1]:,.0f}], this "
            f"repository's {c['environment']['cpu_count']}-core CPU host "
            f"{c['tokens_per_s']:,.0f} [{c['tokens_per_s_ci'][0]:,.0f}, "
            f"{c['tokens_per_s_ci'][1]:,.0f}]: {g['tokens_per_s'] / c['tokens_per_s']:,.0f}x."]
  pal = _rows(GPU / "pallas.jsonl")
  if pal:
    out += ["", "**One layer's decode read** (`scripts/bench_pallas.py`, Llama-3-8B heads, "
            "median µs; the Pallas kernel at its default knobs):", "",
            "| cache | batch | context | XLA grouped | Pallas | JAX paged | Pallas / XLA |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    cells = sorted({(r["codec"], r["batch"], r["context"]) for r in pal},
                   key=lambda c: (["bf16", "int8", "int4"].index(c[0]) if c[0] in
                                  ("bf16", "int8", "int4") else 9, c[1], c[2]))
    for c in cells:
      t = {r["impl"]: r["median_s"] * 1e6 for r in pal if (r["codec"], r["batch"], r["context"]) == c}
      if "grouped" not in t or "pallas" not in t:
        continue
      out.append(f"| {c[0]} | {c[1]} | {c[2]:,} | {t['grouped']:.0f} | {t['pallas']:.0f} | "
                 + (f"{t['jax_paged']:.0f}" if "jax_paged" in t else "-")
                 + f" | {t['pallas'] / t['grouped']:.2f} |")
  sweep = _rows(GPU / "pallas_sweep.jsonl")
  if sweep:
    out += ["", "**The Pallas kernel's knobs** (`configs/accel/pallas_sweep.yaml`): best "
            "setting per cell against XLA's read:", ""]
    for c in sorted({(r["codec"], r["batch"], r["context"]) for r in sweep}):
      rs = [r for r in sweep if (r["codec"], r["batch"], r["context"]) == c]
      xla = [r for r in pal + rs if r["impl"] == "grouped" and (r["codec"], r["batch"],
                                                                 r["context"]) == c]
      ker = [r for r in rs if r["impl"] == "pallas"]
      if len(ker) < 2:
        continue
      best = min(ker, key=lambda r: r["median_s"])
      knobs = ", ".join(f"{k}={v}" for k, v in best["settings"].items())
      line = (f"- {c[0]}, batch {c[1]}, {c[2]:,} tokens: {len(ker)} settings, best "
              f"{best['median_s'] * 1e6:.0f} µs ({knobs})")
      if xla:
        g = min(r["median_s"] for r in xla)
        line += f"; XLA {g * 1e6:.0f} µs, best / XLA {best['median_s'] / g:.2f}"
      out.append(line + ".")
  tests = [r for r in rows if r.get("bench") == "gpu_tests"]
  for t in tests:
    out += ["", f"**GPU tests** ({', '.join(t['files'])}; "
            + ", ".join(f"{k}={v}" for k, v in t["env"].items()) + f"): {t['passed']} passed, "
            f"{len(t['failed'])} failed in {t['seconds']:.0f} s"
            + (": " + ", ".join(f"`{n.split('::')[-1]}`" for n in t["failed"]) if t["failed"]
               else "") + "."]
  return "\n".join(out)


BUILDERS["gpu"] = gpu_table


def _chunk(row: dict) -> int:
  """The `workload.prefill_chunk` a long_prefill row ran with (0: the whole prompt)."""
  for o in row.get("overrides") or []:
    key, _, val = o.partition("=")
    if key == "workload.prefill_chunk":
      return int(val)
  return 0


def long_prefill_table(rows: list[dict]) -> str:
  """docs/long_prompts.md: each long prompt's prefill (scripts/long_prefill.py), its memory
  against the estimate, the keys each kind of layer reads, and transformers beside it."""
  rows = [r for r in rows if r.get("bench") == "long_prefill"]
  names = {"gguf:gemma3-270m": "Gemma 3 270M", "gguf:qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B",
           "gguf:smollm2-135m": "SmolLM2-135M"}
  gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
  out = ["| model | tokens | chunk | compile (s) | prefill (s) | tokens/s | GFLOP/s | of XLA's "
         "matmul | prefill peak RSS (GiB) | estimate (GiB) | of which temporaries (GiB) | peak / "
         "estimate | load peak (GiB) | full layers: keys read / needed | windowed layers: keys "
         "read / needed |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in sorted(rows, key=lambda r: (r["model"], _chunk(r), r["tokens"])):
    reads = r["reads"]
    ratio = {k: f"{v['keys_read'] / v['keys_needed']:.2f}x" if v["keys_read"] else "—"
             for k, v in reads.items()}
    out.append(f"| {names.get(r['model'], r['model'])} | {r['tokens']:,} | "
               f"{f'{_chunk(r):,}' if _chunk(r) else '—'} | {r['compile_s']:.1f} | "
               f"{r['prefill_s']:.1f} | {r['tokens_per_s']:.0f} | {r['flops_per_s'] / 1e9:.0f} | "
               f"{r['flops_roof_fraction']:.2f} | "
               f"{gib(r['prefill_peak_rss_bytes'])} | {gib(r['prefill_estimate_bytes'])} | "
               f"{gib(r['estimate_parts']['temporaries'])} | "
               f"{r['prefill_peak_over_estimate']:.2f} | {gib(r['load_peak_rss_bytes'])} | "
               f"{ratio['full']} | {ratio.get('windowed', '—')} |")
  peers = [r for r in rows if "speedup_vs_torch" in r]
  if peers:
    out += ["", "| model | tokens | chunk | kvjax prefill (s) | transformers prefill (s) | "
            "kvjax's speed / transformers' | 95 % interval | threads | same first token |",
            "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in peers:
      lo, hi = r["speedup_vs_torch_ci"]
      out.append(f"| {names.get(r['model'], r['model'])} | {r['tokens']:,} | "
                 f"{f'{_chunk(r):,}' if _chunk(r) else '—'} | "
                 f"{r['prefill_s']:.1f} | {r['torch_prefill_s']:.1f} | "
                 f"{r['speedup_vs_torch']:.2f}x | [{lo:.2f}, {hi:.2f}] | {r['torch_threads']} | "
                 f"{'yes' if r['torch_first_token'] == r['first_token'] else 'no'} |")
  return "\n".join(out)


def position_table(rows: list[dict]) -> str:
  """docs/long_prompts.md: each setting's Δppl and KL per position bucket, per model and
  text (configs/position.yaml), with intervals; the cells not yet run said so."""
  rows = [r for r in rows if r.get("workload", {}).get("task") == "text_by_position"]
  if not rows:
    return "No rows yet: `kvjax run configs/position.yaml --out results/real_models/position`."
  kilo = lambda n: f"{n // 1024}k" if n and n % 1024 == 0 else str(n)  # noqa: E731
  out = []
  for model in sorted({r["variant"]["model"] for r in rows}):
    for text in sorted({r["workload"]["data"] for r in rows if r["variant"]["model"] == model}):
      here = [r for r in rows if r["variant"]["model"] == model and r["workload"]["data"] == text]
      buckets = sorted({tuple(r["workload"]["bucket"]) for r in here})
      context = max(r["workload"]["context"] for r in here)
      compacted = any(r["workload"].get("protocol", "").startswith("compacted") for r in here)
      how = ("; each policy compacts the prefix before each bucket, then keeps the bucket"
             if compacted else "")
      out += [f"**{model}, {text}** (the first {context:,} tokens{how}; Δppl against the "
              "fp32 cache with its 95 % interval, then KL in nats):", "",
              "| setting | " + " | ".join(f"{kilo(a)}–{kilo(b)}" for a, b in buckets) + " |",
              "|---|" + "---:|" * len(buckets)]
      for s in sorted({r["variant"]["setting"] for r in here}):
        by = {tuple(r["workload"]["bucket"]): r["metrics"] for r in here
              if r["variant"]["setting"] == s}
        cells = [f"{_signed(100 * by[b]['dppl_rel'])}{_pct_ci(by[b])}, {_kl(by[b]['kl'])}"
                 if b in by else "not run" for b in buckets]
        out.append(f"| `{s}` | " + " | ".join(cells) + " |")
      out.append("")
  return "\n".join(out).rstrip()


def long_speed_table(rows: list[dict]) -> str:
  """docs/long_prompts.md: the decode step at 8k-32k tokens (configs/long_speed_*.yaml):
  bf16's step, its cache's share of the bytes, its binding roof, and every other setting's
  step against it with the interval."""
  rows = [r for r in rows if r.get("experiment") == "roofline"]
  if not rows:
    return "Not run yet: `kvjax run configs/long_speed_qwen.yaml --out results/cpu/long_speed_qwen`."
  names = {"long_speed_qwen": "Qwen2.5-Coder-0.5B", "long_speed_gemma3": "Gemma 3 270M"}
  out = []
  for cfg_name in sorted({r["config"]["name"] for r in rows}):
    mine = [r for r in rows if r["config"]["name"] == cfg_name]
    others = sorted({r["variant"]["setting"] for r in mine} - {"bf16"})
    out += [f"**{names.get(cfg_name, cfg_name)}** (bf16 weights; each setting's step over "
            "bf16's in the same repeats, 95 % interval):", "",
            "| batch x context | bf16 step (ms) | cache share of its bytes | binding roof | "
            "roof fraction | " + " | ".join(f"`{o}`" for o in others) + " |",
            "|---|---:|---:|---|---:|" + "---:|" * len(others)]
    shapes = sorted({(r["workload"]["batch"], r["workload"]["context"]) for r in mine})
    for b, c in shapes:
      here = {r["variant"]["setting"]: r["metrics"] for r in mine
              if (r["workload"]["batch"], r["workload"]["context"]) == (b, c)}
      ref = here.get("bf16")
      if ref is None:
        continue
      frac = ref.get("roof_fraction")
      cells = [f"{here[o]['tpot_vs_ref']:.2f}×{_ci(here[o].get('tpot_vs_ref_ci95'), lambda v: f'{v:.2f}')}"
               if o in here else "—" for o in others]
      out.append(f"| {b} x {c:,} | {1e3 * ref['tpot_s']:.1f} | {ref['kv_fraction']:.2f} | "
                 f"{ref['bound']} | {f'{frac:.2f}' if frac is not None and frac <= 1 else '—'} | "
                 + " | ".join(cells) + " |")
    out.append("")
  return "\n".join(out).rstrip()


SOURCES["long_speed"] = tuple(p for p in (ROOT / "results" / "cpu" / f"long_speed_{m}" /
                                         "roofline.jsonl" for m in ("qwen", "gemma3"))
                              if p.exists())  # a model not yet run: its table says so
DOCS["long_speed"] = ROOT / "docs" / "long_prompts.md"
BUILDERS["long_speed"] = long_speed_table
SOURCES["position"] = ROOT / "results" / "real_models" / "position" / "position.jsonl"
DOCS["position"] = ROOT / "docs" / "long_prompts.md"
BUILDERS["position"] = position_table
SOURCES["position_policy"] = ROOT / "results" / "real_models" / "position_policy" / \
    "position.jsonl"
DOCS["position_policy"] = ROOT / "docs" / "long_prompts.md"
BUILDERS["position_policy"] = lambda rows: position_table(rows) if rows else (
    "No rows yet: `kvjax run configs/position_policy.yaml --out "
    "results/real_models/position_policy`.")


def coverage_table(rows: list[dict]) -> str:
  """docs/methods.md: per model, text, codec, windows per set and deal, the share of sets
  whose 95 % interval holds the pooled estimate, Δppl / KL, per interval method
  (scripts/interval_coverage.py)."""
  rows = [r for r in rows if r.get("experiment") == "interval_coverage"]
  if not rows:
    return ("Not run yet: `python scripts/interval_coverage.py --model gguf:smollm2-135m "
            "--text stdlib --out results/real_models/interval_coverage.jsonl`.")
  methods = list(dict.fromkeys(r["variant"]["method"] for r in rows))
  out = ["| model | text | codec | windows a set | deal | sets | " + " | ".join(
      f"`{m}`" for m in methods) + " |", "|---|---|---|---:|---|---:|" + "---:|" * len(methods)]
  keys = sorted({(r["variant"]["model"], r["workload"]["data"], r["variant"]["codec"],
                  r["workload"]["windows"], r["variant"]["assign"]) for r in rows},
                key=lambda k: (k[0], k[1], k[2] != "int8", k[3], k[4]))
  for k in keys:
    here = {r["variant"]["method"]: r["metrics"] for r in rows
            if (r["variant"]["model"], r["workload"]["data"], r["variant"]["codec"],
                r["workload"]["windows"], r["variant"]["assign"]) == k}
    m0 = next(iter(here.values()))
    sets = m0["sets"] * m0.get("deals", 1)
    cells = [f"{here[m]['dppl_rel_coverage']:.2f} / {here[m]['kl_coverage']:.2f}"
             if m in here else "—" for m in methods]
    out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {sets} | " + " | ".join(cells)
               + " |")
  return "\n".join(out)


SOURCES["coverage"] = ROOT / "results" / "real_models" / "interval_coverage.jsonl"
DOCS["coverage"] = ROOT / "docs" / "methods.md"
BUILDERS["coverage"] = coverage_table
SOURCES["long_prefill"] = ROOT / "results" / "cpu" / "long_prefill.jsonl"
DOCS["long_prefill"] = ROOT / "docs" / "long_prompts.md"
BUILDERS["long_prefill"] = long_prefill_table


_BYTES_BANDS = ((0.3, "at most 0.3 of bf16's bytes"), (0.6, "0.3 to 0.6"), (1.01, "0.6 to 1"))


def _share_cell(scores: list[float]) -> str:
  t = intervals.shares(scores)
  return f"{t['score']:.2f}{_ci(t['score_ci95'], lambda v: f'{v:.2f}')} ({t['n']})"


def _ruler_ranking(ranked: list, fam: str) -> list[str]:
  """Per bytes band: the best setting's score, and the settings whose intervals overlap it."""
  out = []
  for hi_frac, band in _BYTES_BANDS:
    lo_frac = max([0.0] + [h for h, _ in _BYTES_BANDS if h < hi_frac])
    inb = [x for x in ranked if lo_frac < x[0] <= hi_frac]
    if not inb:
      continue
    best = max(inb, key=lambda x: x[3]["score"])
    ties = [x for x in inb if x is not best and not intervals.separated(
        x[3]["score_ci95"], best[3]["score_ci95"])]
    tie = (f"; its interval overlaps {', '.join(f'`{x[1]}` ({x[2]})' for x in ties)}"
           if ties else "; the only setting in this band" if len(inb) == 1
           else "; apart from every other setting here")
    out.append(f"- {fam}, {band}: `{best[1]}` ({best[2]}) scores {best[3]['score']:.2f}{tie}.")
  return out


def ruler_table(rows: list[dict]) -> str:
  """docs/long_context.md: per model and context, each cache and protocol's score per task
  family (Wilson 95 % intervals over questions, n in brackets) and its bytes per prompt
  token against a bf16 cache's. A family is scored over the tasks whose fp32 cache scores
  at least 0.8 (`calibration.family_rows`); the others are listed as beyond the model, and a
  family with none is not ranked. Per calibrated family and bytes band: the best score, or
  the settings whose intervals overlap it."""
  rows = [r for r in rows if r.get("experiment") == "ruler"]
  if not rows:
    return "No rows yet: `kvjax run configs/ruler_qwen.yaml --out results/real_models/ruler_qwen`."
  out = []
  for model in sorted({r["variant"]["model"] for r in rows}):
    for n in sorted({r["workload"]["context"] for r in rows if r["variant"]["model"] == model}):
      here = [r for r in rows if r["variant"]["model"] == model and r["workload"]["context"] == n]
      cal = calibration.calibration(here)
      fams = list(dict.fromkeys(r["workload"]["family"] for r in here))
      used, ok, head = {}, {}, {}
      for f in fams:
        mine = [r for r in here if r["workload"]["family"] == f]
        used[f], ok[f] = calibration.family_rows(mine, cal)
        k, m = (len({r["workload"]["task"] for r in x}) for x in (used[f], mine))
        head[f] = (f"{f} ({k} of {m} tasks)" if ok[f] and k < m
                   else f"{f} (beyond the model)" if ok[f] is False else f)
      prompts = len({(r["workload"]["task"], r["workload"]["sample"]) for r in here})
      bf16 = 0.5 * np.mean([r["metrics"]["bytes_per_token"] for r in here
                            if r["variant"]["setting"] == "fp32"])
      tasks = sorted({r["workload"]["task"] for r in here})
      out += [f"**{model} at {n:,} tokens** ({prompts} prompts of {len(tasks)} tasks; score "
              "per family over the tasks its fp32 cache answers (at least 0.8), with the "
              "95 % interval and the questions asked):", "",
              "| cache | protocol | bytes / bf16's | " + " | ".join(head[f] for f in fams)
              + " |", "|---|---|---:|" + "---:|" * len(fams)]
      keys = sorted({(r["variant"]["setting"], r["variant"].get("protocol", "blind"))
                     for r in here}, key=lambda k: (k[0] != "fp32", k))
      ranked: dict = {f: [] for f in fams}
      for s, p in keys:
        mine = [r for r in here if (r["variant"]["setting"], r["variant"].get("protocol",
                                                                             "blind")) == (s, p)]
        frac = np.mean([r["metrics"]["bytes_per_token"] for r in mine]) / bf16
        cells = []
        for f in fams:
          sc = [r["metrics"]["score"] for r in used[f] if (r["variant"]["setting"],
                r["variant"].get("protocol", "blind")) == (s, p)]
          cells.append(_share_cell(sc) if sc else "—")
          if ok[f] and sc:
            ranked[f].append((frac, s, p, intervals.shares(sc)))
        out.append(f"| `{s}` | {p} | {frac:.2f} | " + " | ".join(cells) + " |")
      out.append("")
      beyond = sorted(t for (_, _, t), v in cal.items() if v < calibration.CALIBRATED)
      if beyond:
        out.append("- Beyond the model here (the fp32 cache's score): " + ", ".join(
            f"{t} ({cal[(model, n, t)]:.2f})" for t in beyond) + ".")
      for f in fams:
        out += _ruler_ranking(ranked[f], f) if ok[f] else [
            f"- {f} is beyond the model here: nothing is ranked." if ok[f] is False else
            f"- {f} has no fp32 rows to calibrate it here: nothing is ranked."]
      out.append("")
  return "\n".join(out).rstrip()


def kvpress_table(rows: list[dict]) -> str:
  """docs/long_context.md: kvpress against kvjax on the same prompts (scripts/kvpress_peer.py):
  per press, the Jaccard index of the kept sets per (layer, KV head), the same with
  kvpress's scoring rule applied to kvjax's keys and queries, and both sides' scores."""
  rows = [r for r in rows if r.get("experiment") == "kvpress_peer"]
  if not rows:
    return "Not run yet: `make install-kvpress && python scripts/kvpress_peer.py`."
  r0 = rows[0]
  v = r0["metrics"]["versions_kvpress"]
  out = [f"**{r0['variant']['model']}, {len({r['workload']['id'] for r in rows})} prompts of "
         f"{r0['workload']['context']:,} tokens, {r0['variant']['ratio_removed']:.0%} of each "
         f"context removed** (kvpress {v.get('kvpress', '?')}, transformers "
         f"{v.get('transformers', '?')}; Jaccard per layer and KV head, averaged over them and "
         "the prompts; scores with their 95 % interval):", "",
         "| press | kvjax policy | Jaccard | (layer, head) at ≥ 0.9 | Jaccard with kvpress's rule "
         "on kvjax's keys | score kvjax | score kvpress |", "|---|---|---:|---:|---:|---:|---:|"]
  for press in dict.fromkeys(r["variant"]["press"] for r in rows):
    mine = [r for r in rows if r["variant"]["press"] == press]
    m = [r["metrics"] for r in mine]
    rule = [x["jaccard_kvpress_rule_mean"] for x in m if x.get("jaccard_kvpress_rule_mean")
            is not None]
    pol = ", ".join(f"{k.split('.', 1)[1]}={val}" for k, val in mine[0]["variant"]["kvjax"].items())
    out.append(f"| {press} | {pol} | {np.mean([x['jaccard_mean'] for x in m]):.3f} | "
               f"{np.mean([x['jaccard_share_090'] for x in m]):.2f} | "
               f"{f'{np.mean(rule):.3f}' if rule else '—'} | "
               f"{_share_cell([x['score_kvjax'] for x in m])} | "
               f"{_share_cell([x['score_kvpress'] for x in m])} |")
  return "\n".join(out)


SOURCES["kvpress"] = tuple(p for p in (ROOT / "results" / "real_models" / "kvpress_peer" /
                                       "peer.jsonl",) if p.exists())
DOCS["kvpress"] = ROOT / "docs" / "long_context.md"
BUILDERS["kvpress"] = kvpress_table

SOURCES["ruler"] = tuple(p for p in (ROOT / "results" / "real_models" / f"ruler_{m}" /
                                     "ruler.jsonl" for m in ("qwen", "gemma3", "smollm2"))
                         if p.exists())
DOCS["ruler"] = ROOT / "docs" / "long_context.md"
BUILDERS["ruler"] = ruler_table


def mla_speed_table(rows: list[dict]) -> str:
  """Per model shape: each setting's row width, bytes held per token against bf16's, decode
  step, ratio to bf16 with its interval, and the fraction of the roof that binds."""
  rows = [r for r in rows if r["experiment"] == "roofline" and "tpot_vs_ref" in r["metrics"]]
  if not rows:
    raise SystemExit("doc_tables: no MLA speed rows; run `kvjax run configs/mla_speed_smollm2"
                     ".yaml --out results/cpu/mla_speed_smollm2` (and mla_speed_qwen)")
  out = ["| model shape | setting | what | row per layer | bytes vs bf16 | decode step | "
         "vs bf16 | roof fraction (binds) |", "|---|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    v, m, mod = r["variant"], r["metrics"], r["config"]["model"]
    ref = next(x for x in rows if x["config"]["model"]["d_model"] == mod["d_model"]
               and x["variant"]["setting"] == "bf16")
    K, D = v["kv_heads"], mod.get("head_dim") or mod["d_model"] // mod["n_heads"]
    if v.get("rope_pairs"):
      width = v["latent_rank"] + 2 * K * v["rope_pairs"]
      what = (f"latent {v['latent_rank']} + {v['rope_pairs']} rotated pairs × {K} heads, "
              "read absorbed")
    elif v.get("latent_rank"):
      width, what = v["latent_rank"], f"latent {v['latent_rank']}, up-projected every step"
    else:
      width, what = 2 * K * D, ("MQA" if K == 1 else f"GQA-{K}") + " K and V"
    what += "" if v["codec"] == "bf16" else f", {v['codec']}"
    share = m["bytes_per_token_asymptotic"] / ref["metrics"]["bytes_per_token_asymptotic"]
    out.append(f"| {r['config'].get('name', '').replace('mla_speed_', '')} | `{v['setting']}` | "
               f"{what} | {width} | {share:.3f} | {1e3 * m['tpot_s']:.1f} ms | "
               f"{m['tpot_vs_ref']:.2f}×{_ci(m.get('tpot_vs_ref_ci95'), '{:.2f}'.format)} | "
               f"{m['roof_fraction']:.2f} ({m['bound']}) |")
  env = rows[0]["env"]
  w = rows[0]["workload"]
  return "\n".join(out) + (
      f"\n\nRows: `results/cpu/mla_speed_{{smollm2,qwen}}/roofline.jsonl` (configs/mla_speed_"
      f"{{smollm2,qwen}}.yaml), batch {w['batch']} × {w['context']:,} tokens, "
      f"{rows[0]['metrics']['repeats']} repeats per model with every setting timed in turn "
      f"in each; ratios are medians of per-repeat ratios with bootstrap 95 % intervals. "
      f"{env['cpu_count']} CPU cores{' of ' + env['cpu_model'] if env.get('cpu_model') else ''}.")


SOURCES["mla_speed"] = tuple(p for p in (ROOT / "results" / "cpu" / f"mla_speed_{m}" /
                                         "roofline.jsonl" for m in ("smollm2", "qwen"))
                             if p.exists())
DOCS["mla_speed"] = ROOT / "docs" / "frontier.md"
BUILDERS["mla_speed"] = mla_speed_table


def render(doc: str, blocks: dict[str, str], path: Path = DOC) -> str:
  for name, body in blocks.items():
    pat = re.compile(rf"(<!-- doc_tables:{name} begin -->\n).*?(<!-- doc_tables:{name} end -->)",
                     re.S)
    if not pat.search(doc):
      raise SystemExit(f"doc_tables: {path.name} has no <!-- doc_tables:{name} begin/end --> "
                       "markers; add them where the table belongs")
    doc = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), doc)
  return doc


def _rel(doc: Path) -> str:
  return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else str(doc)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--check", action="store_true", help="exit 1 if the docs differ from the rows")
  args = p.parse_args(argv)
  blocks = {name: build(_rows(SOURCES[name])) for name, build in BUILDERS.items()}
  stale, wrote = [], []
  for doc in [DOC, *sorted(set(DOCS.values()))]:
    mine = {n: b for n, b in blocks.items() if DOCS.get(n, DOC) == doc}
    old = doc.read_text()
    new = render(old, mine, doc)
    if new != old:
      stale.append(_rel(doc))
      if not args.check:
        doc.write_text(new)
    wrote.append(f"{', '.join(mine)} into {_rel(doc)}")
  if args.check:
    if stale:
      print(f"doc_tables: {', '.join(stale)} out of date with its rows; run "
            "python scripts/doc_tables.py", file=sys.stderr)
      return 1
    return 0
  print(f"doc_tables: wrote {'; '.join(wrote)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
