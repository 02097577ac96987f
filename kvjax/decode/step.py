"""One step through the cache: the model over T new tokens against a cache.

    out = step.run(static, params, tokens_BT, positions_BT, cache, logits=, queries=, bucket=)
    out.logits, out.cache, out.queries

Every program that calls the model through a cache calls `run` inside its own jit: prefill
and the decode loop (kvjax.decode), prefill with a policy's capture (kvjax.decode.evict),
and in the lab streamed evaluation (kvjax.lab.evaluate), task prefixes, tails and answers
(kvjax.lab.tasks.through_cache) and the serving step (kvjax.lab.serve.device); the timers
time those programs. So there is one layer-loop choice (`layer_loop`), one position rule
(`positions`), one recompute path (layout `none`) and one place that builds what jit
hashes (`statics`, whose `Static` holds the model, cache and mesh configs).
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
from kvjax.attention import base as attn_base
from kvjax.config import CacheConfig, Config, MeshConfig, ModelConfig
from kvjax.decode import sharding
from kvjax.errors import KvjaxError
from kvjax.model import Transformer


@dataclasses.dataclass(frozen=True)
class Static:
  """What the compiled programs depend on, and all that jit hashes besides the sampler:
  the model, the cache config (layout, codecs, policy), the mesh, the eos id and the
  prefill's chunk. A change to anything else in an experiment's Config (train, grid,
  params, name) never retraces."""

  model: ModelConfig
  cache: CacheConfig
  mesh: MeshConfig
  eos_id: int = -1
  prefill_chunk: int = 0  # `workload.prefill_chunk` (kvjax.decode.prefill)

  @classmethod
  def of(cls, cfg: Config) -> "Static":
    """The Static of `cfg`, its `model.program` resolved (auto: per backend) on the host, so
    that what jit hashes names the program it compiles."""
    return cls(resolved(cfg.model), cfg.cache, cfg.mesh, cfg.workload.eos_id,
               cfg.workload.prefill_chunk)


def resolved(m: ModelConfig) -> ModelConfig:
  """`m` with `program` resolved to `cpu` or `accelerator` (`attention.base.program`) and
  `layer_loop` to the loop it runs (`layer_loop`)."""
  prog = attn_base.program(m.program)
  m = m if m.program == prog else dataclasses.replace(m, program=prog)
  loop = layer_loop(m)
  return m if m.layer_loop == loop else dataclasses.replace(m, layer_loop=loop)


def layer_loop(m: ModelConfig) -> str:
  """How the layers run, decided here only: `model.layer_loop` when set, else `unrolled`
  (a Python loop over per-layer weights) when `model.unrolled`; `scan` (nn.scan over the
  stacked params) in the accelerator program, where slicing a layer's weights is fused into
  its matmuls while the switched scan's conditionals would each copy their branch index to
  the host and sync once per layer; `switch` (one lax.scan over per-layer weights, none
  copied: `model.switched_layers`) in the CPU program, and for `pallas`, whose kernel inside
  nn.scan failed Flax's loop-invariance check on the H200 (docs/gpu.md)."""
  if m.layer_loop != "auto":
    return m.layer_loop
  if model_lib.unrolled(m):
    return "unrolled"
  if attn_base.program(m.program) == "accelerator" and m.attention != "pallas":
    return "scan"
  return "switch"


def statics(cfg: Config, sampler=None, **extra) -> dict:
  """Static keyword arguments of a jitted program's call: its `static` (`Static.of(cfg)`),
  the sampler when it samples, and `extra` (decode's `steps`, the serving step's widths).
  Every call site builds them here."""
  return {"static": Static.of(cfg), **({} if sampler is None else {"sampler": sampler}), **extra}


def positions(start_B, lengths_B, T: int):
  """Positions [B, T] of T right-padded new tokens per row: `start_B` (what the cache holds)
  onwards for the row's first `lengths_B` tokens, -1 (never stored, never attended) after."""
  t_1T = jnp.arange(T, dtype=jnp.int32)[None, :]
  return jnp.where(t_1T < lengths_B[:, None], start_B[:, None] + t_1T, -1)


