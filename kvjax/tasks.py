"""Long-context retrieval tasks, generated here (no downloads), and how to score them.

Three synthetic tasks in the spirit of passkey retrieval and RULER; each builds a long
*context* (instructions plus a haystack of repeated filler sentences with facts hidden
in it) and one *query* per hidden fact:

  passkey   one line "The pass key is 12345. Remember it." at one depth; the question
            asks for the pass key. One query.
  niah      RULER-style needles with distractors: one line "The special magic number for
            WORD is: 1234567." per requested depth, each with its own key word and value;
            one query per needle (the other needles are its distractors).
  vt        variable tracking: per requested depth a chain `VAR A = 12345`, then (later in
            the haystack) `hops` assignments `VAR B = VAR A`, ...; one query per chain,
            "what is the value of" its last variable. Every chain holds a different number, so copying any
            number from the context is right 1 / n_chains of the time (the chance level).
            This is the form chosen for a 135M model: a value lookup one hop deep (default),
            answered by copying digits (RULER's form, listing every variable that holds a
            value, asks for names and is out of reach for such a model).

Generators are tokenizer-agnostic: they take an `encode(text) -> ids` function only to fit
the filler to a target token count, and return text plus the expected answer. The prompt
is `prefix` (instructions + haystack) followed by a query's `tail` (question and the
answer's opening words, e.g. "The pass key is"); `n_tokens` is len(encode(prefix)) +
len(encode(tail)) for the longest tail, at most `target` and within one filler sentence of
it. A `Template` wraps the prompt in a chat format (`CHATML` for SmolLM2-Instruct).

What the cache sees. In kvjax a chunk of tokens fed in one call attends to its own fresh
K/V; only *later* calls read K/V back through the cache codec. If prefix and question went
in as one prefill, a lossy cache would never touch the first answer token. So
`answer_through_cache` feeds the prefix first, then the query's tail as its own call, then
decodes greedily: every token of the tail and of the answer reads the prefix's K/V through
the codec (tests/test_tasks.py holds that this differs from a one-shot prefill under int2).
The prefix itself is prefilled at full precision and then stored through the codec
(`encode_prefix`), which is KIVI's protocol (full-precision prefill, compressed cache) and
lets one fp32 prefill serve every cache setting: storing the fp32 K/V through a codec is
the same write a prefill with that codec makes.

Scoring (`score`): the first run of digits in the generated text must equal the answer
exactly (so "123456" does not count for "12345").
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import KvjaxError

TASKS = ("passkey", "niah", "vt")

FILLER = ("The grass is green. The sky is blue. The sun is warm. Here we go. "
          "There and back again.")

# key words for the needles (RULER draws random words; a fixed list keeps this offline)
WORDS = ("amber", "anchor", "apple", "arrow", "badge", "basket", "beacon", "berry", "blossom",
         "bottle", "bridge", "candle", "canyon", "carpet", "castle", "cedar", "chimney",
         "cliff", "clover", "comet", "copper", "coral", "cotton", "crystal", "dragon", "falcon",
         "feather", "forest", "garden", "glacier", "harbor", "helmet", "island", "jacket",
         "kettle", "ladder", "lantern", "marble", "meadow", "mirror", "orchid", "pebble",
         "pepper", "pillow", "planet", "river", "saddle", "shadow", "silver", "tunnel",
         "velvet", "violin", "walnut", "willow")

_INTRO = {
    "passkey": ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
                "memorize it. I will quiz you about the pass key."),
    "niah": ("Some special magic numbers are hidden inside the following text. Make sure to "
             "memorize them. I will quiz you about one of the numbers afterwards."),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following "
           "text."),
}


@dataclasses.dataclass(frozen=True)
class Template:
  """How a prompt is wrapped: `user` before the context, `assistant` between the question
  and the answer's opening words."""
  name: str
  user: str
  assistant: str


