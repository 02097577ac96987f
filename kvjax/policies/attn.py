"""Attention mass of chosen prompt queries on every prompt key: the scores that `snapkv`,
`h2o` and `tova` rank tokens by."""

import jax
import jax.numpy as jnp


def attention_mass(q_LBTHD, k_LBKSD, lengths_B, qpos_BW):
  """[L, B, K, S]: for each key, the softmax attention it gets from the W queries at
  positions `qpos_BW` ([B, W] int32; -1: no query), summed over those queries and averaged
  over the G query heads that share its KV head. Causal: the query at t sees keys j <= t,
  and only j < length. Only the chosen queries are gathered, so the work is W x S per
  layer, not T x S."""
  L, B, T, H, D = q_LBTHD.shape
  K, S = k_LBKSD.shape[2], k_LBKSD.shape[3]
  W, G = qpos_BW.shape[1], H // K
  idx = jnp.clip(qpos_BW, 0, T - 1)[None, :, :, None, None]
  q_LBWHD = jnp.take_along_axis(q_LBTHD, idx, axis=2)
  j_S = jnp.arange(S)
  see_BWS = (j_S[None, None, :] <= qpos_BW[:, :, None]) & \
      (j_S[None, None, :] < lengths_B[:, None, None]) & (qpos_BW >= 0)[:, :, None]

  def layer(args):
    q_BWHD, k_BKSD = args
    q_BKGWD = q_BWHD.astype(jnp.float32).reshape(B, W, K, G, D).transpose(0, 2, 3, 1, 4)
    logits = jnp.einsum("bkgwd,bksd->bkgws", q_BKGWD * D ** -0.5, k_BKSD.astype(jnp.float32))
    mask = see_BWS[:, None, None]
    p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    p = jnp.where(mask, p, 0.0)  # rows with no visible key (no query) give 0, not NaN
    return p.sum(axis=3).mean(axis=2)  # [B, K, S]

  return jax.lax.map(layer, (q_LBWHD, k_LBKSD))
