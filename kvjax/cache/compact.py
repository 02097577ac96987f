"""Compaction: the tokens a policy keeps, copied into a cache whose capacity is the budget.

`decode.generate` with `cache.policy` other than `full` prefills into an ordinary
contiguous cache (the whole prompt, as every prompt pass needs its own keys anyway),
asks the policy which tokens to keep (`kvjax.policies`), and copies them into an
`EvictedCache` (layout `compacted`) of

    capacity = min(budget, prompt width) + max_new_tokens   (policies that append)
    capacity = min(budget, prompt width + max_new_tokens)    (window/sinks: a ring)

slots, which the decode loop then reads and writes. The prefill cache is donated and
dropped, so what stays allocated (and what `cache_bytes` reports) is the budgeted cache.

Positions: `lengths` counts every token a sequence has seen (the next token's position,
which the decode loop rotates its query at), `held` the slots that hold a token. Keys are
stored already rotated at their original positions, and every held token is older than
any new query, so a held slot is simply valid: no per-slot position is needed.

Codec storage is copied as it is (no re-encoding), which needs codecs that encode every
token on its own: the residual window and per-channel (KIVI) keys are refused.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import cache as cache_lib
from kvjax import codecs, policies
from kvjax.errors import KvjaxError


@struct.dataclass
class EvictedCache:
  k: Any                 # K codec storage, leaves [L, B, K, S, ...] (S = compacted capacity)
  v: Any                 # V codec storage, leaves [L, B, K, S, ...]
  lengths: jax.Array     # [B] int32: tokens seen (= position of the next token)
  held: jax.Array        # [B] int32: slots holding a token (slots [0, held) are valid)
  budget: jax.Array      # [B] int32: tokens kept per sequence (ring size of window/sinks)
  spec: cache_lib.CacheSpec = struct.field(pytree_node=False)

  @property
  def layout(self) -> "Compacted":
    return cache_lib.LAYOUTS["compacted"]

  def layer_stores(self) -> Any:
    """The stacked stores and the held counts (the attention reads (layer, block) itself)."""
    return (self.k, self.v, self.held)


class Compacted(cache_lib.Layout):
  """The layout of a compacted cache: held tokens in slots [0, held), new tokens appended
  (slot held + i), or, for a policy that evicts during decode, written into its ring."""

  name = "compacted"
  internal = True  # built by a cache.policy, never chosen as cache.layout

  def init(self, spec: cache_lib.CacheSpec) -> EvictedCache:
    L, B, K, D = spec.n_layers, spec.batch, spec.n_kv_heads, spec.head_dim
    shape = (L, B, K, spec.capacity, D)
    zeros = jnp.zeros((B,), jnp.int32)
    return EvictedCache(k=spec.kc.init(shape, spec.cache_cfg),
                        v=spec.vc.init(shape, spec.cache_cfg), lengths=zeros, held=zeros,
                        budget=zeros + spec.capacity, spec=spec)

  def forward(self, model, params, tokens_BT, positions_BT, cache):
    return model.apply({"params": params}, tokens_BT, positions_BT, cache)

  def segments(self, spec, layer_store, lengths_B, layer=None):
    k, v, held_B = layer_store
    mask_BS = jnp.arange(spec.capacity)[None, :] < held_B[:, None]
    return [cache_lib.Segment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.max(held_B), layer=layer)]

  segments.stacked = True  # see `Contiguous.segments`

  def write(self, cache: EvictedCache, k_LBTKD, v_LBTKD, positions_BT) -> EvictedCache:
    spec = cache.spec
    pol = policies.get(spec.cache_cfg.policy)
    valid_BT = positions_BT >= 0
    n0, n1 = cache.lengths, cache.lengths + jnp.sum(valid_BT, axis=1).astype(jnp.int32)
    p_BT, S = positions_BT, spec.capacity
    if pol.decode_evicts:  # ring: sinks stay, the rest go to sinks + (p - sinks) mod W
      sinks = pol.sinks(spec.cache_cfg)
      W_B1 = (cache.budget - sinks)[:, None]
      kept = valid_BT & ((p_BT < sinks) | (p_BT >= n1[:, None] - W_B1))
      slot_BT = jnp.where(p_BT < sinks, p_BT, sinks + (p_BT - sinks) % jnp.maximum(W_B1, 1))
      held = jnp.minimum(n1, cache.budget)
    else:  # append after the held tokens
      kept = valid_BT
      slot_BT = p_BT - n0[:, None] + cache.held[:, None]
      held = cache.held + (n1 - n0)
    slot_BT = jnp.where(kept, slot_BT, S)  # evicted at once, or padding: dropped
    k_LBKTD, v_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3), jnp.swapaxes(v_LBTKD, 2, 3)
    k = jax.tree.map(cache_lib._scatter(slot_BT), cache.k, spec.kc.encode(k_LBKTD, spec.cache_cfg))
    v = jax.tree.map(cache_lib._scatter(slot_BT), cache.v, spec.vc.encode(v_LBKTD, spec.cache_cfg))
    return dataclasses.replace(cache, k=k, v=v, lengths=n1, held=held)

  def closed_form_bytes(self, spec: cache_lib.CacheSpec) -> int:
    K, D, c = spec.n_kv_heads, spec.head_dim, spec.cache_cfg
    per_token = spec.kc.bytes_per_token(K, D, c) + spec.vc.bytes_per_token(K, D, c)
    return int(round(spec.n_layers * spec.batch * spec.capacity * per_token)) + 3 * 4 * spec.batch


cache_lib.LAYOUTS["compacted"] = Compacted()


def capacity(cache_cfg, T: int, room: int) -> int:
  """Slots of the compacted cache for prompts of width T and `room` decode tokens."""
  budget = policies.static_budget(cache_cfg, T)
  if policies.get(cache_cfg.policy).decode_evicts:
    return min(budget, T + room)
  return min(budget, T) + room


def held_tokens(cache_cfg, seq_len: int) -> int:
  """Tokens one sequence of `seq_len` holds under the policy (what `kvjax size` sizes)."""
  if cache_cfg.policy == "full":
    return seq_len
  return min(seq_len, policies.static_budget(cache_cfg, seq_len))


def _gather_tokens(pos_LBKS):
  """leaf [L, B, K, S, X] -> [L, B, K, Sk, X], slot i taking token pos[..., i]."""
  def take(a):
    if a.ndim != 5:
      raise KvjaxError("compaction needs codec leaves [L, B, K, S, X]")
    return jnp.take_along_axis(a, pos_LBKS[..., None], axis=3)
  return take


def compress(cache, lengths_B, room: int, q_LBTHD=None, T: int | None = None) -> EvictedCache:
  """The prefilled contiguous `cache` (prompts of `lengths_B` tokens, width T) compacted
  to the policy's budget, with `room` free slots (or a ring) for the decode tokens."""
  spec = cache.spec
  c = spec.cache_cfg
  pol = policies.get(c.policy)
  T = T or spec.capacity
  Sb = policies.static_budget(c, T)
  Sk = min(Sb, T)
  cap = capacity(c, T, room)
  budget_B = policies.budgets(c, lengths_B)
  k_LBKSD = spec.kc.decode(jax.tree.map(lambda a: a[:, :, :, :T], cache.k), jnp.float32) \
      if spec.kc.token_block == 1 else None
  ctx = policies.Context(k_LBKSD, lengths_B, budget_B, c, q_LBTHD)
  pos_LBKS = pol.select(ctx, Sk)

  new_spec = dataclasses.replace(spec, layout="compacted", capacity=cap)
  fresh = cache_lib.LAYOUTS["compacted"].init(new_spec)

  held_B = policies.held(lengths_B, budget_B)
  used_BS = jnp.arange(Sk)[None, :] < held_B[:, None]

  def place(store, kept):  # unused slots stay zero, as in a fresh cache
    kept = jnp.where(used_BS[None, :, None, :, None], kept, jnp.zeros((), kept.dtype))
    return store.at[:, :, :, :Sk].set(kept)
  k = jax.tree.map(place, fresh.k, jax.tree.map(_gather_tokens(pos_LBKS), cache.k))
  v = jax.tree.map(place, fresh.v, jax.tree.map(_gather_tokens(pos_LBKS), cache.v))
  return EvictedCache(k=k, v=v, lengths=cache.lengths, held=held_B, budget=budget_B,
                      spec=new_spec)


