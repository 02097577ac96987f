"""A GGUF file's metadata and tensor table, parsed straight from its bytes.

    f = gguf_file.open_file("model.gguf")
    f.fields["general.architecture"]    # 'gemma3'; arrays are lists (strings) or numpy arrays
    f.tensors["token_embd.weight"].data   # a read-only view of the file: [rows, row bytes]

ggml's `gguf` package reads these files too, but its reader builds numpy views for every
element of every array field before it returns: a 262,144-token vocabulary (three arrays)
took it ~30 s. Here the header is one pass of `struct` over the bytes (numeric arrays are
one `frombuffer` each), tensor data is a view of a memory map made when asked for, and
only dequantization (`gguf.quants`) is left to the package. Every count, length and offset
is checked against the file's size before anything is allocated, so a truncated or
malformed file is one line (`KvjaxError`), never a traceback or a huge allocation.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

from kvjax.errors import KvjaxError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ARRAY_DTYPES = {k: np.dtype(v) for k, v in _SCALARS.items()}
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
          28: np.float64}  # ggml types stored as plain numbers (the rest are blocks of bytes)


class Malformed(ValueError):
  """A structural fault in the file; `open_file` turns it into one line naming the file."""


@dataclasses.dataclass(frozen=True)
class Tensor:
  name: str
  tensor_type: int          # a ggml type (gguf.GGMLQuantizationType)
  shape: tuple              # numpy order: [outer, ..., row length] (ggml's dims reversed)
  offset: int               # of its bytes in the file
  nbytes: int
  file: "GGUFFile"

  @property
  def data(self) -> np.ndarray:
    """The stored bytes as `gguf.quants.dequantize` takes them: plain types as numbers of
    `shape`, block types as uint8 [..., bytes per row]."""
    raw = self.file.bytes_at(self.offset, self.nbytes)
    if self.tensor_type in _PLAIN:
      return raw.view(_PLAIN[self.tensor_type]).reshape(self.shape)
    return raw.reshape(*self.shape[:-1], -1)


@dataclasses.dataclass
class GGUFFile:
  path: Path
  version: int
  fields: dict
  tensors: dict             # name -> Tensor, in file order
  buffer: mmap.mmap         # the whole file, mapped read-only

  def bytes_at(self, offset: int, n: int) -> np.ndarray:
    return np.frombuffer(self.buffer, np.uint8, n, offset)


class _Cursor:
  def __init__(self, buf, size: int):
    self.buf, self.size, self.at = buf, size, 0

  def take(self, n: int) -> int:
    if n < 0 or self.at + n > self.size:
      raise Malformed(f"a field at byte {self.at} runs past the end of the file")
    start, self.at = self.at, self.at + n
    return start

  def scalar(self, fmt: str):
    return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

  def string(self) -> str:
    n = self.scalar("<Q")
    start = self.take(n)
    try:
      return self.buf[start:start + n].decode("utf-8")
    except UnicodeDecodeError:
      raise Malformed(f"the string at byte {start} is not UTF-8") from None

  def value(self, kind: int):
    if kind in _SCALARS:
      v = self.scalar(_SCALARS[kind])
      return bool(v) if kind == 7 else (float(v) if kind in (6, 12) else int(v))
    if kind == _STRING:
      return self.string()
    if kind != _ARRAY:
      raise Malformed(f"unknown value type {kind} at byte {self.at}")
    sub, n = self.scalar("<I"), self.scalar("<Q")
    if sub == _STRING:
      if n * 8 > self.size - self.at:
        raise Malformed(f"an array of {n} strings is longer than the file")
      return [self.string() for _ in range(n)]
    if sub not in _ARRAY_DTYPES:
      raise Malformed(f"an array of value type {sub} (nested or unknown) at byte {self.at}")
    dt = _ARRAY_DTYPES[sub]
    start = self.take(n * dt.itemsize)
    arr = np.frombuffer(self.buf, dt, n, start)
    return arr.astype(bool) if sub == 7 else arr


def _parse(path: Path) -> GGUFFile:
  size = path.stat().st_size
  if size < 24:
    raise Malformed("shorter than a GGUF header")
  with open(path, "rb") as fh:
    buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
  cur = _Cursor(buf, size)
  if buf[:4] != MAGIC:
    raise Malformed("it does not start with 'GGUF'")
  cur.take(4)
  version = cur.scalar("<I")
  if version not in (2, 3):
    raise Malformed(f"GGUF version {version} (kvjax reads versions 2 and 3, little-endian)")
  n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
  if n_tensors > size or n_kv > size:
    raise Malformed(f"it claims {n_tensors} tensors and {n_kv} fields")
  fields = {}
  for _ in range(n_kv):
    key = cur.string()
    fields[key] = cur.value(cur.scalar("<I"))
  infos = []
  for _ in range(n_tensors):
    name = cur.string()
    n_dims = cur.scalar("<I")
    if n_dims > 8:
      raise Malformed(f"tensor '{name}' has {n_dims} dimensions")
    dims = [cur.scalar("<Q") for _ in range(n_dims)]
    infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
  align = fields.get("general.alignment", 32)
  if isinstance(align, bool) or not isinstance(align, int) or not 0 < align <= 1 << 16:
    raise Malformed(f"general.alignment is {align!r:.20}")
  start = -(-cur.at // align) * align
  out = GGUFFile(path, version, fields, {}, buf)
  for name, dims, kind, offset in infos:
    out.tensors[name] = _tensor(out, name, dims, kind, start + offset, size)
  return out


def _tensor(f: GGUFFile, name: str, dims: list, kind: int, offset: int, size: int) -> Tensor:
  from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

  try:
    qtype = GGMLQuantizationType(kind)
    block, per_block = GGML_QUANT_SIZES[qtype]
  except (ValueError, KeyError):
    raise Malformed(f"tensor '{name}' has ggml type {kind}, which the gguf package does not "
                    "know") from None
  n = int(np.prod(dims, dtype=object)) if dims else 1
  if not dims or dims[0] % block or n > size * block:
    raise Malformed(f"tensor '{name}' has dims {dims} (rows must be whole blocks of {block})")
  nbytes = n // block * per_block
  if offset + nbytes > size:
    raise Malformed(f"tensor '{name}' claims bytes past the end of the file")
  return Tensor(name, qtype, tuple(int(d) for d in reversed(dims)), offset, nbytes, f)


def open_file(path: str | Path) -> GGUFFile:
  """The parsed file, or one line naming it and what is wrong."""
  p = Path(path)
  if not p.is_file():
    raise KvjaxError(f"GGUF file not found: {p}; pass a .gguf file or a known model name "
                     "(kvjax models lists them)")
  try:
    return _parse(p)
  except Malformed as e:
    raise KvjaxError(f"cannot read GGUF file {p}: {e} (truncated or not a GGUF file?)") from None
  except (OSError, struct.error, ValueError, OverflowError, MemoryError) as e:
    first = (str(e).splitlines() or [type(e).__name__])[0][:120]
    raise KvjaxError(f"cannot read GGUF file {p}: {first} (truncated or not a GGUF file?)") \
        from None
