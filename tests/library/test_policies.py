"""Token eviction policies and compaction (kvjax/policies, kvjax/cache/compact.py, kvjax/decode/evict.py).

Selection is checked on hand-made keys and queries whose kept set follows from each
policy's definition; decoding from a compacted cache is checked against a full forward
pass that masks the same tokens out (so RoPE positions must survive compaction)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params

from kvjax import attention, cache as cache_lib, cli, decode, policies
from kvjax import model as model_lib
from kvjax.cache import compact
from kvjax.decode import evict, step
from kvjax.decode import generate
from kvjax.errors import KvjaxError


def ctx_of(k_LBKSD, lengths, n_keep, q_LBTHD=None, **cache):
  cfg = tiny_config(**{f"cache.{k}": v for k, v in cache.items()})
  lengths = jnp.asarray(lengths, jnp.int32)
  b = jnp.full(lengths.shape, n_keep)
  return policies.Context(jnp.asarray(k_LBKSD, jnp.float32), lengths, b.astype(jnp.int32),
                          cfg.cache, None if q_LBTHD is None else jnp.asarray(q_LBTHD, jnp.float32))


def kept(pos_LBKS, held_B, l=0, b=0, k=0):
  return [int(p) for p in np.asarray(pos_LBKS)[l, b, k, :int(held_B[b])]]


# -- selection on hand-made patterns ----------------------------------------------------------
def test_window_and_sinks_keep_the_ring_of_recent_tokens():
  k = jnp.zeros((1, 2, 1, 11, 8))
  ctx = ctx_of(k, [11, 3], 6, policy="window", budget=6)
  pos = policies.get("window").select(ctx, 6)
  # Row 0: positions 5..10, each in slot p mod 6; row 1 (3 tokens, within budget) whole.
  assert kept(pos, [6, 3]) == [6, 7, 8, 9, 10, 5]
  assert kept(pos, [6, 3], b=1) == [0, 1, 2]
  ctx = ctx_of(k, [11, 3], 6, policy="sinks", budget=6, sinks=2)
  pos = policies.get("sinks").select(ctx, 6)
  # Sinks 0, 1 in slots 0, 1; recent 7..10 in slots 2 + (p - 2) mod 4.
  assert kept(pos, [6, 3]) == [0, 1, 10, 7, 8, 9]
  assert sorted(kept(pos, [6, 3])) == [0, 1, 7, 8, 9, 10]


def test_knorm_keeps_lowest_key_norms_per_head_and_ragged_rows():
  norms = np.array([[5, 1, 4, 0.5, 3, 2, 6, 7],      # head 0
                    [0.1, 9, 8, 7, 0.2, 6, 0.3, 5]])  # head 1
  k = np.zeros((1, 2, 2, 8, 8), np.float32)
  k[0, :, :, :, 3] = norms[None]
  ctx = ctx_of(k, [8, 5], 3, policy="knorm", budget=3)
  pos = policies.get("knorm").select(ctx, 3)
  held = [3, 3]
  assert kept(pos, held, k=0) == [1, 3, 5]
  assert kept(pos, held, k=1) == [0, 4, 6]
  # Row 1 holds 5 tokens: position 6 (norm 0.3) is padding there, never kept.
  assert kept(pos, held, b=1, k=1) == [0, 3, 4]
  assert kept(pos, held, b=1, k=0) == [1, 3, 4]


def spike_keys(T, D, spikes, scale=10.0, seed=0):
  """Keys of small noise with large keys along channel 0 at `spikes` (per head)."""
  rng = np.random.default_rng(seed)
  k = rng.normal(0, 0.01, (1, 1, len(spikes), T, D)).astype(np.float32)
  for h, js in enumerate(spikes):
    for j in js:
      k[0, 0, h, j, 0] = scale
  return k


def test_snapkv_keeps_pooled_neighbourhoods_of_what_the_window_attends():
  T, D, w = 30, 8, 4
  k = spike_keys(T, D, [[5, 20], [3, 14]])
  q = np.zeros((1, 1, T, 2, D), np.float32)
  q[..., 0] = 5.0  # every query looks along channel 0
  ctx = ctx_of(k, [T], w + 14, q, policy="snapkv", budget=w + 14, window=w)
  pos = policies.get("snapkv").select(ctx, w + 14)
  window = list(range(T - w, T))
  # Max-pooling over 7 tokens spreads each attended token to its 3 neighbours each side.
  assert kept(pos, [18], k=0) == list(range(2, 9)) + list(range(17, 24)) + window
  assert kept(pos, [18], k=1) == list(range(0, 7)) + list(range(11, 18)) + window


def test_snapkv_keeps_a_short_ragged_row_whole():
  T, D = 30, 8
  k = np.concatenate([spike_keys(T, D, [[5]])] * 2, axis=1)
  q = np.ones((1, 2, T, 1, D), np.float32)
  ctx = ctx_of(k, [T, 15], 18, q, policy="snapkv", budget=18, window=4)
  pos = policies.get("snapkv").select(ctx, 18)
  assert kept(pos, [18, 15], b=1) == list(range(15))


def test_h2o_keeps_heavy_hitters_of_all_prompt_queries_plus_recent():
  T, D, w = 30, 8, 4
  k = spike_keys(T, D, [[3, 7]])
  q = np.zeros((1, 1, T, 1, D), np.float32)
  q[..., 0] = 5.0
  ctx = ctx_of(k, [T], w + 3, q, policy="h2o", budget=w + 3, window=w)
  pos = policies.get("h2o").select(ctx, w + 3)
  # Tokens 3 and 7 take about all the mass of every later query; token 0 is next (query 0
  # sees only itself, query 1 splits between 0 and 1, ...): 1 + 1/2 + 1/3 > the rest.
  assert kept(pos, [w + 3]) == [0, 3, 7] + list(range(T - w, T))


def test_tova_keeps_what_the_last_query_attends():
  T, D = 20, 8
  k = spike_keys(T, D, [[4, 11]])
  q = np.zeros((1, 1, T, 1, D), np.float32)
  q[0, 0, T - 1, 0, 0] = 5.0  # only the last query looks at the spikes; it alone counts
  q[0, 0, :T - 1, 0, 1] = 5.0
  ctx = ctx_of(k, [T], 2, q, policy="tova", budget=2)
  pos = policies.get("tova").select(ctx, 2)
  assert kept(pos, [2]) == [4, 11]


# -- compaction, bytes, positions ---------------------------------------------------------------
PROMPTS = [[5, 9, 2, 33, 7, 1, 18, 40, 3, 11, 25, 6], [8, 4, 60, 12, 19]]
CONT = [[14, 2, 37, 9, 50], [22, 41, 3, 6, 17]]  # teacher-forced decode tokens


def run_cached(cfg, params, prompts=PROMPTS, cont=CONT):
  """Prefill (with compaction when a policy is set), then feed `cont` one token at a time.
  Returns the logits [B, 1 + len(cont), V] (prefill's last, then one per step) and caches."""
  tokens, lengths = generate.pad_prompts(prompts)
  c0 = cache_lib.init_cache(cfg, len(prompts), tokens.shape[1] + len(cont[0]))
  prefill = evict.prefill_for(cfg, decode.prefill)
  sampler = decode.Sampler()
  key = jax.random.PRNGKey(0)
  _, last, cache = prefill.lower(params, tokens, lengths, c0, key, static=step.Static.of(cfg),
                                 sampler=sampler).compile()(params, tokens, lengths, c0, key)
  one = jax.jit(lambda c, t: step.run(step.Static.of(cfg), params, t, c.lengths[:, None], c))
  out, caches = [last], [cache]
  for i in range(len(cont[0])):
    res = one(cache, jnp.array([[c[i]] for c in cont], jnp.int32))
    cache = res.cache
    out.append(res.logits[:, 0])
    caches.append(cache)
  return jnp.stack(out, 1), caches


def masked_reference(cfg, params, keep, prompts=PROMPTS, cont=CONT):
  """The full forward pass over prompt + continuation in which a decode query at position
  p of sequence b sees key j of layer l, KV head k iff keep(l, b, k, j, p); prompt queries
  are plain causal. Returns logits at the same positions as `run_cached`."""
  seqs = [p + c for p, c in zip(prompts, cont)]
  tokens, lengths = generate.pad_prompts(seqs)
  B, T = tokens.shape
  positions = np.where(np.arange(T)[None] < lengths[:, None], np.arange(T)[None], -1)
  L, K = cfg.model.n_layers, cfg.model.n_kv_heads
  masks = np.zeros((L, B, K, T, T), bool)
  for b, p0 in enumerate(len(p) for p in prompts):
    for p in range(len(seqs[b])):
      for j in range(p + 1):
        for layer in range(L):
          for k in range(K):
            masks[layer, b, k, p, j] = p < p0 or keep(layer, b, k, j, p)
  layers = iter(masks)

  def attn(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments):
    assert not segments
    m = jnp.asarray(next(layers))
    Bq, Tq, H, D = q_BTHD.shape
    q = (q_BTHD * D ** -0.5).reshape(Bq, Tq, K, H // K, D)
    logits = jnp.einsum("btkgd,bukd->bkgtu", q, k_BTKD)
    probs = jax.nn.softmax(jnp.where(m[:, :, None], logits, -1e30), axis=-1)
    out = jnp.einsum("bkgtu,bukd->btkgd", probs, v_BTKD)
    return out.reshape(Bq, Tq, H, D)

  attention.ATTENTIONS["test_masked"] = attn
  try:
    ref_cfg = tiny_config(**{"model.n_kv_heads": K, "model.attention": "test_masked"})
    model = model_lib.Transformer(ref_cfg.model, layer_loop="unrolled")
    logits, _ = model.apply({"params": model_lib.split_layers(params)}, jnp.asarray(tokens),
                            jnp.asarray(positions))
  finally:
    del attention.ATTENTIONS["test_masked"]
  idx = np.array([[len(p) - 1 + i for i in range(len(cont[0]) + 1)] for p in prompts])
  return jnp.take_along_axis(logits, jnp.asarray(idx)[..., None], axis=1)


@pytest.mark.parametrize("policy,extra", [("window", {"cache.budget": 6}),
                                          ("sinks", {"cache.budget": 6, "cache.sinks": 2})])
def test_ring_decode_equals_masked_full_forward(policy, extra):
  """window/sinks keep evicting during decode; positions (RoPE) of the kept keys and of
  the new queries must survive compaction and the ring's wrap-around."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.policy": policy, **extra})
  params = tiny_params(cfg)
  got, caches = run_cached(cfg, params)
  S = extra.get("cache.sinks", 0) if policy == "sinks" else 0
  W = extra["cache.budget"] - S
  want = masked_reference(cfg, params, lambda l, b, k, j, p: j < S or j >= p - W)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  # The continuation fed as ONE call (as a task's question is): every new query sees the
  # tokens held when the call starts and the call's own, earlier tokens.
  one_call = step.run(step.Static.of(cfg), params, jnp.array(CONT, jnp.int32),
                      caches[0].lengths[:, None] + jnp.arange(len(CONT[0]))[None], caches[0])
  at_start = {b: len(p) for b, p in enumerate(PROMPTS)}
  want_one = masked_reference(cfg, params, lambda l, b, k, j, p:
                              j < S or j >= at_start[b] - W or j >= at_start[b])
  np.testing.assert_allclose(one_call.logits, want_one[:, 1:], atol=2e-5, rtol=1e-5)
  # The cache never grows past the budget; lengths count every token seen.
  assert caches[-1].spec.capacity == 6
  assert list(caches[-1].held) == [6, 6]
  assert list(caches[-1].lengths) == [len(p) + 5 for p in PROMPTS]


def test_knorm_decode_equals_masked_full_forward_per_head():
  """Per-layer, per-KV-head selection: the reference keeps, in each (layer, head), the
  prompt keys of lowest norm, computed here from the uncompressed cache."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.policy": "knorm", "cache.budget": 4})
  params = tiny_params(cfg)
  got, _ = run_cached(cfg, params)
  full_cfg = tiny_config(**{"model.n_kv_heads": 2})
  _, full = run_cached(full_cfg, params)
  k = np.asarray(full[0].k)  # [L, B, K, S, D], prompt keys at slots = positions
  keep_set = {}
  for b, p in enumerate(PROMPTS):
    norms = np.linalg.norm(k[:, b, :, :len(p)], axis=-1)  # [L, K, n]
    for layer in range(norms.shape[0]):
      for h in range(norms.shape[1]):
        order = np.argsort(norms[layer, h], kind="stable")[:4]
        keep_set[layer, b, h] = set(order.tolist())
  want = masked_reference(cfg, params, lambda l, b, h, j, p: j >= len(PROMPTS[b])
                          or j in keep_set[l, b, h])
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["window", "knorm", "snapkv"])
def test_budget_at_least_the_prompt_equals_full_cache(policy):
  cfg_full = tiny_config()
  params = tiny_params(cfg_full)
  want, full = run_cached(cfg_full, params)
  extra = {"cache.window": 2} if policy == "snapkv" else {}
  cfg = tiny_config(**{"cache.policy": policy, "cache.budget": 64, **extra})
  got, caches = run_cached(cfg, params)
  # window and knorm: bit for bit. snapkv's prefill also scores the prompt with the last
  # queries, so it is another XLA program than the full cache's, and under the suite's
  # compile flags (conftest.py) XLA rounds its K/V projections differently in the last place
  # (measured: 1 ulp); it must still equal the full cache to float32 rounding, far below what
  # one dropped or misplaced token moves.
  def same(a, b):
    if policy == "snapkv":
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())
    else:
      np.testing.assert_array_equal(a, b)

  same(np.asarray(got), np.asarray(want))
  T = max(map(len, PROMPTS))
  for a, b in zip(jax.tree.leaves((caches[-1].k, caches[-1].v)),
                  jax.tree.leaves((full[-1].k, full[-1].v))):
    same(np.asarray(a[:, :, :, :T]), np.asarray(b[:, :, :, :T]))


