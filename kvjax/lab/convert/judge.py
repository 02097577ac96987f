"""A conversion asked what caches are for before it is called done: retrieval.

`retrieval` answers the passkey and the single needle (`kvjax.lab.tasks.haystack`, the
long-context experiment's generator) at `context` tokens, DEPTHS x SEEDS prompts each, in
the model's own chat template where it has one, every answer read through the converted
model's own cache (its layout and codec: a latent model through its latent rows). `kvjax
convert` records the result in the checkpoint's meta and prints it beside the conversion's
report (`--judge-context 0` skips it); a score carries its Wilson interval.
"""

from __future__ import annotations

import numpy as np

from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.lab import intervals
from kvjax.lab.tasks import haystack, through_cache

TASKS = ("passkey", "niah")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SEEDS = 2
GEN_LEN = 10    # answer tokens: a 5-digit key and the words around it
TAIL_PAD = 64   # one program serves every question


def template_of(tok) -> haystack.Template:
  """The model's own chat template, or the plain one (a base model's)."""
  try:
    return haystack.own_template(tok)
  except KvjaxError:
    return haystack.PLAIN


def retrieval(cfg, params, tok, context: int = 1024) -> dict:
  """{task: {"score", "correct", "n", "ci95"}} over DEPTHS x SEEDS prompts of `context`
  tokens, each answered greedily through `cfg`'s cache."""
  if context + TAIL_PAD + GEN_LEN > cfg.model.max_seq_len:
    raise KvjaxError(f"a retrieval judge of {context} tokens needs a model of at least "
                     f"{context + TAIL_PAD + GEN_LEN} positions (this one has "
                     f"{cfg.model.max_seq_len}); lower --judge-context")
  template = template_of(tok)
  encode = tok.encode
  params = step.prepare_params(cfg, params)  # once, in the layer loop's form
  out = {}
  for task in TASKS:
    scores = []
    for seed in range(SEEDS):
      for depth in DEPTHS:
        ex = haystack.generate(task, encode, context, [depth], seed=seed, template=template)
        ids = encode(ex.prefix)
        cache = through_cache.prefill(cfg, params, ids, capacity=context + TAIL_PAD + GEN_LEN)
        for q in ex.queries:
          got = through_cache.answer_through_cache(cfg, params, cache, encode(q.tail),
                                                   GEN_LEN, TAIL_PAD)  # (as long_context)
          scores.append(haystack.score(tok.decode(got), q.answer))
    s = intervals.shares(scores)
    out[task] = {"score": s["score"], "correct": int(np.sum(scores)), "n": s["n"],
                 "ci95": [round(x, 4) for x in s["score_ci95"]]}
  return out


def line(result: dict, context: int) -> str:
  """`retrieval at 1,024 tokens: passkey 9/10 [0.60, 0.98], niah 8/10 [...]`."""
  parts = [f"{t} {r['correct']}/{r['n']} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
           for t, r in result.items()]
  return f"retrieval at {context:,} tokens: " + ", ".join(parts)


DEFAULT_CONTEXT = 1024


def check(args, cfg) -> None:
  """Host-side refusal, before any weight is read: an asked length the model cannot hold."""
  asked = getattr(args, "judge_context", None)
  need = (asked or 0) + TAIL_PAD + GEN_LEN
  if asked and cfg.model.max_seq_len < need:
    raise KvjaxError(f"--judge-context {asked}: the model has {cfg.model.max_seq_len} "
                     f"positions, fewer than {need}; lower it, or 0 to skip the judge")


def for_cli(args, cfg, params, tok) -> dict | None:
  """The judge `kvjax convert` runs on what it converted: `--judge-context N` tokens (0:
  none; unset: 1,024 where the model has the positions and a tokenizer, else none, said in
  one line). {"context", task: result} or None."""
  asked = getattr(args, "judge_context", None)
  context = DEFAULT_CONTEXT if asked is None else int(asked)
  if context == 0:
    return None
  need = context + TAIL_PAD + GEN_LEN
  if tok is None or cfg.model.max_seq_len < need:
    why = ("the model has no tokenizer" if tok is None else
           f"the model has {cfg.model.max_seq_len} positions, fewer than {need}")
    if asked is not None:
      raise KvjaxError(f"--judge-context {context}: {why}; lower it, or 0 to skip the judge")
    print(f"retrieval not judged: {why}")
    return None
  result = retrieval(cfg, params, tok, context)
  print(line(result, context))
  return {"context": context, **result}
