"""Per-head budgets (`cache.heads: adaptive`, AdaKV-style): one budget per layer, spread over
its KV heads by score, a modifier any scoring policy that appends in decode can take.

Uniform (the default): every (layer, sequence, KV head) keeps the same `budget` tokens, its
best by the policy's score. Adaptive: a (layer, sequence) keeps K x budget tokens in all,
chosen across its K heads together. Each head first keeps its best `SAFE` x budget tokens
(a floor, so no head is starved). The rest of the layer's total goes to the best-scored
tokens of any head, up to `SPREAD` x budget tokens a head (the slots the compacted cache
allocates per head). A head whose attention is spread thin then keeps more tokens, and a
head that attends to a few tokens keeps fewer.

The compacted cache holds each head's tokens in slots [0, its count) and marks the rest
of the prompt's slots invalid for that head (`CompactedCache.head_held`); decode appends
after the prompt's slots, valid in every head. Attention reads the per-head mask through
the XLA read (the CPU read kernel reads one mask per sequence and steps aside). What the
cache holds is K x budget tokens per layer, the uniform cache's count; what it allocates
is up to SPREAD times that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.errors import KvjaxError

UNIFORM, ADAPTIVE = "uniform", "adaptive"
HEADS = (UNIFORM, ADAPTIVE)
SAFE = 0.2    # the share of the budget every head keeps before the rest is spread
SPREAD = 2    # the most a head may keep, in budgets (the slots allocated per head)


def adaptive(c) -> bool:
  return c.heads == ADAPTIVE


def prompt_slots(c, budget: int, T: int) -> int:
  """Slots of the compacted cache for a prompt of width T: the budget, or under adaptive
  heads up to SPREAD budgets a head."""
  return min(SPREAD * budget if adaptive(c) else budget, T)


def check(c, pol, m=None) -> None:
  """Host-side: adaptive heads need a policy that scores tokens and appends in decode."""
  if c.heads not in HEADS:
    raise KvjaxError(f"unknown cache.heads '{c.heads}'; use {' or '.join(HEADS)}")
  if not adaptive(c):
    return
  scores = type(pol).scores.__qualname__  # (the base's raises: the policy does not score)
  if pol.name == "full" or scores == "Policy.scores" or pol.decode_evicts:
    raise KvjaxError(f"cache.heads=adaptive spreads the budget of a policy that scores "
                     f"tokens and appends in decode (snapkv, knorm); {pol.name} does not")
  if c.layout != "contiguous":
    raise KvjaxError(f"cache.heads=adaptive compacts a contiguous cache; cache.layout="
                     f"{c.layout} is not one")
  if m is not None and (m.windowed or m.n_kv_heads == 1):
    raise KvjaxError("cache.heads=adaptive needs a model with several KV heads and no "
                     "sliding-window layers; use cache.heads=uniform")


def spread(scores_LBKS, lengths_B, budget_B, Sk: int):
  """(positions [L, B, K, Sk] int32, count [L, B, K] int32): each head's kept tokens in
  ascending position order in slots [0, count), the layer's K x min(length, budget) tokens
  spread as the module says. Equal scores favour the earlier token, then the lower head."""
  L, B, K, S = scores_LBKS.shape
  held_B = jnp.minimum(lengths_B, budget_B)
  valid = (jnp.arange(S)[None, :] < lengths_B[:, None])[None, :, None, :]
  s = jnp.where(valid, scores_LBKS.astype(jnp.float32), -jnp.inf)
  order = jnp.argsort(-s, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)  # each token's rank within its head
  safe_B = jnp.floor(SAFE * held_B).astype(jnp.int32)
  safe = rank < safe_B[None, :, None, None]
  eligible = valid & ~safe & (rank < Sk)
  flat = jnp.where(eligible, s, -jnp.inf).reshape(L, B, K * S)
  grank = jnp.argsort(jnp.argsort(-flat, axis=-1, stable=True), axis=-1).reshape(L, B, K, S)
  rest_B = K * (held_B - safe_B)
  keep = (safe & valid) | (eligible & (grank < rest_B[None, :, None, None]))
  count = jnp.sum(keep, axis=-1).astype(jnp.int32)
  pos = jnp.sort(jnp.where(keep, jnp.arange(S), S), axis=-1)[..., :Sk]
  return jnp.where(pos < S, pos, 0).astype(jnp.int32), count
