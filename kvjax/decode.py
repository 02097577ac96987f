"""Prefill and the decode loop: jit-compiled, cache donated, one compile per shape.

    prefill(params, tokens_BT, lengths_B, cache, key)  -> first token_B, cache
    decode(params, cache, token_B, key, steps)         -> tokens_BN, cache  (lax.scan)

Both go through the cache layout's `forward`, so `none` (recompute) and `contiguous`
(and later layouts) share this loop. The loop state is a small dataclass, as in Gemma's
sampler. Lengths vary as data, never as shapes, so N steps never retrace.
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
from kvjax.config import Config
from kvjax.model import Transformer

TRACES = {"prefill": 0, "decode": 0}  # incremented at trace time; tests count compilations


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


def network(cfg: Config, params, **kw) -> tuple[Transformer, Any]:
  """The network for these params. Split ones (`prepare_params`) run the switched layer
  scan (the default) or, when `model.unrolled`, the unrolled loop. Stacked ones run the
  nn.scan program, which copies every weight matrix on every step (kept as the reference
  the others are tested against), or are split here, inside the program, when unrolled."""
  if model_lib.unrolled(cfg.model):
    return Transformer(cfg.model, layer_loop="unrolled", **kw), model_lib.split_layers(params)
  if "layers" not in params:
    return Transformer(cfg.model, layer_loop="switch", **kw), params
  return Transformer(cfg.model, **kw), params


@functools.partial(jax.jit, static_argnames=("cfg", "sampler"), donate_argnames=("cache",))
def prefill(params, tokens_BT, lengths_B, cache, key, *, cfg: Config, sampler: Sampler):
  """Run the (right-padded, ragged) prompts; return the first sampled token and the cache."""
  TRACES["prefill"] += 1
  T = tokens_BT.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  positions_BT = jnp.where(t < lengths_B[:, None], cache.lengths[:, None] + t, -1)
  model, params = network(cfg, params, logits_last=True)  # lm_head on each row's last token
  layout = cache_lib.LAYOUTS[cache.spec.layout]
  logits_B1V, cache = layout.forward(model, params, tokens_BT, positions_BT, cache)
  cache = sharding.constrain_cache(cache, cfg)  # keep the mesh layout (no-op on one device)
  last_BV = logits_B1V[:, 0]
  return sampler(last_BV, key), last_BV, cache


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "steps"),
                   donate_argnames=("cache",))
def decode(params, cache, token_B, key, *, cfg: Config, sampler: Sampler, steps: int):
  """`steps` decode steps in one `lax.scan`; returns the sampled tokens [B, steps]."""
  TRACES["decode"] += 1
  model, params = network(cfg, params)
  layout = cache_lib.LAYOUTS[cache.spec.layout]
  eos = cfg.workload.eos_id

  def step(state: LoopState, _):
    positions_B1 = state.cache.lengths[:, None]
    logits, new_cache = layout.forward(model, params, state.token[:, None], positions_B1,
                                       state.cache)
    new_cache = sharding.constrain_cache(new_cache, cfg)
    key, sub = jax.random.split(state.key)
    nxt = sampler(logits[:, 0], sub)
    if eos >= 0:
      nxt = jnp.where(state.done, eos, nxt)
    done = state.done | (nxt == eos)
    return LoopState(nxt, done, new_cache, key), nxt

  done0 = token_B == eos if eos >= 0 else jnp.zeros_like(token_B, dtype=bool)
  state, toks_NB = jax.lax.scan(step, LoopState(token_B, done0, cache, key), None, length=steps)
  return toks_NB.T, state.cache


# `generate` and its host checks live in kvjax.program (which imports this module); they
# stay importable from here, where the CLI and the tests have always found them.
_PROGRAM = ("generate", "pad_prompts", "check_request")


def __getattr__(name: str):
  if name in _PROGRAM:
    from kvjax import program
    return getattr(program, name)
  raise AttributeError(f"module 'kvjax.decode' has no attribute '{name}'")
