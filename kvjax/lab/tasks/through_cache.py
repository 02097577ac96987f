"""Answering a task's queries through a cache: prefill the prefix, or store its
full-precision K/V through a codec (`encode_prefix`), or compact it through an eviction
policy (`prefill_queries` + `evict_prefix`), then feed each tail as its own call and decode
greedily, so every tail and answer token reads the prefix through the cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import decode
from kvjax.decode import step
from kvjax.errors import KvjaxError

PREFIX_ROUND = 256  # prefix_kv: slots kept per prefix, n rounded up to this


def _static(cfg):
  return step.statics(cfg)["static"]


@functools.partial(jax.jit, static_argnames=("static",))
def _forward(params, tokens_BT, lengths_B, cache, *, static):
  """One call through the cache (not donated: a prefix cache serves several tails).
  Returns the last valid token's logits [B, V] and the new cache."""
  positions_BT = step.positions(cache.lengths, lengths_B, tokens_BT.shape[1])
  out = step.run(static, params, tokens_BT, positions_BT, cache, logits="last")
  return out.logits[:, 0], out.cache


def _pad(ids, size: int) -> tuple[np.ndarray, np.ndarray]:
  out = np.zeros((1, size), np.int32)
  out[0, :len(ids)] = ids
  return out, np.array([len(ids)], np.int32)


def prefill(cfg, params, ids, capacity: int, chunk: int = 512):
  """The prefix through `cfg`'s cache, `chunk` tokens per call (the last call padded, so one
  program serves every length). Returns the filled cache."""
  from kvjax import cache as cache_lib

  if len(ids) > capacity:
    raise KvjaxError(f"prefix of {len(ids)} tokens exceeds the cache capacity {capacity}")
  c = cache_lib.init_cache(cfg, 1, capacity)
  for s in range(0, len(ids), chunk):
    tok, n = _pad(ids[s:s + chunk], chunk)
    _, c = _forward(params, tok, n, c, static=_static(cfg))
  return c


@functools.partial(jax.jit, static_argnames=("static", "capacity"))
def _reencode(k_LKSD, v_LKSD, n, *, static, capacity: int):
  from kvjax import cache as cache_lib
  from kvjax.codecs import rotate

  c = cache_lib.init_cache(static, 1, capacity)
  k = jnp.swapaxes(k_LKSD, 1, 2)[:, None]  # [L, 1, S, K, D]: the S slots fed as T new tokens
  v = jnp.swapaxes(v_LKSD, 1, 2)[:, None]
  rot_DD = rotate.of(static.cache, k.shape[-1])  # stored in the basis the model reads it in
  if rot_DD is not None:
    k, v = rotate.apply(k, rot_DD), rotate.apply(v, rot_DD)
  pos = jnp.where(jnp.arange(k.shape[2]) < n, jnp.arange(k.shape[2]), -1)[None, :]
  return cache_lib.layout_of(c).write(c, k, v, pos.astype(jnp.int32))


