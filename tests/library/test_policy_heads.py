"""Per-head budgets (`cache.heads: adaptive`, kvjax/policies/heads.py): the spread of a
layer's budget over its KV heads, the attention that reads each head's own slots, and the
settings that cannot take it."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params

from kvjax import codecs
from kvjax import config as config_lib
from kvjax.attention import native, xla
from kvjax.cache import base
from kvjax.errors import KvjaxError
from kvjax.lab import evaluate, tasks
from kvjax.policies import heads


def _brute(s_KS, n: int, budget: int, Sk: int):
  """The spread of one (layer, sequence) written plainly: each head's best SAFE x held,
  then the best of the rest across heads, at most Sk a head."""
  K, S = s_KS.shape
  held = min(n, budget)
  safe = int(np.floor(heads.SAFE * held))
  order = [sorted(range(n), key=lambda j: (-s_KS[k, j], j)) for k in range(K)]
  keep = [set(order[k][:safe]) for k in range(K)]
  rest = sorted(((-s_KS[k, j], k * S + j, k, j) for k in range(K)
                 for r, j in enumerate(order[k]) if safe <= r < Sk))
  for _, _, k, j in rest[:K * (held - safe)]:
    keep[k].add(j)
  return keep


@pytest.mark.parametrize("n,budget", [(40, 10), (40, 25), (12, 30)])
def test_spread_is_the_plain_rule(n, budget):
  rng = np.random.default_rng(n + budget)
  L, B, K, S = 2, 1, 3, 48
  s = rng.normal(size=(L, B, K, S)).astype(np.float32)
  s[0, 0, 1, :20] += 3.0  # head 1 of layer 0 concentrates: the others get more of the budget
  Sk = heads.prompt_slots(config_lib.CacheConfig(heads="adaptive"), budget, S)
  pos, count = heads.spread(jnp.asarray(s), jnp.array([n]), jnp.array([budget]), Sk)
  pos, count = np.asarray(pos), np.asarray(count)
  held = min(n, budget)
  for l, k in itertools.product(range(L), range(K)):
    want = _brute(s[l, 0], n, budget, Sk)[k]
    assert set(pos[l, 0, k, :count[l, 0, k]].tolist()) == want
    assert list(pos[l, 0, k, :count[l, 0, k]]) == sorted(want)  # ascending, all < n
    assert int(np.floor(heads.SAFE * held)) <= count[l, 0, k] <= Sk
  assert (count.sum(axis=2) == K * held).all()  # the layer keeps K x budget in all


def _segment(rng, B=2, K=2, S=40, D=8, held=(30, 25)):
  k = rng.normal(size=(B, K, S, D)).astype(np.float32)
  v = rng.normal(size=(B, K, S, D)).astype(np.float32)
  mask = np.arange(S)[None, :] < np.array(held)[:, None]
  head = rng.random((B, K, S)) < 0.6
  head[:, :, 0] = True  # every head sees at least one slot
  fp32 = codecs.get("fp32")
  seg = base.Segment(jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), fp32, fp32,
                     head_BKS=jnp.asarray(head))
  return seg, k, v, mask[:, None, :] & head


def test_attention_reads_each_heads_own_slots():
  """A query of KV head k attends to the slots valid in that head only: the blocked read,
  the native route (which leaves per-head masks to XLA) and the reference agree with a
  softmax over each head's own slots written out."""
  rng = np.random.default_rng(0)
  seg, k, v, valid_BKS = _segment(rng)
  B, K, S, D = k.shape
  G, T = 2, 1
  q = rng.normal(size=(B, T, K * G, D)).astype(np.float32)
  new_k = rng.normal(size=(B, T, K, D)).astype(np.float32)
  new_v = rng.normal(size=(B, T, K, D)).astype(np.float32)
  pos = np.full((B, T), 50, np.int32)
  want = np.zeros((B, T, K * G, D), np.float32)
  for b, kh, g in itertools.product(range(B), range(K), range(G)):
    keys = np.concatenate([k[b, kh][valid_BKS[b, kh]], new_k[b, :, kh]])
    vals = np.concatenate([v[b, kh][valid_BKS[b, kh]], new_v[b, :, kh]])
    logit = keys @ q[b, 0, kh * G + g] / np.sqrt(D)
    p = np.exp(logit - logit.max())
    want[b, 0, kh * G + g] = (p / p.sum()) @ vals
  args = (jnp.asarray(q), jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(pos), [seg])
  for got in (xla.grouped(*args), native.native(*args), xla.reference(*args)):
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def _gqa():
  return tiny_config(**{"model.vocab_size": 260, "model.max_seq_len": 512,
                        "model.n_kv_heads": 2})


