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

  @property
  def kc(self) -> codecs.Codec:
    return codecs.get(self.k_codec)

  @property
  def vc(self) -> codecs.Codec:
    return codecs.get(self.v_codec)

  @classmethod
  def from_config(cls, cfg: Config, batch: int, capacity: int) -> "CacheSpec":
    m, c = cfg.model, cfg.cache
    return cls(layout=c.layout, k_codec=c.k_codec, v_codec=c.v_codec, batch=batch,
               capacity=capacity, n_layers=m.n_layers, n_kv_heads=m.n_kv_heads,
               head_dim=m.D, dtype=m.dtype, cache_cfg=c)


@struct.dataclass
class KVCache:
  k: Any                 # K codec storage, leaves [L, B, K, S, ...]
  v: Any                 # V codec storage, leaves [L, B, K, S, ...]
  lengths: jax.Array     # [B] int32: tokens held per sequence
  spec: CacheSpec = struct.field(pytree_node=False)

  @property
  def layout(self) -> "Layout":
    return LAYOUTS[self.spec.layout]

  def layer_stores(self) -> Any:
    """The per-layer part that the layer scan slices along its leading axis."""
    return (self.k, self.v)


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
    logits_BSV, _ = model.apply({"params": params}, tokens_BS, pos_BS, None)
    logits_BTV = jnp.take_along_axis(logits_BSV, jnp.clip(positions_BT, 0, S - 1)[..., None],
                                     axis=1)
    return logits_BTV, TokenBuffer(tokens=tokens_BS, lengths=lengths, spec=buf.spec)

  def closed_form_bytes(self, spec: CacheSpec) -> int:
    return 4 * spec.batch * spec.capacity + 4 * spec.batch


class Contiguous(Layout):
  """`capacity` preallocated slots per sequence; token at position p lives in slot p."""

  name = "contiguous"

  def init(self, spec: CacheSpec) -> KVCache:
    shape = (spec.n_layers, spec.batch, spec.n_kv_heads, spec.capacity, spec.head_dim)
    return KVCache(k=spec.kc.init(shape, spec.cache_cfg), v=spec.vc.init(shape, spec.cache_cfg),
                   lengths=jnp.zeros((spec.batch,), jnp.int32), spec=spec)

  def forward(self, model, params, tokens_BT, positions_BT, cache: KVCache):
    return model.apply({"params": params}, tokens_BT, positions_BT, cache)

  def segments(self, spec, layer_store, lengths_B):
    k, v = layer_store
    mask_BS = jnp.arange(spec.capacity)[None, :] < lengths_B[:, None]
    return [Segment(k, v, mask_BS, spec.kc, spec.vc)]

  def write(self, cache: KVCache, k_LBTKD, v_LBTKD, positions_BT) -> KVCache:
    spec = cache.spec
    S = spec.capacity
    # [L, B, T, K, D] -> [L, B, K, T, D]: the cache stores K heads before tokens.
    k_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3)
    v_LBKTD = jnp.swapaxes(v_LBTKD, 2, 3)
    slots_BT = jnp.where(positions_BT >= 0, positions_BT, S)  # padding: out of range, dropped

    def put(store, new):
      # store [L, B, K, S, ...], new [L, B, K, T, ...]; scatter each token to its slot.
      B = new.shape[1]
      rows = jnp.arange(B)[:, None]
      return store.at[:, rows, :, slots_BT].set(jnp.moveaxis(new, (1, 3), (0, 1)), mode="drop")

    k = jax.tree.map(put, cache.k, spec.kc.encode(k_LBKTD, spec.cache_cfg))
    v = jax.tree.map(put, cache.v, spec.vc.encode(v_LBKTD, spec.cache_cfg))
    lengths = cache.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    return dataclasses.replace(cache, k=k, v=v, lengths=lengths)

  def closed_form_bytes(self, spec: CacheSpec) -> int:
    per_token = (spec.kc.bytes_per_token(spec.n_kv_heads, spec.head_dim, spec.cache_cfg)
                 + spec.vc.bytes_per_token(spec.n_kv_heads, spec.head_dim, spec.cache_cfg))
    return int(round(spec.n_layers * spec.batch * spec.capacity * per_token)) + 4 * spec.batch


LAYOUTS: dict[str, Layout] = {"none": NoCache(), "contiguous": Contiguous()}


def init_cache(cfg: Config, batch: int, capacity: int):
  """A fresh cache (or token buffer for layout `none`) for `batch` sequences."""
  if capacity <= 0:
    raise KvjaxError(f"cache capacity must be positive, got {capacity}")
  spec = CacheSpec.from_config(cfg, batch, capacity)
  return LAYOUTS[spec.layout].init(spec)
