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
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "experiments.md"
SOURCES = {"quality": ROOT / "results" / "quality.jsonl",
           "real": ROOT / "results" / "real" / "quality.jsonl"}
MODEL_ORDER = ("MHA", "GQA-2", "GQA-4", "GQA-8", "MQA")
LIMIT = 1.0  # the Δppl (%) that the "within" sentence tests


def _rows(path: Path) -> list[dict]:
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


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


def describe(variant: dict) -> str:
  """What a setting is, from the row: codec(s), key axis, group size, residual window."""
  k, v = variant["k_codec"], variant["v_codec"]
  parts = [k if k == v else f"K {k} / V {v}"]
  if variant.get("k_axis") == "channel":
    parts.append("channel keys")
  if variant.get("group_size"):
    parts.append(f"groups of {variant['group_size']}")
  if variant.get("residual"):
    parts.append(f"R={variant['residual']}")
  if len(parts) == 1 and k == v and k.startswith("int"):
    parts.append("per token, whole head")
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
      vals += [_signed(100 * r["metrics"]["dppl_rel"]), _kl(r["metrics"]["kl"])] if r \
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
  within, over = [], []
  for s in settings:
    got = [(m, 100 * cell[(s, m)]["metrics"]["dppl_rel"]) for m in models if (s, m) in cell]
    bad = [(m, v) for m, v in got if v > LIMIT]
    if s == "fp32":
      continue
    if bad:
      over.append(f"`{s}` (" + ", ".join(f"{m} {_signed(v)}" for m, v in bad) + ")")
    else:
      within.append(f"`{s}`" + ("" if len(got) == len(models) else
                                f" (run on {', '.join(m for m, _ in got)} only)"))
  return "\n".join(lines) + (
      f"\n\nRows: `results/quality.jsonl` ({rests}). KL in nats; Δppl = ppl / ppl of the "
      f"fp32 cache − 1.\n\nWithin {LIMIT:g} % Δppl on every model that ran them: "
      + ", ".join(within) + f". Above {LIMIT:g} % on at least one model: "
      + ", ".join(over) + ".")


def _bits(variant: dict) -> int | None:
  """Bits of the K and V codes when both are the same integer width, else None."""
  names = {variant["k_codec"].removeprefix("quanto-"), variant["v_codec"].removeprefix("quanto-")}
  if len(names) == 1 and next(iter(names)).startswith("int"):
    return int(next(iter(names))[3:])
  return None


def real_table(rows: list[dict]) -> str:
  text = [r for r in rows if r["experiment"] == "quality" and r["workload"].get("task") == "text"]
  if not text:
    raise SystemExit("doc_tables: no real-model rows; run "
                     "`kvjax run configs/real_quality.yaml --out results/real`")
  full = max(r["metrics"]["bytes_per_token"] for r in text)
  lines = ["| setting | what | bytes/token | of fp32 | Δppl | KL | agreement |",
           "|---|---|---|---|---|---|---|"]
  for r in sorted(text, key=lambda r: (-r["metrics"]["bytes_per_token"], r["variant"]["setting"])):
    v, m = r["variant"], r["metrics"]
    what = ("transformers QuantizedCache (quanto), " + f"residual {v.get('residual')}"
            if v.get("peer") else describe(v))
    if v.get("variant") == "MQA":
      what = "GQA-3 → MQA, mean-pooled K/V heads (no uptraining), " + what
    lines.append(f"| `{v['setting']}` | {what} | {m['bytes_per_token']:,.0f} | "
                 f"{m['bytes_per_token'] / full:.1%} | {_signed(100 * m['dppl_rel'])} | "
                 f"{_kl(m['kl'])} | {m['agreement']:.3f} |")
  w = text[0]["workload"]
  model = text[0]["variant"].get("model")
  out = "\n".join(lines) + (
      f"\n\nRows: `results/real/quality.jsonl`: model `{model}`, {w['batch']} × {w['context']} = "
      f"{w['batch'] * w['context']:,} tokens of `{w['data']}` validation text fed "
      f"{w['chunk']} at a time. Each row's reference is the same model through an fp32 cache "
      "(transformers' unquantized dynamic cache for the transformers rows). bytes/token is "
      "kvjax's closed form over all 30 layers (codec scales included); for the transformers "
      "rows, the bytes its cache held at the end divided by the tokens.")
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
    out += (f"\n\nAt {bits} bits, kvjax's best setting `{best['variant']['setting']}` "
            f"({describe(best['variant'])}) costs {_signed(bd)} at "
            f"{best['metrics']['bytes_per_token']:,.0f} B/token; transformers' quanto "
            f"int{bits} costs {_signed(pd)} at {p['metrics']['bytes_per_token']:,.0f} B/token "
            f"({ratio} for kvjax).")
  return out


BUILDERS = {"quality": quality_table, "real": real_table}


def render(doc: str, blocks: dict[str, str]) -> str:
  for name, body in blocks.items():
    pat = re.compile(rf"(<!-- doc_tables:{name} begin -->\n).*?(<!-- doc_tables:{name} end -->)",
                     re.S)
    if not pat.search(doc):
      raise SystemExit(f"doc_tables: {DOC.name} has no <!-- doc_tables:{name} begin/end --> "
                       "markers; add them where the table belongs")
    doc = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), doc)
  return doc


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--check", action="store_true", help="exit 1 if the docs differ from the rows")
  args = p.parse_args(argv)
  blocks = {name: build(_rows(SOURCES[name])) for name, build in BUILDERS.items()}
  old = DOC.read_text()
  new = render(old, blocks)
  if args.check:
    if new != old:
      print(f"doc_tables: {DOC.relative_to(ROOT)} is out of date with its rows; run "
            "python scripts/doc_tables.py", file=sys.stderr)
      return 1
    return 0
  DOC.write_text(new)
  print(f"doc_tables: wrote {', '.join(blocks)} into {DOC.relative_to(ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
