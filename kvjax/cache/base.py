"""The cache contract: the static `CacheSpec`, the `Segment`s a layer reads, the `Layout`
protocol and the layout registry.

A cache is an immutable pytree with a `spec` (static, a non-pytree field: jit sees shapes
and names, not values) and per-sequence `lengths`. Its layout decides where tokens live
and how a layer sees them, through five named steps the model calls (`kvjax.model`):

  - `init(spec)`: a fresh, empty cache;
  - `attach(cache, params)`: weights the layout reads, attached for one model call (the
    latent layout's up-projection; the others attach nothing);
  - `store(cache)`: the leaves the layers read, each stacked over layers ([L, ...]);
  - `read(spec, store, lengths_B, layer)`: what layer `layer` attends to, as `Segment`s;
  - `write(cache, k_LBTKD, v_LBTKD, positions_BT)`: encode and store new tokens (and
    detach what `attach` attached); a layout whose `wants_queries(spec)` also gets the
    new tokens' rotated queries, `q_LBTHD` (the compacted cache of h2o/tova scores
    tokens by them).

plus `check(cache_cfg, model_cfg)` (host-side limits, run by `config.validate`) and
`closed_form_bytes(spec)` (what `kvjax size` reports). Each module of this folder defines
one layout and registers it; adding a layout = one module here that calls `register`.

Each cache class names the logical axes of its fields' leaves in `AXES` (field -> the
leading dimensions' names below; a codec's own trailing dimensions are unnamed). One rules
table maps them onto the mesh (`kvjax.decode.sharding.RULES`); a field without named axes
is refused there, never silently replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import codecs
from kvjax.config import CacheConfig, Config, ModelConfig
from kvjax.errors import KvjaxError

# The logical axes of cache leaves (`AXES` of each cache class).
LAYERS, BATCH, KV_HEADS, TOKENS, PAGES = "layers", "batch", "kv_heads", "tokens", "pages"
KV = (LAYERS, BATCH, KV_HEADS, TOKENS)        # per sequence: [L, B, K, S, ...]
POOL = (LAYERS, PAGES, KV_HEADS, TOKENS)      # a shared page pool: [L, P, K, page, ...]
PER_SEQUENCE = (BATCH,)                       # [B]
WEIGHTS = ()                                  # attached weights: whole on every device


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Everything static about a cache: shapes, layout, the bound K/V codecs, and the cache
  and model configs the layouts read (page size, policy, latent rank, RoPE)."""

  layout: str
  kc: codecs.Codec   # the K codec, its knobs bound (`codecs.for_role`)
  vc: codecs.Codec   # the V codec
  batch: int         # B
  capacity: int      # S
  n_layers: int      # L
  n_kv_heads: int    # K
  head_dim: int      # D
  dtype: str         # compute dtype of the model reading the cache
  cache_cfg: CacheConfig = CacheConfig()
  model_cfg: ModelConfig = ModelConfig()

  @property
  def k_codec(self) -> str:
    return self.kc.name

  @property
  def v_codec(self) -> str:
    return self.vc.name

  @property
  def residual(self) -> int:
    """R: slots of the full-precision window of recent tokens (0: none)."""
    return self.cache_cfg.residual

  @property
  def keep_first(self) -> int:
    """The first tokens of each sequence kept in full precision (0: none)."""
    return self.cache_cfg.keep_first

  @property
  def block(self) -> int:
    """U: tokens quantized together when they leave the window (KIVI key groups)."""
    return self.kc.token_block

  @property
  def history(self) -> int:
    """Quantized slots: all of `capacity` (less the first tokens kept apart) without a window,
    else what can ever leave it."""
    R, U, S = self.residual, self.block, self.capacity - self.keep_first
    return S if not R else U * -(-max(S - R, 0) // U)

  @property
  def window_codec(self) -> codecs.Codec:
    return codecs.get(codecs.DTYPE_TO_CODEC[self.dtype])

  def quantized_len(self, lengths_B: jax.Array) -> jax.Array:
    """q(n): tokens held in the quantized history when n of its tokens are cached (n counts
    past the `cache.keep_first` first tokens). The window keeps the newest n - q <= R
    tokens; a block of U leaves it only when the window would overflow."""
    R, U = self.residual, self.block
    if not R:
      return lengths_B
    return (jnp.maximum(lengths_B - R, 0) + U - 1) // U * U

  @classmethod
  def from_config(cls, cfg: Config, batch: int, capacity: int) -> "CacheSpec":
    m, c = cfg.model, cfg.cache
    return cls(layout=c.layout, kc=codecs.for_role(c.k_codec, c, "k"),
               vc=codecs.for_role(c.v_codec, c, "v"), batch=batch, capacity=capacity,
               n_layers=m.n_layers, n_kv_heads=m.n_kv_heads, head_dim=m.D, dtype=m.dtype,
               cache_cfg=c, model_cfg=m)


# -- segments: what one layer attends to ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Segment:
  """A span of S' stored tokens one layer attends to, with leaves holding that layer's
  storage [B, K, S', ...] (codec-encoded). Each kind of segment knows how to cut a block
  of tokens out of its storage (`cut`), so the attention never asks where tokens live."""

  k: Any                 # K codec storage
  v: Any                 # V codec storage
  mask_BS: jax.Array     # [B, S'] True where the slot holds a valid token
  k_codec: codecs.Codec
  v_codec: codecs.Codec
  live: Any = None       # scalar int32: every valid slot lies in [0, live) (None: all S').
                         # The attention reads only ceil(live / block) blocks, so a decode
                         # step costs the tokens held, not the capacity allocated.
  pos_BS: Any = None     # [B, S'] the position each slot holds (None: the layout does not
                         # say, and a layer with a window cannot read it: `model.sliding_window`)
  head_BKS: Any = None   # [B, K, S'] False where a slot is not its KV head's own (per-head
                         # budgets, `kvjax.policies.heads`); None: every head reads mask_BS

  @property
  def unit(self) -> int:
    """The fewest tokens a block may hold: whole codec token blocks."""
    return max(self.k_codec.token_block, self.v_codec.token_block)

  def attend(self, q_BKGTD, state, read):
    """Fold this segment into the online-softmax `state` of the queries [B, K, G, T, D]:
    `read(q, segment, state)` is the attention's read of a stored segment. A segment
    stored in another form than K and V (the latent's absorbed rows) transforms the
    queries and the state around that read."""
    return read(q_BKGTD, self, state)

  def dense(self) -> "Segment":
    """This segment as plain K and V (what the reference attention reads): itself here."""
    return self

  def kernel_view(self):
    """Where the CPU read kernel (`kvjax.kernels`) finds this segment's tokens: (layer,
    layers in the store, block table, page size, pages in the pool); page size 0: rows
    of S' contiguous tokens. None: the kernel does not read this kind of segment."""
    return 0, 1, jnp.zeros((1, 1), jnp.int32), 0, 0

  def cut(self, enc: Any, start, size: int) -> Any:
    """Tokens [start, start + size) as leaves [B, K, size, ...] (a leaf may hold one row
    per S' / rows tokens: the per-channel scales of a block of U tokens)."""
    S = self.mask_BS.shape[1]

    def leaf(a):
      per = S // a.shape[-2]
      return jax.lax.dynamic_slice_in_dim(a, start // per, size // per, axis=a.ndim - 2)
    return jax.tree.map(leaf, enc)


@dataclasses.dataclass(frozen=True)
class LayerSegment(Segment):
  """Leaves are the whole stacked store [L, B, K, S', ...] and `layer` the layer read: a
  block is sliced at (layer, block) directly, so no layer-sized copy is ever made (slicing
  each layer's store in the layer scan compiled to a copy of the whole layer per step)."""

  layer: Any = 0

  def kernel_view(self):
    n_layers = jax.tree.leaves(self.k)[0].shape[0]
    return self.layer, n_layers, jnp.zeros((1, 1), jnp.int32), 0, 0

  def cut(self, enc: Any, start, size: int) -> Any:
    S = self.mask_BS.shape[1]

    def leaf(a):  # a: [L, B, K, rows, ...]
      per = S // a.shape[3]
      idx = (self.layer, 0, 0, start // per) + (0,) * (a.ndim - 4)
      return jax.lax.dynamic_slice(a, idx, (1, *a.shape[1:3], size // per, *a.shape[4:]))[0]
    return jax.tree.map(leaf, enc)


@dataclasses.dataclass(frozen=True)
class PagedSegment(LayerSegment):
  """Leaves are page pools [L, P, K, page_size, ...] found through the block table `pages`
  [B, Q] (physical page of each logical page): a block gathers only its own pages."""

  pages: Any = None
  page_size: int = 1

  @property
  def unit(self) -> int:
    return max(super().unit, self.page_size)

  def kernel_view(self):
    pool = jax.tree.leaves(self.k)[0]
    if self.pages.shape[1] * self.page_size != self.mask_BS.shape[1]:
      return None
    return self.layer, pool.shape[0], self.pages, self.page_size, pool.shape[1]

  def cut(self, enc: Any, start, size: int) -> Any:
    ps = self.page_size
    pg_Bq = jax.lax.dynamic_slice_in_dim(self.pages, start // ps, size // ps, axis=1)

    def leaf(a):  # a: [L, P, K, ps, ...] -> [B, K, size, ...]
      g = a.at[self.layer, pg_Bq].get(mode="clip")
      B, q, K, p = g.shape[:4]
      return jnp.swapaxes(g, 1, 2).reshape(B, K, q * p, *g.shape[4:])
    return jax.tree.map(leaf, enc)


# -- layouts ----------------------------------------------------------------------------------
class Layout:
  """The protocol every layout implements (see the module docstring)."""

  name = "base"
  internal = False  # True: built by something else (a cache.policy), never chosen by name
  sized_as = ""  # the layout `kvjax size` and the memory estimate count instead ("": itself)
  shared_pool = False  # True: leaves [L, P, K, ...] any sequence's pages may use (sharding
                       # replicates them over the data axis instead of splitting the batch)
  compacts = None   # the layout whose caches a cache.policy compacts into this one
  recomputes = False  # True: holds token ids, and every step runs the whole prefix again

  def check(self, cache_cfg: CacheConfig, model_cfg: ModelConfig) -> None:
    """Host-side limits of this layout, when `cache.layout` names it."""

  def init(self, spec: CacheSpec) -> Any:
    raise NotImplementedError

  def attach(self, cache: Any, params: Any) -> Any:
    return cache

  def store(self, cache: Any) -> Any:
    raise NotImplementedError

  def read(self, spec: CacheSpec, store: Any, lengths_B: jax.Array, layer) -> list[Segment]:
    raise NotImplementedError

  def wants_queries(self, spec: CacheSpec) -> bool:
    """True: `write` takes the new tokens' rotated queries [L, B, T, H, D] as well."""
    return False

  def write(self, cache: Any, k_LBTKD, v_LBTKD, positions_BT) -> Any:
    raise NotImplementedError

  def closed_form_bytes(self, spec: CacheSpec) -> int:
    raise NotImplementedError

  def rings(self, spec: CacheSpec):
    """The sliding-window layers this layout holds in rings of their window
    (`kvjax.cache.ring.Layers`: which layers are full, which windowed), or None where it
    holds every layer whole; `kvjax.footprint` counts only the full layers as growing."""
    return None

  def asymptotic(self, cfg: Config) -> float | None:
    """Bytes one more stored token costs over all layers in the long-context limit, where
    this layout stores tokens otherwise than as K and V through the codecs
    (`kvjax.footprint.asymptotic` counts those); None: as K and V."""
    return None


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
  LAYOUTS[layout.name] = layout
  return layout


def get(name: str) -> Layout:
  try:
    return LAYOUTS[name]
  except KeyError:
    raise KvjaxError(f"unknown cache.layout '{name}'; known: {', '.join(LAYOUTS)}") from None


def layout_of(cache: Any) -> Layout:
  return LAYOUTS[cache.spec.layout]


def tree_bytes(tree: Any) -> int:
  """Bytes actually held by the arrays of a pytree (what `cache_bytes` reports)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def scatter(slots_BT):
  """store [L, B, K, S, ...] <- new [L, B, K, T, ...], token t to slot slots_BT[b, t]
  (slots out of range are dropped: padding, evicted tokens)."""
  def put(store, new):
    rows = jnp.arange(new.shape[1])[:, None]
    return store.at[:, rows, :, slots_BT].set(jnp.moveaxis(new, (1, 3), (0, 1)), mode="drop")
  return put
