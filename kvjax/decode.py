"""Prefill and the decode loop: jit-compiled, cache donated, one compile per shape.

    prefill(params, tokens_BT, lengths_B, cache, key, spec=, sampler=)  -> token_B, logits, cache
    decode(params, cache, token_B, key, spec=, sampler=, steps=)         -> tokens_BN, cache

Both make one model call per step through `forward`: the model reads and writes the cache
through its layout (`kvjax.cache`), or, for layout `none`, `forward` recomputes the whole
prefix (the recompute mode). What jit hashes is `Static` (model, cache and mesh configs,
eos) and the `Sampler`, never the experiment Config. The loop state is a small dataclass,
as in Gemma's sampler. Lengths vary as data, never as shapes, so N steps never retrace.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import cache as cache_lib
from kvjax import evict
from kvjax import model as model_lib
from kvjax import sharding
from kvjax.config import CacheConfig, Config, MeshConfig, ModelConfig
from kvjax.errors import KvjaxError
from kvjax.model import Transformer

TRACES = {"prefill": 0, "decode": 0}  # incremented at trace time; tests count compilations


@dataclasses.dataclass(frozen=True)
class Static:
  """What the compiled programs depend on, and all that jit hashes besides the sampler:
  the model, the cache config (layout, codecs, policy), the mesh and the eos id. A change
  to anything else in an experiment's Config (train, grid, params, name) never retraces."""

  model: ModelConfig
  cache: CacheConfig
  mesh: MeshConfig
  eos_id: int = -1

  @classmethod
  def of(cls, cfg: Config) -> "Static":
    return cls(cfg.model, cfg.cache, cfg.mesh, cfg.workload.eos_id)


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
    if self.temperature == 0.0:
      return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV.astype(jnp.float32) / self.temperature
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


def prepare_params(cfg: Config, params):
  """Params as the compiled programs want them: split per layer once, here
  (`model.split_layers`), so that no call pays for the split and no step copies a weight
  (`model.switched_layers`, or the unrolled loop when `model.unrolled`), and stored in
  `model.param_dtype` whatever their source (an imported checkpoint keeps its own dtype
  until here). A second copy of the layer weights for as long as the caller also keeps
  the stacked ones; params already split and in that dtype come back as they are."""
  dtype = jnp.dtype(cfg.model.param_dtype)

  def cast(a):
    return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

  if "layers" not in params and all(a.dtype == dtype for a in jax.tree.leaves(params)
                                    if jnp.issubdtype(a.dtype, jnp.floating)):
    return params
  return jax.jit(lambda p: jax.tree.map(cast, model_lib.split_layers(p)))(params)


def network(cfg: Config | Static, params, **kw) -> tuple[Transformer, Any]:
  """The network of `cfg.model` for these params. Split ones (`prepare_params`) run the switched layer
  scan (the default) or, when `model.unrolled`, the unrolled loop. Stacked ones run the
  nn.scan program, which copies every weight matrix on every step (kept as the reference
  the others are tested against), or are split here, inside the program, when unrolled."""
  if model_lib.unrolled(cfg.model):
    return Transformer(cfg.model, layer_loop="unrolled", **kw), model_lib.split_layers(params)
  if "layers" not in params:
    return Transformer(cfg.model, layer_loop="switch", **kw), params
  return Transformer(cfg.model, **kw), params


def forward(model: Transformer, params, tokens_BT, positions_BT, cache):
  """One model call that reads and writes `cache`: `(logits, cache)`. With layout `none`
  (a `TokenBuffer`) this is the recompute mode: the ids are appended and the whole prefix
  runs again, logits kept only where wanted (each row's last token with `logits_last`,
  else this call's T positions), never at all S recomputed positions."""
  if cache.spec.layout != "none":
    return model.apply({"params": params}, tokens_BT, positions_BT, cache)
  buf = cache_lib.get("none").write(cache, tokens_BT, positions_BT)
  S = buf.tokens.shape[1]
  pos_S = jnp.arange(S, dtype=jnp.int32)
  pos_BS = jnp.where(pos_S[None, :] < buf.lengths[:, None], pos_S[None, :], -1)
  at = None if model.logits_last else jnp.clip(positions_BT, 0, S - 1)
  logits_BTV, _ = model.apply({"params": params}, buf.tokens, pos_BS, None, logits_at=at)
  return logits_BTV, buf


@functools.partial(jax.jit, static_argnames=("spec", "sampler"), donate_argnames=("cache",))
def prefill(params, tokens_BT, lengths_B, cache, key, *, spec: Static, sampler: Sampler):
  """Run the (right-padded, ragged) prompts; return the first sampled token, its logits
  and the cache."""
  TRACES["prefill"] += 1
  T = tokens_BT.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  positions_BT = jnp.where(t < lengths_B[:, None], cache.lengths[:, None] + t, -1)
  model, params = network(spec, params, logits_last=True)  # lm_head on each row's last token
  logits_B1V, cache = forward(model, params, tokens_BT, positions_BT, cache)
  cache = sharding.constrain_cache(cache, spec)  # keep the mesh layout (no-op on one device)
  last_BV = logits_B1V[:, 0]
  return sampler(last_BV, key), last_BV, cache


@functools.partial(jax.jit, static_argnames=("spec", "sampler", "steps"),
                   donate_argnames=("cache",))
