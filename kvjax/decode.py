"""Prefill and the decode loop: jit-compiled, cache donated, one compile per shape.

    prefill(params, tokens_BT, lengths_B, cache, key, spec=, sampler=)  -> token_B, logits, cache
    decode(params, cache, token_B, key, spec=, sampler=, steps=)         -> tokens_BN, cache

Both make one model call per step through `forward`: the model reads and writes the cache
through its layout (`kvjax.cache`), or, for layout `none`, `forward` recomputes the whole
prefix (the recompute mode). What jit hashes is `Static` (model, cache and mesh configs,
eos) and the `Sampler`, never the experiment Config. The loop state is a small dataclass.
Lengths vary as data, never as shapes, so N steps never retrace. `kvjax.program` places,
compiles and runs these two for every driver (generate, the timers, the experiments).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import cache as cache_lib
from kvjax import model as model_lib
from kvjax import sharding
from kvjax.attention import base as attn_base
from kvjax.config import CacheConfig, Config, MeshConfig, ModelConfig
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
    """The spec of `cfg`, its `model.program` resolved (auto: per backend) on the host, so
    that what jit hashes names the program it compiles."""
    return cls(resolved(cfg.model), cfg.cache, cfg.mesh, cfg.workload.eos_id)


def resolved(m: ModelConfig) -> ModelConfig:
  """`m` with `program` resolved to `cpu` or `accelerator` (`attention.base.program`)."""
  prog = attn_base.program(m.program)
  return m if m.program == prog else dataclasses.replace(m, program=prog)


def bucket_for(spec: "Static", live: int, steps: int, capacity: int) -> int:
  """The read bucket of one decode call of `steps` steps from a cache holding at most
  `live` tokens a sequence: in the accelerator program the smallest power of two that
  every step's live length stays within, so the call's one-block reads cover that many
  slots and its time follows what the cache holds; 0 (every slot) in the CPU program,
  whose reads stop at the live length anyway, or when the bucket would reach `capacity`.
  Each distinct bucket is one compile of `decode`."""
  if spec.model.program != "accelerator":
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


def prepare_params(cfg: Config, params):
  """Params as the compiled programs want them: in the CPU program split per layer once,
  here (`model.split_layers`), so that no call pays for the split and no step copies a
  weight (`model.switched_layers`, or the unrolled loop when `model.unrolled`); in the
  accelerator program (`model.program`) left stacked for nn.scan (see below); and stored in
  `model.param_dtype` whatever their source (an imported checkpoint keeps its own dtype
  until here). A second copy of the layer weights for as long as the caller also keeps
  the stacked ones; params already split and in that dtype come back as they are."""
  dtype = jnp.dtype(cfg.model.param_dtype)
  if attn_base.program(cfg.model.program) == "accelerator" and \
      not model_lib.unrolled(cfg.model) and cfg.model.attention != "pallas":
    # The accelerator program keeps the stacked params and runs nn.scan: slicing a layer's
    # weights is fused into its matmuls there, while the switched scan's conditionals would each
    # copy their branch index to the host and sync (30 a step at SmolLM2's depth). The
    # Pallas kernel inside nn.scan failed Flax's loop-invariance check on the H200
    # (docs/gpu.md), so `pallas` keeps the switched scan.
    if "layers" in params:
      return _prepare(dtype.name, split=False)(params)
  if "layers" not in params and all(a.dtype == dtype for a in jax.tree.leaves(params)
                                    if jnp.issubdtype(a.dtype, jnp.floating)):
    return params
  return _prepare(dtype.name, split=True)(params)


@functools.lru_cache(maxsize=8)
def _prepare(dtype_name: str, split: bool):
  """One jitted cast of the floating params to `dtype_name` (after splitting them per layer
  when `split`) per dtype, so a second model of a shape seen before (the CLI, experiments,
  tests) reuses its compiled program instead of tracing a new function."""
  dtype = jnp.dtype(dtype_name)

  def cast(a):
    return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
  return jax.jit(lambda p: jax.tree.map(cast, model_lib.split_layers(p) if split else p))


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
  with sharding.visible(spec):
    logits_B1V, cache = forward(model, params, tokens_BT, positions_BT, cache)
  cache = sharding.constrain_cache(cache, spec)  # keep the mesh layout (no-op on one device)
  last_BV = logits_B1V[:, 0]
  return sampler(last_BV, key), last_BV, cache


@functools.partial(jax.jit, static_argnames=("spec", "sampler", "steps", "bucket"),
                   donate_argnames=("cache",))
def decode(params, cache, token_B, key, *, spec: Static, sampler: Sampler, steps: int,
           bucket: int = 0):
  """`steps` decode steps in one `lax.scan`; returns the sampled tokens [B, steps].
  `bucket` > 0 (`bucket_for`): the stored slots the accelerator program's reads cover;
  every sequence must hold fewer than `bucket - steps + 1` tokens when the call starts."""
  TRACES["decode"] += 1
  model, params = network(spec, params, read_bucket=bucket)
  eos = spec.eos_id

  def step(state: LoopState, _):
    positions_B1 = state.cache.lengths[:, None]
    with sharding.visible(spec):
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
