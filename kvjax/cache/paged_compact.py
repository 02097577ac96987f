"""Eviction on pages: the `paged_compacted` layout, what a `cache.policy` builds from a
prefilled `paged` cache (`cache.layout=paged` with any evicting policy).

`kvjax.decode.evict.prefill` prefills the whole prompt into an ordinary paged cache, reads it back
through the block table as one contiguous view, lets the policy select the kept tokens and
gathers them exactly as the contiguous path does (`kvjax.cache.compact.compress`, reused
unchanged), then stores them into pages: each sequence owns

    Q = ceil(capacity / page_size) pages,   capacity = `Policy.capacity(...)`

(the budget plus the decode room, or the ring for window/sinks), in a fresh pool of B x Q
pages with an identity block table (sequence b owns pages [b Q, (b + 1) Q)). The prefill
pool, with its ceil((prompt + room) / page_size) pages per sequence, is dropped: the pages
beyond a sequence's Q are released on the device, and `cache_bytes` is the budgeted pool
(`closed_form_bytes`). The serving engine does the same in its one shared pool: a request
is compacted into its own first pages once its prompt is cached, and the pages beyond its
held tokens go back to its page allocator (kvjax/lab/serve/engine.py, `compact_pages` in
kvjax/lab/serve/device.py).

Slots: `lengths` counts every token seen (the next token's position, which RoPE needs),
`held` the slots [0, held) that hold a token; slot s lives in logical page s // page_size
at offset s % page_size. Like `compact`, this is storage only: the policy's decode rule
(`Policy.decode_write`: append, the window/sinks ring, score-and-replace) decides the
slots and writes through this layout's `Slots`: `put_tokens` maps each slot to its page
and offset through the table (`locate`), `put_heads` does the same per (layer, KV head),
and `keys` is the held slots' contiguous view, which h2o and tova score exactly as on the
contiguous layout. The policy's per-slot `state` (h2o's `acc` and `pos`, [L, B, K,
capacity]) sits beside the pool.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import base, compact
from kvjax.cache.paged import num_pages, page_size, pages_per_seq


@struct.dataclass
class CompactedPagedCache:
  k: Any                  # K codec storage, pool leaves [L, P, K, page_size, ...]
  v: Any                  # V codec storage, pool leaves [L, P, K, page_size, ...]
  block_table: jax.Array  # [B, Q] int32 physical page of each logical page; P = none
  lengths: jax.Array      # [B] int32 tokens seen (= position of the next token)
  held: jax.Array         # [B] int32 slots holding a token (slots [0, held) are valid)
  budget: jax.Array       # [B] int32 tokens kept per sequence (ring size of window/sinks)
  state: Any              # {name: [L, B, K, S]}: the policy's own leaves per slot (h2o: acc, pos)
  spec: base.CacheSpec = struct.field(pytree_node=False)

  AXES: ClassVar[dict] = {"k": base.POOL, "v": base.POOL, "state": base.KV,
                          **{f: base.PER_SEQUENCE for f in ("block_table", "lengths", "held",
                                                            "budget")}}


def locate(table_BQ, b_idx, slot, ps: int, P: int):
  """(physical page, offset) of each slot through the block table; `b_idx` is the sequence
  index broadcast against `slot`. A slot that is -1 or past the table (or whose page is
  unallocated, entry P) gets page P, which a scatter with mode="drop" skips."""
  Q = table_BQ.shape[1]
  valid = (slot >= 0) & (slot < Q * ps)
  page = jnp.where(valid, table_BQ[b_idx, jnp.clip(slot // ps, 0, Q - 1)], P)
  return page, jnp.where(valid, slot % ps, 0)


def put_pages(pool, table_BQ, slot_BT, enc_LBKTX, P: int):
  """pool [L, P, K, page, X] <- enc [L, B, K, T, X], token t to its slot's page (dropped
  when the slot is -1 or its page is unallocated, table entry P)."""
  b_B1 = jnp.arange(slot_BT.shape[0])[:, None]
  page_BT, off_BT = locate(table_BQ, b_B1, slot_BT, pool.shape[3], P)
  return pool.at[:, page_BT, :, off_BT].set(jnp.moveaxis(enc_LBKTX, (1, 3), (0, 1)), mode="drop")


class PagedCompacted(base.Layout):
  """Held tokens in slots [0, held) of a sequence's pages, found through its block table."""

  name = "paged_compacted"
  internal = True  # built by a cache.policy on cache.layout=paged, never chosen by name
  compacts = "paged"

  def init(self, spec: base.CacheSpec) -> CompactedPagedCache:
    """An empty pool, page j of sequence b at physical page b Q + j (as `Paged.init`)."""
    B, Q = spec.batch, pages_per_seq(spec)
    cache = init_pool(spec)
    return dataclasses.replace(cache, block_table=jnp.arange(B * Q, dtype=jnp.int32)
                               .reshape(B, Q) % num_pages(spec))

  def wants_queries(self, spec: base.CacheSpec) -> bool:
    return compact.policy_of(spec).decode_queries

  def compress(self, cache, lengths_B, room: int, q_LBTHD=None, T: int | None = None):
    """A prefilled `paged` cache compacted into this layout (`compress` below)."""
    return compress(cache, lengths_B, room, q_LBTHD, T=T)

  def store(self, cache: CompactedPagedCache) -> Any:
    return (cache.k, cache.v, cache.block_table, cache.held)

  def read(self, spec, store, lengths_B, layer):
    k, v, bt_BQ, held_B = store
    S = bt_BQ.shape[1] * page_size(spec)
    mask_BS = jnp.arange(S)[None, :] < held_B[:, None]
    return [base.PagedSegment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.max(held_B),
                              layer=layer, pages=bt_BQ, page_size=page_size(spec))]

  def write(self, cache: CompactedPagedCache, k_LBTKD, v_LBTKD, positions_BT, q_LBTHD=None):
    return compact.policy_of(cache.spec).decode_write(cache.spec, self, cache, k_LBTKD,
                                                      v_LBTKD, positions_BT, q_LBTHD)

  # -- Slots: what the policy's decode rule writes through -------------------------------------
  def keys(self, cache: CompactedPagedCache) -> Any:
    S = cache.spec.capacity
    return jax.tree.map(lambda a: a[:, :, :, :S], contiguous_view(cache, S).k)

  def put_tokens(self, cache: CompactedPagedCache, slot_BT, k_LBTKD, v_LBTKD, **fields):
    spec = cache.spec
    P = jax.tree.leaves(cache.k)[0].shape[1]
    k_LBKTD, v_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3), jnp.swapaxes(v_LBTKD, 2, 3)
    put = lambda pool, enc: put_pages(pool, cache.block_table, slot_BT, enc, P)  # noqa: E731
    k = jax.tree.map(put, cache.k, spec.kc.encode(k_LBKTD))
    v = jax.tree.map(put, cache.v, spec.vc.encode(v_LBKTD))
    return dataclasses.replace(cache, k=k, v=v, **fields)

  def put_heads(self, cache: CompactedPagedCache, slot_LBK, k_LBKD, v_LBKD, **fields):
    """Each (layer, sequence, KV head)'s token into its slot's page and offset."""
    spec = cache.spec
    S, ps = spec.capacity, page_size(spec)
    L, B, K = slot_LBK.shape
    P = jax.tree.leaves(cache.k)[0].shape[1]
    page_LBK, off_LBK = locate(cache.block_table, jnp.arange(B)[None, :, None],
                               jnp.where(slot_LBK < S, slot_LBK, -1), ps, P)  # S: none
    idx = (jnp.arange(L)[:, None, None], page_LBK, jnp.arange(K)[None, None, :], off_LBK)
    put = lambda pool, e: pool.at[idx].set(e[:, :, :, 0].astype(pool.dtype),  # noqa: E731
                                           mode="drop")
    new = lambda a: a[:, :, :, None]  # noqa: E731  [L, B, K, D] -> one token [L, B, K, 1, D]
    k = jax.tree.map(put, cache.k, spec.kc.encode(new(k_LBKD)))
    v = jax.tree.map(put, cache.v, spec.vc.encode(new(v_LBKD)))
    return dataclasses.replace(cache, k=k, v=v, **fields)

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    K, D = spec.n_kv_heads, spec.head_dim
    per_token = spec.kc.bytes_per_token(K, D) + spec.vc.bytes_per_token(K, D)
    pool = spec.n_layers * num_pages(spec) * page_size(spec) * per_token
    state = compact.policy_of(spec).state_bytes_per_token(K)  # h2o's acc, pos
    pool += spec.n_layers * spec.batch * spec.capacity * state
    return int(round(pool)) + 4 * spec.batch * pages_per_seq(spec) + 3 * 4 * spec.batch