def _is_q_proj(mdl, method_name) -> bool:
  return isinstance(mdl, nn.Dense) and mdl.name == "q_proj" and method_name == "__call__"


# Not donated: the compacted cache has another shape, so XLA could not reuse the prompt's
# buffers anyway; the caller drops them.
@functools.partial(jax.jit, static_argnames=("cfg", "sampler"))
def prefill(params, tokens_BT, lengths_B, cache, key, *, cfg, sampler):
  """`decode.prefill` followed by compaction: returns the first token, its logits and the
  compacted cache. Policies that read queries run the layers unrolled to capture each
  layer's `q_proj` output (the scan does not carry intermediates)."""
  from kvjax import model as model_lib
  from kvjax.model import Transformer

  pol = policies.get(cfg.cache.policy)
  T = tokens_BT.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  positions_BT = jnp.where(t < lengths_B[:, None], cache.lengths[:, None] + t, -1)
  m = cfg.model
  if pol.needs_queries or "layers" not in params or model_lib.unrolled(m):
    model, p = Transformer(m, logits_last=True, layer_loop="unrolled"), model_lib.split_layers(params)
  else:
    model, p = Transformer(m, logits_last=True), params
  q_LBTHD = None
  if pol.needs_queries:
    (logits_B1V, cache), state = model.apply({"params": p}, tokens_BT, positions_BT, cache,
                                             capture_intermediates=_is_q_proj,
                                             mutable=["intermediates"])
    inter = state["intermediates"]
    B = tokens_BT.shape[0]
    cos, sin = model_lib.rope_cos_sin(positions_BT, m)
    q_LBTHD = jnp.stack([
        model_lib.apply_rope(inter[f"layers_{i}"]["q_proj"]["__call__"][0]
                             .reshape(B, T, m.n_heads, m.D), cos, sin)
        for i in range(m.n_layers)])
  else:
    logits_B1V, cache = model.apply({"params": p}, tokens_BT, positions_BT, cache)
  room = cache.spec.capacity - T
  new_cache = compress(cache, lengths_B, room, q_LBTHD, T=T)
  last_BV = logits_B1V[:, 0]
  return sampler(last_BV, key), last_BV, new_cache


