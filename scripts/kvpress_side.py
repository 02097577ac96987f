"""The kvpress side of scripts/kvpress_peer.py, run in its own environment (`make
install-kvpress`: kvpress caps transformers below the project's). Imports torch,
transformers and kvpress only.

    .venv-kvpress/bin/python scripts/kvpress_side.py PROMPTS.json OUT.jsonl

For each prompt of PROMPTS.json ({"gguf": path, "prompts": [{"id", "context", "question",
"gen_len"}], "presses": {name: {"press": class name, "ratio": share removed, ...}}}) and
each press: the context prefilled through the GGUF model (transformers' own reader, float32)
with the press compressing each layer's cache as the prefill leaves it; the indices each
press keeps per layer and KV head (its scores' top `n_kept`, as the press takes them); then
the question fed through the compressed cache and `gen_len` tokens decoded greedily. One
line per (prompt, press) appended to OUT.jsonl; a line already there is not run again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# torch, transformers and kvpress are imported where used: `--help` answers without them


def _press(spec: dict):
  import kvpress
  cls = getattr(kvpress, spec["press"])
  kw = {k: v for k, v in spec.items() if k not in ("press", "ratio")}
  return cls(compression_ratio=spec["ratio"], **kw)


def _kept(press, model):
  """Hook the press's `score` so the kept indices of every layer are recorded as the press
  takes them (`scores.topk(n_kept)` with kvpress's own `compute_n_kept`)."""
  from kvpress.utils import compute_n_kept
  kept: dict = {}
  inner = press.score

  def score(module, hidden_states, keys, values, attentions, kwargs):
    s = inner(module, hidden_states, keys, values, attentions, kwargs)
    n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
    idx = s.topk(n_kept, dim=-1).indices[0]  # [K, n_kept]
    kept[int(module.layer_idx)] = [sorted(int(i) for i in row) for row in idx]
    return s
  press.score = score
  return kept


def run_one(model, prompt: dict, spec: dict) -> dict:
  import torch
  with torch.no_grad():
    return _run_one(model, prompt, spec)


def _run_one(model, prompt: dict, spec: dict) -> dict:
  import torch
  from transformers import DynamicCache

  press = _press(spec)
  kept = _kept(press, model)
  ctx = torch.tensor([prompt["context"]])
  cache = DynamicCache()
  t0 = time.perf_counter()
  with press(model):
    model(ctx, past_key_values=cache, use_cache=True)
  prefill_s = time.perf_counter() - t0
  held = int(cache.get_seq_length())
  # the question reads the compressed cache; its positions continue the context's
  n = ctx.shape[1]
  q = torch.tensor([prompt["question"]])
  pos = torch.arange(n, n + q.shape[1])[None]
  out = model(q, past_key_values=cache, use_cache=True, position_ids=pos)
  tokens = [int(out.logits[0, -1].argmax())]
  for step in range(prompt["gen_len"] - 1):
    p = torch.tensor([[n + q.shape[1] + step]])
    out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                position_ids=p)
    tokens.append(int(out.logits[0, -1].argmax()))
  return {"kept": [kept[i] for i in sorted(kept)], "held": held, "answer_ids": tokens,
          "prefill_s": prefill_s}


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("prompts", help="the prompts file scripts/kvpress_peer.py writes")
  ap.add_argument("out", help="the JSON-lines file to append to (resumed where it stopped)")
  a = ap.parse_args(argv)
  import torch
  import transformers

  import kvpress
  spec_path, out_path = Path(a.prompts), Path(a.out)
  spec = json.loads(spec_path.read_text())
  done = set()
  if out_path.exists():
    for line in out_path.read_text().splitlines():
      try:
        r = json.loads(line)
      except json.JSONDecodeError:
        continue
      done.add((r["id"], r["press"]))
  transformers.utils.logging.disable_progress_bar()
  transformers.utils.logging.set_verbosity_error()
  gguf = Path(spec["gguf"])
  model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                            dtype=torch.float32)
  model.eval()
  if out_path.exists() and out_path.stat().st_size and not out_path.read_bytes().endswith(b"\n"):
    with out_path.open("a") as f:  # a line torn by a killed run ends here, not in the next
      f.write("\n")
  with out_path.open("a") as f:
    for prompt in spec["prompts"]:
      for name, press in spec["presses"].items():
        if (prompt["id"], name) in done:
          continue
        r = run_one(model, prompt, press)
        f.write(json.dumps({"id": prompt["id"], "press": name, **r,
                            "versions": {"kvpress": kvpress.__version__ if hasattr(
                                kvpress, "__version__") else "0.5.5",
                                "transformers": transformers.__version__,
                                "torch": torch.__version__}}) + "\n")
        f.flush()
        print(f"kvpress side: prompt {prompt['id']} {name}: held {r['held']}, prefill "
              f"{r['prefill_s']:.1f} s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
