"""`h2o` (heavy hitters): tokens ranked by the attention accumulated over every query so
far, per layer and KV head (averaged over the query heads sharing it), plus the last
`window` tokens always kept (`cache.window`, default 16).

Prefill: the prompt's own queries (causal) accumulate the scores; the `budget - window`
best plus the last `window` prompt tokens are kept, each with its score. Decode
(`attn.DecodeScored`, score-and-replace): each new query's attention over the held tokens
and itself adds to their scores (kept per slot in the cache's `state`, `acc`, with each
slot's position `pos`), and once the budget is full the new token takes the slot of the
lowest-accumulated token outside the recent window (the last `window` tokens seen, at most
`budget - 1` of them), so the cache holds `budget` tokens throughout.
"""

import jax.numpy as jnp

from kvjax.policies.attn import DecodeScored, attention_mass
from kvjax.policies.base import KEEP, Policy, register, top_positions


class H2O(DecodeScored, Policy):
  name = "h2o"
  needs_queries = True
  default_window = 16
  accumulates = True

  def protected(self, c) -> int:
    return self.window(c)

  def mass(self, ctx):
    """[L, B, K, S]: attention summed over every prompt query (causal)."""
    T = ctx.q_LBTHD.shape[2]
    n_B1 = ctx.lengths_B[:, None]
    t_BT = jnp.broadcast_to(jnp.arange(T)[None, :], (n_B1.shape[0], T))
    return attention_mass(ctx.q_LBTHD, ctx.k_LBKSD, ctx.lengths_B,
                          jnp.where(t_BT < n_B1, t_BT, -1))

  def protect(self, ctx, mass):
    """The mass with the last `window` prompt tokens raised to `KEEP`."""
    w = self.window(ctx.cache_cfg)
    n_B1 = ctx.lengths_B[:, None]
    j_S = jnp.arange(ctx.k_LBKSD.shape[3])[None, :]
    recent = ((j_S >= n_B1 - w) & (j_S < n_B1))[None, :, None]
    return jnp.where(recent, KEEP, mass)

  def scores(self, ctx):
    return self.protect(ctx, self.mass(ctx))

  def select_scores(self, ctx, Sk):
    mass = self.mass(ctx)
    pos = top_positions(self.protect(ctx, mass), ctx.lengths_B, ctx.budget_B, Sk)
    return pos, jnp.take_along_axis(mass, pos, axis=-1)


register(H2O())