def test_full_policy_is_todays_cache():
  cfg = tiny_config(**{"cache.policy": "full"})
  params = tiny_params(cfg)
  a = generate.generate(cfg, params, PROMPTS, 4, timed=False, return_cache=True)
  b = generate.generate(tiny_config(), params, PROMPTS, 4, timed=False, return_cache=True)
  assert a["tokens"] == b["tokens"] and a["cache_bytes"] == b["cache_bytes"]
  assert type(a["cache"]) is cache_lib.KVCache
  for x, y in zip(jax.tree.leaves(a["cache"]), jax.tree.leaves(b["cache"])):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_generate_cache_bytes_equal_the_formula_at_the_budget(codec):
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.policy": "knorm", "cache.budget": 5,
                       "cache.codec": codec})
  params = tiny_params(cfg)
  out = generate.generate(cfg, params, PROMPTS, 4, timed=False, return_cache=True)
  spec = out["cache"].spec
  assert spec.layout == "compacted" and spec.capacity == 5 + 4
  assert out["cache_bytes"] == cache_lib.tree_bytes(out["cache"])
  assert out["cache_bytes"] == compact.Compacted().closed_form_bytes(spec)
  L, B, K, D = 2, 2, 2, 8
  per_token = 2 * K * D * 4 if codec == "fp32" else 2 * K * (D + 2)  # int8 + one bf16 scale
  assert out["cache_bytes"] == L * B * (5 + 4) * per_token + 3 * 4 * B
  full = generate.generate(tiny_config(**{"model.n_kv_heads": 2, "cache.codec": codec}),
                         params, PROMPTS, 4, timed=False)
  assert out["cache_bytes"] < full["cache_bytes"]


