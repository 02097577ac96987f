"""The serving engine's device side: the jit-compiled step, its bucket widths and the
backend that holds the cache (the host scheduler is kvjax/lab/serve/engine.py).

A step runs rows b (a slice of the slots B) of T new tokens through the model
(`kvjax.decode.step.run`) and samples the token after each row's last one: the engine's
chunked prefill ([prefill_rows, chunk]) or decode ([slots, 1]).
Keeping prefill narrow matters on compute-bound hardware: a [slots, chunk] step would pad
every decode row to `chunk` tokens. Likewise a call reads only the smallest of a few
bucket widths (64, 128, ... tokens, `bucket_widths`) that holds its longest request, not
every slot's full capacity: for the paged cache that is a narrower block table, for the
contiguous cache a window of its slots. Each (shape, width) compiles once, ever
(`Engine.warmup` compiles them all up front; a test counts traces). The paged cache makes
the narrow batch free (it is just other block-table rows); the contiguous cache gathers
those slots' rows and writes them back. A windowed model's rings are per slot on either
layout: a step takes the rows it runs and puts them back (`_ring_rows`).

With a `cache.policy` (paged only) the cache is a `paged_compacted` pool, whose rows also
carry `held` and `budget` (slots, not positions, index a compacted request's pages), and
`compact_pages` compacts one request whose prompt is cached into its own first pages.

Params are placed and prepared by the program's placement (`kvjax.decode.sharding.Placement`) and
the jitted step's static arguments come from `kvjax.decode.generate.statics`, as for prefill and
decode. One device only: `check_config` refuses `mesh.*` in one line (the step gathers and
scatters cache rows by slot, which a batch split over devices would turn into collectives).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import decode, policies
from kvjax.cache import compact, paged, paged_compact
from kvjax.config import Config
from kvjax.decode import generate, sharding, step
from kvjax.errors import KvjaxError

STEP_TRACES: collections.Counter = collections.Counter()  # per tokens shape, at trace time


def _call(static, sampler, params, cache, tokens_BT, positions_BT, last_B, key):
  STEP_TRACES[tokens_BT.shape] += 1
  out = step.run(static, params, tokens_BT, positions_BT, cache, logits=last_B[:, None])
  return sampler(out.logits[:, 0], key), out.cache


@functools.partial(jax.jit, static_argnames=("static", "sampler"), donate_argnames=("cache",))
def serve_step(params, cache, tokens_BT, positions_BT, last_B, key, *, static: step.Static,
               sampler):
  """One model call; returns the token sampled after each row's last token. The cache's
  `lengths` (and block table) say which rows are which: a paged cache may hold any number."""
  return _call(static, sampler, params, cache, tokens_BT, positions_BT, last_B, key)


def _ring_rows(cache, slots_b, all_rows: bool) -> dict:
  """A windowed model's rings [Lw, B, K, W, X] at rows `slots_b` (all of them, in order,
  when `all_rows`), as fields to replace in the cache the step runs; {} without rings."""
  if getattr(cache, "k_ring", None) is None:  # (a compacted pool has none)
    return {}
  take = (lambda a: a) if all_rows else (lambda a: jnp.take(a, slots_b, axis=1))
  return {"k_ring": jax.tree.map(take, cache.k_ring), "v_ring": jax.tree.map(take, cache.v_ring)}


def _rings_back(cache, sub, slots_b, all_rows: bool) -> dict:
  """The rings of `cache` with rows `slots_b` replaced by `sub`'s (`_ring_rows`' inverse)."""
  if getattr(cache, "k_ring", None) is None:
    return {}
  put = (lambda full, part: part) if all_rows else \
      (lambda full, part: full.at[:, slots_b].set(part))
  return {"k_ring": jax.tree.map(put, cache.k_ring, sub.k_ring),
          "v_ring": jax.tree.map(put, cache.v_ring, sub.v_ring)}


@functools.partial(jax.jit, static_argnames=("static", "sampler", "width", "all_rows"),
                   donate_argnames=("cache",))
def serve_contiguous(params, cache, slots_b, tokens_bT, positions_bT, last_b, key, *,
                     static: step.Static, sampler, width: int, all_rows: bool):
  """`serve_step` on a contiguous cache's slots `slots_b` (all of them, in order, when
  `all_rows`) and its first `width` token slots: a window gathered, run and written back,
  so a step reads what the live requests can hold, not every reservation to its end."""
  def window(a):  # leaves [L, B, K, S, X]
    return (a if all_rows else jnp.take(a, slots_b, axis=1))[:, :, :, :width]

  def put(full, part):
    return full.at[:, :, :, :width].set(part) if all_rows else \
        full.at[:, slots_b, :, :width].set(part)

  sub = dataclasses.replace(cache, k=jax.tree.map(window, cache.k), v=jax.tree.map(window, cache.v),
                            lengths=cache.lengths[slots_b],
                            spec=dataclasses.replace(cache.spec, capacity=width),
                            **_ring_rows(cache, slots_b, all_rows))
  nxt, sub = _call(static, sampler, params, sub, tokens_bT, positions_bT, last_b, key)
  return nxt, dataclasses.replace(cache, k=jax.tree.map(put, cache.k, sub.k),
                                  v=jax.tree.map(put, cache.v, sub.v),
                                  **_rings_back(cache, sub, slots_b, all_rows))


@functools.partial(jax.jit, static_argnames=("static", "sampler", "all_rows"),
                   donate_argnames=("cache",))
def serve_ringed(params, cache, slots_b, tokens_bT, positions_bT, last_b, key, *,
                 static: step.Static, sampler, all_rows: bool):
  """`serve_step` on a paged cache whose windowed layers keep a ring per slot
  (kvjax.cache.paged): rows b are slots `slots_b`, so their rings are taken out, run with
  their block-table rows and put back; the pool is shared, as in `serve_step`."""
  sub = dataclasses.replace(cache, **_ring_rows(cache, slots_b, all_rows))
  nxt, sub = _call(static, sampler, params, sub, tokens_bT, positions_bT, last_b, key)
  return nxt, dataclasses.replace(sub, **_rings_back(cache, sub, slots_b, all_rows))


def bucket_widths(capacity: int, smallest: int = 64) -> tuple[int, ...]:
  """Token widths a step may read: doubling from `smallest` up to `capacity` (a few compiles,
  each step reads at most twice what its longest request holds)."""
  widths, w = [], smallest
  while w < capacity:
    widths.append(w)
    w *= 2
  return tuple(widths) + (capacity,)


def check_config(cfg: Config) -> None:
  """What the step can run, refused in one line: the paged or contiguous layout, eviction
  (`cache.policy`) only on pages and only by policies that select from keys or positions
  (chunked prefill keeps no prompt queries) and place decode tokens by slot arithmetic the
  host replays (`Policy.uniform_slots`), no residual window, one device (it places
  nothing on a mesh, so `mesh.*` is refused rather than ignored)."""
  c = cfg.cache
  if c.layout not in ("paged", "contiguous"):
    raise KvjaxError(f"the serving engine needs cache.layout=paged or contiguous, got "
                     f"'{c.layout}'")
  if policies.evicts(c) and c.layout != "paged":
    raise KvjaxError(f"the serving engine evicts tokens (cache.policy={c.policy}) only with "
                     "cache.layout=paged, whose freed pages other requests can use")
  if policies.evicts(c) and policies.get(c.policy).needs_queries:
    raise KvjaxError(f"the serving engine cannot run cache.policy={c.policy}: it scores the "
                     "prompt's queries, which chunked prefill does not keep; use knorm, window "
                     "or sinks (or kvjax generate)")
  if not policies.get(c.policy).uniform_slots:
    raise KvjaxError(f"the serving engine cannot run cache.policy={c.policy}: its decode "
                     "chooses a slot per layer and KV head on the device, which the engine's "
                     "page bookkeeping cannot follow; use knorm, window or sinks (or kvjax "
                     "generate)")
  if cfg.cache.residual or cfg.cache.keep_first:
    raise KvjaxError("the serving engine does not support cache.residual or cache.keep_first "
                     "yet; set both to 0")
  if sharding.is_sharded(cfg):
    raise KvjaxError("the serving engine runs on one device; drop the mesh.* overrides")


class ModelBackend:
  """The device side: the cache pytree and the compiled step. Host state goes in as data."""

  def __init__(self, cfg: Config, params, spec: cache_lib.CacheSpec):
    check_config(cfg)
    self.cfg, self.spec = cfg, spec
    # placed, then split per layer once, here
    self.params = step.prepare_params(cfg, sharding.Placement(cfg).params(params))
    self.paged = spec.layout == "paged"
    self.evicts = policies.evicts(cfg.cache)
    if self.evicts:  # held slots, not positions, index a request's pages once compacted
      self.spec = spec = dataclasses.replace(spec, layout=cache_lib.built(cfg.cache).name)
      self.cache = paged_compact.init_pool(spec)
    else:
      self.cache = paged.init_pool(spec) if self.paged else \
          cache_lib.LAYOUTS[spec.layout].init(spec)
    self.sampler = decode.Sampler.from_config(cfg)
    self.key = jax.random.PRNGKey(cfg.seed)

  def step(self, tokens_bT, positions_bT, table_bQ, lengths_b, last_b, slots_b,
           width: int, **held) -> np.ndarray:
    """Run rows b (all slots, or the narrow prefill batch `slots_b`) reading `width` tokens
    per row; host state goes in as data (with a policy, also `held` and `budget` [b])."""
    self.key, sub = jax.random.split(self.key)
    args = [jnp.asarray(a) for a in (tokens_bT, positions_bT, last_b)] + [sub]
    all_rows = len(slots_b) == self.spec.batch and bool((np.diff(slots_b) == 1).all())
    if self.paged and getattr(self.cache, "k_ring", None) is not None:  # rings, then pages
      cache = dataclasses.replace(self.cache, block_table=jnp.asarray(table_bQ),
                                  lengths=jnp.asarray(lengths_b))
      nxt, self.cache = serve_ringed(
          self.params, cache, jnp.asarray(slots_b), *args,
          **generate.statics(self.cfg, self.sampler, all_rows=all_rows))
    elif self.paged:  # any rows, any width: it is all in the block table
      cache = dataclasses.replace(self.cache, block_table=jnp.asarray(table_bQ),
                                  lengths=jnp.asarray(lengths_b),
                                  **{k: jnp.asarray(v) for k, v in held.items()})
      nxt, self.cache = serve_step(self.params, cache, *args,
                                   **generate.statics(self.cfg, self.sampler))
    else:
      lengths_B = np.zeros((self.spec.batch,), np.int32)  # rows outside slots_b are not read
      lengths_B[slots_b] = lengths_b
      cache = dataclasses.replace(self.cache, lengths=jnp.asarray(lengths_B))
      nxt, self.cache = serve_contiguous(
          self.params, cache, jnp.asarray(slots_b), *args,
          **generate.statics(self.cfg, self.sampler, width=width, all_rows=all_rows))
    return np.asarray(nxt)

  def compact(self, pages: list[int], length: int, width: int) -> None:
    """Compact one request's `length` cached tokens (in `pages`, read `width` wide) by the
    policy into the first pages of its own table: slot s of the kept tokens to page
    pages[s // page_size]. The engine then releases the pages beyond the kept ones."""
    ps, P = paged.page_size(self.spec), paged.num_pages(self.spec)
    table = np.full((1, -(-width // ps)), P, np.int32)
    table[0, :len(pages)] = pages
    self.cache = compact_pages(self.cache, jnp.asarray(table),
                               jnp.asarray([length], jnp.int32), T=width)


@functools.partial(jax.jit, static_argnames=("T",), donate_argnames=("cache",))
def compact_pages(cache, table_1q, length_1, *, T: int):
  """The policy's kept tokens of one request (its table row `table_1q`, `length_1` tokens
  cached, read T wide), gathered as `kvjax.decode.evict.prefill` gathers them, written to slots
  [0, held) of the same pages (the gather reads the pool before the write replaces it)."""
  row = dataclasses.replace(cache, block_table=table_1q, lengths=length_1)
  ev = compact.compress(paged_compact.contiguous_view(row, T), length_1, 0, None, T=T)
  Sk = min(policies.static_budget(cache.spec.cache_cfg, T), T)
  s_S = jnp.arange(Sk, dtype=jnp.int32)
  slot_1S = jnp.where(s_S < ev.held[:, None], s_S, -1)
  P = jax.tree.leaves(cache.k)[0].shape[1]

  def put(pool, kept):
    return paged_compact.put_pages(pool, table_1q, slot_1S, kept[:, :, :, :Sk], P)
  return dataclasses.replace(cache, k=jax.tree.map(put, cache.k, ev.k),
                             v=jax.tree.map(put, cache.v, ev.v))
