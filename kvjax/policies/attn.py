"""Attention mass of chosen prompt queries on every prompt key: the scores that `snapkv`,
`h2o` and `tova` rank tokens by."""

import jax
import jax.numpy as jnp


def attention_mass(q_LBTHD, k_LBKSD, lengths_B, query_BT):
  """[L, B, K, S]: for each key, the softmax attention it gets from the queries marked in
  `query_BT` ([B, T] bool), summed over those queries and averaged over the G query heads
  that share its KV head. Causal: query t sees keys j <= t, and only j < length."""
  L, B, T, H, D = q_LBTHD.shape
  K, S = k_LBKSD.shape[2], k_LBKSD.shape[3]
  G = H // K
  t_T, j_S = jnp.arange(T), jnp.arange(S)
  see_BTS = (j_S[None, None, :] <= t_T[None, :, None]) & \
      (j_S[None, None, :] < lengths_B[:, None, None]) & query_BT[:, :, None]

  def layer(args):
    q_BTHD, k_BKSD = args
    q_BKGTD = q_BTHD.astype(jnp.float32).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
    logits = jnp.einsum("bkgtd,bksd->bkgts", q_BKGTD * D ** -0.5, k_BKSD.astype(jnp.float32))
    mask = see_BTS[:, None, None]
    p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    p = jnp.where(mask, p, 0.0)  # rows with no visible key (not a query) give 0, not NaN
    return p.sum(axis=3).mean(axis=2)  # [B, K, S]

  return jax.lax.map(layer, (q_LBTHD, k_LBKSD))