def test_ratio_budgets_per_ragged_row():
  cfg = tiny_config(**{"cache.policy": "sinks", "cache.ratio": 0.5, "cache.sinks": 1})
  params = tiny_params(cfg)
  _, caches = run_cached(cfg, params)
  assert list(caches[0].held) == [6, 3]  # ceil(0.5 * 12), ceil(0.5 * 5)
  assert list(caches[0].budget) == [6, 3]


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("over,needle", [
    ({"cache.policy": "sinks", "cache.budget": 4, "cache.sinks": 4}, "must exceed cache.sinks"),
    ({"cache.policy": "window", "cache.ratio": 1.5}, "cache.ratio must be a finite number in [0, 1]"),
    ({"cache.policy": "window", "cache.ratio": -0.5}, "cache.ratio must be a finite number in [0, 1]"),
    ({"cache.policy": "knorm", "cache.budget": 8, "cache.layout": "none"},
     "cache.layout=contiguous"),
    ({"cache.policy": "lru"}, "unknown cache.policy"),
    ({"cache.policy": "knorm"}, "needs cache.budget"),
    ({"cache.policy": "full", "cache.budget": 8}, "keeps every token"),
    ({"cache.policy": "window", "cache.budget": 8, "cache.ratio": 0.5}, "not both"),
    ({"cache.policy": "snapkv", "cache.budget": 8, "cache.window": 8}, "must exceed"),
    ({"cache.policy": "knorm", "cache.budget": 8, "cache.residual": 4}, "cache.residual=0"),
    ({"cache.policy": "sinks", "cache.ratio": 0.5, "cache.window": 8}, "drop cache.window"),
    ({"cache.policy": "sinks", "cache.budget": 10, "cache.window": 8, "cache.sinks": 4},
     "disagrees"),
    ({"cache.layout": "compacted"}, "what a policy builds"),
])
def test_bad_policy_settings_are_one_line_errors(over, needle):
  with pytest.raises(KvjaxError, match=None) as e:
    tiny_config(**over)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_policy_exits_2_and_size_shows_the_budget(capsys):
  rc = cli.main(["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                 "--seq-len", "100", "--set", "cache.policy=sinks", "--set", "cache.budget=2",
                 "--set", "cache.sinks=4", "--json"])
  err = capsys.readouterr().err
  assert rc == 2 and "must exceed cache.sinks" in err and err.count("\n") == 1
  rc = cli.main(["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                 "--seq-len", "100", "--codec", "fp32", "--set", "cache.policy=window",
                 "--set", "cache.budget=24", "--json"])
  res = json.loads(capsys.readouterr().out)
  assert rc == 0 and res["held_tokens"] == 24
  assert res["total_bytes"] == 2 * 24 * (2 * 2 * 8 * 4) + 12


