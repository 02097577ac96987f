"""The codec contract and the codec registry.

A codec owns its bytes. `encode` turns a block of vectors `x[..., T, D]` into the codec's
stored pytree (every leaf keeps the token axis at -2, so a layout can allocate, write and
slice any codec the same way). Its read interface is one: `qk` and `pv`, the attention's
two reads of a block of stored tokens (so a quantized codec can fold its scales into the
logits and probabilities instead of materialising a full-precision copy of the cache), and
`stored`, what the storage is for the reads that load it directly (folded, Pallas, the CPU
kernel). The attention
keeps blocks small (`READ_CHUNK` tokens), so whatever a read widens is block-sized.

Registry codecs are generic; `for_role(name, cache_cfg, "k"|"v")` returns the instance a
cache actually uses, with the granularity knobs of `cache_cfg` (group size, key axis)
bound in (`Codec.configure`), so `encode` and the reads never need the config again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.codecs import dots
from kvjax.errors import KvjaxError

CODECS: dict[str, "Codec"] = {}


def register(codec: "Codec") -> "Codec":
  CODECS[codec.name] = codec
  return codec


def get(name: str) -> "Codec":
  try:
    return CODECS[name]
  except KeyError:
    raise KvjaxError(f"unknown codec '{name}'; known: {', '.join(CODECS)}") from None


READ_CHUNK = 512  # stored tokens the attention reads (and a codec widens) at once


_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float8_e4m3fn): jnp.uint8,
         jnp.dtype(jnp.float8_e5m2): jnp.uint8}


def store_bits(x: jax.Array) -> jax.Array:
  """bfloat16 and float8 are stored as their unsigned bit patterns: XLA:CPU has no native
  scatter for them and "normalizes" each one to float32 over the *whole* array (a
  one-token write into a bf16 cache allocated a float32 copy of the cache), while an
  integer scatter updates in place. The bitcast is free on every backend."""
  bits = _BITS.get(jnp.dtype(x.dtype))
  return x if bits is None else jax.lax.bitcast_convert_type(x, bits)


def load_bits(a: jax.Array, dtype) -> jax.Array:
  """Inverse of `store_bits` for a leaf whose logical type is `dtype`."""
  if jnp.dtype(dtype) in _BITS and a.dtype == _BITS[jnp.dtype(dtype)]:
    return jax.lax.bitcast_convert_type(a, dtype)
  return a


@dataclasses.dataclass(frozen=True)
class Codec:
  """Base codec: full-precision storage in `dtype` (fp32 / bf16 / fp16)."""

  name: str
  dtype: Any = jnp.float32

  # Tokens encoded together (1: every token is encoded on its own). A layout writes a
  # codec's storage in whole blocks of this many tokens.
  token_block = 1

  # What the storage is (`Stored.kind`, via `stored`): "float" (one array of `dtype` values
  # or bit patterns), "scaled" (`quant.ScaledCodec`'s codes, scales and zeros), or None: its
  # own, read only through its own `qk` / `pv`. A subclass that changes the storage or its
  # reads without saying what it is gets None (below), never its parent's kind.
  storage = "float"
  _STORAGE = ("init", "encode", "decode", "codes", "_quantize", "qk", "pv")

  def __init_subclass__(cls, **kw):
    super().__init_subclass__(**kw)
    if "storage" not in vars(cls) and any(n in vars(cls) for n in Codec._STORAGE):
      cls.storage = None

  def configure(self, cache_cfg, role: str) -> "Codec":
    """This codec with the granularity knobs of `cache_cfg` for K (`role="k"`) or V bound
    in (group size, key axis); the float codecs have none."""
    return self

  def check(self, cache_cfg, model_cfg, role: str) -> None:
    """Host-side limits of this codec in `role` (`codecs.check` calls it for K and V)."""
    if role == "k" and cache_cfg.k_axis == "channel":
      raise KvjaxError(f"cache.k_axis=channel needs a quantized cache.k_codec (int8, int4, int2, "
                       f"fp8_e4m3, fp8_e5m2), got '{self.name}'; or set cache.k_axis=token")

  # -- storage -------------------------------------------------------------------------
  def init(self, shape: tuple[int, ...]) -> Any:
    """Zeroed storage for `shape` = [..., S, D]: S tokens of D values. Allocated in the
    stored type at once (all-zero bits are +0.0 in bf16 and float8): an eager bitcast of
    float zeros would hold the array twice while it copies."""
    return jnp.zeros(shape, _BITS.get(jnp.dtype(self.dtype), self.dtype))

  def encode(self, x_TD: jax.Array) -> Any:
    """Encode T vectors [..., T, D]; the result has the same pytree structure as `init`."""
    if jnp.dtype(self.dtype) == jnp.float32:
      return x_TD.astype(self.dtype)
    fmax = float(jnp.finfo(self.dtype).max)
    x = x_TD.astype(jnp.float32)
    return store_bits(jnp.where(jnp.isfinite(x), jnp.clip(x, -fmax, fmax), x).astype(self.dtype))

  def decode(self, enc: Any, dtype=jnp.float32) -> jax.Array:
    """Full-precision view (tests and reference paths only; the attention reads through
    `qk` / `pv`)."""
    return load_bits(enc, self.dtype).astype(dtype)

  def bytes_per_token(self, n_kv_heads: int, head_dim: int) -> float:
    """Closed-form bytes one token of K (or V) takes in one layer, metadata included."""
    return n_kv_heads * head_dim * jnp.dtype(self.dtype).itemsize

  # -- the read interface: the attention's two reads of a block, and what is stored --------
  def qk(self, q_BKGTD: jax.Array, k_enc: Any, in_stored_type: bool = False) -> jax.Array:
    """Logits [B, K, G, T, C] over a block of C stored tokens in one go (the caller keeps
    blocks small, so whatever is widened here is block-sized). `in_stored_type`: the block read in
    its stored type (`codecs.dots`, the `native` attention): bf16 codes meet the query in
    bf16 digits; fp32 and fp16 (which bf16 cannot hold exactly) read as without it."""
    if in_stored_type and jnp.dtype(self.dtype) == jnp.bfloat16:
      return dots.qk(q_BKGTD, load_bits(k_enc, self.dtype))
    return dot_qk(q_BKGTD, self.decode(k_enc, q_BKGTD.dtype))

  def pv(self, p_BKGTC: jax.Array, v_enc: Any, in_stored_type: bool = False) -> jax.Array:
    """Probability-weighted values [B, K, G, T, D] of a block of C stored tokens,
    `in_stored_type` as in `qk`."""
    if in_stored_type and jnp.dtype(self.dtype) == jnp.bfloat16:
      return dots.pv(p_BKGTC, load_bits(v_enc, self.dtype))
    return dot_pv(p_BKGTC, self.decode(v_enc, p_BKGTC.dtype))

  @property
  def stored(self) -> "Stored":
    """What the storage is, for the reads that load it directly rather than through `qk` /
    `pv`: the accelerator program's folded read (`attention.folded`), the Pallas kernel
    (`attention.pallas`) and the CPU read kernel (`kvjax.kernels`)."""
    kernel = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1,
              jnp.dtype(jnp.float16): 2}.get(jnp.dtype(self.dtype))
    return Stored(self.storage, kernel if self.storage == "float" else None)


@dataclasses.dataclass(frozen=True)
class Stored:
  """A codec's storage as the direct reads see it.

  kind:   "float", "scaled" or None (the codec's own: only its `qk` / `pv` read it);
  kernel: the CPU read kernel's kind of element (`read.cc`: 0 fp32, 1 bf16, 2 fp16, 3 int8,
          4 int4, 5 int2, 6 / 7 fp8), or None where the kernel does not read it;
  scales: where the kernel finds the scales: "whole" (one per token, or none), "grouped"
          (head_dim groups per token) or "channel" (per channel per token block)."""

  kind: str | None
  kernel: int | None = None
  scales: str = "whole"


def per_head(G: int, D: int, read: str = "qk") -> bool:
  """Split the G query heads sharing a KV head into G batched matvecs for one of the two
  reads (`read`: "qk", the logits; "pv", the values)? Only the CPU program's reads ask;
  the accelerator program keeps one GEMM, which reads each block once (`attention.folded`).

  Logits: XLA:CPU runs the [G*T, D] x [D, C] GEMM (contracting the block's minor axis, so
  the block is transposed for it) slower than G matvecs for a few query heads; each
  matvec is one more operation per block, though, which costs more than it saves for
  many heads or short head_dims. Hence G <= min(4, D / 8).

  Values: the [G*T, C] x [C, D] GEMM contracts the block's major axis and needs no
  transpose, so it reads the widened block once where the split reads it G times: below
  head_dim 128 the one GEMM is faster (`python scripts/bench_xla_cpu.py`, `attend_pv_split`
  vs `attend`). The measurements: docs/methods.md, "CPU decode", *GQA and MQA* and
  *The values' read*."""
  if not 1 < G <= min(4, D // 8):
    return False
  return read == "qk" or D >= 128


def _grouped_einsum(spec: str, a_BKG: jax.Array, b_BKCD: jax.Array, read: str) -> jax.Array:
  """`jnp.einsum(spec)` in float32 of per-query-head operands [B, K, G, ...] against a
  (widened) block [B, K, C, D]: one einsum, or G of them where `per_head` says so."""
  f32 = jnp.float32
  G = a_BKG.shape[2]
  if not per_head(G, b_BKCD.shape[-1], read):
    return jnp.einsum(spec, a_BKG, b_BKCD, preferred_element_type=f32)
  head = spec.replace("g", "")
  return jnp.stack([jnp.einsum(head, a_BKG[:, :, g], b_BKCD, preferred_element_type=f32)
                    for g in range(G)], axis=2)


def dot_qk(q_BKGTD: jax.Array, k_BKCD: jax.Array) -> jax.Array:
  """Logits of the queries against a (widened) block of C keys: [B, K, G, T, C] float32."""
  return _grouped_einsum("bkgtd,bkcd->bkgtc", q_BKGTD, k_BKCD, "qk")


def dot_pv(p_BKGTC: jax.Array, v_BKCD: jax.Array) -> jax.Array:
  """Probability-weighted sum of a (widened) block of C values: [B, K, G, T, D] float32."""
  return _grouped_einsum("bkgtc,bkcd->bkgtd", p_BKGTC, v_BKCD, "pv")


DTYPE_TO_CODEC = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def for_role(name: str, cache_cfg=None, role: str = "v") -> "Codec":
  """The codec instance a cache uses for K (`role="k"`) or V, knobs from `cache_cfg` bound.

  Codecs with granularity knobs override `Codec.configure`; the float codecs have none.
  """
  codec = get(name)
  return codec if cache_cfg is None else codec.configure(cache_cfg, role)
