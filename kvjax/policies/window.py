"""`window`: a sliding window of the last `budget` tokens.

Prefill keeps the prompt's last `budget` tokens; decode keeps evicting (`decode_evicts`):
the cache is a ring of `budget` slots, token p in slot p mod budget, so a decode query at
position p sees exactly the tokens [p - budget, p] (itself included).
"""

import jax.numpy as jnp

from kvjax.policies.base import Policy, register


def ring_positions(lengths_B, budget_B, sinks: int, Sk: int):
  """[B, Sk]: the position held in each slot of a ring of `budget` slots after `length`
  tokens: slots [0, sinks) keep positions [0, sinks); slot s >= sinks keeps the position
  p in [length - W, length) with sinks + (p - sinks) mod W = s (W = budget - sinks).
  A sequence within its budget holds position s in slot s."""
  s_S = jnp.arange(Sk)[None, :]
  n, W = lengths_B[:, None], (budget_B - sinks)[:, None]
  recent = (n - W) + (s_S - n) % jnp.maximum(W, 1)
  wrapped = jnp.where(s_S < sinks, s_S, recent)
  return jnp.where(n <= budget_B[:, None], s_S, wrapped).astype(jnp.int32)


class Window(Policy):
  name = "window"
  decode_evicts = True

  def select(self, ctx, Sk):
    L, B, K = ctx.k_LBKSD.shape[:3]
    pos_BS = ring_positions(ctx.lengths_B, ctx.budget_B, self.sinks(ctx.cache_cfg), Sk)
    pos_BS = jnp.minimum(pos_BS, ctx.k_LBKSD.shape[3] - 1)
    return jnp.broadcast_to(pos_BS[None, :, None, :], (L, B, K, Sk))


register(Window())
