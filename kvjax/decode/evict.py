"""The `cache.policy` path: prefill into an ordinary cache, then compact it to the budget
(`kvjax.cache.compact`; a paged cache into the budget's pages, `kvjax.cache.paged_compact`),
and the likelihood of a continuation read through such a cache (teacher-forced through
`decode.decode`, the one token loop).

`prefill_for(cfg, default)` is what a driver lowers for prefill: `default`
(`decode.prefill`) when the policy is `full`, else `CompactingPrefill`, which checks the
prompt lengths on the host and lowers `prefill` below. Every model call here is one
`kvjax.decode.step.run`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import policies
from kvjax.decode import step
from kvjax.errors import KvjaxError


def _prompt(params, tokens_BT, lengths_B, cache, static, queries: bool) -> step.Out:
  """The prompt through `cache` in one step (`kvjax.decode.step.run`): each row's last logits, the
  filled cache and, when `queries`, the prompt's rotated queries [L, B, T, H, D]."""
  positions_BT = step.positions(cache.lengths, lengths_B, tokens_BT.shape[1])
  return step.run(static, params, tokens_BT, positions_BT, cache, logits="last", queries=queries)


def _squeeze(cache):
  """The compaction of `cache` into the layout its policy builds (`cache.built`: the one
  that says it `compacts` the cache's layout)."""
  return cache_lib.built(cache.spec.cache_cfg).compress


# Not donated: the compacted cache has another shape, so XLA could not reuse the prompt's
# buffers anyway; the caller drops them.
@functools.partial(jax.jit, static_argnames=("static", "sampler"))
def prefill(params, tokens_BT, lengths_B, cache, key, *, static, sampler):
  """`decode.prefill` followed by compaction: returns the first token, its logits and the
  compacted cache (`compacted`, or `paged_compacted` when `cache` is paged). Policies that
  score by attention get the prompt's rotated queries from the same step."""
  T = tokens_BT.shape[1]
  out = _prompt(params, tokens_BT, lengths_B, cache, static,
                policies.get(static.cache.policy).needs_queries)
  room = out.cache.spec.capacity - T
  new_cache = _squeeze(out.cache)(out.cache, lengths_B, room, out.queries, T=T)
  last_BV = out.logits[:, 0]
  return sampler(last_BV, key), last_BV, new_cache


@functools.partial(jax.jit, static_argnames=("static",))
def prefill_queries(params, tokens_BT, lengths_B, cache, *, static):
  """The prompt in one call through `cache` (no compaction): (the filled cache, the rotated
  queries [L, B, T, H, D]). One such prefill through an fp32 cache serves every policy and
  codec: a call attends to its own fresh K/V, so its queries and its keys before storage
  do not depend on the cache's codec (see `compress_filled` below)."""
  out = _prompt(params, tokens_BT, lengths_B, cache, static, True)
  return out.cache, out.queries


@functools.partial(jax.jit, static_argnames=("room", "T"))
def compress_filled(cache, lengths_B, q_LBTHD, *, room: int, T: int):
  """`compress` of a filled contiguous (or paged) cache (its own `cache.policy`, budget and
  codec) with the prompt's queries from `prefill_queries`: the cache `prefill` would return
  for the same prompt, when `cache` holds the same keys and values (tests/lab/test_tasks.py)."""
  q = q_LBTHD if policies.get(cache.spec.cache_cfg.policy).needs_queries else None
  return _squeeze(cache)(cache, lengths_B, room, q, T=T)


class CompactingPrefill:
  """`prefill` with the host-side checks that need the prompt lengths, run at `lower`."""

  def lower(self, params, tokens_BT, lengths_B, cache, key, *, static, sampler):
    if static.mesh.data * static.mesh.model > 1:
      raise KvjaxError(f"cache.policy={static.cache.policy} runs on one device; drop the mesh.* "
                       "overrides")
    policies.check_lengths(static.cache, np.asarray(lengths_B))
    return prefill.lower(params, tokens_BT, lengths_B, cache, key, static=static, sampler=sampler)


def prefill_for(cfg, default):
  """The prefill program `generate.generate` lowers: `default` for `full`, else compaction
  (which scores the whole prompt at once, so it refuses `workload.prefill_chunk`)."""
  if not policies.evicts(cfg.cache):
    return default
  if cfg.workload.prefill_chunk:
    raise KvjaxError(f"workload.prefill_chunk={cfg.workload.prefill_chunk} prefills a prompt in "
                     f"pieces, but cache.policy={cfg.cache.policy} scores the whole prompt at "
                     "once; set workload.prefill_chunk=0 or cache.policy=full")
  return CompactingPrefill()



def continuation_logprobs(cfg, params, context_BT, cont_BM):
  """Quality through eviction: prefill the context (compacted by `cache.policy`), then
  teacher-force the continuation token by token. Returns (log-probabilities [B, M, V] where
  row i predicts cont[:, i], the cache bytes held at the end)."""
  from kvjax import decode
  params = step.prepare_params(cfg, params)
  context_BT, cont_BM = np.asarray(context_BT, np.int32), np.asarray(cont_BM, np.int32)
  (B, T), M = context_BT.shape, cont_BM.shape[1]
  lengths_B = np.full((B,), T, np.int32)
  cache = cache_lib.init_cache(cfg, B, T + M)
  key = jax.random.PRNGKey(0)
  kw = step.statics(cfg, decode.Sampler())
  pre = prefill_for(cfg, decode.prefill).lower(params, context_BT, lengths_B, cache, key,
                                                   **kw).compile()
  _, last_BV, cache = pre(params, context_BT, lengths_B, cache, key)
  # teacher-forced through the one token loop: step i feeds cont[:, i], forced from cont[:, 1]
  _, lp_BMV, cache = decode.decode(params, cache, cont_BM[:, 0], key, steps=M - 1,
                                   forced_BN=cont_BM[:, 1:], logprobs=True, **kw)
  first = jax.nn.log_softmax(last_BV, axis=-1)[:, None]
  return jnp.concatenate([first, lp_BMV], axis=1), cache_lib.tree_bytes(cache)
