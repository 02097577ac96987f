"""The `contiguous` layout: `capacity` preallocated slots per sequence, every leaf stacked
over layers [L, B, K, S, ...] (K heads only, never the repeated query-group copies), with
an optional full-precision window of recent tokens (`cache.residual`, KIVI's R) and the
first tokens of each sequence kept apart in full precision (`cache.keep_first`). A model
with sliding-window layers keeps those layers in rings of W slots (`kvjax.cache.ring`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import base, ring
from kvjax.errors import KvjaxError


@struct.dataclass
class KVCache:
  k: Any                 # K codec storage, leaves [L, B, K, S, ...]
  v: Any                 # V codec storage, leaves [L, B, K, S, ...]
  lengths: jax.Array     # [B] int32: tokens held per sequence
  spec: base.CacheSpec = struct.field(pytree_node=False)
  k_win: Any = None      # full-precision window [L, B, K, R, D] (cache.residual > 0), else None
  v_win: Any = None
  k_first: Any = None    # the first tokens in full precision [L, B, K, S, D], S = cache.keep_first
  v_first: Any = None
  k_ring: Any = None     # sliding-window layers' last W tokens [Lw, B, K, W, ...] (kvjax.cache.ring);
  v_ring: Any = None     # then k and v hold the other layers only [Lg, B, K, S, ...]

  AXES: ClassVar[dict] = {**{f: base.KV for f in ("k", "v", "k_win", "v_win", "k_first",
                                                   "v_first", "k_ring", "v_ring")},
                          "lengths": base.PER_SEQUENCE}


def check_capacity(spec: base.CacheSpec) -> None:
  """`cache.keep_first` must leave room for the tokens after it (host side, at build)."""
  first = spec.keep_first
  if first >= spec.capacity:
    raise KvjaxError(f"cache.keep_first={first} must be below the cache capacity {spec.capacity}; "
                     "keep fewer first tokens or raise cache.capacity (or the context)")


class Contiguous(base.Layout):
  """`capacity` preallocated slots per sequence; token at position p lives in slot p.

  With a residual window (`cache.residual` = R > 0) the newest tokens stay in full
  precision in a ring of R slots (position p in slot p mod R) and the quantized history
  holds positions [0, q(n)) in slot p. When the window would overflow, its oldest block
  of U tokens (U = the K codec's token block: 1, or the KIVI group) is encoded once and
  appended to the history; history is never decoded or re-encoded. Everything is data-
  driven by per-sequence lengths, so prefill and decode never retrace.

  With `cache.keep_first` = f > 0, positions [0, f) live in their own full-precision store
  (slot = position, in the window's codec: the model's dtype) and everything above is the
  cache just described over positions p - f: history slot p - f, window slot (p - f) mod R.
  The first tokens are one more segment of the read, so every attention variant and the
  read kernel see them as they see the window.
  """

  name = "contiguous"

  def rings(self, spec: base.CacheSpec) -> ring.Layers | None:
    return ring.layers(spec)

  def init(self, spec: base.CacheSpec) -> KVCache:
    rg = self.rings(spec)
    if rg is not None:  # sliding-window layers keep rings (kvjax.cache.ring)
      full, local = ring.shapes(spec, rg)
      return KVCache(k=spec.kc.init(full), v=spec.vc.init(full), k_ring=spec.kc.init(local),
                     v_ring=spec.vc.init(local), lengths=jnp.zeros((spec.batch,), jnp.int32),
                     spec=spec)
    L, B, K, D, R = spec.n_layers, spec.batch, spec.n_kv_heads, spec.head_dim, spec.residual
    shape = (L, B, K, spec.history, D)
    cache = KVCache(k=spec.kc.init(shape), v=spec.vc.init(shape),
                    lengths=jnp.zeros((B,), jnp.int32), spec=spec)
    if R:
      win = lambda: spec.window_codec.init((L, B, K, R, D))  # noqa: E731
      cache = dataclasses.replace(cache, k_win=win(), v_win=win())
    if spec.keep_first:
      check_capacity(spec)
      store = lambda: spec.window_codec.init((L, B, K, spec.keep_first, D))  # noqa: E731
      cache = dataclasses.replace(cache, k_first=store(), v_first=store())
    return cache

  def store(self, cache: KVCache) -> Any:
    if cache.k_ring is not None:
      return (cache.k, cache.v, cache.k_ring, cache.v_ring)
    out = (cache.k, cache.v)
    if cache.k_win is not None:
      out += (cache.k_win, cache.v_win)
    if cache.k_first is not None:
      out += (cache.k_first, cache.v_first)
    return out

  def read(self, spec, store, lengths_B, layer):
    rg = self.rings(spec)
    if rg is not None:
      return ring.read(spec, store, lengths_B, layer, rg)
    k, v = store[:2]
    first, wc = spec.keep_first, spec.window_codec
    n_B = jnp.maximum(lengths_B - first, 0) if first else lengths_B  # held after the first
    q_B = spec.quantized_len(n_B)
    segs = []
    B = lengths_B.shape[0]
    slots = lambda n, at=0: jnp.broadcast_to(at + jnp.arange(n)[None, :], (B, n))  # noqa: E731
    if first:
      first_BS = jnp.arange(first)[None, :] < lengths_B[:, None]  # S: this segment's slots
      segs.append(base.LayerSegment(store[-2], store[-1], first_BS, wc, wc, layer=layer,
                                    pos_BS=slots(first)))
    if spec.history:
      mask_BS = jnp.arange(spec.history)[None, :] < q_B[:, None]
      segs.append(base.LayerSegment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.max(q_B),
                                    layer=layer, pos_BS=slots(spec.history, first)))
    if spec.residual:
      R = spec.residual
      slot_R = jnp.arange(R)[None, :]
      pos_BR = q_B[:, None] + (slot_R - q_B[:, None]) % R  # the position each slot holds
      segs.append(base.LayerSegment(store[2], store[3], pos_BR < n_B[:, None], wc, wc,
                                    layer=layer, pos_BS=pos_BR + first))
    return segs

  def write(self, cache: KVCache, k_LBTKD, v_LBTKD, positions_BT) -> KVCache:
    spec = cache.spec
    # [L, B, T, K, D] -> [L, B, K, T, D]: the cache stores K heads before tokens.
    k_LBKTD = jnp.swapaxes(k_LBTKD, 2, 3)
    v_LBKTD = jnp.swapaxes(v_LBTKD, 2, 3)
    lengths = cache.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    rg = self.rings(spec)
    if rg is not None:
      return dataclasses.replace(cache, lengths=lengths, **ring.write(
          cache, k_LBKTD, v_LBKTD, positions_BT, lengths, rg))
    first = spec.keep_first
    if first:  # positions [0, first) to their own store; the rest is the cache over p - first
      first_BT = jnp.where((positions_BT >= 0) & (positions_BT < first), positions_BT, first)

      def put(store, new):
        return base.scatter(first_BT)(store, spec.window_codec.encode(new))
      cache = dataclasses.replace(cache, k_first=put(cache.k_first, k_LBKTD),
                                  v_first=put(cache.v_first, v_LBKTD))
      positions_BT = jnp.where(positions_BT >= first, positions_BT - first, -1)
    if spec.residual:
      n0, n1 = (jnp.maximum(n - first, 0) for n in (cache.lengths, lengths)) if first else \
          (cache.lengths, lengths)
      skip_B = jnp.maximum(first - cache.lengths, 0) if first else None  # now in the first store
      kv = self._write_windowed(cache, k_LBKTD, v_LBKTD, positions_BT, n0, n1, skip_B)
      return dataclasses.replace(cache, **kv, lengths=lengths)
    slots_BT = jnp.where(positions_BT >= 0, positions_BT, spec.history)  # padding: dropped
    k = jax.tree.map(base.scatter(slots_BT), cache.k, spec.kc.encode(k_LBKTD))
    v = jax.tree.map(base.scatter(slots_BT), cache.v, spec.vc.encode(v_LBKTD))
    return dataclasses.replace(cache, k=k, v=v, lengths=lengths)

  def _write_windowed(self, cache, k_LBKTD, v_LBKTD, positions_BT, n0, n1, skip_B) -> dict:
    """The history and window after the write, as KVCache fields (positions and the tokens
    held before (n0) and after (n1) it count from position keep_first; the first skip_B new
    tokens of each row went to the first tokens' store, None: no first store)."""
    spec = cache.spec
    R, U = spec.residual, spec.block
    q0, q1 = spec.quantized_len(n0), spec.quantized_len(n1)
    T = positions_BT.shape[1]
    J = -(-T // U)  # q1 - q0 < T + U, so at most J = ceil(T / U) blocks leave per call
    # The O = J * U positions leaving the window, gathered from (old window ++ new tokens)
    # in full precision.
    p_BO = q0[:, None] + jnp.arange(J * U)[None, :]
    new_BO = R + p_BO - n0[:, None]  # index of a new token in (window ++ new)
    if skip_B is not None:
      new_BO = new_BO + skip_B[:, None]
    src_BO = jnp.clip(jnp.where(p_BO < n0[:, None], p_BO % R, new_BO), 0, R + T - 1)
    blk = q0[:, None] // U + jnp.arange(J)[None, :]
    blk_BJ = jnp.where((jnp.arange(J)[None, :] + 1) * U <= (q1 - q0)[:, None], blk,
                       spec.history // U)  # beyond the history: dropped
    # New tokens that stay in the window go to slot p mod R (the rest never enter it).
    stay = (positions_BT >= 0) & (positions_BT >= q1[:, None])
    wslot_BT = jnp.where(stay, positions_BT % R, R)

    def update(codec, hist, win, new_LBKTD):
      src = jnp.concatenate([win, new_LBKTD.astype(win.dtype)], axis=3)
      out_LBKOD = jnp.take_along_axis(src, src_BO[None, :, None, :, None], axis=3)
      hist = jax.tree.map(scatter_blocks(blk_BJ), hist, codec.encode(out_LBKOD))
      win = base.scatter(wslot_BT)(win, spec.window_codec.encode(new_LBKTD))
      return hist, win

    k, k_win = update(spec.kc, cache.k, cache.k_win, k_LBKTD)
    v, v_win = update(spec.vc, cache.v, cache.v_win, v_LBKTD)
    return {"k": k, "v": v, "k_win": k_win, "v_win": v_win}

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    rg = self.rings(spec)
    if rg is not None:
      return ring.closed_form_bytes(spec, rg)
    check_capacity(spec)
    per_token = (spec.kc.bytes_per_token(spec.n_kv_heads, spec.head_dim)
                 + spec.vc.bytes_per_token(spec.n_kv_heads, spec.head_dim))
    window = 2 * (spec.residual + spec.keep_first) * \
        spec.window_codec.bytes_per_token(spec.n_kv_heads, spec.head_dim)
    return int(round(spec.n_layers * spec.batch * (spec.history * per_token + window))) \
        + 4 * spec.batch


def scatter_blocks(blk_BJ):
  """Like `base.scatter`, for leaves holding J encoded blocks: block j goes to block
  blk_BJ[b, j] (a block beyond the store is dropped). Written as a scatter of the blocks'
  rows on the store's own shape: a scatter of whole blocks on a [.., S / r, r, ..] view of
  it made XLA:CPU give the result another layout and copy the whole store back, every step."""
  def put(store, new):
    J = blk_BJ.shape[1]
    r = new.shape[3] // J  # leaf rows per block (U code rows, or 1 scale row of a channel codec)
    rows_BJr = blk_BJ[:, :, None] * r + jnp.arange(r)[None, None, :]
    return base.scatter(rows_BJr.reshape(blk_BJ.shape[0], J * r))(store, new)
  return put


base.register(Contiguous())
