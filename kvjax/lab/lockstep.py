"""Several caches read in lockstep with one fp32 reference, segment by segment: the
per-position NLL, KL and agreement of each against the reference (`terms`), without ever
holding a long sequence's log-probabilities. The position experiment and the interval
coverage study read through it.

A cache that keeps every token is streamed (`evaluate.stream_segments`). An evicting one
acts on a prefilled prefix, so it is read by bucket: the prefix before each bucket is
prefilled once in one call (shared by every policy), compacted by the policy, and the
bucket streamed through what it kept.

The sequence is read in pieces of at most `PIECE` tokens, each stream's cache handed from
one piece to the next. Given a `Store`, the caches and the terms so far are written after
every piece, and a run killed mid-sequence resumes from the last piece written.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import policies
from kvjax.config import Config
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.lab import evaluate, tasks

PIECE = 4096  # tokens between two saved states of a resumable run


def without_policy(cfg: Config) -> Config:
  """`cfg` keeping every token: its codec and layout, `cache.policy=full`."""
  return config_lib.apply_overrides(cfg, {"cache.policy": "full", "cache.budget": 0,
                                          "cache.ratio": 0.0})


def pieces(M: int, chunk: int, edges, piece: int) -> list[tuple[int, int]]:
  """[a, b) pieces covering M tokens: cut at every bucket edge on the chunk and every
  `piece` tokens (rounded down to whole chunks), so each piece starts where one stream of
  the whole sequence would start a segment."""
  step_ = chunk * max(1, piece // chunk)
  cuts = {0, M, *range(step_, M, step_), *(e for e in edges or () if 0 < e < M and not e % chunk)}
  cuts = sorted(cuts)
  return list(zip(cuts, cuts[1:]))


class Store:
  """A resumable run's state in one folder: after each piece, every stream's cache (its
  leaves' raw bytes, rebuilt on the template of a fresh cache) and the terms so far, under
  a key that names the run; written to a temporary file and renamed, so a kill leaves the
  last whole state. A state of another key, or one that cannot be read, is set aside with
  a warning and the run starts over."""

  def __init__(self, folder):
    self.folder = Path(folder)
    self.path = self.folder / "lockstep.npz"

  def load(self, key: str, templates: dict):
    """(tokens done, {stream: cache}, {name: [terms arrays]}) or None."""
    if not self.path.exists():
      return None
    try:
      with np.load(self.path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if meta["key"] != key:
          raise ValueError("written by another run")
        caches = {}
        for s, tmpl in templates.items():
          if s not in meta["caches"]:
            continue
          leaves, tree = jax.tree.flatten(tmpl)  # shapes and dtypes (jax.ShapeDtypeStruct)
          got = []
          for j, leaf in enumerate(leaves):
            raw = z[f"c{meta['caches'][s]}_{j}"]
            dtype = np.dtype(leaf.dtype)
            if raw.nbytes != dtype.itemsize * int(np.prod(leaf.shape)):
              raise ValueError(f"cache {s!r} leaf {j} is {raw.nbytes} bytes, not its shape's")
            got.append(jnp.asarray(raw.view(dtype).reshape(leaf.shape)))
          caches[s] = jax.tree.unflatten(tree, got)
        parts = {n: [tuple(z[f"t{i}_{k}"] for k in range(4))] if meta["done"] else []
                 for i, n in enumerate(meta["names"])}
        return int(meta["done"]), caches, parts
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
      print(f"kvjax: warning: the saved state {self.path} cannot be resumed ({e}); "
            "starting the sequence over", file=sys.stderr)
      return None

  def save(self, key: str, done: int, caches: dict, parts: dict) -> None:
    self.folder.mkdir(parents=True, exist_ok=True)
    arrays, order = {}, {}
    for i, (s, c) in enumerate(caches.items()):
      order[s] = i
      for j, leaf in enumerate(jax.tree.leaves(c)):
        arrays[f"c{i}_{j}"] = np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).ravel()
    names = list(parts)
    for i, n in enumerate(names):
      for k, x in enumerate(_joined(parts[n])):
        arrays[f"t{i}_{k}"] = x
    meta = {"key": key, "done": done, "caches": order, "names": names}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    tmp = self.path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, self.path)


def _last(segments):
  """The cache a `stream_segments(..., keep=True)` ends with."""
  for start, out in segments:
    if start is None:
      return out


def _joined(parts: list) -> tuple:
  return tuple(np.concatenate(x, axis=1) for x in zip(*parts))


def run_key(tcfgs: dict, ref_cfg, tokens_BM, chunk: int, edges, piece: int) -> str:
  """What a saved state must match: the caches, the reference, the tokens and the cuts."""
  h = hashlib.sha256(np.ascontiguousarray(tokens_BM, np.int32).tobytes())
  h.update(repr((sorted((n, c.to_dict()) for n, c in tcfgs.items()), ref_cfg.to_dict(),
                 chunk, list(edges or ()), piece)).encode())
  return h.hexdigest()


def terms(tcfgs: dict, ref_cfg, params, tokens_BM, chunk: int, progress=None,
          edges=None, store: Store | None = None, piece: int | None = None) -> dict:
  """name -> per-position (NLL, NLL of the reference, KL, argmax agreement) [B, M - 1] of
  each of `tcfgs`' caches against `ref_cfg`'s, all streamed segment by segment in lockstep
  (the reference once). A cache whose policy evicts is compacted at each of `edges` (token
  boundaries from 0, each a multiple of `chunk`), every policy from one shared prefill of
  each prefix; its first bucket (no prefix) is read through its codec alone. With a
  `store`, the state after each piece (`pieces`) is saved there and a saved state of the
  same run is resumed. `piece`: tokens between saved states (default `PIECE`)."""
  piece = piece or PIECE
  names = list(tcfgs)
  tokens_BM = np.asarray(tokens_BM, np.int32)
  B, M = tokens_BM.shape
  evicting = {n for n, c in tcfgs.items() if policies.evicts(c.cache)}
  if evicting and (edges is None or B != 1 or any(e % chunk for e in edges if e < M)):
    c = tcfgs[sorted(evicting)[0]]
    raise KvjaxError(f"cache.policy={c.cache.policy} is evaluated by position on one "
                     "sequence, compacted at bucket edges that are multiples of the chunk")
  bounds = sorted({0, M, *(e for e in edges or () if 0 < e < M)})
  cfgs = {None: ref_cfg, **tcfgs}  # None: the reference
  full = {s: c for s, c in cfgs.items() if s not in evicting}
  params = step.prepare_params(ref_cfg, params)  # once, shared by every stream

  def fresh(c, n):
    return cache_lib.init_cache(c, B, max(c.cache.capacity, n))

  def stream(c, a, b, cache, progress):
    return evaluate.stream_segments(c, params, tokens_BM[:, a:b], chunk, segment=chunk,
                                    progress=progress, cache=cache, keep=True)

  key = run_key(tcfgs, ref_cfg, tokens_BM, chunk, edges, piece)
  state: dict = {}
  parts: dict = {n: [] for n in names}
  done = 0
  if store is not None:
    got = store.load(key, {"ref" if s is None else s: jax.eval_shape(lambda c=c: fresh(c, M))
                           for s, c in full.items()})
    if got is not None:
      done, saved, parts = got
      state = {None if s == "ref" else s: c for s, c in saved.items()}
      if progress is not None:
        progress.update(done * B * len(cfgs))
  memo: dict = {}

  def prefix_of(n: int):
    if n not in memo:
      memo.clear()  # one prefix at a time: every policy reaches it in the same piece
      memo[n] = tasks.prefill_queries(ref_cfg, params, tokens_BM[0, :n].tolist(), n)
    return memo[n]

  for a, b in pieces(M, chunk, edges, piece):
    if b <= done:
      continue
    lo = max(e for e in bounds if e <= a)
    hi = min(e for e in bounds if e > a)
    streams = []
    for s, c in cfgs.items():
      run_cfg = c
      if s in evicting:
        if lo == 0:
          run_cfg = without_policy(c)
        if a == lo or s not in state:  # the prefix compacted afresh (none before the first)
          state[s] = fresh(run_cfg, hi) if lo == 0 else \
              tasks.evict_prefix(c, prefix_of(lo), room=hi - lo)
          if a > lo:  # resumed within the bucket: its tokens so far read again (unsaved)
            state[s] = _last(stream(run_cfg, lo, a, state[s], None))
      elif a == 0:
        state[s] = fresh(c, M)
      streams.append(stream(run_cfg, a, b, state[s], progress))
    for (start, ref_lp), *segs in zip(*streams):
      if start is None:  # each stream's last item is its cache (`keep=True`)
        state[None] = ref_lp
        for s, (_, c) in zip(names, segs):
          state[s] = c
        break
      for name, (got, lp) in zip(names, segs):
        assert got == start, (name, got, start)  # lockstep: the same positions
        nxt = tokens_BM[:, a + start + 1:a + start + lp.shape[1] + 1]  # each position's target
        parts[name].append(evaluate.token_terms(lp, ref_lp, nxt))
    if store is not None and b < M:
      store.save(key, b, {"ref" if s is None else s: state[s] for s in full},
                 {n: [_joined(parts[n])] for n in names})
      parts = {n: [_joined(parts[n])] for n in names}
  out = {}
  for name in names:
    nll, nll_ref, kl, agree = _joined(parts[name])
    n = nll.shape[1]  # the last position has no target
    out[name] = (nll, nll_ref, kl[:, :n], agree[:, :n])
  return out
