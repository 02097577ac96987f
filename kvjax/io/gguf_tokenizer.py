"""The byte-level BPE tokenizer a GGUF file describes in its metadata, as a
`tokenizers.Tokenizer` (`tokenizer: gguf:PATH` in a config; kvjax.io.tokenizer builds it).

    tok, add_bos, bos_id = gguf_tokenizer.tokenizer_json("model.gguf")

The vocabulary, merges and token types are checked before `tokenizers` sees them: the
library panics (a pyo3 `PanicException`, which is a BaseException, with a Rust backtrace
printed on stderr) on a merge that is not a pair, and raises on merges that name tokens
outside the vocabulary. Either is one line naming the file and the first bad entry.
"""

from __future__ import annotations

from pathlib import Path

from kvjax.errors import KvjaxError


def _corrupt(path, what: str) -> KvjaxError:
  return KvjaxError(f"GGUF file {path} has an inconsistent tokenizer ({what}); the file is "
                    "corrupt: restore or re-download it")


def _strings(field, key: str, path) -> list[str]:
  try:
    items = list(field.contents())
  except Exception:  # noqa: BLE001  a field whose bytes do not decode as its declared type
    raise _corrupt(path, f"'{key}' cannot be decoded") from None
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


def _build(vocab: dict, pairs: list, path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  try:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
  except BaseException as e:  # noqa: BLE001  pyo3's PanicException derives from BaseException
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
      raise
    raise _corrupt(path, (str(e).splitlines() or [type(e).__name__])[0][:120]) from None
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return tok


def tokenizer_json(path: str | Path):
  """(`tokenizers.Tokenizer`, add_bos, bos_id) for the file's byte-level BPE vocabulary.

  Built as transformers' GGUF loader builds it: BPE over the stored vocab and merges,
  GPT-2 byte-level pre-tokenizer and decoder, no prefix space, control tokens (type 3) as
  special added tokens that are never split. No BOS is added unless the file asks.
  """
  from tokenizers import AddedToken, pre_tokenizers

  from kvjax.io import gguf

  file = gguf.reader(str(path))
  meta = gguf.metadata(path)
  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise KvjaxError(f"GGUF tokenizer model {kind!r:.40} is not supported; kvjax builds "
                     "byte-level BPE (gpt2) tokenizers from GGUF metadata")
  field = file.fields.get("tokenizer.ggml.tokens")
  if field is None:
    raise KvjaxError(f"GGUF file {path} has a BPE tokenizer without tokens")
  tokens = _strings(field, "tokenizer.ggml.tokens", path)
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
    raise _corrupt(path, f"token {dup!r:.40} appears twice in the vocabulary")
  merges = file.fields.get("tokenizer.ggml.merges")
  if merges is None:
    raise KvjaxError(f"GGUF file {path} has a BPE tokenizer without merges")
  tok = _build(vocab, _merges(merges, vocab, path), path)
  types = file.fields.get("tokenizer.ggml.token_type")
  if types is not None:
    try:
      kinds = list(types.contents())
    except Exception:  # noqa: BLE001
      raise _corrupt(path, "'tokenizer.ggml.token_type' cannot be decoded") from None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, kinds) if ty == 3 and set(t) <= alphabet]
    tok.add_special_tokens(control)
  add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
  bos = meta.get("tokenizer.ggml.bos_token_id")
  if not isinstance(add_bos, bool):
    raise _corrupt(path, f"'tokenizer.ggml.add_bos_token' is {add_bos!r:.40}, not a boolean")
  if add_bos and (isinstance(bos, bool) or not isinstance(bos, int) or not 0 <= bos < len(tokens)):
    raise _corrupt(path, f"'tokenizer.ggml.bos_token_id' is {bos!r:.40}, not a token id "
                   f"below {len(tokens)}")
  return tok, add_bos, bos
