"""Compaction: the tokens a policy keeps, copied into a cache whose capacity is the budget.

`generate.generate` with `cache.policy` other than `full` prefills into an ordinary
contiguous cache (the whole prompt, as every prompt pass needs its own keys anyway),
asks the policy which tokens to keep (`Policy.keep`, `kvjax.policies`), and copies them
into an `CompactedCache` (layout `compacted`) of `Policy.capacity` slots:

    capacity = min(budget, prompt width) + max_new_tokens   (knorm, snapkv: they append)
    capacity = min(budget, prompt width + max_new_tokens)    (window/sinks: a ring;
                                                              h2o/tova: evict by attention)

which the decode loop then reads and writes. The prefill cache is donated and dropped, so
what stays allocated (and what `cache_bytes` reports) is the budgeted cache.

This module is storage only: where decode writes is the policy's rule
(`Policy.decode_write`: append, the window/sinks ring, score-and-replace), which
`Compacted.write` calls with the layout itself as the `Slots` it writes through (`keys`,
`put_tokens`, `put_heads`). The policy's own per-slot leaves (h2o's `acc` and `pos`) are
the cache's `state`, so the decode scan carries them; a layout that wants the queries
(`wants_queries`) is one whose policy reads them (`decode_queries`).

Positions: `lengths` counts every token a sequence has seen (the next token's position,
which the decode loop rotates its query at), `held` the slots that hold a token. Keys are
stored already rotated at their original positions, and every held token is older than
any new query, so a held slot is simply valid: attention needs no per-slot position.

Codec storage is copied as it is (no re-encoding), which needs codecs that encode every
token on its own: the residual window and per-channel (KIVI) keys are refused.

A model with sliding-window layers (`model.sliding_window`) evicts on its full-attention
layers only: those are compacted as above, while each windowed layer keeps the ring of its
last W tokens it would keep without a policy (`kvjax.cache.ring`), in `k_ring` / `v_ring`.
The policy's state is the full layers' alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import policies
from kvjax.cache import base, ring
from kvjax.policies import heads as heads_lib
from kvjax.errors import KvjaxError
from kvjax.policies.base import seen
from kvjax.policies.replace import scatter_heads


@struct.dataclass
class CompactedCache:
  k: Any                 # K codec storage, leaves [L, B, K, S, ...] (S = compacted capacity)
  v: Any                 # V codec storage, leaves [L, B, K, S, ...]
  lengths: jax.Array     # [B] int32: tokens seen (= position of the next token)
  held: jax.Array        # [B] int32: slots holding a token (slots [0, held) are valid)
  budget: jax.Array      # [B] int32: tokens kept per sequence (ring size of window/sinks)
  state: Any             # {name: [L, B, K, S]}: the policy's own leaves per slot (h2o: acc, pos)
  spec: base.CacheSpec = struct.field(pytree_node=False)
  k_ring: Any = None     # windowed layers' last W tokens [Lw, B, K, W, ...] (then k, v and
  v_ring: Any = None     # state hold the full layers only: [Lg, ...])
  head_held: Any = None  # cache.heads=adaptive: [L, B, K] int32, the prompt's slots each head
  prompt_end: Any = None # holds ([0, head_held)) and [B] the slots the prompt took; slots
  #                        from prompt_end on (decode's) are valid in every head

  AXES: ClassVar[dict] = {**{f: base.KV for f in ("k", "v", "state", "k_ring", "v_ring")},
                          **{f: base.PER_SEQUENCE for f in ("lengths", "held", "budget",
                                                            "prompt_end")},
                          "head_held": (base.LAYERS, base.BATCH, base.KV_HEADS)}


def policy_of(spec: base.CacheSpec):
  return policies.get(spec.cache_cfg.policy)


def evicting_layers(spec: base.CacheSpec) -> int:
  """Layers the policy compacts: all, or a windowed model's full-attention layers."""
  rg = ring.split(spec)
  return spec.n_layers if rg is None else len(rg.full)


def init_state(spec: base.CacheSpec) -> dict:
  """The policy's empty state [L, B, K, capacity] (both compacted layouts keep it per slot)."""
  shape = (evicting_layers(spec), spec.batch, spec.n_kv_heads, spec.capacity)
  return policy_of(spec).init_state(shape)


