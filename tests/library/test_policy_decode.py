"""Decode-time eviction of `h2o` and `tova` (kvjax/policies/replace.py and attn.py, through
kvjax/cache/compact.py).

One write step is checked on a hand-made compacted cache against a numpy replay of each
method's rule; decoding through the model is checked against a full forward pass in which
each decode query sees exactly the tokens the cache held at its step (read back from the
caches: key matching after prefill, the slot that changed at each step), so the scores,
the slot choice, RoPE positions and the decode scan's carry must all hold."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params
from test_policies import PROMPTS, masked_reference, run_cached

from kvjax import cache as cache_lib
from kvjax.cache import compact
from kvjax.decode import generate

L, B, K, H, D, S = 2, 2, 2, 4, 8, 6  # tiny model (d_model 32, 4 heads) as GQA-2
HELD, BUDGET, LENGTHS = [5, 3], [5, 4], [20, 3]  # row 0 full, row 1 one slot short
WINDOW = 2
write = jax.jit(compact.Compacted().write)


def hand_made(policy, codec="fp32", seed=0):
  """A compacted cache of `policy` with random keys, ragged rows (one at its budget, one
  below), h2o's positions shuffled over the slots and its accumulated scores; and one
  new token per row (key, value, query) at position `lengths`."""
  cfg = tiny_config(**{"model.n_kv_heads": K, "cache.policy": policy, "cache.codec": codec,
                       "cache.budget": 5, "cache.window": WINDOW})
  spec = dataclasses.replace(cache_lib.CacheSpec.from_config(cfg, B, S), layout="compacted")
  c = compact.Compacted().init(spec)
  rng = np.random.default_rng(seed)
  keys, vals = rng.normal(size=(2, L, B, K, S, D)).astype(np.float32)
  c = dataclasses.replace(c, k=spec.kc.encode(jnp.asarray(keys)),
                          v=spec.vc.encode(jnp.asarray(vals)), held=jnp.array(HELD, jnp.int32),
                          budget=jnp.array(BUDGET, jnp.int32),
                          lengths=jnp.array(LENGTHS, jnp.int32))
  if c.state:
    pos = np.full((L, B, K, S), -1, np.int32)
    acc = np.zeros((L, B, K, S), np.float32)
    for l in range(L):
      for k in range(K):
        # Row 0: 19 (inside the window once token 20 arrives) and four older tokens.
        pos[l, 0, k, :5] = rng.permutation(np.r_[rng.choice(19, 4, replace=False), 19])
        pos[l, 1, k, :3] = rng.permutation(3)
    acc[:, :, :, :5] = rng.uniform(0.5, 3.0, (L, B, K, 5))
    acc[pos == 19] = 0.0  # the lowest score, but protected by the window
    c = dataclasses.replace(c, state={"acc": jnp.asarray(acc), "pos": jnp.asarray(pos)})
  new_k, new_v = rng.normal(size=(2, L, B, 1, K, D)).astype(np.float32)
  q = 2 * rng.normal(size=(L, B, 1, H, D)).astype(np.float32)
  if policy == "tova":  # in (layer 0, row 0, head 1) the new key points away from the queries
    new_k[0, 0, 0, 1] = -3 * q[0, 0, 0, 2:4].mean(0)
  positions = np.array(LENGTHS, np.int32)[:, None]
  return c, jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(q), jnp.asarray(positions)


def reference_step(c, new_k, q, policy):
  """numpy: (slot the new token takes per (layer, row, head), S = dropped; scores after).
  The attention of the new query over the held keys (as stored) and itself, averaged over
  the query heads of each KV head; h2o adds it up and never evicts the last `WINDOW`
  tokens seen, tova ranks by it alone and may drop the new token."""
  kd = np.asarray(c.spec.kc.decode(c.k))
  G = H // K
  slot = np.full((L, B, K), S)
  score = np.zeros((L, B, K, S), np.float32)
  unprotected, current_only = np.zeros((L, B, K), int), np.zeros((L, B, K), int)
  for l in range(L):
    for b in range(B):
      n = HELD[b]
      for k in range(K):
        qs = np.asarray(q)[l, b, 0, k * G:(k + 1) * G] / np.sqrt(D)  # [G, D]
        logits = np.concatenate([qs @ kd[l, b, k, :n].T, qs @ np.asarray(new_k)[l, b, 0, k][:, None]], 1)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p = (p / p.sum(1, keepdims=True)).mean(0)  # [n + 1]
        s = p[:n] + (np.asarray(c.state["acc"])[l, b, k, :n] if policy == "h2o" else 0)
        score[l, b, k, :n] = s
        if n < BUDGET[b]:
          slot[l, b, k] = n
        elif policy == "h2o":
          cand = np.asarray(c.state["pos"])[l, b, k, :n] < LENGTHS[b] + 1 - WINDOW
          slot[l, b, k] = np.flatnonzero(cand)[np.argmin(s[cand])]
          unprotected[l, b, k] = np.argmin(s)
          current_only[l, b, k] = np.flatnonzero(cand)[np.argmin(p[:n][cand])]
        else:
          slot[l, b, k] = S if p[n] < s.min() else np.argmin(s)
        if slot[l, b, k] < S:
          score[l, b, k, slot[l, b, k]] = p[n]
  return slot, score, unprotected, current_only


def check_step(c, after, new_k, slot, score, policy):
  kd, kd_after = np.asarray(c.spec.kc.decode(c.k)), np.asarray(c.spec.kc.decode(after.k))
  stored_new = np.asarray(c.spec.kc.decode(c.spec.kc.encode(new_k[:, :, 0, :, None])))[..., 0, :]
  want = kd.copy()
  for l, b, k in np.ndindex(L, B, K):
    if slot[l, b, k] < S:
      want[l, b, k, slot[l, b, k]] = stored_new[l, b, k]
  np.testing.assert_array_equal(kd_after, want)
  assert list(after.held) == [5, 4] and list(after.lengths) == [21, 4]
  if policy == "h2o":
    held = np.arange(S)[None, :] < np.array([5, 4])[:, None]
    np.testing.assert_allclose(np.where(held[None, :, None], np.asarray(after.state["acc"]), 0), score,
                               rtol=1e-5, atol=1e-6)
    want_pos = np.asarray(c.state["pos"]).copy()
    for l, b, k in np.ndindex(L, B, K):
      want_pos[l, b, k, slot[l, b, k]] = LENGTHS[b]
    np.testing.assert_array_equal(np.asarray(after.state["pos"]), want_pos)
  else:
    assert after.state == {}


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_h2o_step_evicts_the_lowest_accumulated_token_outside_the_window(codec):
  c, new_k, new_v, q, positions = hand_made("h2o", codec)
  after = write(c, new_k, new_v, positions, q)
  slot, score, unprotected, current_only = reference_step(c, new_k, q, "h2o")
  check_step(c, after, new_k, slot, score, "h2o")
  # The inputs discriminate: without the window the protected token (position 19) would
  # go, and by the current query alone another token would.
  row0 = np.s_[:, 0]
  assert np.all(unprotected[row0] != slot[row0])
  assert np.any(current_only[row0] != slot[row0])
  assert np.all(slot[:, 1] == 3)  # row 1 below its budget: appended


def test_tova_step_evicts_the_token_the_current_query_attends_least():
  c, new_k, new_v, q, positions = hand_made("tova")
  after = write(c, new_k, new_v, positions, q)
  slot, score, _, _ = reference_step(c, new_k, q, "tova")
  check_step(c, after, new_k, slot, score, "tova")
  assert slot[0, 0, 1] == S  # the new token scored lowest there: dropped
  assert np.sum(slot[:, 0] < S) >= 2 and np.all(slot[:, 1] == 3)


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_tokens_of_one_call_are_placed_as_if_decoded_one_at_a_time(policy):
  c, _, _, _, _ = hand_made(policy, seed=1)
  rng = np.random.default_rng(2)
  k3, v3 = (jnp.asarray(rng.normal(size=(L, B, 3, K, D)), jnp.float32) for _ in range(2))
  q3 = jnp.asarray(2 * rng.normal(size=(L, B, 3, H, D)), jnp.float32)
  pos3 = jnp.array([[20, 21, 22], [3, 4, -1]], jnp.int32)  # row 1 ends in padding
  at_once = write(c, k3, v3, pos3, q3)
  one = c
  for t in range(3):
    one = write(one, k3[:, :, t:t + 1], v3[:, :, t:t + 1], pos3[:, t:t + 1],
                                    q3[:, :, t:t + 1])
  assert list(at_once.held) == [5, 4] and list(at_once.lengths) == [23, 5]
  for a, b in zip(jax.tree.leaves(at_once), jax.tree.leaves(one)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# -- through the model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_run():
  cfg = tiny_config(**{"model.n_kv_heads": K})
  return cfg, tiny_params(cfg), run_cached(cfg, tiny_params(cfg))


def held_positions(caches, full_prefill):
  """[steps + 1] arrays [L, B, K, S]: the position in each slot of each cache (-1: none).
  After prefill, by matching each held key to the full cache's prompt keys (slot =
  position there); then the slot whose key changed at step i took that step's token."""
  k0, kf = np.asarray(caches[0].k), np.asarray(full_prefill.k)
  pos = np.full(k0.shape[:4], -1)
  for l, b, k in np.ndindex(*pos.shape[:3]):
    for s in range(int(caches[0].held[b])):
      d = np.abs(kf[l, b, k, :len(PROMPTS[b])] - k0[l, b, k, s]).max(-1)
      assert d.min() < 1e-5
      pos[l, b, k, s] = np.argmin(d)
  out = [pos.copy()]
  for i in range(1, len(caches)):
    changed = np.any(np.asarray(caches[i].k) != np.asarray(caches[i - 1].k), axis=-1)
    assert changed.sum(-1).max() <= 1  # one token per step, at most one slot
    for b in range(len(PROMPTS)):
      pos[:, b][changed[:, b]] = len(PROMPTS[b]) + i - 1
    out.append(pos.copy())
  return out


