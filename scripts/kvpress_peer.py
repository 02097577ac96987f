"""kvpress as a peer on kvjax's prompts: the tokens each press keeps against the tokens the
matching kvjax policy keeps, per layer and KV head, and both sides' answers.

    python scripts/kvpress_peer.py [--model qwen2.5-coder-0.5b] [--context 4096] [--prompts 20]
                                   [--out results/real_models/kvpress_peer]

Needs kvpress's own environment (`make install-kvpress`: kvpress 0.5.5 caps transformers
below the version kvjax tests against), which `scripts/kvpress_side.py` runs in.

1. Prompts: the RULER-style suite's niah tasks and vt (kvjax/lab/tasks/ruler.py) at
   `--context` tokens in the model's chat template, cycled over tasks and samples; the first
   question of each. Written to WORK/prompts.json (token ids, so both sides read the same).
2. kvpress: each press compresses the context during its prefill (the question-blind
   pipeline), its kept indices per layer and KV head recorded as it takes them, then the
   question reads the compressed cache and `gen_len` tokens are decoded greedily
   (WORK/kvpress.jsonl, one line per prompt and press; resumed where it stopped).
3. kvjax: one one-call fp32 prefill per prompt with its queries; per press the matching
   policy with the same kept count (kvpress keeps int(n x (1 - ratio)), at least 1, set as
   `cache.budget`), its kept positions from the policy's own selection on the prefill's
   keys and queries, and the answer through the compacted cache (`tasks.evict_prefix`).
4. Rows (OUT/peer.jsonl, one per prompt and press): the Jaccard index of the two kept sets
   per (layer, KV head) (mean, minimum, share at 0.9 or more) and both sides' scores
   (`ruler.score`) and answers. A summary per press is printed; docs/long_context.md's
   kvpress table is generated from the rows (scripts/doc_tables.py).

The presses and the policies they are matched with (ratio = the share kvpress removes):

  snapkv     SnapKVPress(window_size=64, kernel_size=5)  snapkv, cache.window=64
  knorm      KnormPress                                  knorm
  streaming  StreamingLLMPress(n_sink=4)                 sinks, cache.sinks=4
  tova       TOVAPress                                   tova
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESSES = {
    "snapkv": ({"press": "SnapKVPress", "window_size": 64, "kernel_size": 5},
               {"cache.policy": "snapkv", "cache.window": 64}),
    "knorm": ({"press": "KnormPress"}, {"cache.policy": "knorm"}),
    "streaming": ({"press": "StreamingLLMPress", "n_sink": 4},
                  {"cache.policy": "sinks", "cache.sinks": 4}),
    "tova": ({"press": "TOVAPress"}, {"cache.policy": "tova"}),
}
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
         "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt")
SIDE_PY = ROOT / ".venv-kvpress" / "bin" / "python"


def _fail(msg: str) -> None:
  print(f"kvpress_peer: {msg}", file=sys.stderr)
  raise SystemExit(2)


def n_kept(n: int, ratio: float) -> int:
  """kvpress's kept count for a context of n tokens (ratio: the share removed)."""
  return max(1, int(n * (1 - ratio)))


def make_prompts(model: str, context: int, count: int, tok) -> list[dict]:
  from kvjax.lab import data, tasks
  from kvjax.lab.tasks import ruler

  prose = data.eval_text("shakespeare", what="the prose haystack")
  template = tasks.own_template(tok)
  out = []
  for i in range(count):
    task = TASKS[i % len(TASKS)]
    e = ruler.make(task, tok.encode, context - ruler.GEN_LEN[task], seed=i // len(TASKS),
                   template=template, prose=prose)
    q = e.asks[0]
    out.append({"id": i, "task": task, "family": e.family, "context": tok.encode(e.context),
                "question": tok.encode(q.tail), "gen_len": q.gen_len,
                "expected": list(q.expected)})
  return out


def jaccard(a, b) -> float:
  a, b = set(a), set(b)
  return len(a & b) / len(a | b) if a | b else 1.0


