"""The hybrid cache of a model with sliding-window layers (`model.sliding_window` W, local
layers by `model.global_every`), as the `contiguous` layout holds it: the global layers
keep every token ([Lg, B, K, S, ...], slot = position), each windowed layer a ring of its
last W tokens ([Lw, B, K, W, ...], position p in slot p mod W). A windowed layer's bytes
stop growing at W tokens and its read covers at most W slots.

Every layer reads two segments, its own store's and the other kind's with nothing valid
(live length 0: no block is read), so the layer loop stays one traced body. Slots record
the position they hold, and the attention's window floor (`model.layers.window_floor`)
masks the one ring slot a new token no longer sees. A write keeps only each row's last W
positions for the ring (older tokens of a long prompt are never stored there).

Used when the codecs store tokens one at a time (no KIVI key groups), without a residual
window or first tokens kept apart, and W is below the capacity (`layers`); otherwise the
contiguous layout holds every layer whole and the window is a mask on it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import base


@dataclasses.dataclass(frozen=True)
class Layers:
  """Which layers keep a ring: `local` and `full` layer indices, and each layer's index
  into its own store."""

  window: int
  local: tuple
  full: tuple

  def rank(self, layer, of: tuple):
    """Index of `layer` in the store of `of` (0 for a layer of the other kind)."""
    table = np.zeros(len(self.local) + len(self.full), np.int32)
    table[list(of)] = np.arange(len(of))
    return int(table[layer]) if isinstance(layer, int) else jnp.asarray(table)[layer]

  def is_local(self, layer):
    flags = np.zeros(len(self.local) + len(self.full), bool)
    flags[list(self.local)] = True
    return bool(flags[layer]) if isinstance(layer, int) else jnp.asarray(flags)[layer]


def layers(spec: base.CacheSpec) -> Layers | None:
  """The ring split of this cache, or None where the contiguous layout holds layers whole."""
  if spec.model_cfg.sliding_window >= spec.capacity or spec.residual or spec.keep_first \
      or spec.kc.token_block != 1 or spec.vc.token_block != 1:
    return None
  return split(spec)


def split(spec: base.CacheSpec) -> Layers | None:
  """The model's windowed and full layers, or None for a model without windows (or a cache
  of other than all its layers)."""
  m = spec.model_cfg
  if not m.windowed or m.n_layers != spec.n_layers:
    return None
  local = tuple(i for i in range(m.n_layers) if m.window_of(i))
  return Layers(m.sliding_window, local, tuple(i for i in range(m.n_layers)
                                               if not m.window_of(i)))


def shapes(spec: base.CacheSpec, rg: Layers) -> tuple:
  B, K, D = spec.batch, spec.n_kv_heads, spec.head_dim
  return (len(rg.full), B, K, spec.capacity, D), (len(rg.local), B, K, rg.window, D)


def ring_positions(lengths_B, W: int):
  """[B, W] the position each ring slot holds with `lengths_B` tokens written (-1: none
  yet): the newest p < n with p = slot (mod W)."""
  n = lengths_B[:, None]
  return n - 1 - (n - 1 - jnp.arange(W)[None, :]) % W


def read(spec: base.CacheSpec, store, lengths_B, layer, rg: Layers) -> list:
  k, v, k_ring, v_ring = store
  local = rg.is_local(layer)
  B, S, W = lengths_B.shape[0], spec.capacity, rg.window
  held = jnp.max(lengths_B)
  segs = []
  # A layer index known when tracing (the unrolled loop) reads its own segment only; a
  # traced one (nn.scan) gets both, the other with live length 0. The CPU program's
  # blockwise read skips an empty segment, but the accelerator program reads every
  # segment as one masked block, so there only a static layer index saves those bytes.
  if isinstance(local, bool):
    if local:
      return [ring_segment(spec, k_ring, v_ring, lengths_B, held, W, True,
                           rg.rank(layer, rg.local))]
    return [_full_segment(spec, k, v, lengths_B, held, S, False, rg.rank(layer, rg.full))]
  if rg.full:
    segs.append(_full_segment(spec, k, v, lengths_B, held, S, local, rg.rank(layer, rg.full)))
  segs.append(ring_segment(spec, k_ring, v_ring, lengths_B, held, W, local,
                           rg.rank(layer, rg.local)))
  return segs


def _full_segment(spec, k, v, lengths_B, held, S: int, local, rank) -> base.LayerSegment:
  """The full layers' stack as layer `rank` of it reads it (nothing when `local`)."""
  B = lengths_B.shape[0]
  mask_BS = (jnp.arange(S)[None, :] < lengths_B[:, None]) & ~jnp.asarray(local)
  return base.LayerSegment(k, v, mask_BS, spec.kc, spec.vc, live=jnp.where(local, 0, held),
                           layer=rank, pos_BS=jnp.broadcast_to(jnp.arange(S)[None, :], (B, S)))


