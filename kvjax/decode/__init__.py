"""The decode core. This module is its token loop: prefill and the decode loop,
jit-compiled, cache donated, one compile per shape.

    prefill(params, tokens_BT, lengths_B, cache, key, static=, sampler=) -> token_B, logits, cache
    decode(params, cache, token_B, key, static=, sampler=, steps=)        -> tokens_BN, cache
    decode(..., forced_BN=, logprobs=True)  -> tokens_BN, logprobs_BNV, cache (teacher forcing)

Beside it: `step` (the one model call, `step.run`, and what jit hashes, `step.Static`),
`evict` (prefill through a policy's compaction), `generate` (placement, ahead-of-time
compiles and timed runs for every driver: `kvjax generate`, the timers, the experiments)
and `sharding` (meshes and `Placement`).

Both programs make one model call per step through `step.run`: the model reads and writes
the cache through its layout (`kvjax.cache`), or, for layout `none`, recomputes the whole
prefix (the recompute mode). What jit hashes is `step.Static` (model, cache and mesh
configs, eos) and the `Sampler`, never the experiment Config. The loop state is a small
dataclass. Lengths vary as data, never as shapes, so N steps never retrace.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import progress
from kvjax.config import Config
from kvjax.decode import step
from kvjax.decode.step import Static

TRACES = {"prefill": 0, "decode": 0}  # incremented at trace time; tests count compilations


def bucket_for(static: "Static", live: int, steps: int, capacity: int) -> int:
  """The read bucket of one decode call of `steps` steps from a cache holding at most
  `live` tokens a sequence: in the accelerator program the smallest power of two that
  every step's live length stays within, so the call's one-block reads cover that many
  slots and its time follows what the cache holds; 0 (every slot) in the CPU program,
  whose reads stop at the live length anyway, or when the bucket would reach `capacity`.
  Each distinct bucket is one compile of `decode`."""
  if static.model.program != "accelerator":
    return 0
  b = 1 << max(live + steps - 1, 0).bit_length()  # the smallest power of two >= live + steps
  return 0 if b >= capacity else b


@dataclasses.dataclass(frozen=True)
class Sampler:
  temperature: float = 0.0   # 0: greedy
  top_k: int = 0             # 0: off
  top_p: float = 1.0         # 1: off

  @classmethod
  def from_config(cls, cfg: Config) -> "Sampler":
    w = cfg.workload
    return cls(w.temperature, w.top_k, w.top_p)

  def __call__(self, logits_BV: jax.Array, key: jax.Array) -> jax.Array:
    if self.temperature < 2.0**-126:  # 0, or below float32's smallest normal: greedy
      return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    # the best logit is 0 before dividing, so a tiny temperature sends the others to -inf
    # (greedy in the limit) and never the best one to inf
    logits = logits_BV.astype(jnp.float32)
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / self.temperature
    if self.top_k:
      kth = jax.lax.top_k(logits, min(self.top_k, logits.shape[-1]))[0][:, -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p < 1.0:
      sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]
      cum = jnp.cumsum(jax.nn.softmax(sorted_desc, axis=-1), axis=-1)
      # keep the smallest prefix whose mass reaches top_p (always at least one token)
      n_keep = jnp.sum(cum - jax.nn.softmax(sorted_desc, axis=-1) < self.top_p, axis=-1)
      cutoff = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
      logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@struct.dataclass
class LoopState:
  token: jax.Array   # [B] last sampled token
  done: jax.Array    # [B] bool: the sequence emitted eos
  cache: Any
  key: jax.Array


@functools.partial(jax.jit, static_argnames=("static", "sampler"), donate_argnames=("cache",))
def prefill(params, tokens_BT, lengths_B, cache, key, *, static: Static, sampler: Sampler):
  """Run the (right-padded, ragged) prompts; return the first sampled token, its logits
  and the cache. With `workload.prefill_chunk` N below the prompt's width, the prompt goes
  through the cache N tokens at a time (`chunked`)."""
  TRACES["prefill"] += 1
  N, T = static.prefill_chunk, tokens_BT.shape[1]
  if N and T > N:
    last_BV, cache = chunked(static, params, tokens_BT, lengths_B, cache, N)
    return sampler(last_BV, key), last_BV, cache
  positions_BT = step.positions(cache.lengths, lengths_B, T)
  out = step.run(static, params, tokens_BT, positions_BT, cache, logits="last")
  last_BV = out.logits[:, 0]
  return sampler(last_BV, key), last_BV, out.cache


def chunked(static: Static, params, tokens_BT, lengths_B, cache, N: int):
  """A prompt prefilled N tokens at a time: one `lax.scan` over its C = ceil(T / N) chunks
  whose body is the prefill of N tokens after what the cache holds (each chunk reads the
  earlier ones from the cache, through its codec), so a prompt's temporaries are those of
  N tokens whatever its length and the program is the same for every T. Each row's logits
  are those of the chunk holding its last token. Returns (logits [B, V], cache)."""
  B, T = tokens_BT.shape
  C = -(-T // N)
  tokens_CBN = jnp.swapaxes(jnp.pad(tokens_BT, ((0, 0), (0, C * N - T))).reshape(B, C, N), 0, 1)
  n_CB = jnp.clip(lengths_B[None, :] - N * jnp.arange(C, dtype=jnp.int32)[:, None], 0, N)

  def one(carry, xs):
    cache, last_BV = carry
    tokens_BN, n_B = xs
    out = step.run(static, params, tokens_BN, step.positions(cache.lengths, n_B, N), cache,
                   logits="last")
    if progress.wanted(T) and not progress.wanted(N):  # short chunks: one tick a chunk
      jax.debug.callback(progress.tick, n_B[0])
    return (out.cache, jnp.where((n_B > 0)[:, None], out.logits[:, 0], last_BV)), None

  last0_BV = jnp.zeros((B, static.model.vocab_size), jnp.float32)
  (cache, last_BV), _ = jax.lax.scan(one, (cache, last0_BV), (tokens_CBN, n_CB))
  return last_BV, cache


@functools.partial(jax.jit, static_argnames=("static", "sampler", "steps", "bucket", "logprobs"),
                   donate_argnames=("cache",))
def decode(params, cache, token_B, key, *, static: Static, sampler: Sampler, steps: int,
           bucket: int = 0, forced_BN=None, logprobs: bool = False):
  """`steps` decode steps in one `lax.scan`; returns the sampled tokens [B, steps] and
  the cache. The one token loop: generation, timing, task answers and teacher forcing all
  run it.

  `bucket` > 0 (`bucket_for`): the stored slots the accelerator program's reads cover;
  every sequence must hold fewer than `bucket - steps + 1` tokens when the call starts.
  `forced_BN` [B, steps]: the token each step feeds next, in place of the sampled one
  (teacher forcing; eos is then not special). `logprobs`: also return each step's
  log-probabilities [B, steps, V] (row i: of the token after the one step i fed)."""
  TRACES["decode"] += 1
  eos = -1 if forced_BN is not None else static.eos_id

  def one(state: LoopState, forced_B):
    out = step.run(static, params, state.token[:, None], state.cache.lengths[:, None],
                   state.cache, bucket=bucket)
    new_cache = out.cache
    key, sub = jax.random.split(state.key)
    nxt = sampler(out.logits[:, 0], sub) if forced_B is None else forced_B
    if eos >= 0:
      nxt = jnp.where(state.done, eos, nxt)
    done = state.done | (nxt == eos)
    ys = (nxt, jax.nn.log_softmax(out.logits[:, 0].astype(jnp.float32), axis=-1)) \
        if logprobs else nxt
    return LoopState(nxt, done, new_cache, key), ys

  done0 = token_B == eos if eos >= 0 else jnp.zeros_like(token_B, dtype=bool)
  xs = None if forced_BN is None else jnp.swapaxes(forced_BN, 0, 1)
  state, ys = jax.lax.scan(one, LoopState(token_B, done0, cache, key), xs, length=steps)
  if logprobs:
    return ys[0].T, jnp.swapaxes(ys[1], 0, 1), state.cache
  return ys.T, state.cache