def as_kvpress(name: str, q_LTHD, k_LKSD, n: int, keep: int, window: int = 64,
               kernel: int = 5):
  """kvpress's own scoring of `snapkv` and `tova` (kvpress/presses/snapkv_press.py,
  tova_press.py) rewritten on kvjax's prefill keys and queries, kept positions [L][K]: what
  the Jaccard index would be if kvjax scored as kvpress does, so a difference in the kept
  sets is shown to come from the scoring rule and not from the model.

  snapkv: the last `window` queries' softmax over all keys, the weights on the keys before
  the window averaged over the window, average-pooled over `kernel` neighbours (zero
  padding counted), averaged over each KV head's query heads; the window always kept.
  tova: the last query's softmax over all keys, the weights on every key but the last
  averaged over ALL query heads (one ranking shared by every KV head); the last kept."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  L, _, H, D = q_LTHD.shape
  K = k_LKSD.shape[1]
  G = H // K
  w = window if name == "snapkv" else 1
  q = jnp.asarray(q_LTHD[:, n - w:n], jnp.float32)  # [L, w, H, D]
  k = jnp.repeat(jnp.asarray(k_LKSD[:, :, :n], jnp.float32), G, axis=1)  # [L, H, n, D]
  logits = jnp.einsum("lwhd,lhsd->lhws", q, k) / np.sqrt(D)
  causal = jnp.arange(n)[None, :] <= (n - w + jnp.arange(w))[:, None]
  p = jax.nn.softmax(jnp.where(causal[None, None], logits, -jnp.inf), axis=-1)[..., :n - w]
  s = p.mean(axis=2)  # [L, H, n - w]
  if name == "snapkv":
    pad = jnp.pad(s, [(0, 0), (0, 0), (kernel // 2, kernel // 2)])
    s = sum(pad[..., i:i + n - w] for i in range(kernel)) / kernel
    s = s.reshape(L, K, G, n - w).mean(axis=2)
  else:
    s = jnp.broadcast_to(s.mean(axis=1, keepdims=True), (L, K, n - w))
  s = jnp.concatenate([s, jnp.full((L, K, w), jnp.max(s) + 1)], axis=-1)
  idx = np.asarray(jax.lax.top_k(s, keep)[1])
  return [[sorted(int(i) for i in row) for row in layer] for layer in idx]


def kvjax_side(mcfg, params, tok, prompt: dict, ratio: float) -> dict:
  """name -> (kept positions [L][K] sorted, answer ids) for each press's policy."""
  import dataclasses

  import jax.numpy as jnp
  import numpy as np

  from kvjax import config as config_lib
  from kvjax import policies
  from kvjax.lab import evaluate, tasks
  from kvjax.policies.base import Context

  ids, n = prompt["context"], len(prompt["context"])
  ref = evaluate.reference_config(mcfg)
  width = -(-n // 256) * 256
  pre = tasks.prefill_queries(ref, params, ids, width)
  k_LKSD = pre.kv[0]
  out = {}
  for name, (_, over) in PRESSES.items():
    keep = n_kept(n, ratio)
    cfg = config_lib.apply_overrides(mcfg, {**over, "cache.budget": keep})
    pol = policies.get(cfg.cache.policy)
    ctx = Context(jnp.asarray(k_LKSD, jnp.float32)[:, None], jnp.array([n], jnp.int32),
                  jnp.array([keep], jnp.int32), cfg.cache,
                  pre.q if pol.needs_queries else None)
    pos = np.asarray(pol.select(ctx, keep))[:, 0]  # [L, K, keep]
    kept = [[sorted(int(p) for p in row) for row in layer] for layer in pos]
    cache = tasks.evict_prefix(dataclasses.replace(cfg, seed=0), pre,
                               len(prompt["question"]) + prompt["gen_len"] + 16)
    answer = tasks.answer_through_cache(cfg, params, cache, prompt["question"],
                                        prompt["gen_len"], tail_pad=128)
    rule = as_kvpress(name, np.asarray(pre.q)[:, 0], np.asarray(k_LKSD), n, keep) \
        if name in ("snapkv", "tova") else None
    out[name] = (kept, answer, rule)
  return out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="qwen2.5-coder-0.5b")
  ap.add_argument("--context", type=int, default=4096)
  ap.add_argument("--prompts", type=int, default=20)
  ap.add_argument("--ratio", type=float, default=0.5, help="the share each press removes")
  ap.add_argument("--out", default="results/real_models/kvpress_peer")
  ap.add_argument("--work", default="results/tmp_kvpress_peer",
                  help="the prompts and kvpress's raw output (kept indices): large, not committed")
  a = ap.parse_args(argv)
  if not 0 < a.ratio < 1:
    _fail(f"--ratio must be in (0, 1), got {a.ratio}")
  if a.prompts < 1 or a.context < 512:
    _fail("--prompts must be at least 1 and --context at least 512")
  if not SIDE_PY.exists():
    _fail(f"no kvpress environment at {SIDE_PY.parent.parent}; run make install-kvpress")
  from kvjax.errors import KvjaxError
  from kvjax.io import sources, zoo
  from kvjax.lab import metrics
  from kvjax.lab.tasks import ruler
  from kvjax.decode import step

  try:
    gguf = zoo.resolve_gguf(a.model)
    src = sources.parse(f"gguf:{a.model}")
    mcfg, raw, tok = sources.load(src)
  except KvjaxError as e:
    _fail(str(e))
  if a.context > mcfg.model.max_seq_len:
    _fail(f"--context {a.context} exceeds {a.model}'s context {mcfg.model.max_seq_len}")
  out, work = ROOT / a.out, ROOT / a.work
  out.mkdir(parents=True, exist_ok=True)
  work.mkdir(parents=True, exist_ok=True)
  prompts = make_prompts(a.model, a.context, a.prompts, tok)
  spec = {"gguf": str(gguf), "prompts": prompts,
          "presses": {k: {**p, "ratio": a.ratio} for k, (p, _) in PRESSES.items()}}
  (work / "prompts.json").write_text(json.dumps(spec))
  side = subprocess.run([str(SIDE_PY), str(ROOT / "scripts" / "kvpress_side.py"),
                         str(work / "prompts.json"), str(work / "kvpress.jsonl")],
                        env={**os.environ, "PYTHONPATH": ""})
  if side.returncode:
    _fail(f"the kvpress side exited {side.returncode}; its output is above")
  theirs = {}
  for line in (work / "kvpress.jsonl").read_text().splitlines():
    try:
      r = json.loads(line)
    except json.JSONDecodeError:  # a line torn by a killed run: the side runs it again
      continue
    theirs[(r["id"], r["press"])] = r
  params = step.prepare_params(mcfg, raw)
  rows_path = out / "peer.jsonl"
  done = set()
  if rows_path.exists():
    done = {(r["workload"]["id"], r["variant"]["press"]) for r in
            map(json.loads, rows_path.read_text().splitlines())}
  env = metrics.environment()
  with rows_path.open("a") as f:
    for p in prompts:
      if all((p["id"], name) in done for name in PRESSES):
        continue
      mine = kvjax_side(mcfg, params, tok, p, a.ratio)
      for name, (kept, answer, rule) in mine.items():
        if (p["id"], name) in done:
          continue
        t = theirs[(p["id"], name)]
        js = [jaccard(x, y) for la, lb in zip(kept, t["kept"]) for x, y in zip(la, lb)]
        # kvpress's scoring rule on kvjax's keys and queries (snapkv, tova): what is left of
        # the difference once the rules agree
        same_rule = None if rule is None else [
            jaccard(x, y) for la, lb in zip(rule, t["kept"]) for x, y in zip(la, lb)]
        ours_text, their_text = tok.decode(answer), tok.decode(t["answer_ids"])
        row = {"experiment": "kvpress_peer",
               "variant": {"press": name, "kvpress": PRESSES[name][0],
                           "kvjax": PRESSES[name][1], "ratio_removed": a.ratio,
                           "model": a.model},
               "workload": {"id": p["id"], "task": p["task"], "family": p["family"],
                            "context_tokens": len(p["context"]), "context": a.context,
                            "kept": n_kept(len(p["context"]), a.ratio),
                            "protocol": "blind"},
               "metrics": {"jaccard_mean": sum(js) / len(js), "jaccard_min": min(js),
                           "jaccard_share_090": sum(j >= 0.9 for j in js) / len(js),
                           "jaccard_by_layer": [
                               round(sum(jaccard(x, y) for x, y in zip(la, lb)) / len(la), 4)
                               for la, lb in zip(kept, t["kept"])],
                           "jaccard_kvpress_rule_mean": None if same_rule is None
                           else sum(same_rule) / len(same_rule),
                           "jaccard_kvpress_rule_min": None if same_rule is None
                           else min(same_rule),
                           "score_kvjax": ruler.score(ours_text, p["expected"]),
                           "score_kvpress": ruler.score(their_text, p["expected"]),
                           "answer_kvjax": ours_text, "answer_kvpress": their_text,
                           "expected": p["expected"], "held_kvpress": t["held"],
                           "versions_kvpress": t["versions"]},
               "env": env}
        f.write(json.dumps(row) + "\n")
        f.flush()
      print(f"kvpress_peer: prompt {p['id']} ({p['task']}) compared", file=sys.stderr)
  rows = [json.loads(x) for x in rows_path.read_text().splitlines()]
  for name in PRESSES:
    mine = [r["metrics"] for r in rows if r["variant"]["press"] == name]
    if mine:
      print(f"{name}: Jaccard mean {sum(m['jaccard_mean'] for m in mine) / len(mine):.3f}, "
            f"share of (layer, head) >= 0.9: "
            f"{sum(m['jaccard_share_090'] for m in mine) / len(mine):.2f}; score kvjax "
            f"{sum(m['score_kvjax'] for m in mine) / len(mine):.2f}, kvpress "
            f"{sum(m['score_kvpress'] for m in mine) / len(mine):.2f} ({len(mine)} prompts)"
            + ("" if mine[0].get("jaccard_kvpress_rule_mean") is None else
               f"; kvpress's rule on kvjax's keys: Jaccard "
               f"{sum(m['jaccard_kvpress_rule_mean'] for m in mine) / len(mine):.3f}"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
