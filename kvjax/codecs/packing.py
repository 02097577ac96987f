"""Bit packing and the scale arithmetic of the quantized codecs (`kvjax.codecs.quant`):
codes packed along head_dim in bit planes, stored bf16 scales read back as float32, and
the exact divisions and upward rounding that keep the error bounds of the codecs' math."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.codecs import base

SCALE_DTYPE = jnp.bfloat16
SCALE_BYTES = 2
TINY = float(jnp.finfo(jnp.float32).tiny)         # smallest normal float32: the scale floor
UP = 1.0 + 2.0 ** -7                              # bf16 rounds within 2^-8: this rounds up
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Pack codes < 2**bits along the last axis into uint8 in planes: byte j holds the codes
  of elements j, j + D/p, j + 2D/p, ... (p = 8 / bits), so unpacking is a concatenation."""
  per = 8 // bits
  codes = codes.astype(jnp.uint8)
  if per == 1:
    return codes
  *lead, D = codes.shape
  planes = codes.reshape(*lead, per, D // per)
  shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[:, None]
  return jnp.sum(planes << shifts, axis=-2, dtype=jnp.uint8)  # disjoint bits: sum == or


def unpack(packed: jax.Array, bits: int) -> jax.Array:
  """Inverse of `pack`: uint8 [..., D * bits / 8] -> uint8 codes [..., D]."""
  per = 8 // bits
  if per == 1:
    return packed
  # (A concatenation of constant-shifted int32 planes measured slower here on the grouped
  # reads; the whole-head reads avoid unpacking altogether, see `ScaledCodec._planes`.)
  *lead, W = packed.shape
  shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[:, None]
  planes = (packed[..., None, :] >> shifts) & jnp.uint8(2 ** bits - 1)
  return planes.reshape(*lead, per * W)


def load_meta(a: jax.Array) -> jax.Array:
  """A stored scale / zero (bf16 kept as uint16 bits, see `base.store_bits`) as float32."""
  return base.load_bits(a, SCALE_DTYPE).astype(jnp.float32)


def pow2(k: jax.Array) -> jax.Array:
  """Exactly 2**k as float32 for integer k in [-126, 127] (built from the exponent bits)."""
  return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def div(x: jax.Array, s: jax.Array) -> jax.Array:
  """x / s for a normal s > 0. XLA rewrites a division by a broadcast into a product with
  the reciprocal, and 1/s is subnormal (flushed to zero on CPU) once s > 2^126; scaling
  both by the same exact power of two first keeps every intermediate normal."""
  e = (jax.lax.bitcast_convert_type(s, jnp.int32) >> 23) - 127  # s = m * 2^e, m in [1, 2)
  a = -(e // 2)
  fa, fb = pow2(a), pow2(-e - a)
  return (x * fa * fb) / (s * fa * fb)


def round_up_bf16(s: jax.Array) -> jax.Array:
  """A bfloat16 value >= s (s >= 0, finite): bf16's round-to-nearest loses < 2^-8."""
  return jnp.minimum(s * UP, BF16_MAX).astype(SCALE_DTYPE)
