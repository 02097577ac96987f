"""Dots in the codes' stored types: the arithmetic of the `native` attention read.

XLA:CPU hands a dot to its library kernels (a `__ynn_fusion` in the compiled HLO) when
both operands are bf16 (accumulated in float32) or both int8 (accumulated in int32), and
then reads the stored bytes at the same rate whatever their width, so the read's time
follows the codec's bytes. A float32 operand against int8 codes instead widens the block
first, which costs more than the smaller bytes save. So the small, per-query operand is
brought to the cache's type, never the other way round:

  - int8 (and unpacked int4/int2) codes: the query rows (or the probability rows) are
    quantized per row to int8 in two digits, hi = round(x / s) and lo = round((x / s - hi)
    * 254), so x = s (hi + lo / 254) to within s / 508 (s = max|x| / 127): about 15 bits,
    where one int8 digit would drop every probability under 1/254 of its row's largest
    (the long tail behind an attention sink);
  - bf16 codes (and fp8 codes, exactly representable in bf16): the rows in two bf16
    digits, hi = bf16(x), lo = bf16(x - hi): a 16-bit mantissa.

Both digits are stacked along the rows, so one dot reads the block once, and the rows
double: a single query (MHA decode) becomes two, which the library takes (it refuses
dots of one row). The int32 products of 127 x 127 summed over a block stay far below
2^31 for blocks under 100k tokens.

Shapes: `x` is [..., M, X] (M rows: query heads x new tokens, X the contracted axis),
`rhs` a block of codes [..., C, D] with the same leading (batch) axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32
LO = 254.0  # the second int8 digit's weight


def _digits(x_MX: jax.Array, kind: str):
  """x in two digits of the dot type, stacked along the rows: ([..., 2M, X], scale)."""
  x = x_MX.astype(f32)
  if kind == "bf16":
    hi = x.astype(jnp.bfloat16)
    lo = (x - hi.astype(f32)).astype(jnp.bfloat16)
    return jnp.concatenate([hi, lo], axis=-2), None
  # max|x| propagates NaN into the scale, so non-finite rows read back as NaN.
  s = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), jnp.finfo(f32).tiny) / 127.0
  y = x / s
  hi = jnp.round(y)
  lo = jnp.round((y - hi) * LO)
  return jnp.concatenate([hi, lo], axis=-2).astype(jnp.int8), s


def _undigits(r: jax.Array, s, M: int) -> jax.Array:
  """Recombine the two digits' results [..., 2M, N] -> [..., M, N] float32."""
  hi, lo = r[..., :M, :].astype(f32), r[..., M:, :].astype(f32)
  return hi + lo if s is None else (hi + lo / LO) * s


def kind_of(rhs: jax.Array) -> str:
  if rhs.dtype == jnp.int8:
    return "s8"
  if rhs.dtype == jnp.bfloat16:
    return "bf16"
  raise ValueError(f"no stored-type dot for {rhs.dtype}")


def rows_dot(x_MX: jax.Array, rhs: jax.Array, contract_rhs: int) -> jax.Array:
  """x [..., M, X] against rhs [..., C, D] contracting X with rhs axis `contract_rhs`
  (-1: D, the logits' form; -2: C, the values' form), in rhs's stored type: [..., M, N]
  float32, N the rhs axis not contracted."""
  kind = kind_of(rhs)
  M = x_MX.shape[-2]
  d, s = _digits(x_MX, kind)
  nb = rhs.ndim - 2
  batch = tuple(range(nb))
  acc = jnp.int32 if kind == "s8" else f32
  r = jax.lax.dot_general(d, rhs, (((d.ndim - 1,), (rhs.ndim + contract_rhs,)), (batch, batch)),
                          preferred_element_type=acc)
  return _undigits(r, s, M)


def qk(q_BKGTD: jax.Array, codes_BKCD: jax.Array) -> jax.Array:
  """Logits [B, K, G, T, C] of the queries against a block of codes (no scales)."""
  B, K, G, T, D = q_BKGTD.shape
  l_BKMC = rows_dot(q_BKGTD.reshape(B, K, G * T, D), codes_BKCD, -1)
  return l_BKMC.reshape(B, K, G, T, -1)


def pv(p_BKGTC: jax.Array, codes_BKCD: jax.Array) -> jax.Array:
  """Probability-weighted sum [B, K, G, T, D] of a block of codes (no scales)."""
  B, K, G, T, C = p_BKGTC.shape
  o_BKMD = rows_dot(p_BKGTC.reshape(B, K, G * T, C), codes_BKCD, -2)
  return o_BKMD.reshape(B, K, G, T, -1)
