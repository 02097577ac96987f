"""Compaction: the tokens a policy keeps, copied into a cache whose capacity is the budget.

`program.generate` with `cache.policy` other than `full` prefills into an ordinary
contiguous cache (the whole prompt, as every prompt pass needs its own keys anyway),
asks the policy which tokens to keep (`kvjax.policies`), and copies them into an
`EvictedCache` (layout `compacted`) of

    capacity = min(budget, prompt width) + max_new_tokens   (knorm, snapkv: they append)
    capacity = min(budget, prompt width + max_new_tokens)    (window/sinks: a ring;
                                                              h2o/tova: evict by attention)

slots, which the decode loop then reads and writes. The prefill cache is donated and
dropped, so what stays allocated (and what `cache_bytes` reports) is the budgeted cache.

Decode writes (`Compacted.write`): append after the held tokens (knorm, snapkv); a ring
(window, sinks); or, for the policies that evict by attention (`policies.attn.DecodeScored`:
h2o, tova), token by token: the model hands the layout each layer's rotated queries
(`wants_queries`), the new query's attention over the held tokens and itself is recomputed
here (a second read of the held keys per step, see `policies.attn`), and once the budget
is full the new token takes the slot of the lowest-scored candidate, per layer, sequence
and KV head. h2o's accumulated scores and each slot's position (its recent window) are
cache leaves (`acc`, `pos`), so the decode scan carries them; tova stores nothing more.
The choice is `choose_slots`, which the paged layout's write shares (`paged_compact`).
Several tokens in one call (a question fed at once) are placed one after the other, each
scored by its own query, as if decoded one at a time (their attention in that call still
saw each other).

Positions: `lengths` counts every token a sequence has seen (the next token's position,
which the decode loop rotates its query at), `held` the slots that hold a token. Keys are
stored already rotated at their original positions, and every held token is older than
any new query, so a held slot is simply valid: attention needs no per-slot position.

Codec storage is copied as it is (no re-encoding), which needs codecs that encode every
token on its own: the residual window and per-channel (KIVI) keys are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import policies
from kvjax.cache import base
from kvjax.errors import KvjaxError
from kvjax.policies.attn import DecodeScored, step_attention


@struct.dataclass
class EvictedCache:
  k: Any                 # K codec storage, leaves [L, B, K, S, ...] (S = compacted capacity)
  v: Any                 # V codec storage, leaves [L, B, K, S, ...]
  lengths: jax.Array     # [B] int32: tokens seen (= position of the next token)
  held: jax.Array        # [B] int32: slots holding a token (slots [0, held) are valid)
  budget: jax.Array      # [B] int32: tokens kept per sequence (ring size of window/sinks)
  acc: Any               # [L, B, K, S] float32: accumulated attention per slot (h2o), else None
  pos: Any               # [L, B, K, S] int32: position held in each slot, -1 none (h2o), else None
  spec: base.CacheSpec = struct.field(pytree_node=False)


def scored(spec):
  """The policy of `spec` when it evicts by attention during decode, else None."""
  pol = policies.get(spec.cache_cfg.policy)
  return pol if isinstance(pol, DecodeScored) else None


def accumulates(spec) -> bool:
  pol = scored(spec)
  return bool(pol and pol.accumulates)


def init_scores(spec) -> tuple[Any, Any]:
  """h2o's empty `acc` and `pos` [L, B, K, capacity] (both layouts keep them per slot),
  or (None, None) for a policy that stores nothing beside K/V."""
  if not accumulates(spec):
    return None, None
  shape = (spec.n_layers, spec.batch, spec.n_kv_heads, spec.capacity)
  return jnp.zeros(shape, jnp.float32), jnp.full(shape, -1, jnp.int32)


class Compacted(base.Layout):
  """The layout of a compacted cache: held tokens in slots [0, held), new tokens appended
  (slot held + i), written into a ring (window/sinks), or into the slot of the token
  their policy evicts (h2o/tova)."""

  name = "compacted"
  internal = True  # built by a cache.policy, never chosen as cache.layout

  def init(self, spec: base.CacheSpec) -> EvictedCache:
    L, B, K, D = spec.n_layers, spec.batch, spec.n_kv_heads, spec.head_dim
    shape = (L, B, K, spec.capacity, D)
    zeros = jnp.zeros((B,), jnp.int32)
    acc, pos = init_scores(spec)
    return EvictedCache(k=spec.kc.init(shape), v=spec.vc.init(shape), lengths=zeros,
                        held=zeros, budget=zeros + spec.capacity, acc=acc, pos=pos, spec=spec)

  def wants_queries(self, spec: base.CacheSpec) -> bool:
    return scored(spec) is not None

  def store(self, cache: EvictedCache) -> Any:
    """The stacked stores and the held counts (a read slices (layer, block) itself)."""
    return (cache.k, cache.v, cache.held)

  def read(self, spec, store, lengths_B, layer):
    k, v, held_B = store
    mask_BS = jnp.arange(spec.capacity)[None, :] < held_B[:, None]
    return [base.LayerSegment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.max(held_B),
                              layer=layer)]

  def write(self, cache: EvictedCache, k_LBTKD, v_LBTKD, positions_BT,
            q_LBTHD=None) -> EvictedCache:
    spec = cache.spec
    pol = policies.get(spec.cache_cfg.policy)
    if isinstance(pol, DecodeScored):
      return scored_write(cache, pol, k_LBTKD, v_LBTKD, positions_BT, q_LBTHD)
    slot_BT, n1, held = write_slots(spec.cache_cfg, positions_BT, cache.lengths, cache.held,
                                    cache.budget)
    slot_BT = jnp.where(slot_BT >= 0, slot_BT, spec.capacity)  # base.scatter drops slot S
    k_LBKTD, v_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3), jnp.swapaxes(v_LBTKD, 2, 3)
    k = jax.tree.map(base.scatter(slot_BT), cache.k, spec.kc.encode(k_LBKTD))
    v = jax.tree.map(base.scatter(slot_BT), cache.v, spec.vc.encode(v_LBKTD))
    return dataclasses.replace(cache, k=k, v=v, lengths=n1, held=held)

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    K, D = spec.n_kv_heads, spec.head_dim
    per_token = spec.kc.bytes_per_token(K, D) + spec.vc.bytes_per_token(K, D)
    per_token += policies.get(spec.cache_cfg.policy).state_bytes_per_token(K)
    return int(round(spec.n_layers * spec.batch * spec.capacity * per_token)) + 3 * 4 * spec.batch


base.register(Compacted())


def write_slots(cache_cfg, positions_BT, lengths_B, held_B, budget_B):
  """Where decode writes new tokens under the policy's rule, for both compacted layouts:
  (slot of each token [B, T], -1 when evicted at once or padding; lengths [B]; held [B]).
  Append after the held tokens, or the window/sinks ring: sinks stay in slots [0, sinks),
  position p >= sinks goes to sinks + (p - sinks) mod (budget - sinks)."""
  pol = policies.get(cache_cfg.policy)
  valid_BT = positions_BT >= 0
  n1 = lengths_B + jnp.sum(valid_BT, axis=1).astype(jnp.int32)
  p_BT = positions_BT
  if pol.decode_evicts:  # ring
    sinks = pol.sinks(cache_cfg)
    W_B1 = (budget_B - sinks)[:, None]
    kept = valid_BT & ((p_BT < sinks) | (p_BT >= n1[:, None] - W_B1))
    slot_BT = jnp.where(p_BT < sinks, p_BT, sinks + (p_BT - sinks) % jnp.maximum(W_B1, 1))
    held = jnp.minimum(n1, budget_B)
  else:  # append after the held tokens
    kept = valid_BT
    slot_BT = p_BT - lengths_B[:, None] + held_B[:, None]
    held = held_B + (n1 - lengths_B)
  return jnp.where(kept, slot_BT, -1), n1, held


def _put(slot_LBK):
  """store [L, B, K, S, ...] <- new [L, B, K, ...], one token per (layer, sequence, head)
  into its own slot (slots out of range are dropped)."""
  L, B, K = slot_LBK.shape
  idx = (jnp.arange(L)[:, None, None], jnp.arange(B)[None, :, None],
         jnp.arange(K)[None, None, :], slot_LBK)
  return lambda store, new: store.at[idx].set(new.astype(store.dtype), mode="drop")


def choose_slots(spec, pol, k_store, cache, k_LBKD, q_LBHD, p_B):
  """One token per sequence (position p_B, -1: none) scored against the held keys
  `k_store` (K codec storage seen contiguously, leaves [L, B, K, S, ...], S = the
  capacity): (the slot each (layer, sequence, KV head) writes it to [L, B, K], S = none;
  the cache fields that change: lengths, held, and for h2o acc/pos). `cache` is any cache
  with lengths, held, budget, acc, pos (`EvictedCache`, `paged_compact.EvictedPagedCache`)."""
  L, B, K, _ = k_LBKD.shape
  S = spec.capacity
  valid_B = p_B >= 0
  mask_BS = jnp.arange(S)[None, :] < cache.held[:, None]
  rows = lambda a: a.reshape(L * B, *a.shape[2:])  # noqa: E731  [L, B, ...] -> [L*B, ...]
  own_held, own_new = step_attention(rows(q_LBHD), jax.tree.map(rows, k_store), spec.kc,
                                     jnp.tile(mask_BS, (L, 1)), rows(k_LBKD))
  p_LBKS, pnew_LBK = own_held.reshape(L, B, K, S), own_new.reshape(L, B, K)
  score = cache.acc + p_LBKS if pol.accumulates else p_LBKS
  n1_B = cache.lengths + valid_B.astype(jnp.int32)
  w_B = jnp.clip(pol.protected(spec.cache_cfg), 0, cache.budget - 1)  # some slot is evictable
  cand = jnp.broadcast_to(mask_BS[None, :, None], score.shape)
  if pol.accumulates:  # never a token of the recent window (the last w seen)
    cand = cand & (cache.pos < (n1_B - w_B)[None, :, None, None])
  low = jnp.where(cand, score, jnp.inf)
  victim_LBK = jnp.argmin(low, axis=-1).astype(jnp.int32)  # first (lowest) slot on ties
  drop_new = (w_B == 0)[None, :, None] & (pnew_LBK < jnp.min(low, axis=-1))
  full_B = cache.held >= cache.budget
  slot = jnp.where(full_B[None, :, None], jnp.where(drop_new, S, victim_LBK),
                   cache.held[None, :, None])
  slot = jnp.where(valid_B[None, :, None], slot, S)  # padding: nothing written
  acc, pos = cache.acc, cache.pos
  if pol.accumulates:
    put = _put(slot)
    acc = put(jnp.where(valid_B[None, :, None, None], score, acc), pnew_LBK)
    pos = put(pos, jnp.broadcast_to(p_B[None, :, None], slot.shape))
  held = cache.held + (valid_B & ~full_B).astype(jnp.int32)
  return slot, dict(acc=acc, pos=pos, lengths=n1_B, held=held)


def _scored_step(cache: EvictedCache, pol, k_LBKD, v_LBKD, q_LBHD, p_B) -> EvictedCache:
  """One token per sequence into a cache of an attention-scored policy: score, pick each
  (layer, sequence, KV head)'s slot (`choose_slots`), write."""
  spec = cache.spec
  slot, fields = choose_slots(spec, pol, cache.k, cache, k_LBKD, q_LBHD, p_B)
  put = _put(slot)
  new = lambda a: a[:, :, :, None]  # noqa: E731  [L, B, K, D] -> one token [L, B, K, 1, D]
  k = jax.tree.map(lambda s, e: put(s, e[:, :, :, 0]), cache.k, spec.kc.encode(new(k_LBKD)))
  v = jax.tree.map(lambda s, e: put(s, e[:, :, :, 0]), cache.v, spec.vc.encode(new(v_LBKD)))
  return dataclasses.replace(cache, k=k, v=v, **fields)