def ring_segment(spec, k_ring, v_ring, lengths_B, held, W: int, local,
                 rank) -> base.LayerSegment:
  """The rings as windowed layer `rank` reads them (nothing unless `local`)."""
  pos_BW = ring_positions(lengths_B, W)
  return base.LayerSegment(k_ring, v_ring, (pos_BW >= 0) & jnp.asarray(local), spec.kc,
                           spec.vc, live=jnp.where(local, jnp.minimum(held, W), 0),
                           layer=rank, pos_BS=pos_BW)


def write(cache, k_LBKTD, v_LBKTD, positions_BT, lengths_B, rg: Layers) -> dict:
  """The new stores: the full layers' tokens at slot = position, the windowed layers' last
  W positions of each row at slot p mod W (the rest dropped: slot W is out of range)."""
  spec = cache.spec
  full, local = np.asarray(rg.full, np.int32), np.asarray(rg.local, np.int32)
  out = {}
  if rg.full:
    slots_BT = jnp.where(positions_BT >= 0, positions_BT, spec.capacity)
    put = base.scatter(slots_BT)
    out["k"] = jax.tree.map(put, cache.k, spec.kc.encode(k_LBKTD[full]))
    out["v"] = jax.tree.map(put, cache.v, spec.vc.encode(v_LBKTD[full]))
  out["k_ring"], out["v_ring"] = put_rings(spec, cache.k_ring, cache.v_ring, k_LBKTD[local],
                                           v_LBKTD[local], positions_BT, lengths_B, rg.window)
  return out


def put_rings(spec, k_ring, v_ring, k_LBKTD, v_LBKTD, positions_BT, lengths_B, W: int):
  """The windowed layers' rings after a write of their new K/V [Lw, B, K, T, D]: each
  row's last W positions (of `lengths_B` after the write) at slot p mod W."""
  keep = (positions_BT >= 0) & (positions_BT >= lengths_B[:, None] - W)
  put = base.scatter(jnp.where(keep, positions_BT % W, W))
  return (jax.tree.map(put, k_ring, spec.kc.encode(k_LBKTD)),
          jax.tree.map(put, v_ring, spec.vc.encode(v_LBKTD)))


def gather_rings(store, lengths_B, W: int):
  """Rings of W slots taken from a store holding every position at slot = position
  (leaves [Lw, B, K, S, X]): slot s the newest position p < length with p = s (mod W);
  a slot no position fills yet is zero."""
  pos_BW = ring_positions(lengths_B, W)

  def take(a):
    got = jnp.take_along_axis(a, jnp.maximum(pos_BW, 0)[None, :, None, :, None], axis=3)
    return jnp.where((pos_BW >= 0)[None, :, None, :, None], got, jnp.zeros((), a.dtype))
  return jax.tree.map(take, store)


def closed_form_bytes(spec: base.CacheSpec, rg: Layers) -> int:
  per_token = (spec.kc.bytes_per_token(spec.n_kv_heads, spec.head_dim)
               + spec.vc.bytes_per_token(spec.n_kv_heads, spec.head_dim))
  slots = len(rg.full) * spec.capacity + len(rg.local) * rg.window
  return int(round(spec.batch * slots * per_token)) + 4 * spec.batch