@pytest.mark.parametrize("over", [
    {"cache.policy": "h2o", "cache.ratio": 0.5, "cache.window": 3},  # keeps 3 of 5 = window
    {"cache.policy": "sinks", "cache.ratio": 1.0, "cache.sinks": 5},  # ring of 5 = the sinks
    # the 5-token prompt is within its budget of 5 at prefill, but h2o evicts during decode
    {"cache.policy": "h2o", "cache.ratio": 1.0, "cache.window": 5},
])
def test_ratio_too_small_for_the_window_or_sinks_is_refused_before_jit(over):
  cfg = tiny_config(**over)
  with pytest.raises(KvjaxError, match="raise the ratio"):
    generate.generate(cfg, tiny_params(cfg), PROMPTS, 2, timed=False)


def test_check_lengths_treats_decode_evicting_policies_alike():
  """A sequence within its budget at prefill is refused when its budget is not above the
  h2o window, since decode evicts from it (as the window/sinks ring does); snapkv, which
  only appends after prefill, leaves it alone."""
  lengths = [12, 5]  # ratio 1.0: budgets 12 and 5, neither compressed at prefill
  for c, floor in [(tiny_config(**{"cache.policy": "h2o", "cache.ratio": 1.0,
                                   "cache.window": 5}).cache, "window (5)"),
                   (tiny_config(**{"cache.policy": "sinks", "cache.ratio": 1.0,
                                   "cache.sinks": 5}).cache, "sinks (5)")]:
    with pytest.raises(KvjaxError) as e:
      policies.check_lengths(c, lengths)
    msg = str(e.value)
    assert "sequence 1's 5 tokens" in msg and floor in msg and "\n" not in msg
  policies.check_lengths(tiny_config(**{"cache.policy": "snapkv", "cache.ratio": 1.0,
                                        "cache.window": 5}).cache, lengths)
  policies.check_lengths(tiny_config(**{"cache.policy": "tova", "cache.ratio": 1.0}).cache,
                         [12, 1])  # tova protects no window: any budget >= 1 can evict
  policies.check_lengths(tiny_config(**{"cache.policy": "h2o", "cache.ratio": 1.0,
                                        "cache.window": 5}).cache, [12, 6])