def scored_write(cache, pol, k_LBTKD, v_LBTKD, positions_BT, q_LBTHD, step=_scored_step):
  """The T tokens of a call one after the other (`step(cache, pol, k_LBKD, v_LBKD, q_LBHD,
  p_B)`: `_scored_step` here, its paged twin in `paged_compact`); a decode step has one."""
  if q_LBTHD is None:
    raise KvjaxError(f"cache.policy={pol.name} scores each decode token by its query; the "
                     "model must hand the layout its queries (Layout.wants_queries)")
  xs = (jnp.moveaxis(k_LBTKD, 2, 0), jnp.moveaxis(v_LBTKD, 2, 0), jnp.moveaxis(q_LBTHD, 2, 0),
        positions_BT.T)
  if positions_BT.shape[1] == 1:
    return step(cache, pol, *(x[0] for x in xs))
  cache, _ = jax.lax.scan(lambda c, x: (step(c, pol, *x), None), cache, xs)
  return cache


def capacity(cache_cfg, T: int, room: int) -> int:
  """Slots of the compacted cache for prompts of width T and `room` decode tokens."""
  budget = policies.static_budget(cache_cfg, T)
  pol = policies.get(cache_cfg.policy)
  if pol.decode_evicts or isinstance(pol, DecodeScored):
    return min(budget, T + room)
  return min(budget, T) + room