def prefix_kv(fp32_cache) -> tuple:
  """(K, V, n): the full-precision K/V [L, K, S, D] of a one-sequence fp32 contiguous cache
  without a residual window (the output of `prefill` with `evaluate.reference_config`),
  every layer at slot = position. S is n rounded up to a multiple of PREFIX_ROUND (at most
  the capacity), so a memo of many prefixes holds their tokens, not their caches' capacity,
  and few lengths compile. A model with sliding-window layers keeps only each windowed
  layer's last W tokens (`kvjax.cache.ring`): its other slots are zero, which its window
  never reads."""
  from kvjax.cache import ring

  spec = fp32_cache.spec
  if (spec.layout, spec.k_codec, spec.v_codec, spec.residual) != ("contiguous", "fp32",
                                                                   "fp32", 0):
    raise KvjaxError("prefix_kv needs an fp32 contiguous cache without a residual window")
  n = int(fp32_cache.lengths[0])
  S = min(spec.capacity, -(-max(n, 1) // PREFIX_ROUND) * PREFIX_ROUND)
  rg = ring.layers(spec)
  if rg is None:
    return fp32_cache.k[:, 0, :, :S], fp32_cache.v[:, 0, :, :S], n
  pos_W = ring.ring_positions(fp32_cache.lengths[:1], rg.window)[0]
  slot_W = jnp.where(pos_W >= 0, pos_W, S)  # a slot no position fills: dropped

  def whole(full_LKSD, ring_LKWD):
    out = jnp.zeros((spec.n_layers, *full_LKSD.shape[1:2], S, full_LKSD.shape[-1]),
                    full_LKSD.dtype)
    out = out.at[np.asarray(rg.full, np.int32)].set(full_LKSD[:, :, :S])
    at = out[np.asarray(rg.local, np.int32)].at[:, :, slot_W].set(ring_LKWD, mode="drop")
    return out.at[np.asarray(rg.local, np.int32)].set(at)
  return (whole(fp32_cache.k[:, 0], fp32_cache.k_ring[:, 0]),
          whole(fp32_cache.v[:, 0], fp32_cache.v_ring[:, 0]), n)


def encode_prefix(cfg, kv, capacity: int):
  """A fresh `cfg` cache holding the prefix's full-precision K/V stored through its codec
  and layout: the same `write` a prefill with this cache makes after computing them."""
  k, v, n = kv
  return _reencode(k, v, jnp.int32(n), static=_static(cfg), capacity=capacity)


@dataclasses.dataclass(frozen=True)
class Prefix:
  """A prefix prefilled in one call through an fp32 cache: its K/V (`prefix_kv`, [L, K,
  width, D] each, and its length n) and its rotated queries q [L, 1, width, H, D]."""
  kv: tuple
  q: jax.Array
  width: int


def prefill_queries(ref_cfg, params, ids, width: int) -> Prefix:
  """The prefix in ONE call of `width` tokens (padded) through `ref_cfg`'s fp32 cache, its
  queries kept: what a policy that scores by attention needs from every prefix query
  (snapkv's observation window, h2o's sum over all queries, tova's last query), which a
  chunked prefill would not give in one place. Nothing of a question is in it, so the
  selection never sees the question."""
  from kvjax import cache as cache_lib
  from kvjax.decode import evict

  if len(ids) > width:
    raise KvjaxError(f"prefix of {len(ids)} tokens exceeds the prefill width {width}")
  c = cache_lib.init_cache(ref_cfg, 1, width)
  tok, n = _pad(ids, width)
  c, q = evict.prefill_queries(params, tok, n, c, static=_static(ref_cfg))
  return Prefix(prefix_kv(c), q, width)


def _compact(cfg, kv, q, width: int, room: int):
  """`kv` stored through `cfg`'s codec in a cache of `width` slots, then compacted by its
  policy with the queries `q` [L, 1, width, H, D] (rotated into the basis the keys are
  stored in under `cache.rotate`), `room` slots free after."""
  from kvjax.decode import evict
  from kvjax.codecs import rotate

  c = encode_prefix(cfg, kv, width)
  rot_DD = rotate.of(cfg.cache, q.shape[-1])
  if rot_DD is not None:
    q = rotate.apply(q, rot_DD)
  return evict.compress_filled(c, jnp.array([kv[2]], jnp.int32), q, room=room, T=width)


def evict_prefix(cfg, prefix: Prefix, room: int):
  """The cache `cfg` holds after prefilling the prefix: its K/V stored through the codec,
  then compacted by `cache.policy` to its budget (`kvjax.decode.evict.compress_filled`), with `room` free
  slots for the question and the answer (a ring of `budget` slots for window/sinks, which
  keep evicting). The same cache `kvjax.decode.evict.prefill` returns for this prefix with `cfg`
  (a call's queries and fresh K/V do not depend on the codec; under `cache.rotate` the
  fp32 prefix's queries are rotated into the basis its keys are stored in). `full`: the
  encoded contiguous cache, `width + room` slots."""
  from kvjax import policies

  n = prefix.kv[2]
  if not policies.evicts(cfg.cache):
    return encode_prefix(cfg, prefix.kv, prefix.width + room)
  policies.check_lengths(cfg.cache, [n])
  return _compact(cfg, prefix.kv, prefix.q, prefix.width, room)


@functools.partial(jax.jit, static_argnames=("static",))
def _forward_queries(params, tokens_BT, lengths_B, cache, *, static):
  """`_forward`, also returning the call's rotated queries [L, B, T, H, D]."""
  positions_BT = step.positions(cache.lengths, lengths_B, tokens_BT.shape[1])
  out = step.run(static, params, tokens_BT, positions_BT, cache, logits="last", queries=True)
  return out.logits[:, 0], out.cache, out.queries


@jax.jit
def _place(q_prefix, q_tail, n):
  """The prefix's queries [L, 1, P, H, D] (positions [0, n) valid) and the tail's [L, 1, t,
  H, D] (at positions n, n + 1, ...) in one [L, 1, P + t, H, D] array."""
  L, B, P, H, D = q_prefix.shape
  out = jnp.zeros((L, B, P + q_tail.shape[2], H, D), q_prefix.dtype).at[:, :, :P].set(q_prefix)
  return jax.lax.dynamic_update_slice(out, q_tail.astype(out.dtype), (0, 0, n, 0, 0))


@dataclasses.dataclass(frozen=True)
class Prompt:
  """Context and question prefilled together at full precision (`question_prompt`): the
  prompt's last logits [1, V], its K/V (`prefix_kv`: n = context + question tokens) and
  its rotated queries [L, 1, width, H, D], what every policy of the aware protocol
  compacts from."""
  last: jax.Array
  kv: tuple
  q: jax.Array
  width: int


def question_prompt(ref_cfg, params, prefix: Prefix, tail_ids, tail_pad: int) -> Prompt:
  """The tail fed through the prefix's fp32 cache (`ref_cfg`) with its queries kept: the
  context and the question as one prompt, as if prefilled in one call. One per question,
  shared by every cache that compacts it."""
  width = prefix.width + tail_pad
  full = encode_prefix(ref_cfg, prefix.kv, width)
  tok, t = _pad(tail_ids, tail_pad)
  last, full, q_tail = _forward_queries(params, tok, t, full, static=_static(ref_cfg))
  return Prompt(last, prefix_kv(full), _place(prefix.q, q_tail, jnp.int32(prefix.kv[2])),
                width)


def aware(cfg, ref_cfg, params, prefix: Prefix, tail_ids, tail_pad: int, room: int,
          prompt: Prompt | None = None):
  """Question-aware eviction: (the prompt's last logits [1, V], the compacted cache).

  Context and question are one prompt prefilled at full precision (`question_prompt`, or
  `prompt` when the caller made it for several caches); the policy then scores [context;
  question] with the queries of both (snapkv's observation window is the question's last
  tokens) and compacts the whole prompt to its budget (a `cache.ratio` of context +
  question), the codec storing what it keeps. The answer's first token comes from the
  returned logits, which read the uncompacted prompt (as a prefill that compresses after
  it returns, SnapKV's and kvpress's protocol); every later token reads the compacted
  cache. `room`: slots left for the answer."""
  from kvjax import policies

  prompt = prompt or question_prompt(ref_cfg, params, prefix, tail_ids, tail_pad)
  policies.check_lengths(cfg.cache, [prompt.kv[2]])
  return prompt.last, _compact(cfg, prompt.kv, prompt.q, prompt.width, room)


def continue_greedy(cfg, params, cache, first: int, steps: int) -> list:
  """`steps` greedy tokens in all, `first` the first and the rest decoded through `cache`
  (consumed) by generate's own loop (greedy, no eos: an answer is `steps` tokens long)."""
  if steps == 1:
    return [first]
  static = dataclasses.replace(_static(cfg), eos_id=-1)
  rest_BN, _ = decode.decode(params, cache, jnp.array([first], jnp.int32),
                             jax.random.PRNGKey(0), static=static, sampler=decode.Sampler(),
                             steps=steps - 1)
  return [first] + [int(t) for t in np.asarray(rest_BN)[0]]


def answer_through_cache(cfg, params, cache, tail_ids, steps: int, tail_pad: int = 0):
  """Greedy tokens [steps] after feeding `tail_ids` as one call through `cache` (a cache
  holding the prefix; not consumed). Every tail and answer token reads the prefix's
  encoded K/V. `tail_pad` pads the tail so one program serves tails of any length."""
  tok, n = _pad(tail_ids, max(tail_pad, len(tail_ids)))
  last, c = _forward(params, tok, n, cache, static=_static(cfg))
  # `c` is this tail's cache, so decode may donate it
  return continue_greedy(cfg, params, c, int(jnp.argmax(last[0])), steps)