@pytest.mark.parametrize("policy,size,budgets", [("h2o", {"cache.budget": 6}, [6, 6]),
                                                  ("tova", {"cache.ratio": 0.5}, [6, 3])])
def test_greedy_decode_equals_the_masked_full_forward(policy, size, budgets, full_run):
  """`generate.generate` (the decode scan) with the cache at its budget throughout (per
  sequence: ceil(0.5 x 12), ceil(0.5 x 5) for tova); its tokens fed one at a time give the
  same tokens, caches and scores, and logits equal to a full forward pass where each
  decode query sees only the tokens held at its step."""
  _, params, (_, full) = full_run
  budget, N = 6, 8
  cfg = tiny_config(**{"model.n_kv_heads": K, "cache.policy": policy, "cache.window": WINDOW,
                       **size})
  gen = generate.generate(cfg, params, PROMPTS, N, timed=False, return_cache=True)
  c = gen["cache"]
  # Never grows: capacity = the largest budget, every row holds its own, bytes = the formula.
  assert c.spec.capacity == budget and list(c.held) == list(c.budget) == budgets
  assert list(c.lengths) == [len(p) + N - 1 for p in PROMPTS]
  per_token = 2 * K * D * 4 + (K * 8 if policy == "h2o" else 0)  # fp32 K/V (+ acc, pos)
  assert gen["cache_bytes"] == cache_lib.tree_bytes(c) == L * B * budget * per_token + 3 * 4 * B
  assert gen["cache_bytes"] == compact.Compacted().closed_form_bytes(c.spec)

  toks = gen["tokens"]
  got, caches = run_cached(cfg, params, cont=[t[:N - 1] for t in toks])
  assert np.asarray(jnp.argmax(got, -1)).tolist() == toks  # greedy, step by step
  for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(caches[-1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

  pos = held_positions(caches, full[0])
  if policy == "h2o":
    for i, cache in enumerate(caches):
      np.testing.assert_array_equal(np.asarray(cache.state["pos"]), pos[i])
  sets = [{(l, b, k): set(p[l, b, k][p[l, b, k] >= 0].tolist())
           for l, b, k in np.ndindex(L, B, K)} for p in pos]
  # Decode evicted prompt tokens, in every row, and layers or heads differ in which.
  for b in range(B):
    assert any(not sets[0][l, b, k] <= sets[-1][l, b, k] for l, k in np.ndindex(L, K))
  assert len({frozenset(v) for v in sets[-1].values()}) > 1

  def keep(l, b, k, j, p):
    return j == p or j in sets[p - len(PROMPTS[b])][l, b, k]
  want = masked_reference(cfg, params, keep, cont=[t[:N - 1] for t in toks])
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_budget_of_prompt_and_new_tokens_equals_the_full_cache(policy, full_run):
  """No eviction ever happens, so this is the full cache to float32 rounding. Not bit for
  bit under the suite's compile flags (conftest.py): the prompt runs in the program that
  also captures queries (as snapkv's, tests/library/test_policies.py), and in a decode step the
  rotated query has a second reader (the write's scoring), after which XLA:CPU's legacy
  emitters round the step's logits differently in the last place (measured: 1 ulp, and
  0 with XLA's default flags, from the same prefilled cache)."""
  _, params, (want, full) = full_run
  cfg = tiny_config(**{"model.n_kv_heads": K, "cache.policy": policy, "cache.budget": 64})
  got, caches = run_cached(cfg, params)
  assert caches[-1].spec.capacity == full[-1].spec.capacity  # min(64, prompt + new)
  assert list(caches[-1].held) == list(full[-1].lengths) == [len(p) + 5 for p in PROMPTS]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(np.asarray(want)).max())
  for a, b in zip(jax.tree.leaves((caches[-1].k, caches[-1].v)),
                  jax.tree.leaves((full[-1].k, full[-1].v))):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(np.asarray(b)).max())
