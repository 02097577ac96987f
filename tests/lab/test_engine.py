"""The serving engine: allocator invariants, prefix sharing, preemption, compile-once.

Bookkeeping is checked without a model: a fake backend keeps token ids in the page pool
instead of K/V, so each "prediction" is a function of the tokens read back through the
block table. A wrong table, a shared page overwritten or a lost page changes what is
read, hence the outputs. The real model then checks the numerics: every request gets the
tokens it gets from `generate.generate`, with and without prefix sharing and preemption.
"""

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import tiny_config, tiny_params
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jax
from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.decode import generate
from kvjax.errors import KvjaxError
from kvjax.lab import metrics, timers
from kvjax.lab.serve import allocator, device, engine

V = 64


def predict(seq) -> int:
  """The fake model: a deterministic function of the whole sequence."""
  return int(sum((i + 1) * t for i, t in enumerate(seq)) * 31 + len(seq)) % V


def reference(prompt, n) -> list[int]:
  seq = list(prompt)
  for _ in range(n):
    seq.append(predict(seq))
  return seq[len(prompt):]


class FakeBackend:
  """Token ids stand in for K/V: reads go through the block table, writes to (page, slot)."""

  def __init__(self, n_pages: int, page: int):
    self.pool = np.full((n_pages, page), -1, np.int64)
    self.page, self.engine = page, None

  def step(self, tokens_BT, positions_BT, table_BN, lengths_B, last_B, slots_B, width):
    alloc, P = self.engine.alloc, self.pool.shape[0]
    alloc.check()
    assert table_BN.shape[1] * self.page >= min(width, self.engine.max_len)
    assert (positions_BT < width).all() and (lengths_B <= width).all(), "row wider than the call"
    out = np.zeros(tokens_BT.shape[0], np.int32)
    for b in range(tokens_BT.shape[0]):
      valid = positions_BT[b] >= 0
      if not valid.any():
        continue
      pages = [table_BN[b, p // self.page] for p in range(lengths_B[b])]
      assert all(p < P for p in pages), "a cached token lies in an unallocated page"
      hist = [int(self.pool[pg, p % self.page]) for p, pg in enumerate(pages)]
      new = [int(t) for t in tokens_BT[b, valid]]
      for pos, tok in zip(positions_BT[b, valid], new):
        pg = table_BN[b, pos // self.page]
        assert pg < P and alloc.writable(pg), f"write into page {pg} that is not privately owned"
        self.pool[pg, pos % self.page] = tok
      assert int(last_B[b]) == len(new) - 1
      out[b] = predict(hist + new)
    return out


def fake_engine(page, n_pages, slots, max_len, chunk, prefix_cache=True, prefill_rows=2,
                widths=None):
  cfg = tiny_config(**{"cache.layout": "paged", "cache.page_size": page,
                       "cache.num_pages": n_pages})
  fake = FakeBackend(n_pages, page)
  e = engine.Engine(cfg, slots=slots, max_len=max_len, chunk=chunk, prefix_cache=prefix_cache,
                    prefill_rows=prefill_rows, widths=widths, backend=fake)
  fake.engine = e
  return e


SYSTEM = [[7, 3, 9, 1, 4, 4, 2, 8, 5], [6, 6, 1, 2]]
requests_st = st.lists(st.tuples(st.sampled_from([None, 0, 1]),
                                 st.lists(st.integers(0, V - 1), min_size=1, max_size=8),
                                 st.integers(1, 9), st.integers(0, 12)), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None)
@given(reqs=requests_st, page=st.integers(1, 5), chunk=st.sampled_from([1, 2, 3, 8]),
       slots=st.integers(1, 4), extra=st.integers(0, 12), prefix=st.booleans(),
       prefill_rows=st.integers(1, 3), widths=st.sampled_from([None, (3,), (4, 8, 12)]))
def test_every_request_completes_correctly_under_any_pool(reqs, page, chunk, slots, extra, prefix,
                                                          prefill_rows, widths):
  prompts = [(SYSTEM[s] if s is not None else []) + tail for s, tail, _, _ in reqs]
  max_len = max(len(p) + n for p, (_, _, n, _) in zip(prompts, reqs))
  n_pages = -(-max_len // page) + extra  # from exactly one longest request upwards
  e = fake_engine(page, n_pages, slots, max_len, chunk, prefix, prefill_rows, widths)
  rs = [engine.Request(p, n, arrival=a) for p, (_, _, n, a) in zip(prompts, reqs)]
  stats = e.run(rs)
  for r in rs:
    assert r.output == reference(r.prompt, r.max_new_tokens)
  # nothing leaked: every page is free or idle in the prefix cache, no reference left
  e.alloc.check()
  assert e.alloc.available() == n_pages and not any(e.alloc.refs)
  assert sorted(e.free_slots) == list(range(slots))
  assert stats["output_tokens"] == sum(r.max_new_tokens for r in rs)
  assert 0 < stats["memory_utilization"] <= 1
  if not prefix:
    assert stats["prefix_hit_rate"] == 0


def test_prefix_sharing_hits_and_tiny_pool_preempts():
  prompts = [SYSTEM[0] + [i, i + 1] for i in range(6)]
  e = fake_engine(page=3, n_pages=40, slots=4, max_len=24, chunk=4)
  rs = [engine.Request(p, 5, arrival=i) for i, p in enumerate(prompts)]
  stats = e.run(rs)
  assert stats["prefix_hit_rate"] > 0.5 and stats["preemptions"] == 0
  assert all(r.output == reference(r.prompt, 5) for r in rs)

  e = fake_engine(page=2, n_pages=9, slots=4, max_len=18, chunk=4)
  rs = [engine.Request([i, 2, 3, 4, 5], 12) for i in range(5)]
  stats = e.run(rs)
  assert stats["preemptions"] > 0
  assert all(r.output == reference(r.prompt, 12) for r in rs)


# -- the allocator as a state machine --------------------------------------------------------
PAGE = 2


class AllocatorMachine(RuleBasedStateMachine):
  """Requests start (sharing cached prefix pages), grow page by page and finish, as the
  engine drives them; the model is which pages each live request holds."""

  @initialize(n_pages=st.integers(1, 12))
  def setup(self, n_pages):
    self.alloc = allocator.PageAllocator(n_pages)
    self.live: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, pages)
    self.next_id = 0

  def _grow_to(self, tokens, pages, n_tokens) -> bool:
    while len(pages) * PAGE < n_tokens:
      page = self.alloc.allocate()
      if page is None:
        return False
      pages.append(page)
    return True

  def _register(self, tokens, pages):
    full = len(tokens) // PAGE
    for page, key in zip(pages[:full], allocator.page_keys(tokens, PAGE, full)):
      self.alloc.register(page, key)

  @rule(prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 5, 6], [9, 9]]),
        tail=st.lists(st.integers(0, 3), max_size=3))
  def start(self, prefix, tail):
    tokens = prefix + tail
    pages = []
    for key in allocator.page_keys(tokens, PAGE, (len(tokens) - 1) // PAGE):
      page = self.alloc.share(key)
      if page is None:
        break
      pages.append(page)
    shared = len(pages)
    if not self._grow_to(tokens, pages, len(tokens)):
      for p in reversed(pages):
        self.alloc.release(p)
      return
    for page in pages[shared:]:  # prefill writes every page not taken from the cache
      assert self.alloc.writable(page), "would write a shared or cached page"
    self._register(tokens, pages)
    self.live[self.next_id] = (tokens, pages)
    self.next_id += 1

  @precondition(lambda self: self.live)
  @rule(data=st.data(), tok=st.integers(0, 3))
  def grow(self, data, tok):
    rid = data.draw(st.sampled_from(sorted(self.live)))
    tokens, pages = self.live[rid]
    if not self._grow_to(tokens, pages, len(tokens) + 1):
      return
    assert self.alloc.writable(pages[len(tokens) // PAGE]), "would write a shared page"
    tokens.append(tok)
    self._register(tokens, pages)

  @precondition(lambda self: self.live)
  @rule(data=st.data())
  def finish(self, data):
    rid = data.draw(st.sampled_from(sorted(self.live)))
    for p in reversed(self.live.pop(rid)[1]):
      self.alloc.release(p)

  @invariant()
  def consistent(self):
    if not hasattr(self, "alloc"):
      return
    self.alloc.check()
    holders = [0] * self.alloc.num_pages
    for _, pages in self.live.values():
      assert len(set(pages)) == len(pages)
      for p in pages:
        holders[p] += 1
    assert holders == self.alloc.refs, "refcounts differ from the pages requests hold"
    for p, n in enumerate(holders):
      assert n <= 1 or p in self.alloc.key_of, f"page {p} owned twice without being shared"

  def teardown(self):
    if hasattr(self, "alloc"):
      for rid in list(self.live):
        for p in reversed(self.live.pop(rid)[1]):
          self.alloc.release(p)
      self.alloc.check()
      assert self.alloc.available() == self.alloc.num_pages and not any(self.alloc.refs)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- errors ----------------------------------------------------------------------------------
def test_pool_smaller_than_one_request_is_a_one_line_error():
  e = fake_engine(page=4, n_pages=3, slots=2, max_len=40, chunk=4)
  with pytest.raises(KvjaxError, match="smaller than one request.*num_pages") as err:
    e.run([engine.Request([1, 2, 3], 5), engine.Request(list(range(10)), 6)])
  assert "\n" not in str(err.value)
  with pytest.raises(KvjaxError, match="max_len"):
    e.run([engine.Request(list(range(30)), 20)])


def test_engine_refuses_the_none_layout():
  with pytest.raises(KvjaxError, match="layout"):
    engine.Engine(tiny_config(**{"cache.layout": "none"}), slots=2, max_len=8)


@pytest.mark.parametrize("mesh", [{"mesh.data": 2}, {"mesh.model": 2}])
def test_engine_refuses_a_mesh_in_one_line(mesh):
  """The engine places nothing on a mesh: `mesh.*` is refused before anything is built
  (never silently run on one device), with the fake backend and the real one alike."""
  cfg = tiny_config(**{"cache.layout": "paged", **mesh})
  for backend in (FakeBackend(8, 4), None):
    with pytest.raises(KvjaxError, match=r"one device; drop the mesh\.\* overrides") as err:
      engine.Engine(cfg, slots=2, max_len=8, backend=backend)
    assert "\n" not in str(err.value)


# -- the real model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
  """Ragged requests, half with a shared system prompt, and their `generate.generate` tokens."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.page_size": 4})
  params = tiny_params(cfg)
  rng = np.random.default_rng(0)
  system = [int(t) for t in rng.integers(0, V, 13)]
  prompts = [(system if i % 2 == 0 else []) + [int(t) for t in rng.integers(0, V, 2 + i)]
             for i in range(7)]
  news = [int(n) for n in rng.integers(2, 12, len(prompts))]
  ref = generate.generate(cfg, params, prompts, max(news), timed=False)["tokens"]
  return cfg, params, prompts, news, [r[:n] for r, n in zip(ref, news)]


def _serve(e, prompts, news):
  rs = [engine.Request(p, n, arrival=i // 2) for i, (p, n) in enumerate(zip(prompts, news))]
  return e.run(rs), [r.output for r in rs]


def test_paged_engine_matches_generate_with_and_without_prefix_sharing(served):
  cfg, params, prompts, news, ref = served
  pcfg = config_lib.replace(cfg, **{"cache.layout": "paged", "cache.num_pages": 48})
  e = engine.Engine(pcfg, params, slots=4, max_len=32, chunk=8, widths=(16,))
  stats, out = _serve(e, prompts, news)
  assert out == ref and stats["prefix_hit_rate"] > 0
  traces = dict(device.STEP_TRACES)
  e2 = engine.Engine(pcfg, params, slots=4, max_len=32, chunk=8, widths=(16,), prefix_cache=False)
  stats2, out2 = _serve(e2, prompts, news)
  assert out2 == ref and stats2["prefix_hit_rate"] == 0
  # many steps, two runs, two engines: the step compiled once per shape (2 kinds x 2 widths)
  assert stats["steps"] + stats2["steps"] > 20 and dict(device.STEP_TRACES) == traces


@pytest.mark.parametrize("unroll", [1, 2], ids=["scanned", "unrolled"])
def test_preemption_under_a_tiny_pool_keeps_every_output(served, unroll):
  cfg, params, prompts, news, ref = served
  need = max(len(p) + n for p, n in zip(prompts, news))
  pcfg = config_lib.replace(cfg, **{"cache.layout": "paged", "cache.num_pages": -(-need // 4),
                                    "model.scan_unroll": unroll})
  e = engine.Engine(pcfg, params, slots=4, max_len=32, chunk=8)
  stats, out = _serve(e, prompts, news)
  assert stats["preemptions"] > 0 and out == ref


@pytest.mark.parametrize("unroll", [1, 2], ids=["scanned", "unrolled"])
def test_contiguous_reservation_engine_matches_generate(served, unroll):
  cfg, params, prompts, news, ref = served
  ucfg = config_lib.replace(cfg, **{"model.scan_unroll": unroll})
  e = engine.Engine(ucfg, params, slots=3, max_len=32, chunk=8, widths=(16,))
  assert "layers" not in e.backend.params  # split once: switched scan or unrolled loop
  stats, out = _serve(e, prompts, news)
  assert out == ref and stats["preemptions"] == 0 and stats["max_concurrency"] == 3


def test_workload_stream_is_seeded_skewed_and_shares_system_prompts():
  from kvjax.lab.experiments import paged_workload

  cfg = config_lib.load("configs/paged_workload.yaml")
  a, b = paged_workload.stream(cfg), paged_workload.stream(cfg)
  assert [(r.prompt, r.max_new_tokens, r.arrival) for r in a] == \
      [(r.prompt, r.max_new_tokens, r.arrival) for r in b]
  out = np.array([r.max_new_tokens for r in a])
  assert np.mean(out) > np.median(out)  # right-skewed lengths
  heads = [tuple(r.prompt[:32]) for r in a]
  assert max(heads.count(h) for h in set(heads)) >= 4  # common system prompts
  assert all(x <= y for x, y in zip([r.arrival for r in a], [r.arrival for r in a][1:]))
  paged_workload.check(cfg)
  tiny_budget = config_lib.replace(cfg, **{"cache.layout": "contiguous",
                                            "params": {**dict(cfg.params), "budget_kib": 1}})
  with pytest.raises(KvjaxError, match="holds no 288-token reservation"):
    paged_workload.check(tiny_budget)


def test_generate_timer_and_engine_share_the_program(served, monkeypatch):
  """One driver: `generate.generate`, `timers.DecodeTimer` and the engine's step all build
  their jitted calls' static arguments through `kvjax.decode.generate.statics`, and give the same
  greedy tokens for one config."""
  cfg, params, prompts, news, _ = served
  calls = []
  real = generate.statics
  monkeypatch.setattr(generate, "statics", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
  prompt, n = prompts[1], 6

  got = generate.generate(cfg, params, [prompt], n, timed=False)["tokens"][0]
  assert len(calls) == 2  # prefill and decode
  tokens, lengths = np.array([prompt], np.int32), np.array([len(prompt)], np.int32)
  timer = timers.DecodeTimer(cfg, params, tokens, lengths, steps=n - 1)
  assert len(calls) == 4 and isinstance(timer.compiled, generate.Compiled)
  assert timer.compiled.run().tokens()[0].tolist() == got

  e = engine.Engine(cfg, params, slots=2, max_len=16, chunk=4)
  r = engine.Request(prompt, n)
  e.run([r])
  assert r.output == got
  assert len(calls) > 4 and {"width", "all_rows"} <= set(calls[-1])  # the contiguous step


# A model with sliding-window layers: on pages, its windowed layers keep a ring per slot
# beside the pool (kvjax.cache.paged), which holds the full layers only.
WINDOWED = {"model.global_every": 2, "model.sliding_window": 5}


@pytest.fixture(scope="module")
def served_windowed(served):
  cfg, params, prompts, news, _ = served
  wcfg = config_lib.replace(cfg, **WINDOWED)
  ref = generate.generate(wcfg, params, prompts, max(news), timed=False)["tokens"]
  return wcfg, params, prompts, news, [r[:n] for r, n in zip(ref, news)]


def test_a_windowed_model_on_pages_serves_what_generate_does_from_rings_beside_the_pool(
    served_windowed):
  """Rings per slot ([Lw, slots, K, W, D]), the pool one layer deep, the bytes the closed
  form's; every request's tokens those of generate (contiguous rings) with no prefix
  shared (a prefix's pages would not bring its rings), and again under preemption."""
  cfg, params, prompts, news, ref = served_windowed
  pcfg = config_lib.replace(cfg, **{"cache.layout": "paged", "cache.num_pages": 48})
  e = engine.Engine(pcfg, params, slots=4, max_len=32, chunk=8, widths=(16,))
  c = e.backend.cache
  assert jax.tree.leaves(c.k)[0].shape[0] == 1 and jax.tree.leaves(c.k_ring)[0].shape[:2] == (1, 4)
  assert cache_lib.tree_bytes(c) == cache_lib.LAYOUTS["paged"].closed_form_bytes(c.spec)
  stats, out = _serve(e, prompts, news)
  assert out == ref and stats["prefix_hit_rate"] == 0
  need = max(len(p) + n for p, n in zip(prompts, news))
  tight = config_lib.replace(pcfg, **{"cache.num_pages": -(-need // 4)})
  stats, out = _serve(engine.Engine(tight, params, slots=4, max_len=32, chunk=8), prompts, news)
  assert stats["preemptions"] > 0 and out == ref


def test_a_windowed_model_in_contiguous_slots_serves_what_generate_does(served_windowed):
  cfg, params, prompts, news, ref = served_windowed
  e = engine.Engine(cfg, params, slots=3, max_len=32, chunk=8, widths=(16,))
  assert e.backend.cache.k_ring is not None
  stats, out = _serve(e, prompts, news)
  assert out == ref
