"""A policy that evicts during decode is one module: this file defines one and registers it
(no kvjax file names it), then decodes through both compacted layouts with it.

`largest_key_out` keeps, per layer, sequence and KV head, the `budget` tokens of lowest key
norm: at prefill like knorm, and at every decode step the new token takes the slot of the
held token with the largest key norm (or is dropped when its own is strictly the largest).
Only its scores are written here; the score-and-replace rule, the storage and the decode
scan are kvjax's (kvjax/policies/replace.py, kvjax/cache/compact.py, paged_compact.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params
from test_policies import PROMPTS, masked_reference, run_cached
from test_policy_decode import held_positions

from kvjax import cache as cache_lib
from kvjax import policies
from kvjax.cache import paged_compact
from kvjax.decode import generate
from kvjax.errors import KvjaxError
from kvjax.lab.serve import device as serve_step
from kvjax.policies.replace import ScoreAndReplace

NAME, K, BUDGET, N = "largest_key_out", 2, 5, 8


class LargestKeyOut(ScoreAndReplace, policies.Policy):
  name = NAME

  def scores(self, ctx):
    return -jnp.linalg.norm(ctx.k_LBKSD, axis=-1)

  def step_scores(self, spec, keys, mask_BS, k_LBKD, q_LBHD):
    held = -jnp.linalg.norm(spec.kc.decode(keys, jnp.float32), axis=-1)
    return (jnp.where(mask_BS[None, :, None], held, 0.0),
            -jnp.linalg.norm(k_LBKD.astype(jnp.float32), axis=-1))


@pytest.fixture(scope="module")
def registered():
  policies.register(LargestKeyOut())
  yield
  del policies.POLICIES[NAME]


def norms(a):
  return np.linalg.norm(np.asarray(a), axis=-1)


def test_a_registered_decode_time_policy_decodes_through_both_compacted_layouts(registered):
  cfg = tiny_config(**{"model.n_kv_heads": K, "cache.policy": NAME, "cache.budget": BUDGET})
  params = tiny_params(cfg)
  gen = generate.generate(cfg, params, PROMPTS, N, timed=False, return_cache=True)
  c, toks = gen["cache"], gen["tokens"]
  # The budget throughout: capacity = budget, every row full, bytes = the layout's formula.
  assert c.spec.layout == "compacted" and c.spec.capacity == BUDGET
  assert list(c.held) == list(c.budget) == [BUDGET, BUDGET] and c.state == {}
  assert list(c.lengths) == [len(p) + N - 1 for p in PROMPTS]
  assert gen["cache_bytes"] == cache_lib.tree_bytes(c) == \
      cache_lib.LAYOUTS["compacted"].closed_form_bytes(c.spec)

  # Fed one token at a time, the same tokens and cache; each step's one changed slot per
  # (layer, row, head) held the largest key there, and the new key is no larger.
  cont = [t[:N - 1] for t in toks]
  got, caches = run_cached(cfg, params, cont=cont)
  assert np.asarray(jnp.argmax(got, -1)).tolist() == toks
  for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(caches[-1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  replaced = 0
  for before, after in zip(caches, caches[1:]):
    n0, n1 = norms(before.k), norms(after.k)
    for l, b, k in zip(*np.nonzero((n0 != n1).any(-1))):
      s = int(np.flatnonzero(n0[l, b, k] != n1[l, b, k])[0])
      assert n0[l, b, k, s] == n0[l, b, k].max() >= n1[l, b, k, s]
      replaced += 1
  assert replaced > 0  # decode did evict

  # Layer 0's keys do not depend on what the cache held: from the full cache over the same
  # tokens, the final held set is the BUDGET lowest-norm of all tokens seen.
  full_cfg = tiny_config(**{"model.n_kv_heads": K})
  _, full = run_cached(full_cfg, params, cont=cont)
  pos = held_positions(caches, full[0])
  for b, p in enumerate(PROMPTS):
    seen = norms(full[-1].k[0, b, :, :len(p) + N - 1])  # [K, seen]
    for k in range(K):
      assert set(pos[-1][0, b, k]) == set(np.argsort(seen[k])[:BUDGET].tolist())

  # Each decode query attended exactly to the tokens held at its step.
  sets = [{(l, b, k): set(p[l, b, k][p[l, b, k] >= 0].tolist())
           for l, b, k in np.ndindex(*p.shape[:3])} for p in pos]

  def keep(l, b, k, j, p):
    return j == p or j in sets[p - len(PROMPTS[b])][l, b, k]
  want = masked_reference(cfg, params, keep, cont=cont)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)

  # On pages: the same tokens and held K/V; the serving engine refuses it in one line.
  pcfg = tiny_config(**{"model.n_kv_heads": K, "cache.policy": NAME, "cache.budget": BUDGET,
                        "cache.layout": "paged", "cache.page_size": 4})
  pgen = generate.generate(pcfg, params, PROMPTS, N, timed=False, return_cache=True)
  pc = pgen["cache"]
  assert pgen["tokens"] == toks and pc.spec.layout == "paged_compacted"
  view = paged_compact.contiguous_view(pc, BUDGET)
  np.testing.assert_array_equal(np.asarray(view.k)[:, :, :, :BUDGET], np.asarray(c.k))
  np.testing.assert_array_equal(np.asarray(view.v)[:, :, :, :BUDGET], np.asarray(c.v))
  with pytest.raises(KvjaxError, match="slot per layer and KV head") as e:
    serve_step.check_config(pcfg)
  assert "\n" not in str(e.value)
