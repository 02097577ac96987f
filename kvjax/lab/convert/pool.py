"""Fewer or more KV heads of the same weights: GQA/MQA by mean-pooling K/V projection heads
(Ainslie et al. 2023), and the exact expansion the other way (`expand`: GQA/MQA -> more KV
heads, MHA at most, each head copied to its query group; same outputs, more cache).

Query head h reads KV head h // G (kvjax.attention groups heads as [K, G]), so old KV
heads i*P .. i*P+P-1 (P = K_old // K_new) serve exactly the query heads that new KV head
i will serve; averaging their K and V projections (kernels and biases) is the GQA
paper's best initialisation, and with P = 1 it is the identity. Queries, outputs and the
MLP are unchanged. The converted model is then usually uptrained for a few percent of
its original steps (kvjax/lab/experiments/uptrain.py), or aligned before pooling and fitted
after it on calibration text (`kvjax.lab.convert.align`, `kvjax.lab.convert.fit`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax import config as config_lib
from kvjax import registries  # noqa: F401  (config.validate then knows every registry's names)
from kvjax.config import Config
from kvjax.errors import KvjaxError


def check_target(model_cfg, kv_heads: int) -> None:
  """--kv-heads must pool (divide the model's KV heads) or expand (a multiple of them that
  divides the query heads)."""
  K, H = model_cfg.n_kv_heads, model_cfg.n_heads
  pool = 0 < kv_heads <= K and K % kv_heads == 0
  grow = kv_heads > K and kv_heads % K == 0 and H % kv_heads == 0
  if not (pool or grow):
    fewer = [d for d in range(1, K + 1) if K % d == 0]
    more = [m for m in range(2 * K, H + 1, K) if H % m == 0]
    raise KvjaxError(f"cannot pool or expand {K} KV heads into {kv_heads}; --kv-heads must divide {K} "
                     f"(pooling: one of {fewer}) or be a multiple of it that divides the "
                     f"{H} query heads (exact expansion: one of {more or 'none'})")


def expand(cfg: Config, params: Any, kv_heads: int) -> tuple[Config, Any]:
  """The exact twin with `kv_heads` KV heads: each KV head's K/V projection (kernel and
  bias) copied to the r = kv_heads / K new heads that serve its query heads, so every query
  head reads the same keys and values as before: the same outputs for r times the cache."""
  m = cfg.model
  check_target(m, kv_heads)
  if kv_heads <= m.n_kv_heads:
    raise KvjaxError(f"expansion needs more KV heads than the model's {m.n_kv_heads}, got "
                     f"{kv_heads}; fewer heads are pooled (kvjax convert --kv-heads)")
  r = kv_heads // m.n_kv_heads

  def grow(x):
    lead = x.shape[:-1]
    x = x.reshape(*lead, m.n_kv_heads, 1, m.D)
    return jnp.broadcast_to(x, (*lead, m.n_kv_heads, r, m.D)).reshape(*lead, kv_heads * m.D)

  layers = dict(params["layers"])
  for name in ("k_proj", "v_proj"):
    layers[name] = {leaf: grow(a) for leaf, a in layers[name].items()}
  return (config_lib.apply_overrides(cfg, {"model.n_kv_heads": kv_heads}),
          {**params, "layers": layers})


def _pool(x: jax.Array, K: int, K_new: int, D: int) -> jax.Array:
  """Average groups of heads along the last axis ([..., K*D] -> [..., K_new*D])."""
  lead = x.shape[:-1]
  x = x.reshape(*lead, K_new, K // K_new, D).astype(jnp.float32)
  return x.mean(axis=-2).reshape(*lead, K_new * D)


def mean_pool(cfg: Config, params: Any, kv_heads: int) -> tuple[Config, Any]:
  """(config with model.n_kv_heads = kv_heads, params with pooled k_proj/v_proj)."""
  m = cfg.model
  check_target(m, kv_heads)
  if kv_heads > m.n_kv_heads:
    raise KvjaxError(f"cannot pool {m.n_kv_heads} KV heads into more ({kv_heads}); --kv-heads "
                     f"must divide {m.n_kv_heads} to pool (more heads: `expand`)")
  layers = dict(params["layers"])
  for name in ("k_proj", "v_proj"):
    proj = dict(layers[name])
    for leaf in ("kernel", "bias"):
      if leaf in proj:
        proj[leaf] = _pool(proj[leaf], m.n_kv_heads, kv_heads, m.D).astype(proj[leaf].dtype)
    layers[name] = proj
  new_params = {**params, "layers": layers}
  new_cfg = config_lib.apply_overrides(cfg, {"model.n_kv_heads": kv_heads})
  return new_cfg, new_params
