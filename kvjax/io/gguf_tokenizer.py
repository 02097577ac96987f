"""The tokenizer a GGUF file describes in its metadata, as a `tokenizers.Tokenizer`
(`tokenizer: gguf:PATH` in a config; kvjax.io.tokenizer builds it).

    tok, add_bos, bos_id = gguf_tokenizer.tokenizer_json("model.gguf")

Two kinds, built as transformers' GGUF loader builds them, so both give its ids:

- `gpt2` (SmolLM2, Qwen2.5): byte-level BPE over the stored vocabulary and merges, no
  prefix space. The text is split before BPE by the pattern its `tokenizer.ggml.pre` names
  (`SPLITS`: Qwen's splits digits one by one), else by GPT-2's.
- `llama` (SentencePiece BPE, Gemma 3): spaces become "▁", byte fallback for anything
  outside the vocabulary. The file stores no merges: every split of a token into two
  vocabulary tokens is a merge, ranked by the merged token's place in the vocabulary (Gemma
  lists tokens in merge order), the longer left piece first. Tokens made only of spaces are
  stored with real spaces and respelled with "▁" first.

Control tokens (type 3) are special added tokens, never split; user-defined ones (type 4)
are added tokens matched whole. The vocabulary, merges and token types are checked before
`tokenizers` sees them: the library panics (a pyo3 `PanicException`, a BaseException, with a
Rust backtrace on stderr) on a merge that is not a pair, and raises on merges that name
tokens outside the vocabulary. Either is one line naming the file and the first bad entry.
"""

from __future__ import annotations

from pathlib import Path

from kvjax.errors import KvjaxError

# `tokenizer.ggml.pre` -> the pattern that splits text before byte-level BPE.
SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPACE = "\u2581"  # SentencePiece's visible space
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _corrupt(path, what: str) -> KvjaxError:
  return KvjaxError(f"GGUF file {path} has an inconsistent tokenizer ({what}); the file is "
                    "corrupt: restore or re-download it")


def _strings(items, key: str, path) -> list[str]:
  if not isinstance(items, list):
    raise _corrupt(path, f"'{key}' is not an array of strings")
  bad = next((i for i, t in enumerate(items) if not isinstance(t, str)), None)
  if bad is not None:
    raise _corrupt(path, f"'{key}' entry {bad} is {items[bad]!r:.40}, not a string")
  return items


def _merges(field, vocab: dict, path) -> list[tuple[str, str]]:
  """Each merge is 'LEFT RIGHT' with both sides and their concatenation in the vocab."""
  pairs = []
  for i, merge in enumerate(_strings(field, "tokenizer.ggml.merges", path)):
    pair = tuple(merge.split(" ", 1))
    if len(pair) != 2 or not all(pair):
      raise _corrupt(path, f"merge {i} {merge!r:.40} is not two tokens separated by a space")
    missing = next((t for t in (*pair, pair[0] + pair[1]) if t not in vocab), None)
    if missing is not None:
      raise _corrupt(path, f"merge {i} {merge!r:.40} uses {missing!r:.40}, which is not in "
                     "the vocabulary")
    pairs.append(pair)
  return pairs


def implied_merges(tokens: list[str]) -> list[tuple[str, str]]:
  """The merges a SentencePiece vocabulary listed in merge order implies: every split of a
  token into two vocabulary tokens, by the token's rank, the longer left piece first."""
  vocab = set(tokens)
  return [(t[:i], t[i:]) for t in tokens for i in range(len(t) - 1, 0, -1)
          if t[:i] in vocab and t[i:] in vocab]


def _bpe(vocab: dict, pairs: list, path, **kw):
  from tokenizers import Tokenizer, models

  try:
    return Tokenizer(models.BPE(vocab=vocab, merges=pairs, **kw))
  except BaseException as e:  # noqa: BLE001  pyo3's PanicException derives from BaseException
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
      raise
    raise _corrupt(path, (str(e).splitlines() or [type(e).__name__])[0][:120]) from None


def _byte_level(tokens, vocab, file, meta, path):
  from tokenizers import Regex, decoders, pre_tokenizers

  merges = file.fields.get("tokenizer.ggml.merges")
  if merges is None:
    raise KvjaxError(f"GGUF file {path} has a BPE tokenizer without merges; the file is "
                     "incomplete: use another conversion of the model")
  tok = _bpe(vocab, _merges(merges, vocab, path), path, continuing_subword_prefix="",
             end_of_word_suffix="", fuse_unk=False)
  split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
  if split is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  return tok


def _sentencepiece(tokens, vocab, file, meta, path):
  from tokenizers import decoders, normalizers, pre_tokenizers

  unk_id = meta.get("tokenizer.ggml.unknown_token_id")
  if isinstance(unk_id, bool) or not isinstance(unk_id, int) or not 0 <= unk_id < len(tokens):
    raise _corrupt(path, f"'tokenizer.ggml.unknown_token_id' is {unk_id!r:.40}, not a token id")
  tok = _bpe(vocab, implied_merges(tokens), path, unk_token=tokens[unk_id], fuse_unk=True,
             byte_fallback=True)
  tok.normalizer = normalizers.Replace(" ", SPACE)
  tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  return tok


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def _need_field(file, key: str, path):
  field = file.fields.get(key)
  if field is None:
    raise KvjaxError(f"GGUF file {path} has a tokenizer without '{key}'; the file is "
                     "incomplete: use another conversion of the model, or --tokenizer none")
  return field


def tokenizer_json(path: str | Path):
  """(`tokenizers.Tokenizer`, add_bos, bos_id) for the file's tokenizer (`BUILDERS`)."""
  from tokenizers import AddedToken, pre_tokenizers

  from kvjax.io import gguf

  file = gguf.reader(str(path))
  meta = file.fields
  kind = meta.get("tokenizer.ggml.model")
  if kind not in BUILDERS:
    raise KvjaxError(f"GGUF tokenizer model {kind!r:.40} is not supported; kvjax builds "
                     f"{', '.join(BUILDERS)} tokenizers from GGUF metadata")
  tokens = _strings(_need_field(file, "tokenizer.ggml.tokens", path), "tokenizer.ggml.tokens",
                    path)
  if kind == "llama":  # runs of spaces are stored as spaces; the model reads them as "▁"
    tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
    raise _corrupt(path, f"token {dup!r:.40} appears twice in the vocabulary")
  tok = BUILDERS[kind](tokens, vocab, file, meta, path)
  types = file.fields.get("tokenizer.ggml.token_type")
  if types is not None:
    kinds = list(types) if hasattr(types, "__len__") and not isinstance(types, str) else None
    if kinds is None or len(kinds) != len(tokens):
      raise _corrupt(path, "'tokenizer.ggml.token_type' is not one number per token")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if kind == "gpt2" else None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, kinds)
                            if ty == CONTROL and (alphabet is None or set(t) <= alphabet)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, kinds) if ty == USER_DEFINED])
  add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
  bos = meta.get("tokenizer.ggml.bos_token_id")
  if not isinstance(add_bos, bool):
    raise _corrupt(path, f"'tokenizer.ggml.add_bos_token' is {add_bos!r:.40}, not a boolean")
  if add_bos and (isinstance(bos, bool) or not isinstance(bos, int) or not 0 <= bos < len(tokens)):
    raise _corrupt(path, f"'tokenizer.ggml.bos_token_id' is {bos!r:.40}, not a token id "
                   f"below {len(tokens)}")
  return tok, add_bos, bos
