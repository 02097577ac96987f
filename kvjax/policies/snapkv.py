"""`snapkv`: prompt tokens ranked by the attention of an observation window.

At prefill, the last `window` prompt queries (`cache.window`, default 16) score every
earlier prompt token (softmax attention summed over the window, averaged over the query
heads of each KV head), the scores are max-pooled over `POOL` neighbouring tokens so a
chosen token keeps its neighbours, and the best `budget - window` are kept together with
the window itself, per layer and KV head. Decode appends (no eviction). The whole prompt
is the context: nothing treats a trailing question specially.
"""

import jax.numpy as jnp

from kvjax.policies.base import KEEP, Policy, register
from kvjax.policies.attn import attention_mass

POOL = 7  # max-pool width over tokens (odd: centred)


def max_pool(x_LBKS, width: int):
  """Max over [j - width//2, j + width//2] along the last axis (-inf outside)."""
  r = width // 2
  S = x_LBKS.shape[-1]
  pad = jnp.pad(x_LBKS, [(0, 0)] * 3 + [(r, r)], constant_values=-jnp.inf)
  return jnp.max(jnp.stack([pad[..., i:i + S] for i in range(width)]), axis=0)


class SnapKV(Policy):
  name = "snapkv"
  needs_queries = True
  default_window = 16

  def scores(self, ctx):
    w = self.window(ctx.cache_cfg)
    S = ctx.k_LBKSD.shape[3]
    n_B1 = ctx.lengths_B[:, None]
    qpos_BW = n_B1 - w + jnp.arange(w)[None, :]  # the observation window
    qpos_BW = jnp.where(qpos_BW >= 0, qpos_BW, -1)
    mass = attention_mass(ctx.q_LBTHD, ctx.k_LBKSD, ctx.lengths_B, qpos_BW)
    j_S = jnp.arange(S)[None, :]
    before_BS = j_S < n_B1 - w  # candidates: the prompt before the window
    pooled = max_pool(jnp.where(before_BS[None, :, None], mass, -jnp.inf), POOL)
    in_window = ((j_S >= n_B1 - w) & (j_S < n_B1))[None, :, None]
    return jnp.where(in_window, KEEP, pooled)


register(SnapKV())
