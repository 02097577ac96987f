"""`h2o` (heavy hitters): prompt tokens ranked by the attention accumulated over every
prompt query (causal), per layer and KV head, plus the last `window` tokens always kept
(`cache.window`, default 16).

Acts at prefill only, from the prompt's own queries; decode appends without evicting
(the per-step accumulation of the original method is not built).
"""

import jax.numpy as jnp

from kvjax.policies.base import KEEP, Policy, register
from kvjax.policies.attn import attention_mass


class H2O(Policy):
  name = "h2o"
  needs_queries = True
  default_window = 16

  def scores(self, ctx):
    w = self.window(ctx.cache_cfg)
    T = ctx.q_LBTHD.shape[2]
    S = ctx.k_LBKSD.shape[3]
    n_B1 = ctx.lengths_B[:, None]
    t_BT = jnp.broadcast_to(jnp.arange(T)[None, :], (n_B1.shape[0], T))
    mass = attention_mass(ctx.q_LBTHD, ctx.k_LBKSD, ctx.lengths_B, jnp.where(t_BT < n_B1, t_BT, -1))
    j_S = jnp.arange(S)[None, :]
    recent = ((j_S >= n_B1 - w) & (j_S < n_B1))[None, :, None]
    return jnp.where(recent, KEEP, mass)


register(H2O())
