"""The KV cache: an immutable pytree, and the layouts that build, read and write it.

The contract (`CacheSpec`, `Segment` kinds, the `Layout` protocol, the registry) is in
`base`; every module of this folder is imported here and registers one layout:
`contiguous` (preallocated slots, optional full-precision window), `paged` (a page pool
and block tables), `compacted` (`compact`: what a cache.policy keeps), `latent` (one
rank-r vector per token) and `none` (token ids only: the recompute mode of
`kvjax.decode.step.run`). Adding a layout = one module here that calls `base.register`.
"""

from kvjax import plugins, policies
from kvjax.cache.base import (LAYOUTS, CacheSpec, Layout, LayerSegment,  # noqa: F401
                              PagedSegment, Segment, get, layout_of, register, scatter,
                              tree_bytes)
from kvjax.config import Config, add_check
from kvjax.errors import KvjaxError

plugins.import_all(__name__, __path__)

from kvjax.cache.contiguous import KVCache  # noqa: E402,F401  (the face)
from kvjax.cache.none import TokenBuffer  # noqa: E402,F401


def init_cache(cfg: Config, batch: int, capacity: int):
  """A fresh cache (or token buffer for layout `none`) for `batch` sequences."""
  if capacity <= 0:
    raise KvjaxError(f"cache capacity must be positive, got {capacity}")
  spec = CacheSpec.from_config(cfg, batch, capacity)
  return get(spec.layout).init(spec)


def compacted(name: str) -> Layout | None:
  """The layout a cache.policy compacts a `name` cache into (None: it cannot evict); its
  `compress(cache, lengths_B, room, q_LBTHD, T=)` does it."""
  return next((lay for lay in LAYOUTS.values() if lay.compacts == name), None)


def built(cache_cfg) -> Layout:
  """The layout a cache of `cache_cfg` is held in once built, decided here only: the one its
  cache.policy compacts the prompt's cache into (`compacted`), else `cache.layout`'s own."""
  if policies.evicts(cache_cfg):
    return compacted(cache_cfg.layout)
  return get(cache_cfg.layout)


def check(cache_cfg, model_cfg) -> None:
  """The layout registry's config checks: the chosen layout exists and is not one only a
  policy builds, a policy other than `full` has a layout it can compact, and every layout
  checks what concerns it (its own limits when chosen; the latent rank of any model)."""
  c = cache_cfg
  chosen = get(c.layout)
  sources = " or ".join(lay.compacts for lay in LAYOUTS.values() if lay.compacts)
  if chosen.internal:
    evicting = ", ".join(p for p in policies.POLICIES if p != policies.FULL)
    raise KvjaxError(f"cache.layout={c.layout} is what a policy builds; set cache.policy "
                     f"({evicting}) with cache.layout={sources}")
  if policies.evicts(c) and built(c) is None:
    raise KvjaxError(f"cache.policy={c.policy} needs cache.layout={sources} (the {c.layout} "
                     "layout cannot evict tokens)")
  for layout in LAYOUTS.values():
    layout.check(cache_cfg, model_cfg)


add_check(check)  # config.validate runs it (the config imports no registry)


def segments(cache, layer) -> list[Segment]:
  """What layer `layer` of the model attends to in `cache` (tests and benchmarks)."""
  layout = layout_of(cache)
  return layout.read(cache.spec, layout.store(cache), cache.lengths, layer)
