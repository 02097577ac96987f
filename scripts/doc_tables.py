"""Write the tables of docs/experiments.md from the committed results rows, so a claim in
the docs cannot drift from its rows.

    python scripts/doc_tables.py            # rewrite the generated blocks in place
    python scripts/doc_tables.py --check    # exit 1 if a block differs from its rows

A generated block sits between `<!-- doc_tables:NAME begin -->` and
`<!-- doc_tables:NAME end -->`; everything outside the markers is left alone. Blocks:

  quality   results/quality.jsonl: Δppl and KL per cache setting and model, the models and
            token counts they rest on, and which settings stay within 1 % Δppl.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "experiments.md"
SOURCES = {"quality": ROOT / "results" / "quality.jsonl"}
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


BUILDERS = {"quality": quality_table}


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
