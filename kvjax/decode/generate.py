"""Placement, compiled prefill and decode, fresh caches, timed runs: `generate` (the call
`kvjax generate` and `Model.generate` reach through `kvjax.faces.report`, which also reads
their prompts and writes the result they print) and `Compiled`, which every timer goes
through. Generation stops at the stop tokens it is given (the model's EOS and end-of-turn
ids, kvjax.io.chat, unless the caller asks for none).

The drivers that compile prefill and decode ahead of time go through `Compiled`
(`generate` below, the lab's `DecodeTimer`, the roofline and peer experiments,
scripts/bench_prefill.py and bench_sharding.py; the serving engine through `statics` and
`Placement`):

    prog = Compiled(cfg, params, Shape(batch, width, capacity, steps)).compile(tokens, lengths)
    run = prog.run()        # run.tokens(), run.cache, run.prefill_s, run.decode_s

  placement  with more than one device in `mesh.*`, params, prompts and every cache are
             laid out on the mesh (kvjax.decode.sharding) and jit follows; params are
             then prepared once (`step.prepare_params`);
  compile    prefill (through the compaction of `cache.policy` when it is not `full`,
             kvjax.decode.evict) and `steps` decode steps, ahead of time: `compile_s`
             (both programs; decode is lowered on the shapes prefill returns, so nothing
             runs), `peak_bytes` (footprint.program_bytes);
  run        a fresh cache every time, allocated before the clock starts (both programs
             donate it); prefill, then decode, each blocked on and timed.

A shape of width 0 compiles no prefill: decode starts from a fresh cache whose lengths say
it already holds `context` tokens (zeros: decode speed does not depend on values).

`statics` (`kvjax.decode.step.statics`) builds the static keyword arguments of every call
of a jitted program (decode.prefill, decode.decode, evict.prefill, the serving step): the
narrow `step.Static` and the sampler, never the experiment Config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import decode, footprint, inputs, progress
from kvjax.config import Config
from kvjax.decode import evict, sharding, step
from kvjax.errors import ArgError, KvjaxError


statics = step.statics  # the static keyword arguments of every jitted program's call


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  width: int          # prompt width T; 0: no prefill (decode from a filled cache)
  capacity: int       # cache slots per sequence
  steps: int = 0      # decode steps after the first token; 0: no decode program
  context: int = 0    # tokens a fresh cache holds when there is no prefill


@dataclasses.dataclass
class Run:
  """One prefill + decode: device outputs and seconds (ttft = prefill + first sample)."""

  first: jax.Array          # [B] the token prefill sampled (the input token when filled)
  rest: jax.Array | None    # [B, steps] decoded tokens, None without a decode program
  cache: Any
  prefill_s: float
  decode_s: float
  logits: jax.Array | None = None  # [B, V] prefill's logits of each row's last prompt token

  def tokens(self) -> np.ndarray:
    """[B, 1 + steps] on the host (gathered from every process of a multi-host mesh)."""
    first = sharding.to_host(self.first)[:, None]
    if self.rest is None:
      return first
    return np.concatenate([first, sharding.to_host(self.rest)], axis=1)


class Compiled:
  """Compiled prefill and decode for one config, params and `Shape`, on its placement.

  `keys` = (prefill key, decode key), both `PRNGKey(cfg.seed)` unless given."""

  def __init__(self, cfg: Config, params, shape: Shape, *, keys: tuple | None = None):
    self.cfg, self.shape = cfg, shape
    self.sampler = decode.Sampler.from_config(cfg)
    key = jax.random.PRNGKey(cfg.seed)
    self.keys = tuple(keys) if keys is not None else (key, key)
    self.place = sharding.Placement(cfg, shape.batch)
    self.params = step.prepare_params(cfg, self.place.params(params))
    self.pre = self.dec = self.token = self.prompts = None
    self.bucket = 0  # slots decode's reads cover (`decode.bucket_for`; 0: all)
    self.compile_s = 0.0

  def fresh(self):
    s = self.shape
    return self.place.cache(s.batch, s.capacity, 0 if s.width else s.context)

  def compile(self, tokens_BT=None, lengths_B=None) -> "Compiled":
    """Lower and compile prefill on these prompts (a `cache.policy` checks their lengths
    here) and decode on the cache that prefill returns; with width 0, decode only."""
    s, cfg, kw = self.shape, self.cfg, statics(self.cfg, self.sampler)
    t0 = time.perf_counter()
    if s.width:
      self.prompts = (self.place.batch(tokens_BT), self.place.batch(lengths_B))
      prefill = evict.prefill_for(cfg, decode.prefill)
      cache = self.fresh()
      self.pre = prefill.lower(self.params, *self.prompts, cache, self.keys[0], **kw).compile()
      if s.steps > 0:  # decode is lowered on what prefill returns (compaction reshapes it):
        # its shapes and shardings, so compiling runs no prefill (a long prompt's costs minutes)
        self.token, _, cache = self.pre.out_info
    else:
      self.token, cache = self.place.full(s.batch, 0), self.fresh()
    if s.steps > 0:  # the accelerator program reads a bucket of slots, not the capacity
      kw = statics(cfg, self.sampler, steps=s.steps)
      self.bucket = decode.bucket_for(kw["static"], s.width or s.context, s.steps, s.capacity)
      self.dec = decode.decode.lower(self.params, cache, self.token, self.keys[1], **kw,
                                     bucket=self.bucket).compile()
    self.compile_s = time.perf_counter() - t0
    return self

  @property
  def peak_bytes(self) -> int | None:
    return footprint.program_bytes(*(p for p in (self.pre, self.dec) if p is not None))

  def run(self, tokens_BT=None, lengths_B=None) -> Run:
    """Prefill (the compiled prompts unless others of the same shape are given) and decode
    once, on a fresh cache allocated before the clock starts."""
    if self.pre is None and self.dec is None:
      raise RuntimeError("Compiled.run before Compiled.compile")
    prompts = self.prompts if tokens_BT is None else (self.place.batch(tokens_BT),
                                                       self.place.batch(lengths_B))
    c = self.fresh()
    t0 = time.perf_counter()
    tok, logits = self.token, None
    if self.pre is not None:
      tok, logits, c = self.pre(self.params, *prompts, c, self.keys[0])
      jax.block_until_ready((tok, c))
    t1 = time.perf_counter()
    rest = None
    if self.dec is not None:
      rest, c = self.dec(self.params, c, tok, self.keys[1])
      jax.block_until_ready((rest, c))
    t2 = time.perf_counter()
    return Run(tok, rest, c, t1 - t0, t2 - t1, logits)


# -- generate: ragged prompts in, new tokens out ----------------------------------------------
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
    raise ArgError("max_new_tokens", f"{{arg}} must be >= 1, got {max_new_tokens}")
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


def generate(cfg: Config, params, prompts: list[list[int]], max_new_tokens: int,
             seed: int | None = None, timed: bool = True, return_cache: bool = False,
             stop=()) -> dict:
  """Prefill + decode for a batch of ragged prompts.

  Both programs are compiled ahead of time (reported as `compile_s`), run once to warm
  up (unless `timed` is False: one run), then timed: `ttft_s` is prefill + first sample,
  `tpot_s` the decode loop time per token. Returns new tokens per sequence (cut after the first stop token: `workload.eos_id`
  and the ids in `stop`), cache bytes and timings (and the
  final cache under "cache" with `return_cache`). With more than one device in `cfg.mesh`
  the parameters, prompts and cache are laid out on the mesh first (kvjax.decode.sharding).
  """
  capacity = cfg.cache.capacity or max(len(p) for p in prompts) + max_new_tokens
  check_request(cfg, prompts, max_new_tokens, capacity)
  tokens, lengths = pad_prompts(prompts)
  keys = tuple(jax.random.split(jax.random.PRNGKey(cfg.seed if seed is None else seed)))
  steps = max_new_tokens - 1
  shape = Shape(len(prompts), tokens.shape[1], capacity, steps)
  prog = Compiled(cfg, params, shape, keys=keys).compile(tokens, lengths)
  n, unit = progress.ticks(shape.width, cfg.workload.prefill_chunk, cfg.model.n_layers)
  bar = progress.layers(n * (1 + timed), unit=unit) if n else contextlib.nullcontext()
  with bar:  # a long prompt's prefill ticks once a layer or chunk (warm-up and timed run)
    if timed:
      prog.run()  # warm-up: first executions pay one-time costs
    run = prog.run()
  if run.logits is not None and not sharding.to_host(jnp.all(jnp.isfinite(run.logits))):
    raise KvjaxError("the forward pass produced non-finite logits (NaN or inf), so no tokens "
                     "are printed; check the weights and model.rope_theta, model.norm_eps, "
                     "model.dtype")
  stops = set(stop) | ({cfg.workload.eos_id} if cfg.workload.eos_id >= 0 else set())
  seqs = []
  for row in run.tokens().tolist():
    end = next((i for i, t in enumerate(row) if t in stops), None)
    seqs.append(row if end is None else row[:end + 1])
  extra = {"cache": run.cache} if return_cache else {}
  return {
      **extra,
      "tokens": seqs,
      "cache_bytes": cache_lib.tree_bytes(run.cache),
      "cache_bytes_per_device": sharding.measured_device_bytes(run.cache),
      "ttft_s": run.prefill_s,
      "tpot_s": run.decode_s / steps if steps > 0 else 0.0,
      "compile_s": prog.compile_s,
      "capacity": capacity,
  }
