"""Compaction: the tokens a policy keeps, copied into a cache whose capacity is the budget.

`program.generate` with `cache.policy` other than `full` prefills into an ordinary
contiguous cache (the whole prompt, as every prompt pass needs its own keys anyway),
asks the policy which tokens to keep (`kvjax.policies`), and copies them into an
`EvictedCache` (layout `compacted`) of

    capacity = min(budget, prompt width) + max_new_tokens   (policies that append)
    capacity = min(budget, prompt width + max_new_tokens)    (window/sinks: a ring)

slots, which the decode loop then reads and writes. The prefill cache is donated and
dropped, so what stays allocated (and what `cache_bytes` reports) is the budgeted cache.

Positions: `lengths` counts every token a sequence has seen (the next token's position,
which the decode loop rotates its query at), `held` the slots that hold a token. Keys are
stored already rotated at their original positions, and every held token is older than
any new query, so a held slot is simply valid: no per-slot position is needed.

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


@struct.dataclass
class EvictedCache:
  k: Any                 # K codec storage, leaves [L, B, K, S, ...] (S = compacted capacity)
  v: Any                 # V codec storage, leaves [L, B, K, S, ...]
  lengths: jax.Array     # [B] int32: tokens seen (= position of the next token)
  held: jax.Array        # [B] int32: slots holding a token (slots [0, held) are valid)
  budget: jax.Array      # [B] int32: tokens kept per sequence (ring size of window/sinks)
  spec: base.CacheSpec = struct.field(pytree_node=False)


class Compacted(base.Layout):
  """The layout of a compacted cache: held tokens in slots [0, held), new tokens appended
  (slot held + i), or, for a policy that evicts during decode, written into its ring."""

  name = "compacted"
  internal = True  # built by a cache.policy, never chosen as cache.layout

  def init(self, spec: base.CacheSpec) -> EvictedCache:
    L, B, K, D = spec.n_layers, spec.batch, spec.n_kv_heads, spec.head_dim
    shape = (L, B, K, spec.capacity, D)
    zeros = jnp.zeros((B,), jnp.int32)
    return EvictedCache(k=spec.kc.init(shape),
                        v=spec.vc.init(shape), lengths=zeros, held=zeros,
                        budget=zeros + spec.capacity, spec=spec)

  def store(self, cache: EvictedCache) -> Any:
    """The stacked stores and the held counts (a read slices (layer, block) itself)."""
    return (cache.k, cache.v, cache.held)

  def read(self, spec, store, lengths_B, layer):
    k, v, held_B = store
    mask_BS = jnp.arange(spec.capacity)[None, :] < held_B[:, None]
    return [base.LayerSegment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.max(held_B),
                              layer=layer)]

  def write(self, cache: EvictedCache, k_LBTKD, v_LBTKD, positions_BT) -> EvictedCache:
    spec = cache.spec
    pol = policies.get(spec.cache_cfg.policy)
    valid_BT = positions_BT >= 0
    n0, n1 = cache.lengths, cache.lengths + jnp.sum(valid_BT, axis=1).astype(jnp.int32)
    p_BT, S = positions_BT, spec.capacity
    if pol.decode_evicts:  # ring: sinks stay, the rest go to sinks + (p - sinks) mod W
      sinks = pol.sinks(spec.cache_cfg)
      W_B1 = (cache.budget - sinks)[:, None]
      kept = valid_BT & ((p_BT < sinks) | (p_BT >= n1[:, None] - W_B1))
      slot_BT = jnp.where(p_BT < sinks, p_BT, sinks + (p_BT - sinks) % jnp.maximum(W_B1, 1))
      held = jnp.minimum(n1, cache.budget)
    else:  # append after the held tokens
      kept = valid_BT
      slot_BT = p_BT - n0[:, None] + cache.held[:, None]
      held = cache.held + (n1 - n0)
    slot_BT = jnp.where(kept, slot_BT, S)  # evicted at once, or padding: dropped
    k_LBKTD, v_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3), jnp.swapaxes(v_LBTKD, 2, 3)
    k = jax.tree.map(base.scatter(slot_BT), cache.k, spec.kc.encode(k_LBKTD))
    v = jax.tree.map(base.scatter(slot_BT), cache.v, spec.vc.encode(v_LBKTD))
    return dataclasses.replace(cache, k=k, v=v, lengths=n1, held=held)

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    K, D = spec.n_kv_heads, spec.head_dim
    per_token = spec.kc.bytes_per_token(K, D) + spec.vc.bytes_per_token(K, D)
    return int(round(spec.n_layers * spec.batch * spec.capacity * per_token)) + 3 * 4 * spec.batch


base.register(Compacted())


def capacity(cache_cfg, T: int, room: int) -> int:
  """Slots of the compacted cache for prompts of width T and `room` decode tokens."""
  budget = policies.static_budget(cache_cfg, T)
  if policies.get(cache_cfg.policy).decode_evicts:
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
  to the policy's budget, with `room` free slots (or a ring) for the decode tokens."""
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
  return EvictedCache(k=k, v=v, lengths=cache.lengths, held=held_B, budget=budget_B,
                      spec=new_spec)