def test_continuation_logprobs_full_and_unbudgeted_equal_the_full_forward():
  cfg = tiny_config()
  params = tiny_params(cfg)
  rng = np.random.default_rng(0)
  toks = rng.integers(0, 64, (2, 16)).astype(np.int32)
  logits, _ = model_lib.Transformer(cfg.model).apply({"params": params}, jnp.asarray(toks),
                                                      jnp.arange(16)[None].repeat(2, 0))
  want = jax.nn.log_softmax(logits[:, 9:15], axis=-1)  # predictions of tokens 10..15
  got, _ = evict.continuation_logprobs(cfg, params, toks[:, :10], toks[:, 10:])
  np.testing.assert_allclose(got, want, atol=1e-5)
  kcfg = tiny_config(**{"cache.policy": "knorm", "cache.budget": 10})
  got_k, nbytes = evict.continuation_logprobs(kcfg, params, toks[:, :10], toks[:, 10:])
  np.testing.assert_allclose(got_k, want, atol=1e-5)
  wcfg = tiny_config(**{"cache.policy": "window", "cache.budget": 4})
  got_w, nbytes_w = evict.continuation_logprobs(wcfg, params, toks[:, :10], toks[:, 10:])
  assert nbytes_w < nbytes and np.max(np.abs(np.asarray(got_w - want))) > 1e-4


