"""Cache codecs: how K or V is stored in the cache and read back by the attention.

A codec owns its bytes. `encode` turns a block of vectors `x[..., T, D]` into the codec's
stored pytree (every leaf keeps the token axis at -2, so the cache can allocate, write
and slice any codec the same way); `qk` and `pv` are the attention's two reads, so a
quantized codec can fold its scales into the logits and probabilities instead of
materialising a full-precision copy of the cache.

Adding a codec = one class here (or in its own module) + one `register()` call. The
quantized codecs (int8/int4/int2, fp8_e4m3/fp8_e5m2) live in `kvjax.codecs.quant`, imported at the
bottom of this module so the registry is always complete.

Registry codecs are generic; `for_role(name, cache_cfg, "k"|"v")` returns the instance a
cache actually uses, with the granularity knobs of `cache_cfg` (group size, key axis)
bound in, so `encode`/`qk`/`pv` never need the config again.

Non-finite input: the float codecs propagate NaN and +-Inf unchanged (a cast), and
saturate finite values at the storage type's largest finite value, so finite input
never becomes Inf (fp16 would otherwise overflow above 65504, bf16 just below 2**128).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

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


READ_CHUNK = 512  # stored tokens widened at once on the read path (see `read_qk`)


_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float8_e4m3fn): jnp.uint8,
         jnp.dtype(jnp.float8_e5m2): jnp.uint8}


def store_bits(x: jax.Array) -> jax.Array:
  """bfloat16 and float8 are stored as their unsigned bit patterns: XLA:CPU has no native
  scatter for them and "normalizes" each one to float32 over the *whole* array (measured:
  a one-token write into a bf16 cache allocated a float32 copy of the cache; fp8_e4m3
  decode ran 5-8x slower than bf16), while an integer scatter updates in place. The
  bitcast is free on every backend."""
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

  # -- storage -------------------------------------------------------------------------
  def init(self, shape_XSD: tuple[int, ...], cache_cfg=None) -> Any:
    """Zeroed storage for `shape[..., S, D]` tokens."""
    return store_bits(jnp.zeros(shape_XSD, self.dtype))

  def encode(self, x_XTD: jax.Array, cache_cfg=None) -> Any:
    """Encode a block of vectors; the result has the same pytree structure as `init`."""
    if jnp.dtype(self.dtype) == jnp.float32:
      return x_XTD.astype(self.dtype)
    fmax = float(jnp.finfo(self.dtype).max)
    x = x_XTD.astype(jnp.float32)
    return store_bits(jnp.where(jnp.isfinite(x), jnp.clip(x, -fmax, fmax), x).astype(self.dtype))

  def decode(self, enc: Any, dtype=jnp.float32) -> jax.Array:
    """Full-precision view (tests and reference paths only; attention uses qk/pv)."""
    return load_bits(enc, self.dtype).astype(dtype)

  def bytes_per_token(self, n_kv_heads: int, head_dim: int, cache_cfg=None) -> float:
    """Closed-form bytes one token of K (or V) takes in one layer, metadata included."""
    return n_kv_heads * head_dim * jnp.dtype(self.dtype).itemsize

  # -- the attention's reads -----------------------------------------------------------
  def qk(self, q_BKGTD: jax.Array, k_enc: Any) -> jax.Array:
    """Logits `q · k` over the stored tokens: [B, K, G, T, S] in float32."""
    if jnp.dtype(self.dtype) == q_BKGTD.dtype:  # nothing to widen: one einsum
      return self._qk_block(q_BKGTD, k_enc)
    return read_qk(self._qk_block, q_BKGTD, k_enc, self.token_block, READ_CHUNK)

  def pv(self, p_BKGTS: jax.Array, v_enc: Any) -> jax.Array:
    """Probability-weighted sum of stored values: [B, K, G, T, D] in float32."""
    if jnp.dtype(self.dtype) == p_BKGTS.dtype:
      return self._pv_block(p_BKGTS, v_enc)
    return read_pv(self._pv_block, p_BKGTS, v_enc, self.token_block, READ_CHUNK)

  def qk_block(self, q_BKGTD: jax.Array, k_enc: Any) -> jax.Array:
    """Logits over a block of stored tokens in one go (the blockwise attention's read:
    the caller keeps blocks small, so whatever is widened here is block-sized)."""
    return self._qk_block(q_BKGTD, k_enc)

  def pv_block(self, p_BKGTS: jax.Array, v_enc: Any) -> jax.Array:
    """Probability-weighted values of a block of stored tokens in one go."""
    return self._pv_block(p_BKGTS, v_enc)

  def _qk_block(self, q_BKGTD, k_enc):
    return dot_qk(q_BKGTD, self.decode(k_enc, q_BKGTD.dtype))

  def _pv_block(self, p_BKGTS, v_enc):
    return dot_pv(p_BKGTS, self.decode(v_enc, p_BKGTS.dtype))


def _per_head(G: int, D: int) -> bool:
  """Split the G query heads sharing a KV head into G batched matvecs? CPU only: XLA:CPU ran
  the [G*T, D] x [D, S] GEMM 1.3-1.8x slower than G matvecs for G = 2-4 at head_dim 32-128
  (it transposes the block for the GEMM or takes a slow path). Each matvec is one more
  operation per block, though, and that overhead won for G = 8 (7-80% slower split) and
  for G = 4 at head_dim 16 (5-14%); G = 2 at head_dim 16 still gained 15-20% (decode,
  batch 4, 4k, bench_codecs). Accelerators keep one GEMM, which reads each block once."""
  return jax.default_backend() == "cpu" and 1 < G <= min(4, D // 8)


def _grouped_einsum(spec: str, a_BKG: jax.Array, b_BKSD: jax.Array) -> jax.Array:
  """`jnp.einsum(spec)` in float32 of per-query-head operands [B, K, G, ...] against a
  (widened) block [B, K, S, D]: one einsum, or G of them where `_per_head` says so."""
  f32 = jnp.float32
  G = a_BKG.shape[2]
  if not _per_head(G, b_BKSD.shape[-1]):
    return jnp.einsum(spec, a_BKG, b_BKSD, preferred_element_type=f32)
  head = spec.replace("g", "")
  return jnp.stack([jnp.einsum(head, a_BKG[:, :, g], b_BKSD, preferred_element_type=f32)
                    for g in range(G)], axis=2)


def dot_qk(q_BKGTD: jax.Array, k_BKSD: jax.Array) -> jax.Array:
  """Logits of the queries against a (widened) block of keys: [B, K, G, T, S] float32."""
  return _grouped_einsum("bkgtd,bksd->bkgts", q_BKGTD, k_BKSD)


def dot_pv(p_BKGTS: jax.Array, v_BKSD: jax.Array) -> jax.Array:
  """Probability-weighted sum of a (widened) block of values: [B, K, G, T, D] float32."""
  return _grouped_einsum("bkgts,bksd->bkgtd", p_BKGTS, v_BKSD)


register(Codec("fp32", jnp.float32))
register(Codec("bf16", jnp.bfloat16))
register(Codec("fp16", jnp.float16))

DTYPE_TO_CODEC = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def for_role(name: str, cache_cfg=None, role: str = "v") -> "Codec":
  """The codec instance a cache uses for K (`role="k"`) or V, knobs from `cache_cfg` bound.

  Codecs with granularity knobs define `configure(cache_cfg, role)`; the float codecs have
  none and are returned as registered.
  """
  codec = get(name)
  configure = getattr(codec, "configure", None)
  return codec if configure is None or cache_cfg is None else configure(cache_cfg, role)

def _token_slice(enc: Any, start, size: int, S: int) -> Any:
  """Tokens [start, start + size) of every leaf (a leaf may hold one row per S // rows tokens)."""
  def cut(a):
    per = S // a.shape[-2]
    return jax.lax.dynamic_slice_in_dim(a, start // per, size // per, axis=a.ndim - 2)
  return jax.tree.map(cut, enc)


def _plan(enc: Any, block: int, chunk: int) -> tuple[int, int, int]:
  S = jax.tree.leaves(enc)[0].shape[-2]
  C = max(block, chunk // block * block)
  return S, C, S // C


def read_qk(qk_block: Callable, q_BKGTD: jax.Array, enc: Any, block: int, chunk: int):
  """Logits over all stored tokens, computed `chunk` tokens at a time (a loop, not unrolled),
  so whatever `qk_block` widens is chunk-sized, never cache-sized."""
  S, C, n = _plan(enc, block, chunk)
  if S <= C:
    return qk_block(q_BKGTD, enc)
  out = jnp.zeros(q_BKGTD.shape[:-1] + (S,), jnp.float32)
  put = lambda o, i, size: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
      o, qk_block(q_BKGTD, _token_slice(enc, i * C, size, S)), i * C, axis=4)
  out = jax.lax.fori_loop(0, n, lambda i, o: put(o, i, C), out)
  return put(out, n, S - n * C) if S % C else out


def read_pv(pv_block: Callable, p_BKGTS: jax.Array, enc: Any, block: int, chunk: int):
  """Probability-weighted values, accumulated `chunk` stored tokens at a time."""
  S, C, n = _plan(enc, block, chunk)
  if S <= C:
    return pv_block(p_BKGTS, enc)
  part = lambda i, size: pv_block(  # noqa: E731
      jax.lax.dynamic_slice_in_dim(p_BKGTS, i * C, size, axis=4), _token_slice(enc, i * C, size, S))
  shape = jax.eval_shape(lambda: part(0, C)).shape
  out = jax.lax.fori_loop(0, n, lambda i, acc: acc + part(i, C), jnp.zeros(shape, jnp.float32))
  return out + part(n, S - n * C) if S % C else out


# Extra cache-config checks that codecs need (e.g. group sizes); codec modules append.
CACHE_CHECKS: list[Callable] = []


def check_cache_config(cache_cfg, model_cfg) -> None:
  for check in CACHE_CHECKS:
    check(cache_cfg, model_cfg)


from kvjax.codecs import quant  # noqa: E402,F401  (registers the quantized codecs and their checks)
