"""Quality measured *through* the cache.

`stream_logprobs` feeds a sequence chunk by chunk (chunk=1: token by token, exactly like
decode) into a cache of the configured layout and codec; each chunk's positions continue
from `cache.lengths`, so every earlier token is read back from the encoded cache and only
the chunk's own tokens are fresh. With the fp32 cache this equals the teacher-forced full
forward pass (tests/test_quality.py holds the harness to that), so any difference under
another codec is the codec's.

Metrics against the same model with an fp32 cache, on the same tokens:
  ppl        exp(mean next-token NLL) through the tested cache; ppl_ref through fp32
  kl         mean KL(p_ref || p_codec) of the next-token distributions (nats)
  agreement  fraction of positions whose greedy (argmax) token matches the reference's,
             along a fixed continuation (teacher-forced, so one early flip does not
             poison the rest)
  recall     accuracy on associative-recall answers (kvjax.data) at a given context
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import data
from kvjax.config import Config
from kvjax.errors import KvjaxError
from kvjax.model import Transformer


def reference_config(cfg: Config) -> Config:
  """The same model with a plain fp32 contiguous cache: the baseline every codec is held to."""
  ref = dataclasses.replace(cfg, cache=config_lib.CacheConfig(layout="contiguous",
                                                              capacity=cfg.cache.capacity))
  return config_lib.validate(config_lib.resolve(ref))


@functools.partial(jax.jit, static_argnames=("model_cfg", "chunk"))
def _stream(params, tokens_BN, valid_BN, cache, *, model_cfg, chunk: int):
  """Compiled per model and chunk; the cache's static spec carries codec and layout."""
  B, N = tokens_BN.shape
  model = Transformer(model_cfg)
  layout = cache_lib.LAYOUTS[cache.spec.layout]
  toks = tokens_BN.reshape(B, N // chunk, chunk).swapaxes(0, 1)
  valid = valid_BN.reshape(B, N // chunk, chunk).swapaxes(0, 1)
  offs = jnp.arange(chunk, dtype=jnp.int32)

  def step(c, xs):
    tok_BC, valid_BC = xs
    positions = jnp.where(valid_BC, c.lengths[:, None] + offs, -1)
    logits, c = layout.forward(model, params, tok_BC, positions, c)
    return c, jax.nn.log_softmax(logits, axis=-1)

  c, lp = jax.lax.scan(step, cache, (toks, valid))
  return lp.swapaxes(0, 1).reshape(B, N, -1), c


def stream_logprobs(cfg: Config, params, tokens_BN, chunk: int = 1):
  """Log-probabilities [B, N, V] of each next token, computed through the cache.

  Returns (logprobs, cache bytes of the filled cache). Sequences are right-padded to a
  multiple of `chunk` with position -1 (never stored, never attended).
  """
  tokens_BN = np.asarray(tokens_BN, np.int32)
  B, N = tokens_BN.shape
  if chunk <= 0:
    raise KvjaxError(f"chunk must be positive, got {chunk}")
  if N > cfg.model.max_seq_len:
    raise KvjaxError(f"{N} tokens exceed model.max_seq_len={cfg.model.max_seq_len}; "
                     "evaluate a shorter context")
  pad = (-N) % chunk
  tok = np.pad(tokens_BN, ((0, 0), (0, pad)))
  valid = np.arange(N + pad)[None, :].repeat(B, 0) < N
  capacity = max(cfg.cache.capacity, N)
  c = cache_lib.init_cache(cfg, B, capacity)
  lp, c = _stream(params, tok, valid, c, model_cfg=cfg.model, chunk=chunk)
  return lp[:, :N], cache_lib.tree_bytes(c)


@functools.partial(jax.jit, static_argnames=("model_cfg",))
def full_logprobs(params, tokens_BN, *, model_cfg):
  """Teacher-forced full forward pass (no cache): the exactness reference."""
  B, N = tokens_BN.shape
  pos = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
  logits, _ = Transformer(model_cfg).apply({"params": params}, tokens_BN, pos, None)
  return jax.nn.log_softmax(logits, axis=-1)


def nll(logprobs_BNV, tokens_BN) -> float:
  """Mean next-token NLL: prediction at t scores token t+1."""
  lp = jnp.take_along_axis(logprobs_BNV[:, :-1], jnp.asarray(tokens_BN)[:, 1:, None], axis=-1)
  return float(-jnp.mean(lp))


def compare(lp_BNV, ref_BNV, tokens_BN) -> dict:
  """ppl, ppl_ref, kl (mean KL(ref || test)), agreement, and the relative Δppl."""
  ppl, ppl_ref = float(np.exp(nll(lp_BNV, tokens_BN))), float(np.exp(nll(ref_BNV, tokens_BN)))
  kl = float(jnp.mean(jnp.sum(jnp.exp(ref_BNV) * (ref_BNV - lp_BNV), axis=-1)))
  agree = float(jnp.mean(jnp.argmax(lp_BNV, -1) == jnp.argmax(ref_BNV, -1)))
  return {"ppl": ppl, "ppl_ref": ppl_ref, "dppl_rel": ppl / ppl_ref - 1.0, "kl": max(kl, 0.0),
          "agreement": agree}


def recall_accuracy(cfg: Config, params, batch_BN, mask_BN, chunk: int = 1) -> float:
  """Fraction of recall answers the model predicts (argmax) reading the cache."""
  lp, _ = stream_logprobs(cfg, params, batch_BN, chunk)
  pred = np.asarray(jnp.argmax(lp[:, :-1], -1))
  hit = pred == np.asarray(batch_BN)[:, 1:]
  m = np.asarray(mask_BN)[:, 1:]
  return float(hit[m].mean())


def recall_set(seed: int, n: int, context: int, n_pairs: int, filler: np.ndarray):
  """A fixed recall evaluation set (same seed, same sequences for every codec)."""
  rng = np.random.default_rng([seed, context, n_pairs])
  return data.recall_batch(rng, n, context, n_pairs, n_pairs, filler)


def greedy_tokens(cfg: Config, params, prompts: list[list[int]], gen_len: int) -> list:
  """Free-running greedy decode through `cfg`'s cache (no eos: fixed length)."""
  from kvjax import decode

  greedy = config_lib.apply_overrides(cfg, {"workload.temperature": 0.0, "workload.eos_id": -1})
  return decode.generate(greedy, params, prompts, gen_len, timed=False)["tokens"]


def generation_agreement(tokens: list, ref_tokens: list) -> float:
  """Fraction of generated tokens equal, position by position, to the fp32 cache's."""
  same = [np.mean(np.array(a) == np.array(b)) for a, b in zip(tokens, ref_tokens)]
  return float(np.mean(same))
