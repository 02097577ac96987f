"""The task generators (passkey, niah, vt): a haystack of filler sentences fitted to a token
budget with fact lines at the requested depths, one query per fact, and `score`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

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
  and the answer's opening words; `intro`: open with the task's instructions (a chat
  model's prompt). A base model reads no instructions; it continues text, and one that
  names the fact ("There is a pass key hidden ...") is a second match for the answer's
  opening words, which such a model copies from instead of the fact."""
  name: str
  user: str
  assistant: str
  intro: bool = True


PLAIN = Template("plain", "", "\n")
BASE = Template("base", "", "\n", intro=False)
CHATML = Template("chatml", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
GEMMA = Template("gemma", "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n")
TEMPLATES = {t.name: t for t in (PLAIN, BASE, CHATML, GEMMA)}
OWN = "model"  # params.template: the model's own chat template (`own_template`)
_SLOT = "\x00question\x00"
_TURN_TOKENS = ((GEMMA, "<start_of_turn>"), (CHATML, "<|im_start|>"))


def own_template(tok) -> Template:
  """The model's own chat template as a `Template`: one user turn holding a placeholder,
  rendered with the assistant's opening (`kvjax.io.chat.render`), split at the
  placeholder; the BOS the template prints is left to the tokenizer where it adds one
  itself. Where the metadata has no template (Gemma 3's GGUF files), the turn format its
  vocabulary's turn tokens name (`<start_of_turn>`: GEMMA, `<|im_start|>`: CHATML). A
  template that does not print the user's text once, or none at all, is one line."""
  from kvjax.io import chat
  info = getattr(tok, "chat", None)
  if info is None or info.template is None:
    to_id = getattr(tok, "token_to_id", lambda _: None)
    for template, token in _TURN_TOKENS:
      if to_id(token) is not None:
        return Template(OWN, template.user, template.assistant)
  text = chat.render(info, [{"role": "user", "content": _SLOT}])
  if text.count(_SLOT) != 1:
    raise KvjaxError(f"the chat template of {info.origin} does not print a user turn's "
                     "text once; use params.template=plain or chatml")
  user, assistant = text.split(_SLOT)
  if getattr(tok, "bos_id", None) is not None and info.bos_token \
      and user.startswith(info.bos_token):
    user = user[len(info.bos_token):]
  return Template(OWN, user, assistant)


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
  parts = [template.user + (_INTRO[task] + "\n" if template.intro else "")]
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