class _Program:
  """`prefill` with the host-side checks that need the prompt lengths, run at `lower`."""

  def lower(self, params, tokens_BT, lengths_B, cache, key, *, cfg, sampler):
    if cfg.mesh.data * cfg.mesh.model > 1:
      raise KvjaxError(f"cache.policy={cfg.cache.policy} runs on one device; drop the mesh.* "
                       "overrides")
    policies.check_lengths(cfg.cache, np.asarray(lengths_B))
    return prefill.lower(params, tokens_BT, lengths_B, cache, key, cfg=cfg, sampler=sampler)


def prefill_program(cfg, default):
  """The prefill program `decode.generate` lowers: `default` for `full`, else compaction."""
  return default if cfg.cache.policy == "full" else _Program()


codecs.CACHE_CHECKS.append(policies.check_config)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _continue(params, cache, cont_BM, *, cfg):
  """Feed cont_BM one token per step through the cache; log-probabilities [B, M, V]."""
  from kvjax import decode
  model, p = decode.network(cfg, params)

  def step(c, tok_B):
    logits, c = c.layout.forward(model, p, tok_B[:, None], c.lengths[:, None], c)
    return c, jax.nn.log_softmax(logits[:, 0], axis=-1)

  cache, lp_MBV = jax.lax.scan(step, cache, cont_BM.T)
  return jnp.swapaxes(lp_MBV, 0, 1), cache


def continuation_logprobs(cfg, params, context_BT, cont_BM):
  """Quality through eviction: prefill the context (compacted by `cache.policy`), then
  teacher-force the continuation token by token. Returns (log-probabilities [B, M, V] where
  row i predicts cont[:, i], the cache bytes held at the end)."""
  from kvjax import decode
  context_BT, cont_BM = np.asarray(context_BT, np.int32), np.asarray(cont_BM, np.int32)
  (B, T), M = context_BT.shape, cont_BM.shape[1]
  lengths_B = np.full((B,), T, np.int32)
  cache = cache_lib.init_cache(cfg, B, T + M)
  key = jax.random.PRNGKey(0)
  pre = prefill_program(cfg, decode.prefill).lower(params, context_BT, lengths_B, cache, key,
                                                   cfg=cfg, sampler=decode.Sampler()).compile()
  _, last_BV, cache = pre(params, context_BT, lengths_B, cache, key)
  lp_BMV, cache = _continue(params, cache, cont_BM[:, :-1], cfg=cfg)
  first = jax.nn.log_softmax(last_BV, axis=-1)[:, None]
  return jnp.concatenate([first, lp_BMV], axis=1), cache_lib.tree_bytes(cache)
