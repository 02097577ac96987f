"""Conversions between attention variants: GQA/MQA by mean-pooling K/V projection heads
(Ainslie et al. 2023), and the exact expansion the other way (`expand`: GQA/MQA -> more KV
heads, MHA at most, each head copied to its query group; same outputs, more cache).

Query head h reads KV head h // G (kvjax.attention groups heads as [K, G]), so old KV
heads i*P .. i*P+P-1 (P = K_old // K_new) serve exactly the query heads that new KV head
i will serve; averaging their K and V projections (kernels and biases) is the GQA
paper's best initialisation, and with P = 1 it is the identity. Queries, outputs and the
MLP are unchanged. The converted model is then usually uptrained for a few percent of
its original steps (kvjax/experiments/uptrain.py).

`--latent-rank R` instead factors each layer's K/V projections to rank R for the latent
cache (`kvjax.cache.latent.factor`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import config as config_lib
from kvjax import registries  # noqa: F401  (config.validate then knows every registry's names)
from kvjax.config import Config
from kvjax.errors import KvjaxError
from kvjax.runner import claims


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


def convert_cli(args) -> dict:
  """`kvjax convert (--checkpoint DIR | --hf DIR | --gguf FILE) --kv-heads K --out DIR`.

  The converted checkpoint keeps the source's tokenizer reference (a GGUF source's
  `gguf:FILE`), so `kvjax generate --checkpoint OUT --prompt ...` still reads text. One
  writer per --out: a second convert or train into it meanwhile is a one-line error."""
  from kvjax.io import sources

  src = sources.from_args(args)
  rank = getattr(args, "latent_rank", None)
  if (args.kv_heads is None) == (rank is None):
    raise KvjaxError("convert needs exactly one of --kv-heads K or --latent-rank R")
  with claims.sole_writer(args.out, "convert"):  # one writer per --out, from the start
    return _convert(args, src, rank)


def _convert(args, src, rank: int | None) -> dict:
  from kvjax.io import checkpoint
  from kvjax.io import sources

  cfg, params, _ = sources.load(src, config_lib.parse_set(getattr(args, "set", None)))
  before = cfg.model.variant
  if rank is not None:
    from kvjax.cache import latent
    new_cfg, new_params = latent.factor(cfg, params, rank)
    method, what = f"latent_rank_{rank}", f"rank-{rank} latent K/V (SVD per layer)"
  elif args.kv_heads > cfg.model.n_kv_heads:
    new_cfg, new_params = expand(cfg, params, args.kv_heads)
    method, what = "expand", "K/V heads copied to their query groups (exact)"
  else:
    new_cfg, new_params = mean_pool(cfg, params, args.kv_heads)
    method, what = "mean_pool", "mean-pooled K/V heads"
  out = Path(args.out)
  if checkpoint.latest_step(out) is not None:
    raise KvjaxError(f"{out} already holds a checkpoint; choose a new --out folder")
  checkpoint.save(out, new_cfg, new_params, step=0,
                  meta={"converted_from": str(src), "method": method})
  print(f"converted {before} -> {new_cfg.model.variant} ({what}); checkpoint in {out}")
  return {"from": before, "to": new_cfg.model.variant, "out": str(out),
          "latent_rank": new_cfg.model.latent_rank}