def decode(params, cache, token_B, key, *, spec: Static, sampler: Sampler, steps: int):
  """`steps` decode steps in one `lax.scan`; returns the sampled tokens [B, steps]."""
  TRACES["decode"] += 1
  model, params = network(spec, params)
  eos = spec.eos_id

  def step(state: LoopState, _):
    positions_B1 = state.cache.lengths[:, None]
    logits, new_cache = forward(model, params, state.token[:, None], positions_B1, state.cache)
    new_cache = sharding.constrain_cache(new_cache, spec)
    key, sub = jax.random.split(state.key)
    nxt = sampler(logits[:, 0], sub)
    if eos >= 0:
      nxt = jnp.where(state.done, eos, nxt)
    done = state.done | (nxt == eos)
    return LoopState(nxt, done, new_cache, key), nxt

  done0 = token_B == eos if eos >= 0 else jnp.zeros_like(token_B, dtype=bool)
  state, toks_NB = jax.lax.scan(step, LoopState(token_B, done0, cache, key), None, length=steps)
  return toks_NB.T, state.cache


def pad_prompts(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad ragged prompts into [B, T] ids and [B] lengths."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise KvjaxError("every prompt needs at least one token")
  T = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), T), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, np.array([len(p) for p in prompts], np.int32)


def check_request(cfg: Config, prompts: list[list[int]], max_new_tokens: int,
                  capacity: int) -> None:
  """Shape-level limits, checked on the host before anything is traced."""
  if max_new_tokens < 1:
    raise KvjaxError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
  V = cfg.model.vocab_size
  for p in prompts:
    bad = [t for t in p if not 0 <= t < V]
    if bad:
      raise KvjaxError(f"token id {bad[0]} is outside the vocabulary [0, {V}); "
                       "fix the prompt ids or model.vocab_size")
  need = max(len(p) for p in prompts) + max_new_tokens
  if need > capacity:
    raise KvjaxError(f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens "
                     f"({max_new_tokens}) = {need} exceeds the cache capacity {capacity}; "
                     "raise cache.capacity or shorten the request")
  if need > cfg.model.max_seq_len:
    raise KvjaxError(f"{need} tokens exceed model.max_seq_len={cfg.model.max_seq_len}; "
                     "shorten the request")


def _block(x):
  return jax.block_until_ready(x)


def generate(cfg: Config, params, prompts: list[list[int]], max_new_tokens: int,
             seed: int | None = None, timed: bool = True, return_cache: bool = False) -> dict:
  """Prefill + decode for a batch of ragged prompts.

  Both programs are compiled ahead of time (reported as `compile_s`), run once to warm
  up, then timed: `ttft_s` is prefill + first sample, `tpot_s` the decode loop time per
  token. Returns new tokens per sequence (cut after eos), cache bytes and timings (and the
  final cache under "cache" with `return_cache`). With more than one device in `cfg.mesh`
  the parameters, prompts and cache are laid out on the mesh first (kvjax.sharding).
  """
  capacity = cfg.cache.capacity or max(len(p) for p in prompts) + max_new_tokens
  check_request(cfg, prompts, max_new_tokens, capacity)
  tokens, lengths = pad_prompts(prompts)
  sampler = Sampler.from_config(cfg)
  key = jax.random.PRNGKey(cfg.seed if seed is None else seed)
  k_prefill, k_decode = jax.random.split(key)
  steps = max_new_tokens - 1
  B = len(prompts)
  fresh = lambda: cache_lib.init_cache(cfg, B, capacity)  # noqa: E731
  if sharding.is_sharded(cfg):  # params, prompts and cache laid out on the mesh; jit follows
    mesh = sharding.make_mesh(cfg)
    sharding.check_batch(cfg, B)
    params = sharding.shard_params(params, cfg, mesh)
    tokens, lengths = sharding.put_batch(tokens, mesh), sharding.put_batch(lengths, mesh)
    fresh = lambda: sharding.init_cache(cfg, B, capacity, mesh)  # noqa: E731
  params = prepare_params(cfg, params)

  t0 = time.perf_counter()
  c0 = fresh()
  # cache.policy other than full: prefill, then compact to the budget (kvjax.evict)
  program, spec = evict.prefill_program(cfg, prefill), Static.of(cfg)
  pre = program.lower(params, tokens, lengths, c0, k_prefill, spec=spec, sampler=sampler).compile()
  tok0, _, c1 = pre(params, tokens, lengths, c0, k_prefill)
  dec = decode.lower(params, c1, tok0, k_decode, spec=spec, sampler=sampler,
                     steps=max(steps, 0)).compile() if steps > 0 else None
  compile_s = time.perf_counter() - t0
  _block(c1)

  def run():
    c = _block(fresh())
    ta = time.perf_counter()
    tok, _, c = pre(params, tokens, lengths, c, k_prefill)
    _block(tok)
    tb = time.perf_counter()
    rest = np.zeros((B, 0), np.int32)
    if dec is not None:
      rest, c = dec(params, c, tok, k_decode)
      _block(rest)
    tc = time.perf_counter()
    return (np.concatenate([sharding.to_host(tok)[:, None], sharding.to_host(rest)], 1), c,
            tb - ta, tc - tb)

  if timed:
    run()  # warm-up: first executions pay one-time costs
  out, final_cache, ttft, decode_s = run()
  seqs = []
  for row in out.tolist():
    if cfg.workload.eos_id >= 0 and cfg.workload.eos_id in row:
      row = row[:row.index(cfg.workload.eos_id) + 1]
    seqs.append(row)
  extra = {"cache": final_cache} if return_cache else {}
  return {
      **extra,
      "tokens": seqs,
      "cache_bytes": cache_lib.tree_bytes(final_cache),
      "cache_bytes_per_device": sharding.measured_device_bytes(final_cache),
      "ttft_s": ttft,
      "tpot_s": decode_s / steps if steps > 0 else 0.0,
      "compile_s": compile_s,
      "capacity": capacity,
  }