def test_adaptive_keeping_everything_answers_like_the_full_cache():
  """At ratio 1 every head keeps every token: the per-head masks mark all of them, and the
  question and the decoded answer read them as the full cache does."""
  cfg32 = _gqa()
  params = tiny_params(cfg32)
  rng = np.random.default_rng(3)
  prefix, tail = rng.integers(0, 256, 70).tolist(), rng.integers(0, 256, 6).tolist()
  ref = evaluate.reference_config(cfg32)
  pre = tasks.prefill_queries(ref, params, prefix, 80)
  want = tasks.answer_through_cache(cfg32, params, tasks.evict_prefix(cfg32, pre, 22), tail, 6,
                                    tail_pad=16)
  cfg = config_lib.apply_overrides(cfg32, {"cache.policy": "snapkv", "cache.ratio": 1.0,
                                           "cache.heads": "adaptive"})
  c = tasks.evict_prefix(cfg, pre, 22)
  assert (np.asarray(c.head_held) == 70).all() and int(c.prompt_end[0]) == 70
  assert tasks.answer_through_cache(cfg, params, c, tail, 6, tail_pad=16) == want


def test_adaptive_holds_the_uniform_count_spread_over_heads():
  cfg32 = _gqa()
  params = tiny_params(cfg32)
  rng = np.random.default_rng(4)
  prefix = rng.integers(0, 256, 90).tolist()
  pre = tasks.prefill_queries(evaluate.reference_config(cfg32), params, prefix, 96)
  over = {"cache.policy": "snapkv", "cache.ratio": 0.3, "cache.window": 4}
  uni = tasks.evict_prefix(config_lib.apply_overrides(cfg32, over), pre, 21)
  ada = tasks.evict_prefix(config_lib.apply_overrides(cfg32, {**over, "cache.heads":
                                                              "adaptive"}), pre, 21)
  held = int(uni.held[0])
  counts = np.asarray(ada.head_held)[:, 0]  # [L, K]
  assert (counts.sum(axis=1) == 2 * held).all() and (counts != held).any()
  assert int(ada.prompt_end[0]) == counts.max() == int(ada.held[0])
  assert ada.spec.capacity == heads.SPREAD * int(np.ceil(0.3 * 96)) + 21


@pytest.mark.parametrize("over,model,match", [
    ({"cache.policy": "h2o", "cache.ratio": 0.5}, {}, "h2o does not"),
    ({"cache.policy": "window", "cache.budget": 8}, {}, "window does not"),
    ({"cache.policy": "snapkv", "cache.ratio": 0.5, "cache.layout": "paged"}, {},
     "compacts a contiguous cache"),
    ({"cache.policy": "snapkv", "cache.ratio": 0.5}, {"model.n_kv_heads": 1},
     "several KV heads"),
    ({"cache.policy": "snapkv", "cache.ratio": 0.5, "cache.heads": "many"}, {},
     "unknown cache.heads"),
])
def test_settings_that_cannot_spread_are_one_line(over, model, match):
  heads_value = over.pop("cache.heads", "adaptive")
  with pytest.raises(KvjaxError, match=match) as e:
    config_lib.apply_overrides(_gqa(), {**model, **over, "cache.heads": heads_value})
  assert "\n" not in str(e.value)
