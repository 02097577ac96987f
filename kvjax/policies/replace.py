"""Score-and-replace: the decode rule of a policy that keeps evicting per layer, sequence
and KV head (mixed into `h2o` and `tova` through `attn.DecodeScored`, which scores by
attention; a policy scoring some other way writes only its `step_scores`).

The compacted cache holds `budget` slots and never grows. Each new token is scored with
the held tokens (`step_scores`); once the budget is full, it takes the slot of the
lowest-scored candidate: every held token except the last `protected` tokens seen (the
new one included); when nothing is protected, the new token is a candidate too and is
dropped when it scores strictly lowest. Equal lowest scores evict the lowest slot.
`accumulates`: the score adds up over every step (h2o), kept per slot in the cache's
`state` as `acc`, with each slot's position `pos` (which tells the protected window);
otherwise it is the current step's alone (tova) and the cache keeps nothing beyond K/V.
Several tokens in one call (a question fed at once) are placed one after the other, each
scored on its own, as if decoded one at a time (their attention in that call still saw
each other). The rule reads and writes storage only through the layout's `Slots`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.errors import KvjaxError


def scatter_heads(slot_LBK):
  """store [L, B, K, S, ...] <- new [L, B, K, ...], one token per (layer, sequence, head)
  into its own slot (slots out of range are dropped)."""
  L, B, K = slot_LBK.shape
  idx = (jnp.arange(L)[:, None, None], jnp.arange(B)[None, :, None],
         jnp.arange(K)[None, None, :], slot_LBK)
  return lambda store, new: store.at[idx].set(new.astype(store.dtype), mode="drop")


class ScoreAndReplace:
  """The decode rule above, mixed in before `Policy`."""

  decode_evicts = True
  uniform_slots = False  # the slot differs per layer and KV head, chosen on the device
  accumulates = False

  def protected(self, c) -> int:
    """Recent tokens never evicted (at most budget - 1 of them are)."""
    return 0

  def step_scores(self, spec, keys, mask_BS, k_LBKD, q_LBHD):
    """What the held tokens and the new one are worth at this step, higher = keep: (held
    [L, B, K, S] float32, where `mask_BS`; new [L, B, K]). `keys`: the K codec storage
    seen contiguously (`Slots.keys`), read through `spec.kc`; q_LBHD: the new query when
    `decode_queries`, else None."""
    raise NotImplementedError

  def select_scores(self, ctx, Sk: int):
    """(`select`, the score each kept token starts decode with [L, B, K, Sk] or None)."""
    return self.select(ctx, Sk), None

  def keep(self, ctx, Sk: int):
    pos_LBKS, acc_LBKS = self.select_scores(ctx, Sk)
    return pos_LBKS, ({"acc": acc_LBKS, "pos": pos_LBKS} if self.accumulates else {})

  def init_state(self, shape_LBKS: tuple) -> dict:
    """h2o's `acc` (float32, 0) and `pos` (int32, -1: none) per slot; tova keeps nothing."""
    if not self.accumulates:
      return {}
    return {"acc": jnp.zeros(shape_LBKS, jnp.float32), "pos": jnp.full(shape_LBKS, -1, jnp.int32)}

  def decode_write(self, spec, slots, cache, k_LBTKD, v_LBTKD, positions_BT, q_LBTHD=None):
    """The T tokens of a call one after the other (`step`); a decode step has one."""
    if self.decode_queries and q_LBTHD is None:
      raise KvjaxError(f"cache.policy={self.name} scores each decode token by its query; the "
                       "model must hand the layout its queries (Layout.wants_queries)")
    q = None if q_LBTHD is None else jnp.moveaxis(q_LBTHD, 2, 0)
    xs = (jnp.moveaxis(k_LBTKD, 2, 0), jnp.moveaxis(v_LBTKD, 2, 0), q, positions_BT.T)
    if positions_BT.shape[1] == 1:
      return self.step(spec, slots, cache, *jax.tree.map(lambda x: x[0], xs))
    cache, _ = jax.lax.scan(lambda c, x: (self.step(spec, slots, c, *x), None), cache, xs)
    return cache

  def step(self, spec, slots, cache, k_LBKD, v_LBKD, q_LBHD, p_B):
    """One token per sequence (position p_B, -1: none): score it with the held tokens,
    pick each (layer, sequence, KV head)'s slot, write it there (`Slots.put_heads`)."""
    S, st = spec.capacity, cache.state
    valid_B = p_B >= 0
    mask_BS = jnp.arange(S)[None, :] < cache.held[:, None]
    held_LBKS, new_LBK = self.step_scores(spec, slots.keys(cache), mask_BS, k_LBKD, q_LBHD)
    score = st["acc"] + held_LBKS if self.accumulates else held_LBKS
    n1_B = cache.lengths + valid_B.astype(jnp.int32)
    w_B = jnp.clip(self.protected(spec.cache_cfg), 0, cache.budget - 1)  # one is evictable
    cand = jnp.broadcast_to(mask_BS[None, :, None], score.shape)
    if self.accumulates:  # never a token of the recent window (the last w seen)
      cand = cand & (st["pos"] < (n1_B - w_B)[None, :, None, None])
    low = jnp.where(cand, score, jnp.inf)
    victim_LBK = jnp.argmin(low, axis=-1).astype(jnp.int32)  # first (lowest) slot on ties
    drop_new = (w_B == 0)[None, :, None] & (new_LBK < jnp.min(low, axis=-1))
    full_B = cache.held >= cache.budget
    slot = jnp.where(full_B[None, :, None], jnp.where(drop_new, S, victim_LBK),
                     cache.held[None, :, None])
    slot = jnp.where(valid_B[None, :, None], slot, S)  # padding: nothing written
    if self.accumulates:
      put = scatter_heads(slot)
      st = {"acc": put(jnp.where(valid_B[None, :, None, None], score, st["acc"]), new_LBK),
            "pos": put(st["pos"], jnp.broadcast_to(p_B[None, :, None], slot.shape))}
    held = cache.held + (valid_B & ~full_B).astype(jnp.int32)
    return slots.put_heads(cache, slot, k_LBKD, v_LBKD, state=st, lengths=n1_B, held=held)
