"""Eviction policies on the paged layout (kvjax/cache/paged_compact.py, kvjax/decode/evict.py, the
serving engine's compaction in kvjax/serve): the same tokens as the contiguous layout, the
budgeted pool measured and in closed form, and in the engine the pages beyond a request's
kept tokens back in the allocator, where another request takes them."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params

from kvjax import cache as cache_lib
from kvjax import cli, policies
from kvjax import config as config_lib
from kvjax.cache import paged, paged_compact
from kvjax.decode import generate
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.lab.serve import engine, request

PROMPTS = [[1, 5, 9, 3, 7, 2, 8, 4, 6, 11, 13, 12], [3, 2, 1, 9, 8]]  # ragged, 12 and 5
NEW = 7  # the window/sinks ring of 6 wraps across page boundaries during decode


def _contiguous_and_paged(base: dict):
  """`generate` (greedy, caches returned) with `base` on the contiguous layout and on pages
  of 4: (contiguous result, paged result, the paged config)."""
  cfg = tiny_config(**base)
  params = tiny_params(cfg)
  want = generate.generate(cfg, params, PROMPTS, NEW, timed=False, return_cache=True)
  pcfg = tiny_config(**base, **{"cache.layout": "paged", "cache.page_size": 4})
  got = generate.generate(pcfg, params, PROMPTS, NEW, timed=False, return_cache=True)
  return want, got, pcfg


@pytest.mark.parametrize("policy,extra,kv_heads,codec", [
    ("window", {"cache.budget": 6}, 2, "int8"),  # a ring over pages; GQA
    # per-head selection from the queries, appends; MHA (knorm, sinks: the engine test)
    ("snapkv", {"cache.budget": 6, "cache.window": 2}, 4, "int8"),
])
def test_paged_policy_generates_what_contiguous_does_in_budgeted_pages(policy, extra, kv_heads,
                                                                       codec):
  base = {"model.n_kv_heads": kv_heads, "cache.policy": policy, "cache.codec": codec, **extra}
  want, got, pcfg = _contiguous_and_paged(base)
  assert got["tokens"] == want["tokens"]
  c, ref = got["cache"], want["cache"]
  spec = c.spec
  assert spec.layout == "paged_compacted" and spec.capacity == ref.spec.capacity
  Q = -(-spec.capacity // 4)  # each sequence owns the pages of its budget, no more
  assert c.block_table.shape == (2, Q) and sorted(np.asarray(c.block_table).ravel()) == \
      list(range(2 * Q))
  assert all(leaf.shape[1] == 2 * Q for leaf in jax.tree.leaves((c.k, c.v)))  # the pool
  assert list(c.held) == list(ref.held) and list(c.lengths) == [len(p) + NEW - 1
                                                                 for p in PROMPTS]
  # what cache_bytes reports is the budgeted pool: measured = closed form < the prefill pool
  assert got["cache_bytes"] == cache_lib.tree_bytes(c)
  assert got["cache_bytes"] == cache_lib.LAYOUTS["paged_compacted"].closed_form_bytes(spec)
  prefill_spec = cache_lib.CacheSpec.from_config(pcfg, 2, got["capacity"])
  assert got["cache_bytes"] < paged.Paged().closed_form_bytes(prefill_spec)


@pytest.mark.parametrize("policy,extra", [
    ("h2o", {"cache.budget": 6, "cache.window": 2}),  # acc/pos carried; budget 6 of 2 pages
    ("tova", {"cache.ratio": 0.5}),  # budgets 6 and 3: the short prompt evicts from step 2
])
def test_paged_h2o_tova_evict_during_decode_as_contiguous_does(policy, extra):
  """h2o and tova keep evicting by attention on pages: per (layer, sequence, KV head) the
  same slot as the contiguous cache, so the same tokens, the same held K/V (through the
  block table) and, for h2o, the same scores and positions; the pool never grows."""
  base = {"model.n_kv_heads": 2, "cache.policy": policy, "cache.codec": "int8", **extra}
  want, got, pcfg = _contiguous_and_paged(base)
  assert got["tokens"] == want["tokens"]
  c, ref = got["cache"], want["cache"]
  S = c.spec.capacity
  assert c.spec.layout == "paged_compacted" and S == ref.spec.capacity == 6
  assert list(c.held) == list(ref.held) == list(c.budget)  # at the budget throughout
  assert list(c.lengths) == list(ref.lengths) == [len(p) + NEW - 1 for p in PROMPTS]
  assert all(int(n) - int(b) > max(0, len(p) - int(b)) for n, b, p in
             zip(c.lengths, c.budget, PROMPTS))  # decode tokens past the budget: evicted
  view = paged_compact.contiguous_view(c, S)
  held_BS = np.arange(S)[None, :] < np.asarray(c.held)[:, None]
  for a, b in zip(jax.tree.leaves((view.k, view.v)), jax.tree.leaves((ref.k, ref.v))):
    m = held_BS[None, :, None, :].reshape((1, 2, 1, S) + (1,) * (b.ndim - 4))
    np.testing.assert_array_equal(np.where(m, np.asarray(a)[:, :, :, :S], 0),
                                  np.where(m, np.asarray(b), 0))
  if policy == "h2o":
    np.testing.assert_array_equal(np.asarray(c.state["pos"]), np.asarray(ref.state["pos"]))
    np.testing.assert_array_equal(np.asarray(c.state["acc"]), np.asarray(ref.state["acc"]))
    prompt_B = np.asarray([len(p) for p in PROMPTS])[None, :, None, None]
    assert (np.asarray(c.state["pos"]) >= prompt_B).any(axis=-1).all()  # decode tokens held
  else:
    assert c.state == {}
  assert got["cache_bytes"] == cache_lib.tree_bytes(c)
  assert got["cache_bytes"] == cache_lib.LAYOUTS["paged_compacted"].closed_form_bytes(c.spec)
  assert c.block_table.shape == (2, 2)  # two pages of 4 hold the 6 slots of each sequence


def test_size_and_generate_json_report_the_paged_budget(capsys):
  dims = ["--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]
  rc = cli.main(["size", *dims, "--seq-len", "100", "--batch", "3", "--codec", "fp32", "--json",
                 "--set", "cache.layout=paged", "--set", "cache.page_size=16",
                 "--set", "cache.policy=window", "--set", "cache.budget=24"])
  res = json.loads(capsys.readouterr().out)
  per_token = 2 * 2 * 8 * 4  # K and V, 2 heads of 8 fp32
  assert rc == 0 and res["held_tokens"] == 24 and res["layout"] == "paged_compacted"
  # 2 pages of 16 per sequence (24 tokens), the block table, lengths/held/budget
  assert res["total_bytes"] == 2 * 3 * 2 * 16 * per_token + 4 * 3 * 2 + 3 * 4 * 3
  quick = ["--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.n_heads=4",
           "--set", "model.n_kv_heads=2"]
  sets = ["--set", "cache.layout=paged", "--set", "cache.page_size=4", "--set",
          "cache.policy=window", "--set", "cache.budget=4", "--set", "cache.codec=int8"]
  rc = cli.main(["generate", "--config", "configs/quickstart.yaml", *quick, *sets,
                 "--prompt-ids", "1,2,3,4,5,6", "--prompt-ids", "4,5", "--max-new-tokens", "3",
                 "--greedy", "--json"])
  res = json.loads(capsys.readouterr().out)
  assert rc == 0 and [len(t) for t in res["tokens"]] == [3, 3]
  cfg = config_lib.apply_overrides(config_lib.load("configs/quickstart.yaml"), {
      **{s.split("=")[0]: s.split("=")[1] for s in (quick + sets)[1::2]}})
  spec = cache_lib.CacheSpec.from_config(cfg, 2, policies.capacity(cfg.cache, 6, 3))
  assert res["cache_bytes"] == cache_lib.LAYOUTS["paged_compacted"].closed_form_bytes(spec)
  assert spec.capacity == 4  # one page of 4 per sequence, where the prefill held 3 each


@pytest.mark.parametrize("over,needle", [
    ({"cache.residual": 4, "cache.codec": "int8"}, "cache.residual=0"),
    # per-channel keys need a residual window (KIVI): refused as one, both split pages
    ({"cache.k_axis": "channel", "cache.codec": "int4", "cache.group_size": 4,
      "cache.residual": 8}, "cache.residual=0"),
])
def test_paged_policy_bad_settings_are_one_line_errors(over, needle):
  with pytest.raises(KvjaxError) as e:
    tiny_config(**{"cache.layout": "paged", "cache.policy": "knorm", "cache.budget": 8, **over})
  assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("over,needle", [
    ({"cache.layout": "paged_compacted"}, "what a policy builds"),
    ({"cache.layout": "none", "cache.policy": "knorm", "cache.budget": 4},
     "cache.layout=contiguous or paged"),
])
def test_internal_or_unevictable_layouts_are_refused(over, needle):
  with pytest.raises(KvjaxError) as e:
    tiny_config(**over)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_paged_policy_errors_exit_2(capsys):
  base = ["generate", "--config", "configs/quickstart.yaml", "--prompt-ids", "1,2,3",
          "--max-new-tokens", "2", "--set", "cache.layout=paged", "--set", "cache.policy=knorm",
          "--set", "cache.budget=2"]
  for extra, needle in [(["--set", "cache.residual=4", "--set", "cache.codec=int8"], "residual"),
                        # the prefill pool (2 pages of 4 for 3 + 2 tokens) must fit first
                        (["--set", "cache.num_pages=1", "--set", "cache.page_size=4"],
                         "cache.num_pages=1")]:
    rc = cli.main(base + extra)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("over,needle", [
    ({"cache.layout": "paged", "cache.policy": "snapkv", "cache.budget": 6,
      "cache.window": 2}, "queries"),
    ({"cache.policy": "knorm", "cache.budget": 6}, "only with cache.layout=paged"),
])
def test_engine_refuses_what_it_cannot_evict(over, needle):
  cfg = tiny_config(**over)
  with pytest.raises(KvjaxError) as e:
    engine.Engine(cfg, tiny_params(cfg), slots=2, max_len=32)
  assert needle in str(e.value) and "\n" not in str(e.value)


class Checked(engine.Engine):
  """The engine, with the allocator's invariants checked before every step and every
  compaction, and each compaction's freed pages recorded."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.freed, self.seen = {}, {}

  def _check_pages(self):
    a = self.alloc
    a.check()  # one state per page: free, idle-cached or in use
    owners = [p for r in self.running for p in r.pages]
    assert len(owners) == len(set(owners)), "a page is owned by two requests (no prefix cache)"
    for p in range(self.n_pages):
      assert a.refs[p] == owners.count(p), f"page {p}: refcount != block-table references"
    assert len(a.free) + len(a.idle) + sum(r > 0 for r in a.refs) == self.n_pages
    for r in self.running:
      if r.held >= 0:  # compacted: the pages of its held slots (+ its next one, reserved)
        most = request.slots_after(self.cfg.cache, r, 1)
        assert -(-r.held // self.page) <= len(r.pages) <= -(-most // self.page), (r.held, r.pages)

  def _step(self, rows, T, R):
    self._check_pages()
    for r, _ in rows:
      self.seen.setdefault(id(r), set()).update(r.pages)
    return super()._step(rows, T, R)

  def _compact(self, r):
    self._check_pages()
    before = list(r.pages)
    super()._compact(r)
    self.freed[id(r)] = [p for p in before if p not in r.pages]
    self._check_pages()


@pytest.mark.parametrize("policy,extra", [("knorm", {"cache.budget": 5}),
                                          ("sinks", {"cache.budget": 6, "cache.sinks": 2})])
def test_engine_returns_compacted_pages_to_the_pool_for_other_requests(policy, extra):
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.page_size": 4, "cache.policy": policy,
                       "cache.codec": "int8", **extra})
  params = tiny_params(cfg)
  rng = np.random.default_rng(1)
  prompts = [[int(t) for t in rng.integers(0, 64, n)] for n in (17, 13, 9)]
  news = [6, 4, 5]
  ref = generate.generate(cfg, params, prompts, max(news), timed=False)["tokens"]
  # 7 pages: the first prompt alone takes 5 (17 tokens); uncompacted, it would leave too few
  # for the second (4 pages) to start before it finishes.
  pcfg = config_lib.replace(cfg, **{"cache.layout": "paged", "cache.num_pages": 7})
  e = Checked(pcfg, params, slots=3, max_len=32, chunk=32, widths=(16,))
  rs = [engine.Request(p, n, arrival=i) for i, (p, n) in enumerate(zip(prompts, news))]
  stats = e.run(rs)
  assert [r.output for r in rs] == [r[:n] for r, n in zip(ref, news)]
  assert stats["preemptions"] == 0 and stats["freed_pages"] >= 3
  first = rs[0]
  assert len(e.freed[id(first)]) == 3  # 5 prompt pages -> 2 for its 5 or 6 kept tokens
  # the second request started while the first still ran, on pages the first gave back
  assert rs[1].first_token_step < first.finish_step
  assert set(e.freed[id(first)]) & e.seen[id(rs[1])]
  e._check_pages()
  assert e.alloc.available() == 7 and not any(e.alloc.refs)


