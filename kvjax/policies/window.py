"""`window`: a sliding window of the last `budget` tokens, and the ring rule that `sinks`
shares.

Prefill keeps the prompt's last `budget` tokens; decode keeps evicting (`decode_evicts`):
the cache is a ring of `budget` slots, token p in slot p mod budget, so a decode query at
position p sees exactly the tokens [p - budget, p] (itself included). With sinks (`Sinks`),
slots [0, sinks) keep the first tokens and the other `budget - sinks` slots are the ring:
position p >= sinks goes to slot sinks + (p - sinks) mod (budget - sinks). The ring is slot
arithmetic (`write_slots`), the same in every layer and KV head, so it works on pages
unchanged (the block table maps slots to pages) and the serving engine replays it on the
host. `cache.window` alone sets the budget (window, or sinks + window).
"""

import jax.numpy as jnp

from kvjax.errors import KvjaxError
from kvjax.policies.base import Policy, effective_budget, register, seen


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

  def window_budget(self, c) -> int:
    return self.sinks(c) + c.window if c.window else 0

  def floor(self, c) -> tuple[str, int]:
    return "sinks", self.sinks(c)

  def check(self, c) -> None:
    budget = effective_budget(c)
    if c.window and c.ratio:
      raise KvjaxError(f"cache.policy={c.policy} with cache.ratio sizes its window from the "
                       "ratio; drop cache.window")
    if budget and c.window and c.budget and c.budget != self.sinks(c) + c.window:
      raise KvjaxError(f"cache.budget={c.budget} disagrees with cache.sinks + cache.window = "
                       f"{self.sinks(c) + c.window}; set only one of them")
    if budget and budget <= self.sinks(c):
      raise KvjaxError(f"cache.budget={budget} must exceed cache.sinks={self.sinks(c)}; raise "
                       "the budget or lower cache.sinks")

  def select(self, ctx, Sk):
    L, B, K = ctx.k_LBKSD.shape[:3]
    pos_BS = ring_positions(ctx.lengths_B, ctx.budget_B, self.sinks(ctx.cache_cfg), Sk)
    pos_BS = jnp.minimum(pos_BS, ctx.k_LBKSD.shape[3] - 1)
    return jnp.broadcast_to(pos_BS[None, :, None, :], (L, B, K, Sk))

  def write_slots(self, c, positions_BT, lengths_B, held_B, budget_B):
    """The ring (numpy or jax): sinks stay in slots [0, sinks), position p >= sinks goes
    to sinks + (p - sinks) mod (budget - sinks); a token already outside the ring when
    its call ends (several in one call) is not written (-1)."""
    xp, valid_BT, n1 = seen(positions_BT, lengths_B)
    p_BT, sinks = positions_BT, self.sinks(c)
    W_B1 = (budget_B - sinks)[:, None]
    kept = valid_BT & ((p_BT < sinks) | (p_BT >= n1[:, None] - W_B1))
    slot_BT = xp.where(p_BT < sinks, p_BT, sinks + (p_BT - sinks) % xp.maximum(W_B1, 1))
    return xp.where(kept, slot_BT, -1), n1, xp.minimum(n1, budget_B)


register(Window())