@pytest.mark.parametrize("which", ["every", "window", "last"])
def test_attention_mass_in_query_blocks_equals_the_whole_attention(which, monkeypatch):
  """The attention mass the scoring policies rank by (h2o: every prompt query; snapkv: an
  observation window; tova: the last query), summed over query blocks of 3 (the last one
  padded), equals the mass read off the whole [T, T] softmax of each layer and head,
  averaged over the query heads of each KV head; ragged rows."""
  from kvjax.policies import attn
  monkeypatch.setattr(attn, "MASS_BLOCK", 3)
  rng = np.random.default_rng(7)
  L, B, T, H, K, D = 2, 2, 11, 4, 2, 8
  q = rng.standard_normal((L, B, T, H, D)).astype(np.float32)
  k = rng.standard_normal((L, B, K, T, D)).astype(np.float32)
  lengths = np.array([11, 6])
  t = np.arange(T)[None, :]
  qpos = {"every": np.where(t < lengths[:, None], t, -1),
          "window": lengths[:, None] - 4 + np.arange(4)[None, :],
          "last": lengths[:, None] - 1}[which]
  got = attn.attention_mass(jnp.asarray(q), jnp.asarray(k), jnp.asarray(lengths, jnp.int32),
                            jnp.asarray(qpos, jnp.int32))
  want = np.zeros((L, B, K, T))
  for layer in range(L):
    for b in range(B):
      for h in range(H):
        logits = q[layer, b, :, h] @ k[layer, b, h // (H // K)].T / np.sqrt(D)  # [T, T]
        for w in qpos[b]:
          if w < 0:
            continue
          seen = np.arange(T) <= min(w, lengths[b] - 1)
          e = np.exp(logits[w] - logits[w][seen].max()) * seen
          want[layer, b, h // (H // K)] += e / e.sum() / (H // K)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_ratio_budget_is_one_number_on_host_and_device():
  """ceil(ratio x length) in float64 wherever it is asked: a traced length reads the host's
  table, so the compacted cache holds what the host-side check and the sizes expect (in
  float32, 0.3 x 90 rounds up to 27.000002 and its ceiling to 28)."""
  from kvjax import config as config_lib
  from kvjax.policies import base, token_budget

  c = config_lib.CacheConfig(policy="snapkv", ratio=0.3)
  lengths = np.arange(1, 200, dtype=np.int32)
  host = token_budget.budgets(c, lengths)
  device = jax.jit(lambda n: token_budget.budgets(c, n, 256))(jnp.asarray(lengths))
  np.testing.assert_array_equal(host, np.asarray(device))
  assert int(host[89]) == 27 and base.static_budget(c, 90) == 27
  assert int(policies.budgets(c, np.array([1], np.int32))[0]) == 1
