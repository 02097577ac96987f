"""Align the KV heads that will be merged, exactly, before pooling them.

Mean-pooling averages heads whose coordinates mean different things: two key heads can
carry the same pattern in rotated or permuted directions, and their mean keeps neither.
Before pooling, each head of a group is mapped onto the group's first head by a change of
basis the model cannot see:

- Keys: per RoPE frequency pair (dims f and f + D/2, the rotate-half convention), a 2-D
  rotation. RoPE rotates each pair by a position's angle; 2-D rotations commute, so
  rotating a key head's pair by theta and its query heads' pair by the same theta leaves
  every q.k, at every position, unchanged. theta is fitted in closed form to the group's
  first head on calibration keys: with z = k_f + i k_{f+D/2}, theta = arg(sum conj(z_j) z_ref).
- Values: an orthogonal D x D map Q per head (Procrustes: the nearest to mapping its values
  onto the first head's), undone in o_proj's rows for the query heads that read the head,
  so every attention output is unchanged.

The aligned, unmerged model computes the same logits as the original (up to float
rounding); only the pooling that follows loses anything. Models with q/k norms are
refused: a norm's per-dimension weight does not commute with the rotation.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.config import Config
from kvjax.errors import KvjaxError
from kvjax.lab.convert import layerwise, pool


def check(cfg: Config, kv_heads: int) -> None:
  m = cfg.model
  pool.check_target(m, kv_heads)
  if kv_heads >= m.n_kv_heads:
    raise KvjaxError(f"alignment merges KV heads: --kv-heads must be fewer than the model's "
                     f"{m.n_kv_heads} (and divide it); more heads are an exact expansion "
                     "(--method pool)")
  if m.qk_norm:
    raise KvjaxError("this model normalises q/k per dimension, which does not commute with "
                     "the alignment's rotations; convert it with --method pool")
  if m.latent_rank:
    raise KvjaxError("a latent model has no KV heads to align; convert the original model")


def _key_rotation(k_ND: np.ndarray, ref_ND: np.ndarray) -> np.ndarray:
  """The D x D block rotation (one angle per frequency pair) that best maps keys k onto ref."""
  half = k_ND.shape[-1] // 2
  z = k_ND[:, :half] + 1j * k_ND[:, half:]
  z_ref = ref_ND[:, :half] + 1j * ref_ND[:, half:]
  theta = np.angle(np.sum(np.conj(z) * z_ref, axis=0))
  c, s = np.cos(theta), np.sin(theta)
  R = np.zeros((2 * half, 2 * half))
  i = np.arange(half)
  # x' = x R: x'_f = x_f c - x_{f+h} s, x'_{f+h} = x_f s + x_{f+h} c (z' = z e^{i theta})
  R[i, i], R[i + half, i], R[i, i + half], R[i + half, i + half] = c, -s, s, c
  return R


def _value_map(v_ND: np.ndarray, ref_ND: np.ndarray) -> np.ndarray:
  """The orthogonal D x D map Q minimising |v Q - ref| (Procrustes)."""
  u, _, wt = np.linalg.svd(v_ND.T.astype(np.float64) @ ref_ND.astype(np.float64))
  return u @ wt


def _heads(w, n: int, D: int) -> np.ndarray:
  """[..., n*D] -> [..., n, D] as float64."""
  w = np.asarray(w, np.float64)
  return w.reshape(*w.shape[:-1], n, D)


def align(cfg: Config, params: Any, kv_heads: int, tokens_NS: np.ndarray) -> Any:
  """params with each group's KV heads (the old heads pooled into one new head) aligned to
  the group's first head on the calibration tokens; same config, same outputs."""
  check(cfg, kv_heads)
  m = cfg.model
  H, K, D = m.n_heads, m.n_kv_heads, m.D
  G, P = H // K, K // kv_heads
  original = params
  x = layerwise.embed(m, params, tokens_NS)
  for layer in range(m.n_layers):
    k_NSKD, v_NSKD = layerwise.keys_values(m, params, layer, x)
    k = k_NSKD.reshape(-1, K, D)
    v = v_NSKD.reshape(-1, K, D)
    p = layerwise.layer_params(params, layer)
    wq, wk, wv = (_heads(p[n]["kernel"], c, D) for n, c in (("q_proj", H), ("k_proj", K),
                                                               ("v_proj", K)))
    bq, bk, bv = (_heads(p[n]["bias"], c, D) if "bias" in p[n] else None
                  for n, c in (("q_proj", H), ("k_proj", K), ("v_proj", K)))
    wo = np.asarray(p["o_proj"]["kernel"], np.float64).reshape(H, D, -1)
    for j in range(K):
      ref = (j // P) * P
      if j == ref:
        continue
      R = _key_rotation(k[:, j], k[:, ref])
      Q = _value_map(v[:, j], v[:, ref])
      wk[:, j], wv[:, j] = wk[:, j] @ R, wv[:, j] @ Q
      if bk is not None:
        bk[j], bv[j] = bk[j] @ R, bv[j] @ Q
      for h in range(j * G, (j + 1) * G):  # the query heads that read KV head j
        wq[:, h] = wq[:, h] @ R
        if bq is not None:
          bq[h] = bq[h] @ R
        wo[h] = Q.T @ wo[h]
    new = {"q_proj": {"kernel": wq.reshape(-1, H * D)}, "k_proj": {"kernel": wk.reshape(-1, K * D)},
           "v_proj": {"kernel": wv.reshape(-1, K * D)},
           "o_proj": {"kernel": wo.reshape(H * D, -1)}}
    for name, b in (("q_proj", bq), ("k_proj", bk), ("v_proj", bv)):
      if b is not None:
        new[name]["bias"] = b.reshape(-1)
    params = layerwise.set_layer(params, layer, {n: {leaf: jnp.asarray(a, jnp.float32)
                                                     for leaf, a in d.items()}
                                                 for n, d in new.items()})
    x = layerwise.advance(m, original, layer, x)  # the same stream with either weights
  return params
