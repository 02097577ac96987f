"""Cache codecs: how K or V is stored in the cache and read back by the attention.

A codec owns its bytes. `encode` turns a block of vectors `x[..., T, D]` into the codec's
stored pytree (every leaf keeps the token axis at -2, so the cache can allocate, write
and slice any codec the same way); `qk` and `pv` are the attention's two reads, so a
quantized codec can fold its scales into the logits and probabilities instead of
materialising a full-precision copy of the cache.

Adding a codec = one class here (or in its own module) + one `register()` call.
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


@dataclasses.dataclass(frozen=True)
class Codec:
  """Base codec: full-precision storage in `dtype` (fp32 / bf16 / fp16)."""

  name: str
  dtype: Any = jnp.float32

  # -- storage -------------------------------------------------------------------------
  def init(self, shape_XSD: tuple[int, ...], cache_cfg=None) -> Any:
    """Zeroed storage for `shape[..., S, D]` tokens."""
    return jnp.zeros(shape_XSD, self.dtype)

  def encode(self, x_XTD: jax.Array, cache_cfg=None) -> Any:
    """Encode a block of vectors; the result has the same pytree structure as `init`."""
    return x_XTD.astype(self.dtype)

  def decode(self, enc: Any, dtype=jnp.float32) -> jax.Array:
    """Full-precision view (tests and reference paths only; attention uses qk/pv)."""
    return enc.astype(dtype)

  def bytes_per_token(self, n_kv_heads: int, head_dim: int, cache_cfg=None) -> float:
    """Closed-form bytes one token of K (or V) takes in one layer, metadata included."""
    return n_kv_heads * head_dim * jnp.dtype(self.dtype).itemsize

  # -- the attention's reads -----------------------------------------------------------
  def qk(self, q_BKGTD: jax.Array, k_enc: Any) -> jax.Array:
    """Logits `q · k` over the stored tokens: [B, K, G, T, S] in float32."""
    k = k_enc.astype(q_BKGTD.dtype)
    return jnp.einsum("bkgtd,bksd->bkgts", q_BKGTD, k, preferred_element_type=jnp.float32)

  def pv(self, p_BKGTS: jax.Array, v_enc: Any) -> jax.Array:
    """Probability-weighted sum of stored values: [B, K, G, T, D] in float32."""
    v = v_enc.astype(p_BKGTS.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", p_BKGTS, v, preferred_element_type=jnp.float32)


register(Codec("fp32", jnp.float32))
register(Codec("bf16", jnp.bfloat16))
register(Codec("fp16", jnp.float16))

DTYPE_TO_CODEC = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# Extra cache-config checks that codecs need (e.g. group sizes); codec modules append.
CACHE_CHECKS: list[Callable] = []


def check_cache_config(cache_cfg, model_cfg) -> None:
  for check in CACHE_CHECKS:
    check(cache_cfg, model_cfg)
