"""The read of the scaled codecs in their stored type (`quant.ScaledCodec.qk` / `pv` with
`in_stored_type=True`, what the `native` attention reads through XLA):
a block of codes meets the query (or probability) rows in the codes' own type through
`codecs.dots`, and every scale, zero point and offset is applied around the dot, never
to the block:

  - int8 codes are read as they are; int4/int2 codes are unpacked to signed int8, c - 2^(b-1),
    which moves their offset to z + s/2 (x = z + (c - h) s = z + s/2 + (c - 2^(b-1)) s);
  - fp8 codes are widened to bf16, which holds every fp8 value exactly;
  - per-token scales multiply the logits after the dot (K) and the probabilities before
    it (V); a token's offset adds (sum of the query) x offset to its logit and
    (sum of p) x offset to the output;
  - G groups along head_dim (group_size): the query (probability) rows are repeated once
    per group with the other groups' columns zeroed (probabilities: scaled by that
    group's scales), so one dot reads the block once and each group's partial sums come
    out as their own rows, recombined with their scales;
  - per-channel keys (KIVI): each block of U tokens shares one scale and offset per
    channel, so the query is scaled per channel for each of the J blocks, which become a
    batch axis of the dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.codecs import base, dots, packing

f32 = jnp.float32


def signed_codes(codec, enc) -> jax.Array:
  """The block's codes in a stored-type dot's operand type: int8 [..., C, D] (int8, int4,
  int2) or bf16 (fp8)."""
  raw = enc["codes"]
  if codec.kind == "fp8":
    return base.load_bits(raw, codec.dtype).astype(jnp.bfloat16)
  if codec.kind == "int":
    return raw
  u = packing.unpack(raw, codec.bits).astype(jnp.int8)
  return u - jnp.int8(2 ** (codec.bits - 1))


def _meta(codec, enc):
  """Scale and offset (asymmetric codecs: z + s/2, see the module doc; else None), float32."""
  s = packing.load_meta(enc["scale"])
  off = packing.load_meta(enc["zero"]) + 0.5 * s if codec.asym else None
  return s, off


def _group_mask(n: int, D: int) -> jax.Array:
  """[n, D] float32: 1 where column d belongs to group i (groups of D / n along head_dim)."""
  return (jnp.arange(D)[None, :] // (D // n) == jnp.arange(n)[:, None]).astype(f32)


def qk(codec, q_BKGTD: jax.Array, enc) -> jax.Array:
  """Logits [B, K, G, T, C] over a block of C stored tokens."""
  c_BKCD = signed_codes(codec, enc)
  s, off = _meta(codec, enc)
  B, K, G, T, D = q_BKGTD.shape
  C = c_BKCD.shape[-2]
  q = q_BKGTD.astype(f32)
  if codec.axis == "channel":  # s, off [B, K, J, D]: one scale per channel per U tokens
    J = s.shape[-2]
    qs = q[:, :, None] * s[:, :, :, None, None, :]                       # [B, K, J, G, T, D]
    l = dots.rows_dot(qs.reshape(B, K, J, G * T, D), c_BKCD.reshape(B, K, J, C // J, D), -1)
    l = l.reshape(B, K, J, G, T, C // J)
    if off is not None:
      l = l + jnp.einsum("bkgtd,bkjd->bkjgt", q, off)[..., None]
    return jnp.moveaxis(l, 2, 4).reshape(B, K, G, T, C)
  n = s.shape[-1]  # per-token scales [B, K, C, n]
  if n == 1:
    l = dots.qk(q, c_BKCD) * s[:, :, None, None, :, 0]
    if off is not None:
      l = l + jnp.sum(q, -1)[..., None] * off[:, :, None, None, :, 0]
    return l
  mask = _group_mask(n, D)
  qn = (q[..., None, :] * mask).reshape(B, K, G, T * n, D)
  l = dots.qk(qn, c_BKCD).reshape(B, K, G, T, n, C)
  l = jnp.sum(l * jnp.swapaxes(s, -1, -2)[:, :, None, None], axis=-2)
  if off is not None:
    qsum = jnp.sum(q.reshape(B, K, G, T, n, D // n), -1)
    l = l + jnp.einsum("bkgtn,bkcn->bkgtc", qsum, off)
  return l


def pv(codec, p_BKGTC: jax.Array, enc) -> jax.Array:
  """Probability-weighted values [B, K, G, T, D] of a block of C stored tokens."""
  c_BKCD = signed_codes(codec, enc)
  s, off = _meta(codec, enc)  # [B, K, C, n]: values are per token
  B, K, G, T, C = p_BKGTC.shape
  D = c_BKCD.shape[-1]
  p = p_BKGTC.astype(f32)
  n = s.shape[-1]
  if n == 1:
    out = dots.pv(p * s[:, :, None, None, :, 0], c_BKCD)
    if off is not None:
      out = out + jnp.einsum("bkgtc,bkc->bkgt", p, off[..., 0])[..., None]
    return out
  ps = p[..., None, :] * jnp.swapaxes(s, -1, -2)[:, :, None, None]     # [B, K, G, T, n, C]
  out = dots.pv(ps.reshape(B, K, G, T * n, C), c_BKCD).reshape(B, K, G, T, n, D)
  out = jnp.sum(out * _group_mask(n, D), axis=-2)
  if off is not None:
    out = out + jnp.repeat(jnp.einsum("bkgtc,bkcn->bkgtn", p, off), D // n, axis=-1)
  return out