class Compacted(base.Layout):
  """The layout of a compacted cache: held tokens in slots [0, held), new tokens where the
  policy's decode rule puts them (`Policy.decode_write`, through this layout's `Slots`)."""

  name = "compacted"
  internal = True  # built by a cache.policy, never chosen as cache.layout
  compacts = "contiguous"

  def init(self, spec: base.CacheSpec) -> CompactedCache:
    B, K, D = spec.batch, spec.n_kv_heads, spec.head_dim
    shape = (evicting_layers(spec), B, K, spec.capacity, D)
    zeros = jnp.zeros((B,), jnp.int32)
    rg = ring.split(spec)
    rings = {} if rg is None else {
        "k_ring": spec.kc.init((len(rg.local), B, K, rg.window, D)),
        "v_ring": spec.vc.init((len(rg.local), B, K, rg.window, D))}
    return CompactedCache(k=spec.kc.init(shape), v=spec.vc.init(shape), lengths=zeros,
                          held=zeros, budget=zeros + spec.capacity, state=init_state(spec),
                          spec=spec, **rings)

  def wants_queries(self, spec: base.CacheSpec) -> bool:
    return policy_of(spec).decode_queries

  def compress(self, cache, lengths_B, room: int, q_LBTHD=None, T: int | None = None):
    """A prefilled `contiguous` cache compacted into this layout (`compress` below)."""
    return compress(cache, lengths_B, room, q_LBTHD, T=T)

  def store(self, cache: CompactedCache) -> Any:
    """The stacked stores and the held counts (a read slices (layer, block) itself); last,
    under adaptive heads, the per-head counts."""
    rings = () if cache.k_ring is None else (cache.k_ring, cache.v_ring)
    heads = () if cache.head_held is None else ((cache.head_held, cache.prompt_end),)
    return (cache.k, cache.v, cache.held, *rings, *heads)

  def read(self, spec, store, lengths_B, layer):
    k, v, held_B = store[:3]
    mask_BS = jnp.arange(spec.capacity)[None, :] < held_B[:, None]
    rg = ring.split(spec)
    if rg is None:
      head = None
      if heads_lib.adaptive(spec.cache_cfg):  # each head's own prompt slots, then decode's
        head_held, end_B = store[-1]
        s_S = jnp.arange(spec.capacity)
        head = (s_S[None, None, :] < head_held[layer][:, :, None]) | \
            (s_S[None, None, :] >= end_B[:, None, None])
      return [base.LayerSegment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.max(held_B),
                                layer=layer, head_BKS=head)]
    # A windowed model: the full layers' compacted store, where every held token is in
    # sight (position 0 is at or above a full layer's window floor, 0), and the rings. A
    # layer index known when tracing reads its own only, as `ring.read` does.
    local = rg.is_local(layer)
    held = jnp.max(lengths_B)

    def rings(is_local):
      return ring.ring_segment(spec, store[3], store[4], lengths_B, held, rg.window,
                               is_local, rg.rank(layer, rg.local))

    def full(is_local):
      B, S = mask_BS.shape
      return base.LayerSegment(k, v, mask_BS & ~jnp.asarray(is_local), spec.kc, spec.vc,
                               live=jnp.where(is_local, 0, jnp.max(held_B)),
                               layer=rg.rank(layer, rg.full),
                               pos_BS=jnp.zeros((B, S), jnp.int32))
    if isinstance(local, bool):
      return [rings(True) if local else full(False)]
    return ([full(local)] if rg.full else []) + [rings(local)]

  def write(self, cache: CompactedCache, k_LBTKD, v_LBTKD, positions_BT,
            q_LBTHD=None) -> CompactedCache:
    spec = cache.spec
    rg = ring.split(spec)
    if rg is not None:  # the rings first: the policy's write moves the lengths on
      local, full = np.asarray(rg.local, np.int32), np.asarray(rg.full, np.int32)
      _, _, n1 = seen(positions_BT, cache.lengths)  # the lengths after this write
      k_ring, v_ring = ring.put_rings(spec, cache.k_ring, cache.v_ring,
                                      jnp.swapaxes(k_LBTKD[local], 2, 3),
                                      jnp.swapaxes(v_LBTKD[local], 2, 3), positions_BT, n1,
                                      rg.window)
      cache = dataclasses.replace(cache, k_ring=k_ring, v_ring=v_ring)
      k_LBTKD, v_LBTKD = k_LBTKD[full], v_LBTKD[full]
      q_LBTHD = None if q_LBTHD is None else q_LBTHD[full]
    return policy_of(spec).decode_write(spec, self, cache, k_LBTKD, v_LBTKD, positions_BT,
                                        q_LBTHD)

  # -- Slots: what the policy's decode rule writes through -------------------------------------
  def keys(self, cache: CompactedCache) -> Any:
    return cache.k

  def put_tokens(self, cache: CompactedCache, slot_BT, k_LBTKD, v_LBTKD, **fields):
    spec = cache.spec
    slot_BT = jnp.where(slot_BT >= 0, slot_BT, spec.capacity)  # base.scatter drops slot S
    k_LBKTD, v_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3), jnp.swapaxes(v_LBTKD, 2, 3)
    k = jax.tree.map(base.scatter(slot_BT), cache.k, spec.kc.encode(k_LBKTD))
    v = jax.tree.map(base.scatter(slot_BT), cache.v, spec.vc.encode(v_LBKTD))
    return dataclasses.replace(cache, k=k, v=v, **fields)

  def put_heads(self, cache: CompactedCache, slot_LBK, k_LBKD, v_LBKD, **fields):
    spec, put = cache.spec, scatter_heads(slot_LBK)
    new = lambda a: a[:, :, :, None]  # noqa: E731  [L, B, K, D] -> one token [L, B, K, 1, D]
    k = jax.tree.map(lambda s, e: put(s, e[:, :, :, 0]), cache.k, spec.kc.encode(new(k_LBKD)))
    v = jax.tree.map(lambda s, e: put(s, e[:, :, :, 0]), cache.v, spec.vc.encode(new(v_LBKD)))
    return dataclasses.replace(cache, k=k, v=v, **fields)

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    K, D = spec.n_kv_heads, spec.head_dim
    kv = spec.kc.bytes_per_token(K, D) + spec.vc.bytes_per_token(K, D)
    per_token = kv + policy_of(spec).state_bytes_per_token(K)  # h2o's acc and pos
    rg = ring.split(spec)
    rings = 0 if rg is None else len(rg.local) * spec.batch * rg.window * kv
    return int(round(evicting_layers(spec) * spec.batch * spec.capacity * per_token + rings)) \
        + 3 * 4 * spec.batch


