"""The RULER-style suite: retrieval, multi-hop tracing and aggregation tasks generated here
(no downloads) at any token length, scored by string match.

Eleven tasks in three families (`FAMILY`); each `make` returns a `Suite` example: a
*context* (template opening, instructions for a chat prompt, the haystack with its facts)
and its questions, each with the strings its answer must contain (`Ask.expected`).

  niah_single_1    noise haystack (repeated filler sentences); one needle "One of the
                   special magic numbers for KEY is: 1234567."; asked for KEY's number
  niah_single_2    the same needle in a prose haystack (the named prose text)
  niah_single_3    prose haystack, the value a UUID
  niah_multikey_1  prose haystack, four needles with four keys; each asked in turn (the
                   other three are its distractors)
  niah_multikey_2  a haystack made of needles alone (every sentence is a distractor); four
                   of them, spread through the context, asked in turn
  niah_multikey_3  the same with UUID keys and UUID values
  niah_multivalue  prose haystack, four needles of one key; the answer must hold all four
  niah_multiquery  prose haystack, four needles; one question asks for all four keys
  vt               noise haystack holding a chain `VAR A = 12345`, then `VAR B = VAR A`, ...
                   (`hops` links, each after the one it copies); the answer must name
                   every variable that holds the value
  cwe              common words: a numbered list where ten words appear `COMMON` times each
                   and the rest `RARE` times; the answer must name the ten
  fwe              frequent words: a "coded text" of made-up words drawn from a Zipf law
                   (exponent `ZIPF`); the answer must name the three most frequent

Keys are two words from fixed lists (`WORDS`, `ADJECTIVES`; over two thousand pairs),
values seven-digit numbers or UUIDs, made-up words syllable strings: all drawn from a
generator seeded by (task, length, seed), so one set of arguments gives one example.

Score (`score`): the share of the expected strings found in the generated text, ignoring
case (RULER's string-match-all); a question with one expected string scores 0 or 1.
Which scores are ranked: `kvjax.lab.tasks.calibration`.

The context fills `target` tokens of the model's tokenizer, less the longest question's
tail: a bisection on the number of haystack pieces (sentences of the prose, filler
sentences, needles, list items, coded words), the facts held at their depths.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from kvjax.errors import KvjaxError
from kvjax.lab.tasks.haystack import FILLER, WORDS, PLAIN, Template

FAMILY = {
    "niah_single_1": "niah", "niah_single_2": "niah", "niah_single_3": "niah",
    "niah_multikey_1": "niah", "niah_multikey_2": "niah", "niah_multikey_3": "niah",
    "niah_multivalue": "niah", "niah_multiquery": "niah",
    "vt": "vt", "cwe": "aggregation", "fwe": "aggregation",
}
TASKS = tuple(FAMILY)
FAMILIES = tuple(dict.fromkeys(FAMILY.values()))
SINGLE = ("niah_single_1", "niah_single_2", "niah_single_3")

# tokens an answer may take: seven digits, a UUID (36 characters), four numbers, five
# variable names, ten words, three words; each with room for the model's punctuation
GEN_LEN = {"niah_single_1": 12, "niah_single_2": 12, "niah_single_3": 32,
           "niah_multikey_1": 12, "niah_multikey_2": 12, "niah_multikey_3": 32,
           "niah_multivalue": 48, "niah_multiquery": 48, "vt": 32, "cwe": 48, "fwe": 20}

ADJECTIVES = ("able", "bold", "brave", "bright", "calm", "clever", "cold", "cosmic",
              "curious", "dark", "eager", "early", "faint", "fancy", "fierce", "gentle",
              "giant", "golden", "grand", "hidden", "humble", "icy", "jolly", "kind",
              "lively", "lonely", "lucky", "magic", "mellow", "misty", "modern", "noble",
              "odd", "pale", "proud", "quiet", "rapid", "royal", "rustic", "silent",
              "sleepy", "smooth", "solar", "spicy", "steady", "stormy", "sunny", "swift",
              "tender", "tiny", "vivid", "wild", "witty", "young")
N_NEEDLES = 4   # multikey_1's needles, multivalue's values, multiquery's keys, asked needles
HOPS = 4        # vt: links after the value line
COMMON, RARE, N_COMMON = 30, 3, 10  # cwe: the ten common words' and the others' counts
ZIPF, N_FREQUENT = 2.0, 3           # fwe


@dataclasses.dataclass(frozen=True)
class Ask:
  """One question: `tail` fed after the context (question, template, answer opening),
  the strings the answer must hold, the depth (0 first, 1 last) and token of the fact it
  rests on, and the answer tokens to generate."""
  tail: str
  expected: tuple
  depth: float
  fact_token: int
  gen_len: int
  key: str = ""


@dataclasses.dataclass(frozen=True)
class Suite:
  task: str
  family: str
  haystack: str      # noise, prose, needles, list, coded
  context: str       # template opening + instructions + haystack
  asks: tuple        # of Ask
  n_tokens: int      # tokens of context + the longest tail
  context_tokens: int
  target: int
  seed: int


# -- what a task draws -------------------------------------------------------------------------

def _number(rng) -> str:
  return str(int(rng.integers(10 ** 6, 10 ** 7)))


def _uuid(rng) -> str:
  h = "".join(f"{int(b):02x}" for b in rng.integers(0, 256, size=16))
  return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _keys(rng, n: int) -> list[str]:
  """n distinct two-word keys ("quiet-harbor")."""
  pairs = rng.choice(len(ADJECTIVES) * len(WORDS), size=n, replace=False)
  return [f"{ADJECTIVES[int(p) // len(WORDS)]}-{WORDS[int(p) % len(WORDS)]}" for p in pairs]


_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")


def _made_up(rng, n: int, syllables: int = 3) -> list[str]:
  """n distinct made-up words of `syllables` syllables ("kotaru")."""
  out: dict = {}
  while len(out) < n:
    picks = rng.integers(0, len(_SYLLABLES), size=(2 * n, syllables))
    for row in picks:
      out.setdefault("".join(_SYLLABLES[int(i)] for i in row), None)
      if len(out) == n:
        break
  return list(out)


def _var_names(rng, n: int) -> list[str]:
  names: dict = {}
  while len(names) < n:
    names.setdefault("".join(chr(ord("A") + int(i)) for i in rng.integers(0, 26, size=5)), None)
  return list(names)


def _needle(key: str, value: str, kind: str) -> str:
  return f"One of the special magic {kind} for {key} is: {value}."


def _kind(task: str) -> str:
  return "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"


# -- haystacks: lists of pieces, joined with spaces ------------------------------------------

def _sentences(text: str) -> list[str]:
  """The prose text cut into sentences (whitespace folded), for a prose haystack."""
  flat = " ".join(text.split())
  return [s.strip() for s in re.split(r"(?<=[.!?])\s+", flat) if s.strip()]


def _noise(n: int) -> list[str]:
  filler = [s.strip() + "." for s in FILLER.split(".") if s.strip()]
  return [filler[i % len(filler)] for i in range(n)]


@dataclasses.dataclass
class _Plan:
  """A task's pieces before fitting: `pieces(n)` the haystack of n pieces, `facts` the
  (depth, line) pairs inserted at their depths, the questions and what they expect."""
  haystack: str
  intro: str
  pieces: Callable[[int], list]
  facts: list             # (depth, line)
  questions: list         # (question, answer opening, expected, depth, fact index, key)
  max_pieces: int = 1 << 20
  joiner: str = " "
  recount: Callable[[int], tuple] | None = None  # the expected strings, from n pieces


def _plan(task: str, rng, prose: list[str]) -> _Plan:
  kind = _kind(task)
  intro = ("Some special magic " + kind + " are hidden inside the following text. Make sure "
           "to memorize them. I will quiz you about the " + kind + " afterwards.")
  value = _uuid if kind == "uuids" else _number

  rng_start = rng.integers(0, 1 << 30)  # where the prose starts; seeds the shuffles

  def prose_pieces(n):
    if not prose:
      raise KvjaxError("the prose haystack needs the named prose text: run make models")
    start = int(rng_start) % len(prose)
    return [prose[(start + i) % len(prose)] for i in range(n)]
  opening = "The special magic {k} for {key} mentioned in the provided text {verb}"
  ask = "What {verb} {det}special magic {k} for {key} mentioned in the provided text?"

  def single(key, depth, expected, idx, plural=False):
    verb = "are" if plural else "is"
    q = ask.format(verb=verb, det="all the " if plural else "the ", k=kind if plural
                   else kind[:-1], key=key)
    o = opening.format(k=kind if plural else kind[:-1], key=key, verb=verb)
    return (q, o, tuple(expected), depth, idx, key)

  if task in ("niah_single_1", "niah_single_2", "niah_single_3"):
    (key,), v, d = _keys(rng, 1), value(rng), float(rng.uniform(0, 1))
    pieces = _noise if task == "niah_single_1" else prose_pieces
    return _Plan("noise" if task == "niah_single_1" else "prose", intro, pieces,
                 [(d, _needle(key, v, kind))], [single(key, d, [v], 0)])
  if task == "niah_multikey_1":
    keys, depths = _keys(rng, N_NEEDLES), np.sort(rng.uniform(0, 1, size=N_NEEDLES))
    values = [value(rng) for _ in keys]
    facts = [(float(d), _needle(k, v, kind)) for d, k, v in zip(depths, keys, values)]
    return _Plan("prose", intro, prose_pieces, facts,
                 [single(k, float(d), [v], i) for i, (d, k, v) in
                  enumerate(zip(depths, keys, values))])
  if task in ("niah_multikey_2", "niah_multikey_3"):
    # every piece is a needle; the asked ones sit at spread depths among them
    pool = 2048
    keys_all = _keys(rng, pool) if kind == "numbers" else [_uuid(rng) for _ in range(pool)]
    vals_all = [value(rng) for _ in range(pool)]
    asked_keys, others = keys_all[:N_NEEDLES], keys_all[N_NEEDLES:]
    depths = np.sort(rng.uniform(0, 1, size=N_NEEDLES))
    facts = [(float(d), _needle(k, v, kind)) for d, k, v in zip(depths, asked_keys, vals_all)]
    return _Plan("needles", intro,
                 lambda n: [_needle(k, v, kind) for k, v in
                            zip(others[:n], vals_all[N_NEEDLES:N_NEEDLES + n])], facts,
                 [single(k, float(d), [v], i) for i, (d, k, v) in
                  enumerate(zip(depths, asked_keys, vals_all))], max_pieces=pool - N_NEEDLES)
  if task == "niah_multivalue":
    (key,), depths = _keys(rng, 1), np.sort(rng.uniform(0, 1, size=N_NEEDLES))
    values = [value(rng) for _ in range(N_NEEDLES)]
    facts = [(float(d), _needle(key, v, kind)) for d, v in zip(depths, values)]
    return _Plan("prose", intro, prose_pieces, facts,
                 [single(key, float(depths[0]), values, 0, plural=True)])
  if task == "niah_multiquery":
    keys, depths = _keys(rng, N_NEEDLES), np.sort(rng.uniform(0, 1, size=N_NEEDLES))
    values = [value(rng) for _ in keys]
    facts = [(float(d), _needle(k, v, kind)) for d, k, v in zip(depths, keys, values)]
    named = ", ".join(keys[:-1]) + " and " + keys[-1]
    return _Plan("prose", intro, prose_pieces, facts,
                 [single(named, float(depths[0]), values, 0, plural=True)])
  if task == "vt":
    names, v = _var_names(rng, HOPS + 1), str(int(rng.integers(10 ** 4, 10 ** 5)))
    depths = np.sort(rng.uniform(0, 1, size=HOPS + 1))
    facts = [(float(depths[0]), f"VAR {names[0]} = {v}.")] + \
        [(float(d), f"VAR {b} = VAR {a}.") for d, a, b in zip(depths[1:], names, names[1:])]
    intro_vt = ("Memorize and track the chain(s) of variable assignment hidden in the "
                "following text.")
    q = f"Find all variables that are assigned the value {v} in the text above."
    o = (f"According to the chain(s) of variable assignment in the text above, {HOPS + 1} "
         f"variables are assigned the value {v}, they are:")
    return _Plan("noise", intro_vt, _noise, facts,
                 [(q, o, tuple(names), float(depths[0]), 0, v)])
  if task == "cwe":
    words = _made_up(rng, 8192)
    common, rare = words[:N_COMMON], words[N_COMMON:]
    order = rng.permutation(len(rare))
    intro_cwe = ("Below is a numbered list of words. In these words, some appear more often "
                 "than others. Memorize the ones that appear most often.")

    def items(n):  # n rare words, each RARE times, with the common ones, shuffled (seeded)
      bag = [rare[int(i)] for i in order[:n]] * RARE + common * COMMON
      perm = np.random.default_rng([int(rng_start), n]).permutation(len(bag))
      return [f"{j + 1}. {bag[int(p)]}" for j, p in enumerate(perm)]
    q = f"What are the {N_COMMON} most common words in the above list?"
    o = f"The top {N_COMMON} words that appear most often in the list are:"
    return _Plan("list", intro_cwe, items, [], [(q, o, tuple(common), 0.0, -1, "")],
                 max_pieces=len(rare), joiner="\n")
  # fwe
  vocab = _made_up(rng, 4096)
  weights = 1.0 / np.arange(1, len(vocab) + 1) ** ZIPF
  intro_fwe = ("Read the following coded text and track the frequency of each coded word. "
               "Find the three most frequently appeared coded words.")

  def coded(n):
    draw = np.random.default_rng([int(rng_start), n]).choice(len(vocab), size=n,
                                                             p=weights / weights.sum())
    return [vocab[int(i)] for i in draw]
  q = "What are the three most frequently appeared words in the above coded text?"
  o = "According to the coded text above, the three most frequently appeared words are:"
  def top(n):  # the drawn text's own most frequent words (ties: the likelier word first)
    index = {w: i for i, w in enumerate(vocab)}
    counts = np.bincount([index[w] for w in coded(n)], minlength=len(vocab))
    return tuple(vocab[int(i)] for i in np.argsort(-counts, kind="stable")[:N_FREQUENT])
  return _Plan("coded", intro_fwe, coded, [], [(q, o, tuple(vocab[:N_FREQUENT]), 0.0, -1, "")],
               recount=top)


def _context(plan: _Plan, n: int, template: Template) -> tuple[str, list[int]]:
  """The context of n haystack pieces with the facts at their depths; (text, the character
  offset of each fact line)."""
  pieces = plan.pieces(n)  # cwe: n rare words make more list items than n
  n = len(pieces)
  at: list[list] = [[] for _ in range(n + 1)]
  for i, (d, line) in enumerate(plan.facts):
    at[int(round(d * n))].append((i, line))
  head = template.user + (plan.intro + "\n" if template.intro else "")
  parts, pos, offsets = [head], len(head), [0] * len(plan.facts)
  for i in range(n + 1):
    for j, line in at[i]:
      offsets[j] = pos
      parts.append(line + plan.joiner)
      pos += len(line) + len(plan.joiner)
    if i < n:
      parts.append(pieces[i] + plan.joiner)
      pos += len(pieces[i]) + len(plan.joiner)
  return "".join(parts) + "\n", offsets


def check(task: str, target: int) -> None:
  if task not in FAMILY:
    raise KvjaxError(f"unknown task '{task}'; use one of {', '.join(TASKS)} (or a family: "
                     f"{', '.join(FAMILIES)})")
  if int(target) <= 0:
    raise KvjaxError(f"context length must be positive, got {target}")


def expand(names) -> list[str]:
  """Task names with families (`niah`, `vt`, `aggregation`) and `all` spelled out, in
  suite order, each once; an unknown name is one line."""
  names = [names] if isinstance(names, str) else list(names)
  out: dict = {}
  for n in names:
    if n == "all":
      out.update(dict.fromkeys(TASKS))
    elif n in FAMILIES:
      out.update(dict.fromkeys(t for t in TASKS if FAMILY[t] == n))
    else:
      check(n, 1)
      out[n] = None
  return list(out)


def make(task: str, encode: Callable[[str], list], target: int, seed: int = 0,
         template: Template = PLAIN, prose: str = "") -> Suite:
  """One example of `task` whose context and longest question fit `target` tokens of
  `encode`, within one haystack piece of it; `prose`: the text a prose haystack is cut
  from. Deterministic: the same arguments give the same example."""
  check(task, target)
  rng = np.random.default_rng([seed, int(target), TASKS.index(task)])
  plan = _plan(task, rng, _sentences(prose) if prose else [])
  tails = [(f"Question: {q}{template.assistant}{o}", exp, d, i, key)
           for q, o, exp, d, i, key in plan.questions]
  tail_tokens = max(len(encode(t[0])) for t in tails)

  def size(n):
    return len(encode(_context(plan, n, template)[0])) + tail_tokens

  if size(0) > target:
    raise KvjaxError(f"{task}: instructions, facts and question alone take {size(0)} tokens, "
                     f"more than the context length {target}; ask for a longer context")
  lo, hi = 0, 1
  while hi <= plan.max_pieces and size(hi) <= target:
    lo, hi = hi, hi * 2
  hi = min(hi, plan.max_pieces + 1)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if size(mid) <= target else (lo, mid)
  context, offsets = _context(plan, lo, template)
  if plan.recount is not None:
    tails = [(t, plan.recount(lo), d, i, key) for t, _, d, i, key in tails]
  asks = tuple(Ask(tail=t, expected=exp, depth=d, gen_len=GEN_LEN[task], key=key,
                   fact_token=len(encode(context[:offsets[i]])) if i >= 0 else 0)
               for t, exp, d, i, key in tails)
  n = len(encode(context))
  return Suite(task=task, family=FAMILY[task], haystack=plan.haystack, context=context,
               asks=asks, n_tokens=n + tail_tokens, context_tokens=n, target=int(target),
               seed=int(seed))


def score(generated: str, expected) -> float:
  """The share of `expected` strings found in `generated`, ignoring case."""
  if not expected:
    raise KvjaxError("a question must expect at least one string")
  text = generated.lower()
  return sum(e.lower() in text for e in expected) / len(expected)