base.register(PagedCompacted())


def init_pool(spec: base.CacheSpec) -> CompactedPagedCache:
  """A zeroed pool with an empty block table (every entry = P): the serving engine's."""
  L, B, K, D = spec.n_layers, spec.batch, spec.n_kv_heads, spec.head_dim
  P, Q = num_pages(spec), pages_per_seq(spec)
  shape = (L, P, K, page_size(spec), D)
  zeros = jnp.zeros((B,), jnp.int32)
  return CompactedPagedCache(k=spec.kc.init(shape), v=spec.vc.init(shape),
                           block_table=jnp.full((B, Q), P, jnp.int32), lengths=zeros,
                           held=zeros, budget=zeros + spec.capacity,
                           state=compact.init_state(spec), spec=spec)


def contiguous_view(cache, T: int):
  """The first T tokens of every sequence of a paged cache, gathered through its block
  table, as a contiguous cache's leaves [L, B, K, T, ...] (what `compact.compress` reads)."""
  ps = page_size(cache.spec)
  q = -(-T // ps)
  bt_Bq = cache.block_table[:, :q]

  def view(a):  # [L, P, K, ps, X] -> [L, B, K, q * ps, X]
    g = a.at[:, bt_Bq].get(mode="clip")  # [L, B, q, K, ps, X]; unallocated (P): masked later
    L, B, _, K = g.shape[:4]
    return jnp.swapaxes(g, 2, 3).reshape(L, B, K, q * ps, *g.shape[5:])
  spec = dataclasses.replace(cache.spec, layout="contiguous", capacity=q * ps,
                             batch=bt_Bq.shape[0])
  return types.SimpleNamespace(k=jax.tree.map(view, cache.k), v=jax.tree.map(view, cache.v),
                               lengths=cache.lengths, spec=spec)


def to_pages(ev: compact.CompactedCache) -> CompactedPagedCache:
  """A compacted contiguous cache [L, B, K, cap, X] stored into B x Q pages (slot s of
  sequence b in its logical page s // page_size, physical page b Q + s // page_size)."""
  spec = dataclasses.replace(ev.spec, layout=PagedCompacted.name,  # a pool of just these pages
                             cache_cfg=dataclasses.replace(ev.spec.cache_cfg, num_pages=0))
  ps, Q = page_size(spec), pages_per_seq(spec)

  def pool(a):  # [L, B, K, cap, X] -> [L, B Q, K, ps, X]
    L, B, K, S = a.shape[:4]
    a = jnp.pad(a, [(0, 0)] * 3 + [(0, Q * ps - S)] + [(0, 0)] * (a.ndim - 4))
    a = a.reshape(L, B, K, Q, ps, *a.shape[4:])
    return jnp.swapaxes(a, 2, 3).reshape(L, B * Q, K, ps, *a.shape[5:])
  B = spec.batch
  return CompactedPagedCache(k=jax.tree.map(pool, ev.k), v=jax.tree.map(pool, ev.v),
                           block_table=jnp.arange(B * Q, dtype=jnp.int32).reshape(B, Q),
                           lengths=ev.lengths, held=ev.held, budget=ev.budget,
                           state=ev.state, spec=spec)


def compress(cache, lengths_B, room: int, q_LBTHD=None, T: int | None = None):
  """The prefilled paged `cache` compacted to the policy's budget (`compact.compress` on
  its contiguous view), stored into a pool of the pages the budget needs."""
  T = T or cache.spec.capacity
  return to_pages(compact.compress(contiguous_view(cache, T), lengths_B, room, q_LBTHD, T=T))