def prepare_params(cfg: Config | Static, params):
  """Params in the form the layer loop (`layer_loop`) runs: split per layer once, here
  (`model.split_layers`), for the switched and unrolled loops, so that no call pays for
  the split and no step copies a weight; left stacked for nn.scan; and stored in
  `model.param_dtype` whatever their source (an imported checkpoint keeps its own dtype
  until here). Only what changes is copied: the layers' weights when they are split (a
  second copy for as long as the caller also keeps the stacked ones: `memory.split_bytes`)
  and a leaf of another dtype; every other leaf comes back as it is."""
  dtype = jnp.dtype(cfg.model.param_dtype)
  split = layer_loop(cfg.model) != "scan" and "layers" in params
  if not split and not any(_recast(a, dtype) for a in jax.tree.leaves(params)):
    return params
  out = {}
  for name, sub in params.items():
    if split and name == "layers":
      out.update(_prepare(dtype.name, split=True)({"layers": sub}))
    elif any(_recast(a, dtype) for a in jax.tree.leaves(sub)):
      out[name] = _prepare(dtype.name, split=False)(sub)
    else:
      out[name] = sub
  return out


def _recast(a, dtype) -> bool:
  return jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype


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
  """The network of `cfg.model` running its `layer_loop`, and the params in that loop's
  form: stacked params given to the switched or unrolled loop are split here, inside the
  program (each call then copies the weights: `prepare_params` splits them once instead);
  params split per layer cannot run nn.scan (a one-line error)."""
  loop = layer_loop(cfg.model)
  stacked = "layers" in params
  if loop == "scan":
    if not stacked:
      raise KvjaxError("these params are split per layer (step.prepare_params of another "
                       "layer loop), and model.layer_loop=scan runs nn.scan over stacked "
                       "params; prepare them with this config, or pass the stacked params")
    return Transformer(cfg.model, **kw), params
  return (Transformer(cfg.model, layer_loop=loop, **kw),
          model_lib.split_layers(params) if stacked else params)


@struct.dataclass
class Out:
  """What one step returns: logits [B, n, V] (float32; n = T, 1 for `logits="last"`, or the
  indices asked for), the new cache, and the new tokens' rotated queries [L, B, T, H, D]
  (in the basis the cache stores keys in) when asked, else None. A pytree, so a jitted
  program may return it whole."""

  logits: jax.Array
  cache: Any
  queries: jax.Array | None = None


def run(static: Static, params, tokens_BT, positions_BT, cache, *, logits="all",
        queries: bool = False, bucket: int = 0) -> Out:
  """The model over `tokens_BT` at `positions_BT` (-1: padding) against `cache`, which it
  reads and writes through its layout. `logits`: "all" (this call's T positions), "last"
  (each row's last valid token: the lm_head, the largest matmul of a prompt, runs once a
  row) or an int array [B, n] of token indices into this call. `queries`: also return the
  new tokens' rotated queries (what a policy scoring by attention selects with). `bucket`
  > 0: the stored slots the accelerator program's reads cover (`decode.bucket_for`).

  With layout `none` (a token buffer) this is the recompute mode: the ids are appended and
  the whole prefix runs again, logits kept only where wanted, never at all S positions.
  On a mesh (`mesh.*`) the read runs per device and the cache keeps its layout."""
  last = isinstance(logits, str) and logits == "last"
  at = None if isinstance(logits, str) else logits
  model, params = network(static, params, logits_last=last, read_bucket=bucket,
                          return_queries=queries)
  with sharding.visible(static):
    if not cache_lib.get(cache.spec.layout).recomputes:
      res = model.apply({"params": params}, tokens_BT, positions_BT, cache, logits_at=at)
    else:
      buf = cache_lib.get("none").write(cache, tokens_BT, positions_BT)
      S = buf.tokens.shape[1]
      pos_S = jnp.arange(S, dtype=jnp.int32)
      pos_BS = jnp.where(pos_S[None, :] < buf.lengths[:, None], pos_S[None, :], -1)
      if at is not None:  # indices into this call's tokens -> into the buffer
        at = jnp.take_along_axis(jnp.clip(positions_BT, 0, S - 1), at.astype(jnp.int32), 1)
      elif not last:  # ("last": the model's own rule, each row's last valid buffer token)
        at = jnp.clip(positions_BT, 0, S - 1)
      res = model.apply({"params": params}, buf.tokens, pos_BS, None, logits_at=at)
      res = (res[0], buf, *res[2:])
  logits_BnV, new_cache, *q = res
  new_cache = sharding.constrain_cache(new_cache, static)  # no-op on one device
  return Out(logits_BnV, new_cache, q[0] if q else None)
