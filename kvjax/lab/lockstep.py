"""Several caches read in lockstep with one fp32 reference, segment by segment: the
per-position NLL, KL and agreement of each against the reference (`terms`), without ever
holding a long sequence's log-probabilities. The position experiment and the interval
coverage study read through it.

A cache that keeps every token is streamed (`evaluate.stream_segments`). An evicting one
acts on a prefilled prefix, so it is read by bucket (`compacted_segments`): the prefix
before each bucket is prefilled once in one call (shared by every policy), compacted by the
policy, and the bucket streamed through what it kept.
"""

from __future__ import annotations

import numpy as np

from kvjax import config as config_lib
from kvjax import policies
from kvjax.config import Config
from kvjax.errors import KvjaxError
from kvjax.lab import evaluate, tasks


def without_policy(cfg: Config) -> Config:
  """`cfg` keeping every token: its codec and layout, `cache.policy=full`."""
  return config_lib.apply_overrides(cfg, {"cache.policy": "full", "cache.budget": 0,
                                          "cache.ratio": 0.0})


def compacted_segments(cfg: Config, params, tokens_1M, chunk: int, edges, prefix_of,
                       progress=None):
  """`evaluate.stream_segments` for an evicting cache: the tokens of each bucket [edges[i],
  edges[i+1]) streamed through the cache `cfg`'s policy leaves of the prefix before it,
  compacted once at the bucket's start (`tasks.evict_prefix`, with the one-call prefill
  `prefix_of(n)` of the first n tokens, which every policy of a cell shares) and every
  bucket token kept after; the first bucket (no prefix) through the codec alone. The
  segments start where `evaluate.stream_segments`'s do when every edge is a multiple of
  `chunk`. Then (None, bytes of the last bucket's cache)."""
  tokens_1M = np.asarray(tokens_1M, np.int32)
  nbytes = 0
  for lo, hi in zip(edges, edges[1:]):
    if lo == 0:
      c0, run_cfg = None, without_policy(cfg)
    else:
      c0, run_cfg = tasks.evict_prefix(cfg, prefix_of(lo), room=hi - lo), cfg
    for start, out in evaluate.stream_segments(run_cfg, params, tokens_1M[:, lo:hi], chunk,
                                               segment=chunk, progress=progress, cache=c0):
      if start is None:
        nbytes = out
      else:
        yield lo + start, out
  yield None, nbytes


def terms(tcfgs: dict, ref_cfg, params, tokens_BM, chunk: int, progress=None,
          edges=None) -> dict:
  """name -> per-position (NLL, NLL of the reference, KL, argmax agreement) [B, M - 1] of
  each of `tcfgs`' caches against `ref_cfg`'s, all streamed segment by segment in lockstep
  (the reference once). A cache whose policy evicts is compacted at each of `edges` (token
  boundaries from 0, each a multiple of `chunk`; `compacted_segments`), every policy from
  one shared prefill of each prefix."""
  names = list(tcfgs)
  tokens_BM = np.asarray(tokens_BM)
  memo: dict = {}

  def prefix_of(n: int):
    if n not in memo:
      memo.clear()  # one prefix at a time: every policy reaches it in the same segment
      memo[n] = tasks.prefill_queries(ref_cfg, params, tokens_BM[0, :n].tolist(), n)
    return memo[n]

  def stream(c):
    if not policies.evicts(c.cache):
      return evaluate.stream_segments(c, params, tokens_BM, chunk, segment=chunk,
                                      progress=progress)
    if edges is None or tokens_BM.shape[0] != 1 or any(e % chunk for e in edges):
      raise KvjaxError(f"cache.policy={c.cache.policy} is evaluated by position on one "
                       "sequence, compacted at bucket edges that are multiples of the chunk")
    return compacted_segments(c, params, tokens_BM, chunk, edges, prefix_of, progress)

  streams = [stream(c) for c in (ref_cfg, *tcfgs.values())]
  parts: dict = {n: [] for n in names}
  for (start, ref_lp), *segs in zip(*streams):
    if start is None:
      break
    for name, (got, lp) in zip(names, segs):
      assert got == start, (name, got, start)  # lockstep: the same positions
      nxt = tokens_BM[:, start + 1:start + lp.shape[1] + 1]  # each position's target
      parts[name].append(evaluate.token_terms(lp, ref_lp, nxt))
  out = {}
  for name in names:
    nll, nll_ref, kl, agree = (np.concatenate(x, axis=1) for x in zip(*parts[name]))
    n = nll.shape[1]  # the last position has no target
    out[name] = (nll, nll_ref, kl[:, :n], agree[:, :n])
  return out