def test_compacting_a_filled_paged_cache_is_what_prefill_returns():
  """`evict.compress_filled` (the long-context tasks' path) on a paged cache prefilled as usual
  equals `evict.prefill`'s paged compaction of the same prompts."""
  from kvjax import decode
  from kvjax.decode import evict
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.layout": "paged", "cache.page_size": 4,
                       "cache.policy": "knorm", "cache.budget": 5, "cache.codec": "int8"})
  params = tiny_params(cfg)
  tokens, lengths = generate.pad_prompts(PROMPTS)
  T, room, key = tokens.shape[1], 3, jax.random.PRNGKey(0)
  static, sampler = step.Static.of(cfg), decode.Sampler()
  fresh = lambda: cache_lib.init_cache(cfg, 2, T + room)  # noqa: E731
  _, _, want = evict.prefill(params, tokens, lengths, fresh(), key, static=static, sampler=sampler)
  _, _, filled = decode.prefill(params, tokens, lengths, fresh(), key, static=static,
                                sampler=sampler)
  got = evict.compress_filled(filled, jnp.asarray(lengths), None, room=room, T=T)
  assert got.spec == want.spec and got.spec.layout == "paged_compacted"
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The compaction of a layout is found as data: the layout that names it (`compacts`).
  layout = cache_lib.compacted(filled.spec.layout)
  assert layout.name == "paged_compacted" and cache_lib.compacted("latent") is None
  by_layout = jax.jit(layout.compress, static_argnames=("room", "T"))(
      filled, jnp.asarray(lengths), room=room, T=T)
  for a, b in zip(jax.tree.leaves(by_layout), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
