"""The `paged` layout (PagedAttention): the device side of paging.

Device side: one pool of fixed-size pages per layer holds codec-encoded K/V (every leaf
`[L, P, K, page_size, ...]`, token axis still at -2, so any token-axis codec works
unchanged), and a block table `[B, Q]` (Q = ceil(capacity / page_size), or fewer: a narrower table
reads fewer tokens, as the engine does for short requests) maps each sequence's logical
page i to a physical page. The block table is data in the cache
pytree: the engine rewrites it between steps and nothing retraces. A layer's attention
reads its sequences block by block: each block gathers only its pages, through the block
table, from the stacked pool (`PagedSegment.pages`), and reads stop at the live length, so a
step reads the pages in use, never the whole pool or a layer-sized copy. Invalid slots
are masked exactly as in the contiguous layout. New tokens are scattered to (page, slot);
positions whose page is unallocated (table entry = P, the sentinel) are dropped, never
written into another sequence's page.

The host side, which pages a sequence owns, shares or frees, is the serving engine's page
allocator (kvjax/lab/serve/allocator.py), which fills the block table between steps.

A model with sliding-window layers (`model.sliding_window`) keeps, as the contiguous layout
does, each windowed layer in a ring of its last W tokens per sequence (kvjax.cache.ring):
those rings `[Lw, B, K, W, ...]` sit beside the pool, which then holds only the full
layers, so a page costs Lg / L of a whole model's page and a windowed layer never takes
one; a sequence's pages are the full layers' and go back to the pool as before. A ring
belongs to its sequence's row, so the serving engine caches no prefix for such a model
(a prefix's pages would not bring its rings). With an eviction policy the pool holds
every layer and the window is a mask on it, as the compaction expects.

Eviction (`cache.policy` other than `full`) composes with paging: the prompt is prefilled
into this layout, then the kept tokens are stored by slot, not position, into the pages of
the budget (`paged_compacted`, kvjax/cache/paged_compact.py); the engine returns the pages
beyond them to its allocator.

Not supported yet, refused with a one-line error: the full-precision residual window
(`cache.residual`) and per-channel key scales (`cache.k_axis=channel`), whose token
blocks straddle pages.
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
from kvjax.errors import KvjaxError


def page_size(spec: base.CacheSpec) -> int:
  return spec.cache_cfg.page_size


def pages_per_seq(spec: base.CacheSpec) -> int:
  """Q: block-table width, enough pages for `capacity` tokens."""
  return -(-spec.capacity // page_size(spec))


def num_pages(spec: base.CacheSpec) -> int:
  """P: pool size (`cache.num_pages`, or 0 for every sequence's full capacity)."""
  return spec.cache_cfg.num_pages or spec.batch * pages_per_seq(spec)


def rings(spec: base.CacheSpec) -> ring.Layers | None:
  """The windowed layers' ring split (kvjax.cache.ring), or None: no windowed layer, a
  window as wide as the capacity, or an eviction policy (its compaction reads every layer
  from the pool)."""
  return None if policies.evicts(spec.cache_cfg) else ring.layers(spec)


def check_config(c, m=None) -> None:
  """What paging cannot hold yet, refused on the host (`Paged.check`)."""
  if c.residual:
    raise KvjaxError(f"cache.layout=paged does not support the residual window (cache.residual="
                     f"{c.residual}); set cache.residual=0 or use cache.layout=contiguous")
  if c.k_axis == "channel":
    raise KvjaxError("cache.layout=paged does not support per-channel key scales; set "
                     "cache.k_axis=token or use cache.layout=contiguous")
  if c.keep_first:
    raise KvjaxError(f"cache.layout=paged does not support cache.keep_first={c.keep_first}; "
                     "set cache.keep_first=0 or use cache.layout=contiguous")



@struct.dataclass
class PagedCache:
  k: Any                  # K codec storage, leaves [L, P, K, page_size, ...]
  v: Any                  # V codec storage, leaves [L, P, K, page_size, ...]
  block_table: jax.Array  # [B, Q] int32 physical page of each logical page; P = unallocated
  lengths: jax.Array      # [B] int32 tokens held per sequence
  spec: base.CacheSpec = struct.field(pytree_node=False)
  k_ring: Any = None      # sliding-window layers' last W tokens [Lw, B, K, W, ...] (`rings`);
  v_ring: Any = None      # then the pools hold the other layers only [Lg, P, K, page_size, ...]

  # any sequence may own (or share, with prefix caching) any page: pools split KV heads only
  AXES: ClassVar[dict] = {"k": base.POOL, "v": base.POOL, "k_ring": base.KV,
                          "v_ring": base.KV, "block_table": base.PER_SEQUENCE,
                          "lengths": base.PER_SEQUENCE}


class Paged(base.Layout):
  """Pages of `cache.page_size` tokens from a shared pool, found through a block table."""

  name = "paged"
  shared_pool = True

  def check(self, cache_cfg, model_cfg) -> None:
    if cache_cfg.layout == self.name:
      check_config(cache_cfg)

  def rings(self, spec: base.CacheSpec) -> ring.Layers | None:
    return rings(spec)

  def init(self, spec: base.CacheSpec) -> PagedCache:
    """A pool with every sequence's pages allocated up front (what `generate.generate` needs:
    page j of sequence b is physical page b * Q + j). The engine uses `init_pool`."""
    B, Q, P = spec.batch, pages_per_seq(spec), num_pages(spec)
    if P < B * Q:
      raise KvjaxError(f"cache.num_pages={P} is smaller than the {B * Q} pages that batch {B} x "
                       f"capacity {spec.capacity} needs up front; raise cache.num_pages or set it "
                       "to 0 (the serving engine allocates on demand)")
    cache = init_pool(spec)
    return dataclasses.replace(cache, block_table=jnp.arange(B * Q, dtype=jnp.int32).reshape(B, Q))

  def store(self, cache: PagedCache) -> Any:
    """The whole stacked pools and the block table (a read gathers (layer, page) itself),
    and the rings of the windowed layers where there are any."""
    if cache.k_ring is not None:
      return (cache.k, cache.v, cache.block_table, cache.k_ring, cache.v_ring)
    return (cache.k, cache.v, cache.block_table)

  def read(self, spec, store, lengths_B, layer):
    """The segment spans the table's Q * page_size slots (a narrower table reads less); the
    attention gathers only the pages of the blocks it reads, up to the live length. With
    rings, a windowed layer reads its ring instead (`ring.read`'s rule: a layer index known
    when tracing reads its own segment only, a traced one both, the other empty)."""
    k, v, bt_BQ = store[:3]
    S = bt_BQ.shape[1] * page_size(spec)
    mask_BS = jnp.arange(S)[None, :] < jnp.minimum(lengths_B, spec.capacity)[:, None]
    held = jnp.max(lengths_B)
    rg = rings(spec)

    def pages(local=False, rank=layer):
      return base.PagedSegment(k, v, mask_BS & ~jnp.asarray(local), spec.kc, spec.vc,
                               live=jnp.where(local, 0, held), layer=rank, pages=bt_BQ,
                               page_size=page_size(spec),
                               pos_BS=jnp.broadcast_to(jnp.arange(S)[None, :], mask_BS.shape))
    if rg is None:
      return [pages()]
    local = rg.is_local(layer)
    ring_seg = ring.ring_segment(spec, store[3], store[4], lengths_B, held, rg.window, local,
                                 rg.rank(layer, rg.local))
    if isinstance(local, bool):
      return [ring_seg] if local else [pages(False, rg.rank(layer, rg.full))]
    return ([pages(local, rg.rank(layer, rg.full))] if rg.full else []) + [ring_seg]

  def write(self, cache: PagedCache, k_LBTKD, v_LBTKD, positions_BT) -> PagedCache:
    spec = cache.spec
    ps, Q, P = page_size(spec), cache.block_table.shape[1], num_pages(spec)
    valid = (positions_BT >= 0) & (positions_BT < Q * ps)
    logical_BT = jnp.clip(positions_BT // ps, 0, Q - 1)
    page_BT = jnp.where(valid, jnp.take_along_axis(cache.block_table, logical_BT, axis=1), P)
    slot_BT = jnp.where(valid, positions_BT % ps, 0)

    def put(store, new):  # store [L, P, K, page, X] <- new [L, B, K, T, X]
      return store.at[:, page_BT, :, slot_BT].set(jnp.moveaxis(new, (1, 3), (0, 1)), mode="drop")

    k_LBKTD, v_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3), jnp.swapaxes(v_LBTKD, 2, 3)
    lengths = cache.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    rg, extra = rings(spec), {}
    if rg is not None:  # the windowed layers' last W positions to their rings, the rest paged
      local, full = np.asarray(rg.local, np.int32), np.asarray(rg.full, np.int32)
      extra["k_ring"], extra["v_ring"] = ring.put_rings(
          spec, cache.k_ring, cache.v_ring, k_LBKTD[local], v_LBKTD[local], positions_BT,
          lengths, rg.window)
      k_LBKTD, v_LBKTD = k_LBKTD[full], v_LBKTD[full]
    k = jax.tree.map(put, cache.k, spec.kc.encode(k_LBKTD))
    v = jax.tree.map(put, cache.v, spec.vc.encode(v_LBKTD))
    return dataclasses.replace(cache, k=k, v=v, lengths=lengths, **extra)

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    K, D = spec.n_kv_heads, spec.head_dim
    per_token = spec.kc.bytes_per_token(K, D) + spec.vc.bytes_per_token(K, D)
    rg = rings(spec)
    paged_layers = spec.n_layers if rg is None else len(rg.full)
    pool = paged_layers * num_pages(spec) * page_size(spec) * per_token
    ringed = 0 if rg is None else len(rg.local) * spec.batch * rg.window * per_token
    return int(round(pool + ringed)) + 4 * spec.batch * pages_per_seq(spec) + 4 * spec.batch


def init_pool(spec: base.CacheSpec) -> PagedCache:
  """A zeroed pool with an empty block table (every entry = P, nothing allocated)."""
  check_config(spec.cache_cfg, None)
  L, B, K, D = spec.n_layers, spec.batch, spec.n_kv_heads, spec.head_dim
  P, Q = num_pages(spec), pages_per_seq(spec)
  rg = rings(spec)
  extra = {}
  if rg is not None:  # the pool holds the full layers; each windowed layer a ring per row
    L = len(rg.full)
    ring_shape = ring.shapes(spec, rg)[1]
    extra = {"k_ring": spec.kc.init(ring_shape), "v_ring": spec.vc.init(ring_shape)}
  shape = (L, P, K, page_size(spec), D)
  return PagedCache(k=spec.kc.init(shape), v=spec.vc.init(shape),
                    block_table=jnp.full((B, Q), P, jnp.int32),
                    lengths=jnp.zeros((B,), jnp.int32), spec=spec, **extra)


base.register(Paged())
