"""Continuous batching over a paged KV cache (or, as the baseline, contiguous slots): the
host scheduler. Its device step is kvjax/lab/serve/device.py, its page allocator
kvjax/lab/serve/allocator.py; it runs on one device (`mesh.*` is refused, never ignored).

A fixed number of decode slots share one cache. A request's state is just (tokens known,
tokens cached), so prefill, decode and recompute after preemption are one loop: each
engine step feeds every running request the tokens it has not cached yet and samples the
token after its last one. A step is at most two calls of two jit-compiled functions:
  - chunked prefill: up to `prefill_rows` requests with more than one uncached token feed
    up to `chunk` tokens each, as a narrow [prefill_rows, chunk] batch;
  - decode: every slot at once, [slots, 1], for the requests with one uncached token.
Each call reads the smallest bucket width that holds its longest row (device.py).

With `cache.layout=paged` the host `PageAllocator` hands out pages on demand as a
sequence crosses a page boundary; requests are admitted when a slot is free and the
pool holds pages for their known tokens (beyond a small watermark, so admission does not
immediately starve running requests). When a running request needs a page and none is
left, the most recently admitted request is preempted: its pages are released (full ones
stay in the prefix cache, reusable on readmission) and it goes back to the front of the
queue with its output so far, recomputed from scratch when readmitted. The oldest request
is never preempted for a younger one, so every request finishes. With
`cache.layout=contiguous` every admitted request reserves `max_len` slots (max-length
reservation, the pre-vLLM way), so nothing is ever preempted.

Prefix caching: on admission the chained keys of the request's full pages (within its
first len-1 tokens, so at least one token is always computed) are looked up; hits are
shared read-only (refcount + 1) and skipped by prefill. Every page that fills up is
registered, so later requests (and readmissions) can hit it.

Eviction (`cache.policy` knorm, window or sinks, paged only): a request is prefilled whole,
then compacted once its prompt is cached (device.py `compact_pages`): the kept tokens move to
slots [0, held) of its first pages and the pages beyond them go back to the allocator
(`freed_pages`); decode then appends (or writes the window/sinks ring) by slot, on demand
(request.py). Compacted pages are private, so prefix caching is off for such configs.

A model with sliding-window layers on pages keeps those layers in a ring per slot beside
the pool (kvjax.cache.paged): its pages hold the full layers only, and prefix caching is
off (a prefix's pages would not bring its rings); a preempted request recomputes them.

Time is counted in engine steps: arrivals are given in steps, so scheduling, utilization,
concurrency and hit rates are deterministic for a seed; only `tokens_per_s` is wall time.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from kvjax import cache as cache_lib
from kvjax import policies
from kvjax.cache import paged, ring
from kvjax.config import Config
from kvjax.errors import KvjaxError
from kvjax.lab.serve import device
from kvjax.lab.serve import request as request_lib
from kvjax.lab.serve.allocator import PageAllocator, page_keys
from kvjax.lab.serve.request import Request  # noqa: F401  (the engine's request type)


class Engine:
  """Serve `Request`s to completion: `run(requests) -> stats` (outputs land in each request)."""

  def __init__(self, cfg: Config, params=None, *, slots: int, max_len: int, chunk: int = 32,
               prefill_rows: int = 2, prefix_cache: bool = True, watermark: float = 0.01,
               widths: tuple[int, ...] | None = None, backend=None):
    device.check_config(cfg)  # layouts, eviction on pages only, no residual window, one device
    if min(slots, max_len, chunk, prefill_rows) <= 0:
      raise KvjaxError("engine slots, max_len, chunk and prefill_rows must be positive")
    if max_len > cfg.model.max_seq_len:
      raise KvjaxError(f"engine max_len={max_len} exceeds model.max_seq_len="
                       f"{cfg.model.max_seq_len}; lower it")
    self.cfg, self.slots, self.max_len, self.chunk = cfg, slots, max_len, chunk
    self.prefill_rows = min(prefill_rows, slots)
    self.widths = tuple(sorted({min(w, max_len) for w in widths or ()} | {max_len})) \
        if widths else device.bucket_widths(max_len)
    self.spec = cache_lib.CacheSpec.from_config(cfg, slots, max_len)
    rg = ring.layers(self.spec)
    if rg is not None and cfg.cache.layout == "contiguous":
      # a contiguous step reads `width` slots as a cache of that capacity, which keeps its
      # rings only while wider than the window: no narrower width
      self.widths = tuple(sorted({min(max(w, rg.window + 1), max_len) for w in self.widths}))
    self.paged = cfg.cache.layout == "paged"
    self.evicts = policies.evicts(cfg.cache)  # compacted pages are private: no prefix cache
    # nor where windowed layers keep rings per row: a prefix's pages do not bring its rings
    self.prefix_cache = prefix_cache and self.paged and not self.evicts and \
        paged.rings(self.spec) is None
    if self.paged:
      self.page = paged.page_size(self.spec)
      self.n_pages = paged.num_pages(self.spec)
      self.watermark = int(watermark * self.n_pages)
    self.backend = backend or device.ModelBackend(cfg, params, self.spec)

  # -- checks and bookkeeping ---------------------------------------------------------------
  def _check(self, r: Request) -> None:
    need = len(r.prompt) + r.max_new_tokens
    if not r.prompt or r.max_new_tokens < 1:
      raise KvjaxError("every request needs a prompt token and max_new_tokens >= 1")
    if need > self.max_len:
      raise KvjaxError(f"a request needs {need} tokens but engine max_len={self.max_len}; "
                       "raise max_len (cache.capacity) or shorten the request")
    if self.paged and -(-need // self.page) > self.n_pages:
      raise KvjaxError(f"the page pool ({self.n_pages} pages of {self.page}) is smaller than one "
                       f"request ({-(-need // self.page)} pages); raise cache.num_pages")

  def _done(self, r: Request) -> bool:
    eos = self.cfg.workload.eos_id
    return len(r.output) >= r.max_new_tokens or (eos >= 0 and bool(r.output)
                                                   and r.output[-1] == eos)

  def _release(self, r: Request) -> None:
    for p in reversed(r.pages):  # tail pages first, so LRU evicts a prefix's end before its start
      self.alloc.release(p)
    r.pages, r.cached, r.registered, r.held = [], 0, 0, -1
    self.free_slots.append(r.slot)
    self.running.remove(r)

  def _keys(self, r: Request, n: int) -> list[bytes]:
    """Chained keys of r's first n full pages (extending the ones already computed)."""
    if len(r.keys) < n:
      have = len(r.keys)
      r.keys += page_keys(r.seq[have * self.page:], self.page, n - have,
                                r.keys[-1] if r.keys else b"")
    return r.keys[:n]

  # -- scheduling ----------------------------------------------------------------------------
  def _admit(self) -> None:
    while self.waiting and self.free_slots:
      r = self.waiting[0]
      if self.paged:
        hits = []
        if self.prefix_cache:
          for key in self._keys(r, (len(r.seq) - 1) // self.page):
            if self.alloc.peek(key) is None:
              break
            hits.append(key)
        idle = sum(self.alloc.refs[self.alloc.peek(k)] == 0 for k in hits)
        need = -(-len(r.seq) // self.page) - len(hits)
        if need > self.alloc.available() - idle - (self.watermark if self.running else 0):
          return
        r.pages = [self.alloc.share(k) for k in hits]
        r.cached, r.registered = len(hits) * self.page, len(hits)
        self.stats["prompt_tokens"] += len(r.seq)
        self.stats["hit_tokens"] += r.cached
      self.waiting.popleft()
      r.slot = self.free_slots.pop()
      self.running.append(r)

  def _preempt(self, r: Request) -> None:
    self._release(r)
    r.preemptions += 1
    self.stats["preemptions"] += 1
    self.waiting.appendleft(r)

  def _reserve(self, r: Request, n: int) -> bool:
    """Pages for r's next n tokens, preempting the youngest requests (possibly r) if the pool
    is dry; False when r itself was preempted."""
    while self.paged and len(r.pages) * self.page < request_lib.slots_after(self.cfg.cache, r, n):
      page = self.alloc.allocate()
      if page is None:
        self._preempt(self.running[-1])
        if r not in self.running:
          return False
      else:
        r.pages.append(page)
    return True

  def _plan(self) -> tuple[list, list]:
    """(prefill rows, decode rows) of the next step as (request, tokens to feed), oldest
    request first, pages allocated; may preempt."""
    prefill, decoding = [], []
    for r in list(self.running):
      if r not in self.running:
        continue  # preempted for an older request in this loop
      pending = len(r.seq) - r.cached
      if pending > 1 and len(prefill) == self.prefill_rows:
        continue  # waits for a prefill row
      n = min(self.chunk, pending)
      if self._reserve(r, n):
        (prefill if pending > 1 else decoding).append((r, n))
    return prefill, decoding

  # -- the loop ------------------------------------------------------------------------------
  def run(self, requests: list[Request]) -> dict:
    for r in requests:
      self._check(r)
    self.alloc = PageAllocator(self.n_pages) if self.paged else None
    self.free_slots = list(range(self.slots - 1, -1, -1))
    self.running: list[Request] = []
    self.waiting: collections.deque = collections.deque()
    self.stats = collections.Counter()
    pending = collections.deque(sorted(requests, key=lambda r: r.arrival))
    util, running, clock, steps = [], [], 0, 0
    t0 = time.perf_counter()
    while pending or self.waiting or self.running:
      while pending and pending[0].arrival <= clock:
        self.waiting.append(pending.popleft())
      if not self.waiting and not self.running:
        clock = pending[0].arrival
        continue
      self._admit()
      prefill, decoding = self._plan()
      rows = prefill + decoding
      nxt = {}
      if prefill:
        nxt.update(self._step(prefill, self.chunk, self.prefill_rows))
      if decoding:
        nxt.update(self._step(decoding, 1, self.slots))
      steps += 1
      for r, n in rows:
        if r.held >= 0:  # compacted: its new tokens took slots (appended, or in the ring)
          r.held = request_lib.slots_after(self.cfg.cache, r, n)
        r.cached += n
        if r.cached == len(r.seq):
          r.output.append(nxt[r])
          if r.first_token_step < 0:
            r.first_token_step = clock
          if self.evicts and r.held < 0:
            self._compact(r)
        if self.prefix_cache:
          full = r.cached // self.page
          for i, key in enumerate(self._keys(r, full)[r.registered:], start=r.registered):
            self.alloc.register(r.pages[i], key)
          r.registered = max(r.registered, full)
      running.append(len(self.running))
      util.append(self._utilization())
      for r, _ in rows:
        if self._done(r):
          r.finish_step = clock
          self._release(r)
      clock += 1
    wall = time.perf_counter() - t0
    out_tokens = sum(len(r.output) for r in requests)
    s = self.stats
    return {
        "requests": len(requests), "steps": steps, "wall_s": wall, "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
        "memory_utilization": float(np.mean(util)) if util else 0.0,
        "max_concurrency": max(running, default=0),
        "mean_concurrency": float(np.mean(running)) if running else 0.0,
        "preemptions": s["preemptions"],
        "prefix_hit_rate": s["hit_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0,
        "evictions": self.alloc.evictions if self.paged else 0, "freed_pages": s["freed_pages"],
        "mean_latency_steps": float(np.mean([r.finish_step - r.arrival + 1 for r in requests])),
        "mean_ttft_steps": float(np.mean([r.first_token_step - r.arrival + 1 for r in requests])),
    }

  def _table_width(self, width: int) -> int:
    return min(-(-width // self.page), paged.pages_per_seq(self.spec)) if self.paged else 1

  def _step(self, rows, T: int, n_rows: int) -> dict:
    """One call on `n_rows` rows of T new tokens: all slots (row = slot) when that is the
    slot count, else a narrow batch whose spare rows are distinct idle slots (they write
    nothing). The call reads the smallest bucket width that holds its longest row."""
    if n_rows == self.slots:
      slots = np.arange(n_rows)
      order = {r.slot: r for r, _ in rows}
    else:
      used = [r.slot for r, _ in rows]
      slots = np.array(used + [b for b in range(self.slots) if b not in used][:n_rows - len(used)])
      order = {i: r for i, (r, _) in enumerate(rows)}
    fed, c = dict(rows), self.cfg.cache
    width = min(w for w in self.widths if w >= max(request_lib.slots_after(c, r, n)
                                                    for r, n in rows))
    tokens = np.zeros((n_rows, T), np.int32)
    positions = np.full((n_rows, T), -1, np.int32)
    last, lengths = np.zeros((n_rows,), np.int32), np.zeros((n_rows,), np.int32)
    table = np.full((n_rows, self._table_width(width)), self.n_pages if self.paged else 0, np.int32)
    held = {"held": np.zeros((n_rows,), np.int32), "budget": np.zeros((n_rows,), np.int32)} \
        if self.evicts else {}
    for i, r in order.items():
      n = fed[r]
      tokens[i, :n] = r.seq[r.cached:r.cached + n]
      positions[i, :n] = np.arange(r.cached, r.cached + n)
      last[i], lengths[i] = n - 1, r.cached
      if self.paged:
        table[i, :len(r.pages)] = r.pages
        for j in {s // self.page for s in request_lib.next_slots(c, r, n)}:
          if not self.alloc.writable(r.pages[j]):
            raise AssertionError(f"page {r.pages[j]} is shared or cached but would be written")
      if self.evicts:  # not compacted yet: slots are positions, and nothing is evicted
        held["held"][i] = r.held if r.held >= 0 else r.cached
        held["budget"][i] = r.budget if r.held >= 0 else self.max_len
    out = self.backend.step(tokens, positions, table, lengths, last, slots, width, **held)
    return {r: int(out[i]) for i, r in order.items()}

  def _utilization(self) -> float:
    return request_lib.utilization(self.running, self.page if self.paged else 0, self.max_len)

  def _compact(self, r: Request) -> None:
    """r's prompt is cached: keep what the policy selects in its first pages, free the rest."""
    r.held, r.budget = request_lib.compacted(self.cfg.cache, r)
    width = min(w for w in self.widths if w >= r.cached)
    self.backend.compact(r.pages, r.cached, width)
    keep = -(-r.held // self.page)
    freed, r.pages = r.pages[keep:], r.pages[:keep]
    for p in reversed(freed):  # back to the pool: other requests can take them
      self.alloc.release(p)
    self.stats["freed_pages"] += len(freed)

  def warmup(self) -> None:
    """Compile (and run once) every step shape with every row idle: nothing is written."""
    for n, T in sorted({(self.prefill_rows, self.chunk), (self.slots, 1)}):
      for width in self.widths:
        self.backend.step(np.zeros((n, T), np.int32), np.full((n, T), -1, np.int32),
                          np.full((n, self._table_width(width)),
                                  self.n_pages if self.paged else 0, np.int32),
                          np.zeros((n,), np.int32), np.zeros((n,), np.int32), np.arange(n), width,
                          **({"held": np.zeros((n,), np.int32), "budget": np.zeros((n,), np.int32)}
                             if self.evicts else {}))
