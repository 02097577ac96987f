"""Attention variants. MHA, GQA and MQA are one grouped computation.

Queries are grouped as [B, K, G, T, D] (G = H // K query heads share one KV head), so
MHA is G = 1 and MQA is K = 1, and the cache only ever holds K heads. A layer attends to
the stored segments its cache layout hands it (read through each segment's codec, which
may fold quantization scales into the logits and probabilities) plus the T new tokens
of this call, causally. All segments share one softmax: logits are concatenated along
the key axis, so no segment is ever special-cased.

Adding a variant = one function with the `grouped` signature + one `ATTENTIONS` entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so fully masked (padding) rows give finite garbage, never NaN


def grouped(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments) -> jax.Array:
  """Grouped-query attention over stored segments + the new tokens. Returns [B, T, H, D]."""
  B, T, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  G = H // K
  q_BKGTD = (q_BTHD * (D ** -0.5)).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
  k_BKTD = k_BTKD.transpose(0, 2, 1, 3)
  v_BKTD = v_BTKD.transpose(0, 2, 1, 3)

  logits, sizes = [], []
  for seg in segments:
    l_BKGTS = seg.k_codec.qk(q_BKGTD, seg.k)
    logits.append(jnp.where(seg.mask_BS[:, None, None, None, :], l_BKGTS, MASKED))
    sizes.append(l_BKGTS.shape[-1])
  # The new tokens: causal by position; padding (position -1) is never a key.
  l_new = jnp.einsum("bkgtd,bkud->bkgtu", q_BKGTD, k_BKTD, preferred_element_type=jnp.float32)
  causal_BTU = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & \
      (positions_BT[:, None, :] >= 0)
  logits.append(jnp.where(causal_BTU[:, None, None], l_new, MASKED))

  probs = jax.nn.softmax(jnp.concatenate(logits, axis=-1), axis=-1)
  out_BKGTD = jnp.einsum("bkgtu,bkud->bkgtd", probs[..., sum(sizes):].astype(v_BKTD.dtype),
                         v_BKTD, preferred_element_type=jnp.float32)
  start = 0
  for seg, size in zip(segments, sizes):
    out_BKGTD = out_BKGTD + seg.v_codec.pv(probs[..., start:start + size], seg.v)
    start += size
  return out_BKGTD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


ATTENTIONS = {"grouped": grouped}