def held_tokens(cache_cfg, seq_len: int) -> int:
  """Tokens one sequence of `seq_len` holds under the policy (what `kvjax size` sizes)."""
  if cache_cfg.policy == "full":
    return seq_len
  return min(seq_len, policies.static_budget(cache_cfg, seq_len))


def _gather_tokens(pos_LBKS):
  """leaf [L, B, K, S, X] -> [L, B, K, Sk, X], slot i taking token pos[..., i]."""
  def take(a):
    if a.ndim != 5:
      raise KvjaxError("compaction needs codec leaves [L, B, K, S, X]")
    return jnp.take_along_axis(a, pos_LBKS[..., None], axis=3)
  return take


def compress(cache, lengths_B, room: int, q_LBTHD=None, T: int | None = None) -> EvictedCache:
  """The prefilled contiguous `cache` (prompts of `lengths_B` tokens, width T) compacted
  to the policy's budget, with `room` free slots (or a ring, or the budget of a policy
  that evicts by attention) for the decode tokens."""
  spec = cache.spec
  c = spec.cache_cfg
  pol = policies.get(c.policy)
  T = T or spec.capacity
  Sb = policies.static_budget(c, T)
  Sk = min(Sb, T)
  cap = capacity(c, T, room)
  budget_B = policies.budgets(c, lengths_B)
  k_LBKSD = spec.kc.decode(jax.tree.map(lambda a: a[:, :, :, :T], cache.k), jnp.float32) \
      if spec.kc.token_block == 1 else None
  ctx = policies.Context(k_LBKSD, lengths_B, budget_B, c, q_LBTHD)
  acc_LBKS = None
  if isinstance(pol, DecodeScored):
    pos_LBKS, acc_LBKS = pol.select_scores(ctx, Sk)
  else:
    pos_LBKS = pol.select(ctx, Sk)

  new_spec = dataclasses.replace(spec, layout="compacted", capacity=cap)
  fresh = Compacted().init(new_spec)

  held_B = policies.held(lengths_B, budget_B)
  used_BS = jnp.arange(Sk)[None, :] < held_B[:, None]

  def place(store, kept):  # unused slots stay zero, as in a fresh cache
    kept = jnp.where(used_BS[None, :, None, :, None], kept, jnp.zeros((), kept.dtype))
    return store.at[:, :, :, :Sk].set(kept)
  k = jax.tree.map(place, fresh.k, jax.tree.map(_gather_tokens(pos_LBKS), cache.k))
  v = jax.tree.map(place, fresh.v, jax.tree.map(_gather_tokens(pos_LBKS), cache.v))
  acc, pos = fresh.acc, fresh.pos
  if acc is not None:  # the scores the kept tokens start decode with, and their positions
    used = used_BS[None, :, None, :]
    acc = acc.at[:, :, :, :Sk].set(jnp.where(used, acc_LBKS, 0.0))
    pos = pos.at[:, :, :, :Sk].set(jnp.where(used, pos_LBKS, -1))
  return EvictedCache(k=k, v=v, lengths=cache.lengths, held=held_B, budget=budget_B,
                      acc=acc, pos=pos, spec=new_spec)