PLAIN = Template("plain", "", "\n")
CHATML = Template("chatml", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATES = {t.name: t for t in (PLAIN, CHATML)}


@dataclasses.dataclass(frozen=True)
class Query:
  tail: str          # fed after the prefix: question + template + answer opening
  answer: str        # the digits expected
  depth: float       # requested depth of the fact the answer rests on, in [0, 1]
  fact_char: int     # where that fact's line starts in `prefix` (characters)
  fact_token: int    # ... and in tokens (len(encode(prefix[:fact_char])))
  key: str = ""      # niah: the key word; vt: the variable asked about


@dataclasses.dataclass(frozen=True)
class Example:
  task: str
  prefix: str        # template opening + instructions + haystack
  queries: tuple     # of Query
  n_tokens: int      # tokens of prefix + the longest tail
  prefix_tokens: int # tokens of prefix alone
  target: int        # the context length asked for
  seed: int


def _digits(rng, n: int) -> str:
  return str(int(rng.integers(10 ** (n - 1), 10 ** n)))


def _var_name(rng, taken: set) -> str:
  while True:
    name = "".join(chr(ord("A") + int(i)) for i in rng.integers(0, 26, size=5))
    if name not in taken:
      taken.add(name)
      return name


def _facts(task: str, depths, rng, hops: int = 1) -> list[tuple[float, str, str, str, str]]:
  """(depth, line, answer, key, question) per fact line; vt hops follow their chain."""
  out = []
  if task == "passkey":
    key = _digits(rng, 5)
    out.append((depths[0], f"The pass key is {key}. Remember it.", key, "",
                "What is the pass key?"))
  elif task == "niah":
    words = rng.choice(len(WORDS), size=len(depths), replace=False)
    values: set = set()
    for d, w in zip(depths, words):
      v = _digits(rng, 7)
      while v in values:
        v = _digits(rng, 7)
      values.add(v)
      word = WORDS[int(w)]
      out.append((d, f"The special magic number for {word} is: {v}.", v, word,
                  f"What is the special magic number for {word} mentioned in the provided "
                  "text?"))
  else:  # vt
    taken: set = set()
    values = set()
    for d in depths:
      v = _digits(rng, 5)
      while v in values:
        v = _digits(rng, 5)
      values.add(v)
      names = [_var_name(rng, taken) for _ in range(hops + 1)]
      out.append((d, f"VAR {names[0]} = {v}.", v, names[-1],
                  f"What is the value of VAR {names[-1]}?"))
      # hops sit between the value line and the end, in order (never before their source)
      hop_depths = np.sort(rng.uniform(d, 1.0, size=hops))
      for hd, a, b in zip(hop_depths, names[:-1], names[1:]):
        out.append((float(hd), f"VAR {b} = VAR {a}.", "", "", ""))
  return out


def _answer_opening(task: str, key: str) -> str:
  if task == "passkey":
    return "The pass key is"
  if task == "niah":
    return f"The special magic number for {key} mentioned in the provided text is"
  return f"The value of VAR {key} is"


def _build(task, facts, n_filler: int, template: Template):
  """The prefix text for `n_filler` filler sentences, fact lines inserted at their depths;
  returns (prefix, [char offset of each fact line])."""
  sentences = [s.strip() + "." for s in FILLER.split(".") if s.strip()]
  lines: list[list[str]] = [[] for _ in range(n_filler + 1)]  # facts before filler i
  for i, (d, line, *_) in enumerate(facts):
    lines[int(round(d * n_filler))].append((i, line))
  parts = [template.user + _INTRO[task] + "\n"]
  pos = len(parts[0])
  offsets = [0] * len(facts)
  for i in range(n_filler + 1):
    for j, line in lines[i]:
      text = line + " "
      offsets[j] = pos
      parts.append(text)
      pos += len(text)
    if i < n_filler:
      text = sentences[i % len(sentences)] + " "
      parts.append(text)
      pos += len(text)
  return "".join(parts) + "\n", offsets


def check_args(task: str, target: int, depths) -> None:
  if task not in TASKS:
    raise KvjaxError(f"unknown task '{task}'; use one of {', '.join(TASKS)}")
  if not depths:
    raise KvjaxError("give at least one depth in [0, 1]")
  bad = [d for d in depths if not 0.0 <= float(d) <= 1.0]
  if bad:
    raise KvjaxError(f"depth {bad[0]} is outside [0, 1]; 0 puts the fact first in the "
                     "haystack, 1 last")
  if task == "passkey" and len(depths) != 1:
    raise KvjaxError(f"passkey hides one key: give one depth, got {len(depths)}")
  if task == "niah" and len(depths) > len(WORDS):
    raise KvjaxError(f"niah has {len(WORDS)} key words: give at most that many depths")
  if int(target) <= 0:
    raise KvjaxError(f"context length must be positive, got {target}")


def generate(task: str, encode: Callable[[str], list], target: int, depths, seed: int = 0,
             template: Template = PLAIN, hops: int = 1) -> Example:
  """One example of `task` whose prompt (prefix + longest tail) is at most `target` tokens
  of `encode` and within one filler sentence of it; a fact line at each depth in `depths`.

  `hops` (vt only): assignments between the value and the variable asked about.
  Deterministic: the same arguments give the same example.
  """
  check_args(task, target, depths)
  if hops < 0:
    raise KvjaxError(f"vt hops must be >= 0, got {hops}")
  depths = [float(d) for d in depths]
  rng = np.random.default_rng([seed, int(target), TASKS.index(task)]
                              + [int(round(d * 1e6)) for d in depths])
  facts = _facts(task, depths, rng, hops)
  asked = [(f, j) for j, f in enumerate(facts) if f[2]]  # hops carry no answer
  tails = [f"Question: {f[4]}{template.assistant}{_answer_opening(task, f[3])}"
           for f, _ in asked]
  tail_tokens = [len(encode(t)) for t in tails]

  def size(n):
    prefix, _ = _build(task, facts, n, template)
    return len(encode(prefix)) + max(tail_tokens)

  if size(0) > target:
    raise KvjaxError(f"{task}: instructions, facts and question alone take {size(0)} tokens, "
                     f"more than the context length {target}; ask for a longer context")
  lo, hi = 0, 1
  while size(hi) <= target:  # grow, then bisect the largest filler count that fits
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if size(mid) <= target else (lo, mid)
  prefix, offsets = _build(task, facts, lo, template)
  queries = tuple(Query(tail=tail, answer=f[2], depth=f[0], fact_char=offsets[j],
                        fact_token=len(encode(prefix[:offsets[j]])), key=f[3])
                  for (f, j), tail in zip(asked, tails))
  n_prefix = len(encode(prefix))
  return Example(task=task, prefix=prefix, queries=queries,
                 n_tokens=n_prefix + max(tail_tokens), prefix_tokens=n_prefix,
                 target=int(target), seed=int(seed))


_DIGITS = re.compile(r"\d+")


def score(generated: str, answer: str) -> float:
  """1.0 when the first run of digits in `generated` is exactly `answer`, else 0.0."""
  m = _DIGITS.search(generated)
  return float(m is not None and m.group(0) == answer)


# -- answering through a cache -------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, tokens_BT, lengths_B, cache, *, cfg):
  """One call through the cache (not donated: a prefix cache serves several tails).
  Returns the last valid token's logits [B, V] and the new cache."""
  from kvjax import cache as cache_lib
  from kvjax import decode

  T = tokens_BT.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  positions = jnp.where(t < lengths_B[:, None], cache.lengths[:, None] + t, -1)
  model, params = decode.network(cfg, params, logits_last=True)  # lm_head on the last token
  logits_B1V, cache = cache_lib.LAYOUTS[cache.spec.layout].forward(model, params, tokens_BT,
                                                                   positions, cache)
  return logits_B1V[:, 0], cache


@functools.partial(jax.jit, static_argnames=("cfg", "steps"))
def _greedy(params, cache, logits_BV, *, cfg, steps: int):
  from kvjax import cache as cache_lib
  from kvjax import decode

  model, params = decode.network(cfg, params)
  layout = cache_lib.LAYOUTS[cache.spec.layout]

  def step(carry, _):
    c, tok = carry
    logits, c = layout.forward(model, params, tok[:, None], c.lengths[:, None], c)
    nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    return (c, nxt), nxt

  first = jnp.argmax(logits_BV, -1).astype(jnp.int32)
  _, rest = jax.lax.scan(step, (cache, first), None, length=steps - 1)
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def _pad(ids, size: int) -> tuple[np.ndarray, np.ndarray]:
  out = np.zeros((1, size), np.int32)
  out[0, :len(ids)] = ids
  return out, np.array([len(ids)], np.int32)


def prefill(cfg, params, ids, capacity: int, chunk: int = 512):
  """The prefix through `cfg`'s cache, `chunk` tokens per call (the last call padded, so one
  program serves every length). Returns the filled cache."""
  from kvjax import cache as cache_lib

  if len(ids) > capacity:
    raise KvjaxError(f"prefix of {len(ids)} tokens exceeds the cache capacity {capacity}")
  c = cache_lib.init_cache(cfg, 1, capacity)
  for s in range(0, len(ids), chunk):
    tok, n = _pad(ids[s:s + chunk], chunk)
    _, c = _forward(params, tok, n, c, cfg=cfg)
  return c


@functools.partial(jax.jit, static_argnames=("cfg", "capacity"))
def _reencode(k_LKND, v_LKND, n, *, cfg, capacity: int):
  from kvjax import cache as cache_lib

  c = cache_lib.init_cache(cfg, 1, capacity)
  k = jnp.swapaxes(k_LKND, 1, 2)[:, None]  # [L, 1, N, K, D]
  v = jnp.swapaxes(v_LKND, 1, 2)[:, None]
  pos = jnp.where(jnp.arange(k.shape[2]) < n, jnp.arange(k.shape[2]), -1)[None, :]
  return cache_lib.LAYOUTS[c.spec.layout].write(c, k, v, pos.astype(jnp.int32))


def prefix_kv(fp32_cache) -> tuple:
  """(K, V, n): the full-precision K/V [L, K, n, D] of a one-sequence fp32 contiguous cache
  without a residual window (the output of `prefill` with `evaluate.reference_config`)."""
  spec = fp32_cache.spec
  if (spec.layout, spec.k_codec, spec.v_codec, spec.residual) != ("contiguous", "fp32",
                                                                   "fp32", 0):
    raise KvjaxError("prefix_kv needs an fp32 contiguous cache without a residual window")
  n = int(fp32_cache.lengths[0])
  return fp32_cache.k[:, 0], fp32_cache.v[:, 0], n


def encode_prefix(cfg, kv, capacity: int):
  """A fresh `cfg` cache holding the prefix's full-precision K/V stored through its codec
  and layout: the same `write` a prefill with this cache makes after computing them."""
  k, v, n = kv
  return _reencode(k, v, jnp.int32(n), cfg=cfg, capacity=capacity)


def answer_through_cache(cfg, params, cache, tail_ids, steps: int, tail_pad: int = 0):
  """Greedy tokens [steps] after feeding `tail_ids` as one call through `cache` (a cache
  holding the prefix; not consumed). Every tail and answer token reads the prefix's
  encoded K/V. `tail_pad` pads the tail so one program serves tails of any length."""
  tok, n = _pad(tail_ids, max(tail_pad, len(tail_ids)))
  last, c = _forward(params, tok, n, cache, cfg=cfg)
  return [int(t) for t in np.asarray(_greedy(params, c, last, cfg=cfg, steps=steps))[0]]
