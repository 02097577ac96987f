"""The accelerator program's reads of a block of stored tokens: only a convert before each dot.

An accelerator's compiler fuses a dot operand's convert into the dot (XLA:GPU's GEMM
fusion reads the narrow codes and widens them in registers), but a multiply of the widened
codes by their scales makes them a separate fusion that writes the widened block to memory
first. So here the codes reach each dot through nothing but their unpack (shift and mask
of packed bit planes, a reshape) and one convert to the compute dtype, and every scale and
zero point is applied on the dot's other side or to its result:

  - keys, per-token scales (whole heads, or groups along head_dim): the logits are
    multiplied after the dot; the asymmetric offset o = z - h s of a token adds
    (the query summed over the group) x o to its logit;
  - keys, per-channel scales (`cache.k_axis=channel`, one per channel per U tokens): the
    scale folds into the query, one scaled query per token group (a batch axis of the dot),
    the offset into a per-row constant q . o;
  - values, per-token scales: fold into the probabilities before the dot, the offset adds
    (p . o) to the output. (Values are always quantized per token; a per-channel value
    scale would multiply the output after the dot.)

Both dots run in the compute dtype (the query's) with float32 accumulation, so a bf16
model's reads meet the tensor cores; int8, int4, int2 and fp8 codes are exact in bf16, and
the probabilities are cast to the compute dtype as they are for the new tokens. What a
codec stores is what it says (`Codec.stored`): "float" or "scaled" storage is read here, any
other (nf4/nf2's level indices, a codec's own storage) through its own `qk` / `pv`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import codecs
from kvjax.codecs import logits, packing

f32 = jnp.float32


def _float(codec) -> bool:
  return codec.stored.kind == "float"


def _scaled(codec) -> bool:
  return codec.stored.kind == "scaled"


def codes(codec, enc, dtype) -> jax.Array:
  """A block's codes as dot operands [..., C, D] in `dtype`: unpack (packed codes) and
  convert, nothing else."""
  if _float(codec):
    return codecs.load_bits(enc, codec.dtype).astype(dtype)
  if codec.asym:
    return packing.unpack(enc["codes"], codec.bits).astype(dtype)
  return codecs.load_bits(enc["codes"], codec.dtype).astype(dtype)


def _meta(codec, enc):
  """Scale and the asymmetric offset z - h s (None when symmetric), float32."""
  s = packing.load_meta(enc["scale"])
  return s, (packing.load_meta(enc["zero"]) - codec.half * s if codec.asym else None)


def qk(codec, q_BKGTD: jax.Array, k_enc) -> jax.Array:
  """Logits [B, K, G, T, C] (float32) of the queries against a block of C stored keys."""
  dt = q_BKGTD.dtype
  if _float(codec):
    return jnp.einsum("bkgtd,bkcd->bkgtc", q_BKGTD, codes(codec, k_enc, dt),
                      preferred_element_type=f32)
  if not _scaled(codec):
    return codec.qk(q_BKGTD, k_enc)
  c_BKCD = codes(codec, k_enc, dt)
  s, off = _meta(codec, k_enc)
  if codec.axis == "channel":  # s, off [B, K, J, D]: J groups of U tokens
    return logits.channel_logits(q_BKGTD, c_BKCD, s, off)
  n = s.shape[-1]  # per-token scales [B, K, C, n], n groups along head_dim
  if n == 1:
    l = jnp.einsum("bkgtd,bkcd->bkgtc", q_BKGTD, c_BKCD, preferred_element_type=f32)
    l = l * s[:, :, None, None, :, 0]
    if off is not None:
      l = l + jnp.sum(q_BKGTD.astype(f32), -1)[..., None] * off[:, :, None, None, :, 0]
    return l
  return logits.group_logits(q_BKGTD, c_BKCD, s, off)


def pv(codec, p_BKGTC: jax.Array, v_enc, dtype) -> jax.Array:
  """Probability-weighted values [B, K, G, T, D] (float32) of a block of C stored tokens;
  the dot in `dtype` (the compute dtype)."""
  if _float(codec):
    return jnp.einsum("bkgtc,bkcd->bkgtd", p_BKGTC.astype(dtype), codes(codec, v_enc, dtype),
                      preferred_element_type=f32)
  if not _scaled(codec):
    return codec.pv(p_BKGTC, v_enc)
  c_BKCD = codes(codec, v_enc, dtype)
  s, off = _meta(codec, v_enc)
  B, K, G, T, C = p_BKGTC.shape
  D = c_BKCD.shape[-1]
  p = p_BKGTC.astype(f32)
  if codec.axis == "channel":  # s, off [B, K, J, D]: the scale multiplies the output
    J = s.shape[-2]
    pj = p.reshape(B, K, G, T, J, C // J)
    t = jnp.einsum("bkgtju,bkjud->bkgtjd", pj.astype(dtype), c_BKCD.reshape(B, K, J, C // J, D),
                   preferred_element_type=f32)
    out = jnp.einsum("bkgtjd,bkjd->bkgtd", t, s)
    if off is not None:
      out = out + jnp.einsum("bkgtj,bkjd->bkgtd", jnp.sum(pj, -1), off)
    return out
  n = s.shape[-1]
  if n == 1:
    ps = (p * s[:, :, None, None, :, 0]).astype(dtype)
    out = jnp.einsum("bkgtc,bkcd->bkgtd", ps, c_BKCD, preferred_element_type=f32)
    if off is not None:
      out = out + jnp.einsum("bkgtc,bkc->bkgt", p, off[..., 0])[..., None]
    return out
  ps = (p[..., None] * s[:, :, None, None]).astype(dtype)  # [B, K, G, T, C, n]
  out = jnp.einsum("bkgtcn,bkcnd->bkgtnd", ps, c_BKCD.reshape(B, K, C, n, D // n),
                   preferred_element_type=f32)
  if off is not None:
    out = out + jnp.einsum("bkgtc,bkcn->bkgtn", p, off)[..., None]
  return out.reshape(B, K, G, T, D)
