"""The KV cache: an immutable pytree, and the storage layouts that build and read it.

`KVCache` holds only the KV heads (never repeated query-group copies), codec-encoded,
stacked over layers on a leading axis so the layer scan slices one layer per step,
plus per-sequence `lengths`. Static metadata (`CacheSpec`) rides along as a non-pytree
field, so jit sees shapes and names, not values.

A layout decides where tokens live and how a layer sees them:
  - `forward(model, params, tokens, positions, cache) -> (logits, cache)`: one model
    call through this layout (the decode loop only ever calls this);
  - `segments(spec, layer_store, lengths)`: what one layer's attention reads, as a
    list of `Segment`s (stored K, stored V, validity mask);
  - `write(cache, k_new, v_new, positions)`: encode and store new tokens.

Layouts: `none` keeps only the token ids and recomputes the whole prefix every step
(the quadratic baseline and the reference); `contiguous` preallocates `capacity` slots
per sequence. Adding a layout = one class + one `LAYOUTS` entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import codecs
from kvjax.config import Config
from kvjax.errors import KvjaxError


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Everything static about a cache: shapes, layout and codec names."""

  layout: str
  k_codec: str
  v_codec: str
  batch: int         # B
  capacity: int      # S
  n_layers: int      # L
  n_kv_heads: int    # K
  head_dim: int      # D
  dtype: str         # compute dtype of the model reading the cache
  cache_cfg: Any = None  # the CacheConfig (axis, groups, residual, pages)
  model_cfg: Any = None  # the ModelConfig (the latent layout's rank and RoPE)

  @property
  def kc(self) -> codecs.Codec:
    return codecs.for_role(self.k_codec, self.cache_cfg, "k")

  @property
  def vc(self) -> codecs.Codec:
    return codecs.for_role(self.v_codec, self.cache_cfg, "v")

  @property
  def residual(self) -> int:
    """R: slots of the full-precision window of recent tokens (0: none)."""
    return getattr(self.cache_cfg, "residual", 0) or 0

  @property
  def block(self) -> int:
    """U: tokens quantized together when they leave the window (KIVI key groups)."""
    return self.kc.token_block

  @property
  def history(self) -> int:
    """Quantized slots: all of `capacity` without a window, else what can ever leave it."""
    R, U = self.residual, self.block
    return self.capacity if not R else U * -(-max(self.capacity - R, 0) // U)

  @property
  def window_codec(self) -> codecs.Codec:
    return codecs.get(codecs.DTYPE_TO_CODEC[self.dtype])

  def quantized_len(self, lengths_B: jax.Array) -> jax.Array:
    """q(n): tokens held in the quantized history when n are cached. The window keeps the
    newest n - q <= R tokens; a block of U leaves it only when the window would overflow."""
    R, U = self.residual, self.block
    if not R:
      return lengths_B
    return (jnp.maximum(lengths_B - R, 0) + U - 1) // U * U

  @classmethod
  def from_config(cls, cfg: Config, batch: int, capacity: int) -> "CacheSpec":
    m, c = cfg.model, cfg.cache
    return cls(layout=c.layout, k_codec=c.k_codec, v_codec=c.v_codec, batch=batch,
               capacity=capacity, n_layers=m.n_layers, n_kv_heads=m.n_kv_heads,
               head_dim=m.D, dtype=m.dtype, cache_cfg=c, model_cfg=m)


@struct.dataclass
class KVCache:
  k: Any                 # K codec storage, leaves [L, B, K, S, ...]
  v: Any                 # V codec storage, leaves [L, B, K, S, ...]
  lengths: jax.Array     # [B] int32: tokens held per sequence
  spec: CacheSpec = struct.field(pytree_node=False)
  k_win: Any = None      # full-precision window [L, B, K, R, D] (cache.residual > 0), else None
  v_win: Any = None

  @property
  def layout(self) -> "Layout":
    return LAYOUTS[self.spec.layout]

  def layer_stores(self) -> Any:
    """The per-layer part that the layer scan slices along its leading axis."""
    if self.k_win is None:
      return (self.k, self.v)
    return (self.k, self.v, self.k_win, self.v_win)


@struct.dataclass
class TokenBuffer:
  """The `none` layout's state: token ids only; K/V are recomputed every step."""

  tokens: jax.Array      # [B, S] int32
  lengths: jax.Array     # [B] int32
  spec: CacheSpec = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class Segment:
  """A span of stored tokens one layer attends to."""

  k: Any                 # K codec storage [B, K, S', ...]
  v: Any                 # V codec storage [B, K, S', ...]
  mask_BS: jax.Array     # [B, S'] True where the slot holds a valid token
  k_codec: codecs.Codec
  v_codec: codecs.Codec
  live: Any = None       # scalar int32: every valid slot lies in [0, live) (None: all S).
                         # The attention reads only ceil(live / block) blocks, so a decode
                         # step costs the tokens held, not the capacity allocated.
  layer: Any = None      # None: leaves are one layer's [B, K, S', ...]. Else leaves are the
                         # whole stacked store [L, B, K, S', ...] and this is the layer index:
                         # the attention slices (layer, block) itself, so no layer-sized copy.
  pages: Any = None      # paged storage: block table [B, N] int32 (physical page of each logical
                         # page). Leaves are then pools [(L,) P, K, page_size, ...] and the
                         # attention gathers only the pages of the block it reads.
  page_size: int = 0


def tree_bytes(tree: Any) -> int:
  """Bytes actually held by the arrays of a pytree (what `cache_bytes` reports)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


class Layout:
  name = "base"

  def init(self, spec: CacheSpec) -> Any:
    raise NotImplementedError

  def forward(self, model, params, tokens_BT, positions_BT, cache):
    raise NotImplementedError

  def segments(self, spec: CacheSpec, layer_store: Any, lengths_B: jax.Array) -> list[Segment]:
    return []

  def closed_form_bytes(self, spec: CacheSpec) -> int:
    raise NotImplementedError


class NoCache(Layout):
  """Recompute the whole prefix every step: O(S^2) work per token, only token ids kept."""

  name = "none"

  def init(self, spec: CacheSpec) -> TokenBuffer:
    B, S = spec.batch, spec.capacity
    return TokenBuffer(tokens=jnp.zeros((B, S), jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
                       spec=spec)

  def forward(self, model, params, tokens_BT, positions_BT, buf: TokenBuffer):
    B, S = buf.tokens.shape
    rows = jnp.arange(B)[:, None]
    slots = jnp.where(positions_BT >= 0, positions_BT, S)  # padding goes out of range: dropped
    tokens_BS = buf.tokens.at[rows, slots].set(tokens_BT, mode="drop")
    lengths = buf.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    pos_S = jnp.arange(S, dtype=jnp.int32)
    pos_BS = jnp.where(pos_S[None, :] < lengths[:, None], pos_S[None, :], -1)
    # Logits only where they are wanted (the model's last token, or this call's T tokens),
    # not at all S recomputed positions.
    at = None if getattr(model, "logits_last", False) else jnp.clip(positions_BT, 0, S - 1)
    logits_BTV, _ = model.apply({"params": params}, tokens_BS, pos_BS, None, logits_at=at)
    return logits_BTV, TokenBuffer(tokens=tokens_BS, lengths=lengths, spec=buf.spec)

  def closed_form_bytes(self, spec: CacheSpec) -> int:
    return 4 * spec.batch * spec.capacity + 4 * spec.batch


class Contiguous(Layout):
  """`capacity` preallocated slots per sequence; token at position p lives in slot p.

  With a residual window (`cache.residual` = R > 0) the newest tokens stay in full
  precision in a ring of R slots (position p in slot p mod R) and the quantized history
  holds positions [0, q(n)) in slot p. When the window would overflow, its oldest block
  of U tokens (U = the K codec's token block: 1, or the KIVI group) is encoded once and
  appended to the history; history is never decoded or re-encoded. Everything is data-
  driven by per-sequence lengths, so prefill and decode never retrace.
  """

  name = "contiguous"

  def init(self, spec: CacheSpec) -> KVCache:
    L, B, K, D, R = spec.n_layers, spec.batch, spec.n_kv_heads, spec.head_dim, spec.residual
    shape = (L, B, K, spec.history, D)
    cache = KVCache(k=spec.kc.init(shape, spec.cache_cfg), v=spec.vc.init(shape, spec.cache_cfg),
                    lengths=jnp.zeros((B,), jnp.int32), spec=spec)
    if R:
      win = lambda: spec.window_codec.init((L, B, K, R, D))  # noqa: E731
      cache = dataclasses.replace(cache, k_win=win(), v_win=win())
    return cache

  def forward(self, model, params, tokens_BT, positions_BT, cache: KVCache):
    return model.apply({"params": params}, tokens_BT, positions_BT, cache)

  def segments(self, spec, layer_store, lengths_B, layer=None):
    """With `layer`, `layer_store` is the whole stacked store (see `Segment.layer`)."""
    k, v = layer_store[:2]
    q_B = spec.quantized_len(lengths_B)
    segs = []
    if spec.history:
      mask_BS = jnp.arange(spec.history)[None, :] < q_B[:, None]
      segs.append(Segment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.max(q_B), layer=layer))
    if spec.residual:
      R = spec.residual
      slot_R = jnp.arange(R)[None, :]
      pos_BR = q_B[:, None] + (slot_R - q_B[:, None]) % R  # the position each slot holds
      wc = spec.window_codec
      segs.append(Segment(layer_store[2], layer_store[3], pos_BR < lengths_B[:, None], wc, wc,
                          layer=layer))
    return segs

  # The model passes the stacked store and a layer index to a `segments` marked so. The
  # layer scan slicing each layer's store instead compiled to a copy of the whole layer's
  # capacity every step (measured: a [B, K, S, D] dynamic-slice fusion per layer).
  segments.stacked = True

  def write(self, cache: KVCache, k_LBTKD, v_LBTKD, positions_BT) -> KVCache:
    spec = cache.spec
    # [L, B, T, K, D] -> [L, B, K, T, D]: the cache stores K heads before tokens.
    k_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3)
    v_LBKTD = jnp.swapaxes(v_LBTKD, 2, 3)
    lengths = cache.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    if spec.residual:
      return self._write_windowed(cache, k_LBKTD, v_LBKTD, positions_BT, lengths)
    slots_BT = jnp.where(positions_BT >= 0, positions_BT, spec.history)  # padding: dropped
    k = jax.tree.map(_scatter(slots_BT), cache.k, spec.kc.encode(k_LBKTD, spec.cache_cfg))
    v = jax.tree.map(_scatter(slots_BT), cache.v, spec.vc.encode(v_LBKTD, spec.cache_cfg))
    return dataclasses.replace(cache, k=k, v=v, lengths=lengths)

  def _write_windowed(self, cache, k_LBKTD, v_LBKTD, positions_BT, lengths):
    spec = cache.spec
    R, U = spec.residual, spec.block
    n0, n1 = cache.lengths, lengths
    q0, q1 = spec.quantized_len(n0), spec.quantized_len(n1)
    T = positions_BT.shape[1]
    n_blocks = -(-T // U)  # q1 - q0 < T + U, so at most ceil(T / U) blocks leave per call
    # Positions leaving the window, gathered from (old window ++ new tokens) in full precision.
    p_BP = q0[:, None] + jnp.arange(n_blocks * U)[None, :]
    src_BP = jnp.clip(jnp.where(p_BP < n0[:, None], p_BP % R, R + p_BP - n0[:, None]), 0, R + T - 1)
    blk = q0[:, None] // U + jnp.arange(n_blocks)[None, :]
    blk_BN = jnp.where((jnp.arange(n_blocks)[None, :] + 1) * U <= (q1 - q0)[:, None], blk,
                       spec.history // U)  # beyond the history: dropped
    # New tokens that stay in the window go to slot p mod R (the rest never enter it).
    stay = (positions_BT >= 0) & (positions_BT >= q1[:, None])
    wslot_BT = jnp.where(stay, positions_BT % R, R)

    def update(codec, hist, win, new_LBKTD):
      src = jnp.concatenate([win, new_LBKTD.astype(win.dtype)], axis=3)
      out_LBKPD = jnp.take_along_axis(src, src_BP[None, :, None, :, None], axis=3)
      hist = jax.tree.map(_scatter_blocks(blk_BN), hist, codec.encode(out_LBKPD, spec.cache_cfg))
      win = _scatter(wslot_BT)(win, spec.window_codec.encode(new_LBKTD))
      return hist, win

    k, k_win = update(spec.kc, cache.k, cache.k_win, k_LBKTD)
    v, v_win = update(spec.vc, cache.v, cache.v_win, v_LBKTD)
    return dataclasses.replace(cache, k=k, v=v, k_win=k_win, v_win=v_win, lengths=lengths)

  def closed_form_bytes(self, spec: CacheSpec) -> int:
    per_token = (spec.kc.bytes_per_token(spec.n_kv_heads, spec.head_dim, spec.cache_cfg)
                 + spec.vc.bytes_per_token(spec.n_kv_heads, spec.head_dim, spec.cache_cfg))
    window = 2 * spec.residual * spec.window_codec.bytes_per_token(spec.n_kv_heads, spec.head_dim)
    return int(round(spec.n_layers * spec.batch * (spec.history * per_token + window))) \
        + 4 * spec.batch


def _scatter(slots_BT):
  """store [L, B, K, S, ...] <- new [L, B, K, T, ...], token t to slot slots_BT[b, t]."""
  def put(store, new):
    rows = jnp.arange(new.shape[1])[:, None]
    return store.at[:, rows, :, slots_BT].set(jnp.moveaxis(new, (1, 3), (0, 1)), mode="drop")
  return put


def _scatter_blocks(blk_BN):
  """Like `_scatter`, for leaves holding N encoded blocks: block j goes to block blk_BN[b, j]."""
  def put(store, new):
    N = blk_BN.shape[1]
    L, B, K, rows = new.shape[:4]
    r = rows // N  # leaf rows per block (U codes rows, or 1 scale row for a channel codec)
    store5 = store.reshape(L, B, K, store.shape[3] // r, r, *store.shape[4:])
    new5 = new.reshape(L, B, K, N, r, *new.shape[4:])
    out = _scatter(blk_BN)(store5, new5)
    return out.reshape(store.shape)
  return put


LAYOUTS: dict[str, Layout] = {"none": NoCache(), "contiguous": Contiguous()}


def init_cache(cfg: Config, batch: int, capacity: int):
  """A fresh cache (or token buffer for layout `none`) for `batch` sequences."""
  if capacity <= 0:
    raise KvjaxError(f"cache capacity must be positive, got {capacity}")
  spec = CacheSpec.from_config(cfg, batch, capacity)
  return LAYOUTS[spec.layout].init(spec)


from kvjax.cache import paged  # noqa: E402,F401  registers the "paged" layout
from kvjax.cache import compact  # noqa: E402,F401  registers "compacted" and the cache.policy checks
from kvjax.cache import latent  # noqa: E402,F401  registers the "latent" layout (MLA-style)