base.register(Compacted())


def _gather_tokens(pos_LBKS):
  """leaf [L, B, K, S, X] -> [L, B, K, Sk, X], slot i taking token pos[..., i]."""
  def take(a):
    if a.ndim != 5:
      raise KvjaxError("compaction needs codec leaves [L, B, K, S, X]")
    return jnp.take_along_axis(a, pos_LBKS[..., None], axis=3)
  return take


def compress(cache, lengths_B, room: int, q_LBTHD=None, T: int | None = None) -> CompactedCache:
  """The prefilled contiguous `cache` (prompts of `lengths_B` tokens, width T) compacted
  to the policy's budget, with `room` free slots (or a ring, or the budget of a policy
  that evicts by attention) for the decode tokens."""
  spec = cache.spec
  c = spec.cache_cfg
  pol = policy_of(spec)
  T = T or spec.capacity
  Sk = min(policies.static_budget(c, T), T)
  budget_B = policies.budgets(c, lengths_B, T)
  k_store, v_store, rings = cache.k, cache.v, {}
  rg = ring.split(spec)
  if rg is not None:  # a windowed model: its full layers compacted, its windowed layers' rings
    full, local = np.asarray(rg.full, np.int32), np.asarray(rg.local, np.int32)
    if cache.k_ring is not None:  # the prefill cache keeps them already
      rings = {"k_ring": cache.k_ring, "v_ring": cache.v_ring}
    else:  # a window at least the prefill cache's capacity: every layer held whole
      rings = {"k_ring": ring.gather_rings(_layers(cache.k, local), cache.lengths, rg.window),
               "v_ring": ring.gather_rings(_layers(cache.v, local), cache.lengths, rg.window)}
      k_store, v_store = _layers(cache.k, full), _layers(cache.v, full)
    q_LBTHD = None if q_LBTHD is None else q_LBTHD[full]
  k_LBKSD = spec.kc.decode(jax.tree.map(lambda a: a[:, :, :, :T], k_store), jnp.float32) \
      if spec.kc.token_block == 1 else None
  ctx = policies.Context(k_LBKSD, lengths_B, budget_B, c, q_LBTHD)
  heads = {}
  if heads_lib.adaptive(c):  # per-head counts: slots past a head's count are not its own
    Sk = heads_lib.prompt_slots(c, Sk, T)
    pos_LBKS, count_LBK = heads_lib.spread(pol.scores(ctx), lengths_B, budget_B, Sk)
    kept_state = {}
    held_B = jnp.max(count_LBK, axis=(0, 2))
    heads = {"head_held": count_LBK, "prompt_end": held_B}
  else:
    pos_LBKS, kept_state = pol.keep(ctx, Sk)
    held_B = policies.held(lengths_B, budget_B)

  new_spec = dataclasses.replace(spec, layout=Compacted.name, capacity=pol.capacity(c, T, room))
  fresh = Compacted().init(new_spec)

  used_BS = jnp.arange(Sk)[None, :] < held_B[:, None]

  def place(store, kept):  # unused slots stay zero, as in a fresh cache
    kept = jnp.where(used_BS[None, :, None, :, None], kept, jnp.zeros((), kept.dtype))
    return store.at[:, :, :, :Sk].set(kept)
  k = jax.tree.map(place, fresh.k, jax.tree.map(_gather_tokens(pos_LBKS), k_store))
  v = jax.tree.map(place, fresh.v, jax.tree.map(_gather_tokens(pos_LBKS), v_store))

  def place_state(empty, kept):  # each kept slot's state; the others stay as initialized
    return empty.at[:, :, :, :Sk].set(jnp.where(used_BS[None, :, None, :], kept,
                                                empty[:, :, :, :Sk]))
  state = {name: place_state(fresh.state[name], kept_state[name]) for name in fresh.state}
  return CompactedCache(k=k, v=v, lengths=cache.lengths, held=held_B, budget=budget_B,
                        state=state, spec=new_spec, **rings, **heads)


def _layers(store, idx):
  """The layers `idx` of a stacked store's leaves [L, ...]."""
  return jax.tree.map(lambda a: a[idx], store)
