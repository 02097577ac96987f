"""The KV cache: an immutable pytree, and the layouts that build, read and write it.

The contract (`CacheSpec`, `Segment` kinds, the `Layout` protocol, the registry) is in
`base`; every module of this folder is imported here and registers one layout:
`contiguous` (preallocated slots, optional full-precision window), `paged` (a page pool
and block tables), `compacted` (`compact`: what a cache.policy keeps), `latent` (one
rank-r vector per token) and `none` (token ids only: the recompute mode of
`kvjax.step.run`). Adding a layout = one module here that calls `base.register`.
"""

from kvjax import plugins
from kvjax.cache.base import (LAYOUTS, CacheSpec, Layout, LayerSegment,  # noqa: F401
                              PagedSegment, Segment, get, layout_of, register, scatter,
                              tree_bytes)
from kvjax.config import Config
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


def check(cache_cfg, model_cfg) -> None:
  """The layout registry's config checks: the chosen layout exists, and every layout checks
  what concerns it (its own limits when chosen; the latent rank of any model)."""
  get(cache_cfg.layout)
  for layout in LAYOUTS.values():
    layout.check(cache_cfg, model_cfg)


def segments(cache, layer) -> list[Segment]:
  """What layer `layer` of the model attends to in `cache` (tests and benchmarks)."""
  layout = layout_of(cache)
  return layout.read(cache.spec, layout.store(cache), cache.lengths, layer)
