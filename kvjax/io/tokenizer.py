"""Tokenizers: byte-level (vocab 256 + specials, no files needed), a Hugging Face
`tokenizer.json` through the `tokenizers` library when a checkpoint ships one, or the
byte-level BPE a GGUF file describes in its metadata (`gguf:PATH`, built by
kvjax.io.gguf_tokenizer)."""

from __future__ import annotations

from pathlib import Path

from kvjax.errors import KvjaxError

BOS, EOS, PAD = 256, 257, 258
BYTE_VOCAB = 260  # 256 bytes + BOS, EOS, PAD + one spare (a multiple of 4)


class ByteTokenizer:
  """Bytes as ids; no chat template and no stop tokens (the models it serves are random)."""

  vocab_size = BYTE_VOCAB
  bos_id, eos_id, pad_id = BOS, EOS, PAD
  chat = None
  stop_ids: frozenset = frozenset()

  def encode(self, text: str, bos: bool = True) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A `tokenizers.Tokenizer` from a tokenizer.json file (or an already built one); `chat`
  holds the model's chat template and stop ids (kvjax.io.chat) when its metadata has them."""

  chat = None

  def __init__(self, path: str | Path | None = None, *, built=None, bos_id: int | None = None):
    self.bos_id = bos_id  # prepended by encode() when the model's tokenizer asks for it
    if built is not None:
      self._tok = built
      return
    try:
      from tokenizers import Tokenizer
    except ImportError:
      raise KvjaxError("reading tokenizer.json needs the `tokenizers` package: "
                       "pip install tokenizers") from None
    try:
      self._tok = Tokenizer.from_file(str(path))
    except BaseException as e:  # plain Exceptions for bad files, pyo3's PanicException (a
      if isinstance(e, (KeyboardInterrupt, SystemExit)):  # BaseException) for some
        raise
      first = (str(e).splitlines() or [type(e).__name__])[0][:160]
      raise KvjaxError(f"cannot read tokenizer {path}: {first}; the file is corrupt: restore "
                       "it or delete it to run without a tokenizer (--prompt-ids)") from None

  def encode(self, text: str, bos: bool = True) -> list[int]:
    """Ids of `text` (special tokens written in it become their ids); BOS first when the
    model asks for one and `bos` (a chat template prints its own)."""
    ids = self._tok.encode(text).ids
    return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids])

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  @property
  def stop_ids(self) -> frozenset:
    """Ids that end a reply: EOS and the end-of-turn ids of the metadata."""
    return self.chat.stop_ids if self.chat is not None else frozenset()


def get_tokenizer(name: str, folder: str | Path | None = None):
  """`bytes`, `none`, `gguf:PATH` or a path to tokenizer.json; a checkpoint folder's
  tokenizer.json wins."""
  from kvjax.io import chat

  if folder is not None and (Path(folder) / "tokenizer.json").is_file():
    name = str(Path(folder) / "tokenizer.json")
  if name.startswith("gguf:"):
    from kvjax.io import gguf, gguf_tokenizer
    path = name[len("gguf:"):]
    built, add_bos, bos = gguf_tokenizer.tokenizer_json(path)
    tok = HFTokenizer(built=built, bos_id=bos if add_bos else None)
    tok.chat = chat.from_gguf(gguf.metadata(path), built.id_to_token, origin=Path(path).name)
    return tok
  if name == "bytes":
    return ByteTokenizer()
  if name in ("", "none"):
    return None
  if Path(name).is_file():
    tok = HFTokenizer(name)
    tok.chat = chat.from_hf(Path(name).parent, tok.token_to_id)
    return tok
  raise KvjaxError(f"unknown tokenizer '{name}'; use bytes, none, gguf:FILE or a path to tokenizer.json")
