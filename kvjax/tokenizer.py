"""Tokenizers: byte-level (vocab 256 + specials, no files needed) or a Hugging Face
`tokenizer.json` through the `tokenizers` library when a checkpoint ships one."""

from __future__ import annotations

from pathlib import Path

from kvjax.errors import KvjaxError

BOS, EOS, PAD = 256, 257, 258
BYTE_VOCAB = 260  # 256 bytes + BOS, EOS, PAD + one spare (a multiple of 4)


class ByteTokenizer:
  vocab_size = BYTE_VOCAB
  bos_id, eos_id, pad_id = BOS, EOS, PAD

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  def __init__(self, path: str | Path):
    try:
      from tokenizers import Tokenizer
    except ImportError:
      raise KvjaxError("reading tokenizer.json needs the `tokenizers` package: "
                       "pip install tokenizers") from None
    try:
      self._tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exceptions for bad files
      raise KvjaxError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from None

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids])


def get_tokenizer(name: str, folder: str | Path | None = None):
  """`bytes`, `none`, or a path to tokenizer.json; a checkpoint folder's tokenizer wins."""
  if folder is not None and (Path(folder) / "tokenizer.json").is_file():
    return HFTokenizer(Path(folder) / "tokenizer.json")
  if name == "bytes":
    return ByteTokenizer()
  if name in ("", "none"):
    return None
  if Path(name).is_file():
    return HFTokenizer(name)
  raise KvjaxError(f"unknown tokenizer '{name}'; use bytes, none or a path to tokenizer.json")
