"""How `kvjax size`, `generate` and `eval` print their result for a person (without
--json): sizes humanized, one line per fact.
"""

from __future__ import annotations

import sys

from kvjax.footprint import human
from kvjax.lab import intervals
from kvjax.lab.intervals import text as ci_text


def _ci(ci, fmt: str, scale: float = 1.0) -> str:
  return f" {ci_text(ci, fmt, scale)}" if ci else ""


def print_size(result: dict) -> None:
  """`kvjax size`: the shape and cache, bytes per token and in all, the mesh, the budget."""
  cache = f"K:{result['k_codec']} V:{result['v_codec']}"
  for key, text in (("k_axis", "keys per channel"), ("group_size", "groups of {}"),
                    ("residual", "window {}"), ("keep_first", "first {} kept"),
                    ("rotate", "{} rotation"), ("clip", "{} clipping")):
    val = result.get(key)
    if val and val not in ("token", "none"):
      cache += ", " + text.format(val)
  print(f"{result['variant']} L={result['layers']} H={result['heads']} K={result['kv_heads']} "
        f"D={result['head_dim']}  cache {cache}, {result['layout']}")
  for note in result.get("notes", []):
    print(f"  ({note})")
  bpt, limit = result["bytes_per_token"], result["bytes_per_token_asymptotic"]
  print(f"bytes per token: {bpt:,.1f} ({human(bpt)}) held at {result['seq_len']} tokens, "
        f"{result['bits_per_element']:.2f} bits/element all-in"
        + (f"; {limit:,.1f} per held token, {result['held_tokens']:,} held"
           if result.get("policy", "full") != "full" else
           f"; {limit:,.1f} in the long-context limit" if round(bpt) != round(limit) else ""))
  print(f"total for batch {result['batch']} x {result['seq_len']} tokens: "
        f"{result['total_bytes']:,} ({human(result['total_bytes'])})")
  if result["devices"] > 1 or "param_bytes" in result:
    mesh = result["mesh"]
    rep = f", each KV head on {mesh['kv_replication']} devices" \
        if mesh["kv_replication"] > 1 else ""
    print(f"mesh {mesh['data']}x{mesh['model']} (data x model){rep}: cache "
          f"{human(result['bytes_per_device'])} per device "
          f"(ideal {human(result['ideal_bytes_per_device'])})")
    if "param_bytes" in result:
      print(f"parameters {human(result['param_bytes'])} in {result['param_dtype']}: "
            f"{human(result['param_bytes_per_device'])} per device")
  b = result.get("budget")
  if b:
    w = b["weight_bytes"]
    print(f"budget {b['text']} read as {b['budget_bytes']:,} bytes ({b['unit']}; "
          f"{human(b['budget_bytes'])})")
    after = f" - weights {human(w)} = {human(b['free_bytes'])}" if w is not None else ""
    print(f"  {human(b['budget_bytes'])}{after} for the cache; one sequence of "
          f"{result['seq_len']} tokens takes {human(b['seq_bytes'])}")
    print(f"  fits {b['max_sequences']} concurrent sequences of {result['seq_len']} tokens "
          f"with {cache}; batch {result['batch']} "
          + ("fits" if b["batch_fits"] else
             f"does not fit (needs {human(b['batch_bytes'])})"))
    print("  same model, whole-head codecs: "
          + ", ".join(f"{c} {n}" for c, n in b["max_sequences_by_codec"].items()))
    print(f"  counted: {b['counted']}")
    print(f"  not counted: {b['not_counted']}")


def print_human(command: str, result: dict) -> None:
  """The result of `size`, `eval` or `generate` as text (their --json prints it raw)."""
  if command == "size":
    print_size(result)
  elif command == "eval":
    print(f"{result['source']}  K:{result['k_codec']} V:{result['v_codec']}  "
          f"{result['seqs']} x {result['tokens']} tokens, chunk {result['chunk']}")
    ci = {k: result.get(f"{k}_ci95") for k in ("dppl_rel", "kl", "agreement")}
    ref = result.get("ref", "fp32 cache")
    if ref != "fp32 cache":
      print(f"paired against {ref} on the same tokens (Δppl, KL(ref || this), agreement)")
    print(f"ppl {result['ppl']:.4f} ({ref} {result['ppl_ref']:.4f}, "
          f"{100 * result['dppl_rel']:+.3f} %{_ci(ci['dppl_rel'], '{:+.3f}', 100)})  "
          f"KL {result['kl']:.3g}{_ci(ci['kl'], '{:.3g}')}  "
          f"agreement {result['agreement']:.4f}{_ci(ci['agreement'], '{:.4f}')}")
    if ci["dppl_rel"]:
      print(f"  (95 % intervals, {result.get('seqs', 1)} windows: "
            f"{intervals.describe(result.get('ci_method', 'blocks'))})")
    print(f"cache {result['bytes_per_token']:,.0f} B/token held at {result['tokens']} tokens "
          f"({result['bits_per_element']:.2f} bits/element all-in), "
          f"{result['bytes_per_token_asymptotic']:,.0f} B/token in the long-context limit")
  elif command == "generate":
    if result.get("random_weights"):
      print("kvjax: note: random weights (a --config model is initialised, not trained): the "
            "text is noise; use --gguf, --hf or --checkpoint for a trained model",
            file=sys.stderr)
    for i, toks in enumerate(result["tokens"]):
      text = f"  {result['text'][i]!r}" if "text" in result else ""
      print(f"[{i}] {toks}{text}")
    print(f"cache {human(result['cache_bytes'])}  TTFT {result['ttft_s'] * 1e3:.2f} ms  "
          f"TPOT {result['tpot_s'] * 1e3:.3f} ms  compile {result['compile_s']:.2f} s")
