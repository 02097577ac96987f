"""Latent (MLA-style) KV cache: one rank-A vector per token and layer instead of K and V.

A model with `model.latent_rank = A` has K/V projections of rank A: for each layer,

    [k_pre | v] = h @ W + b,   W = W_down @ U   (W_down: [E, A], U = `latent_up`: [A, Y],
                                                 Y = 2·K·D, rows orthonormal)

so the A numbers c = ([k_pre | v] - b) @ Uᵀ = h @ W_down determine the token's K and V.
The `latent` layout stores c (through the K codec, as an [L, B, 1, S, A] store: one "head"
of width A) and reads K and V back as c @ U + b.

RoPE: applied after the up-projection, at read time. The model hands the layout keys
already rotated at their positions; `write` rotates them back (RoPE at -θ), projects onto
the latent, and `read` up-projects every slot and rotates its key again at the slot's
position (slot = position, as in `contiguous`). No decoupled RoPE part is cached.

Read cost: each layer up-projects its whole store to a float32 [B, K, S, D] K and V on
every call (folding U into the query and output projections is not built), so the
latent saves memory held, not time.

Bytes per token: L · (K codec bytes of one A-wide vector) — L · A · 4 with fp32, against
2 · L · K · D · 4 for the dense cache.

`kvjax convert --latent-rank A` builds such a model from a dense one (`factor`): per
layer, the SVD of [W_k | W_v] ([E, Y]) gives U = the top A right singular vectors and
W ← W Uᵀ U (the best rank-A approximation). At A = min(E, Y) nothing is lost and the
logits equal the dense model's (tests/test_latent.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import codecs
from kvjax.cache import base
from kvjax.attention.rope import apply_rope, rope_cos_sin
from kvjax.errors import KvjaxError


def full_rank(m) -> int:
  """The rank at which the factorization is exact: min(E, 2·K·D)."""
  return min(m.d_model, 2 * m.n_kv_heads * m.D)


def check_config(c, m) -> None:
  """Host-side checks (`Latent.check`): the rank of any model, and what the layout needs."""
  if m.latent_rank < 0 or m.latent_rank > full_rank(m):
    raise KvjaxError(f"model.latent_rank={m.latent_rank} must be in [0, {full_rank(m)}] "
                     "(0: dense K/V; at most min(d_model, 2 * n_kv_heads * head_dim))")
  if c.layout != "latent":
    return
  if not m.latent_rank:
    raise KvjaxError("cache.layout=latent needs a latent model (model.latent_rank > 0); build "
                     "one with `kvjax convert --latent-rank R`")
  if m.windowed or m.rope_local_theta:
    raise KvjaxError("cache.layout=latent reads one RoPE base and no window; this model has "
                     "local layers (model.sliding_window / rope_local_theta): use "
                     "cache.layout=contiguous or paged")
  if c.residual or c.k_axis == "channel":
    raise KvjaxError("cache.layout=latent stores single latents; set cache.residual=0 and "
                     "cache.k_axis=token")
  if c.rotate != "none" or c.keep_first:
    raise KvjaxError("cache.layout=latent stores rank-A latents, not per-head keys: set "
                     "cache.rotate=none and cache.keep_first=0")



@struct.dataclass
class LatentCache:
  c: Any                 # K codec storage of the latents, leaves [L, B, 1, S, A]
  lengths: jax.Array     # [B] int32: tokens held per sequence
  spec: base.CacheSpec = struct.field(pytree_node=False)
  up: Any = None         # [L, A, Y] and [L, Y] (Y = 2·K·D): the model's up-projection and K/V
  bias: Any = None       # bias, attached for one model call only (`Latent.attach`; weights,
                         # not cache: `write` detaches them)


def weights(params, m) -> tuple[jax.Array, jax.Array]:
  """(up [L, A, Y], bias [L, Y]) from stacked (`layers`) or split (`layers_i`) params."""
  def stacked(name, leaf):
    if "layers" in params:
      return params["layers"][name][leaf]
    return jnp.stack([params[f"layers_{i}"][name][leaf] for i in range(m.n_layers)])

  if "layers" in params:
    up = params["layers"]["latent_up"]
  else:
    up = jnp.stack([params[f"layers_{i}"]["latent_up"] for i in range(m.n_layers)])
  L, KD = up.shape[0], m.n_kv_heads * m.D
  if m.qkv_bias:
    bias = jnp.concatenate([stacked("k_proj", "bias"), stacked("v_proj", "bias")], axis=-1)
  else:
    bias = jnp.zeros((L, 2 * KD), jnp.float32)
  return up.astype(jnp.float32), bias.astype(jnp.float32)


class Latent(base.Layout):
  """`capacity` slots per sequence of one rank-A latent per layer; position p in slot p."""

  name = "latent"

  def check(self, cache_cfg, model_cfg) -> None:
    check_config(cache_cfg, model_cfg)

  def init(self, spec: base.CacheSpec) -> LatentCache:
    m = spec.model_cfg
    shape = (spec.n_layers, spec.batch, 1, spec.capacity, m.latent_rank)
    return LatentCache(c=spec.kc.init(shape),
                       lengths=jnp.zeros((spec.batch,), jnp.int32), spec=spec)

  def attach(self, cache: LatentCache, params) -> LatentCache:
    up, bias = weights(params, cache.spec.model_cfg)
    return dataclasses.replace(cache, up=up, bias=bias)

  def store(self, cache: LatentCache) -> Any:
    return (cache.c, cache.up, cache.bias)

  def read(self, spec, store, lengths_B, layer):
    c, up, bias = store
    m = spec.model_cfg
    B, S, K, D = spec.batch, spec.capacity, spec.n_kv_heads, spec.head_dim
    c_B1SA = jax.tree.map(lambda a: a[layer], c)
    lat_BSA = spec.kc.decode(c_B1SA, jnp.float32)[:, 0]
    kv_BSY = jnp.einsum("bsa,ay->bsy", lat_BSA, up[layer]) + bias[layer]
    k_BSKD = kv_BSY[..., :K * D].reshape(B, S, K, D)
    v_BSKD = kv_BSY[..., K * D:].reshape(B, S, K, D)
    cos, sin = rope_cos_sin(jnp.arange(S, dtype=jnp.int32)[None, :], m)
    k_BSKD = apply_rope(k_BSKD, cos, sin)  # RoPE after the up-projection, at slot = position
    mask_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
    f32 = codecs.get("fp32")
    return [base.Segment(k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3), mask_BS,
                         f32, f32, live=jnp.max(lengths_B))]

  def write(self, cache: LatentCache, k_LBTKD, v_LBTKD, positions_BT) -> LatentCache:
    spec = cache.spec
    L, B, T, K, D = k_LBTKD.shape
    cos, sin = rope_cos_sin(positions_BT, spec.model_cfg)
    # Undo RoPE (rotation by -θ): the latent holds the unrotated key.
    k_flat = jnp.moveaxis(k_LBTKD.astype(jnp.float32), 0, 2).reshape(B, T, L * K, D)  # L·K heads
    k_pre = jnp.moveaxis(apply_rope(k_flat, cos, -sin).reshape(B, T, L, K, D), 2, 0)
    kv_LBTY = jnp.concatenate([k_pre.reshape(L, B, T, K * D),
                               v_LBTKD.astype(jnp.float32).reshape(L, B, T, K * D)], axis=-1)
    c_LBTA = jnp.einsum("lbty,lay->lbta", kv_LBTY - cache.bias[:, None, None], cache.up)
    slots_BT = jnp.where(positions_BT >= 0, positions_BT, spec.capacity)  # padding: dropped
    new = spec.kc.encode(c_LBTA[:, :, None])
    c = jax.tree.map(base.scatter(slots_BT), cache.c, new)
    lengths = cache.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    return dataclasses.replace(cache, c=c, lengths=lengths, up=None, bias=None)

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    per_token = spec.kc.bytes_per_token(1, spec.model_cfg.latent_rank)
    return int(round(spec.n_layers * spec.batch * spec.capacity * per_token)) + 4 * spec.batch


base.register(Latent())


def factor(cfg, params, rank: int):
  """(config with model.latent_rank = rank and cache.layout = latent, params whose K/V
  projections are their best rank-`rank` approximation, with `latent_up`), per layer."""
  from kvjax import config as config_lib
  m = cfg.model
  if not 1 <= rank <= full_rank(m):
    raise KvjaxError(f"--latent-rank {rank} must be in [1, {full_rank(m)}] for this model "
                     "(min(d_model, 2 * n_kv_heads * head_dim))")
  if "layers" not in params:
    raise KvjaxError("latent conversion needs stacked layer params (a scanned model)")
  layers = dict(params["layers"])
  Wk, Wv = layers["k_proj"]["kernel"], layers["v_proj"]["kernel"]  # [L, E, K·D]
  W = jnp.concatenate([Wk, Wv], axis=-1).astype(jnp.float32)
  _, _, Vt = jnp.linalg.svd(W, full_matrices=False)
  up = Vt[:, :rank]  # [L, A, Y], orthonormal rows
  W_r = jnp.einsum("lex,lax,lay->ley", W, up, up)
  KD = Wk.shape[-1]
  layers["k_proj"] = {**layers["k_proj"], "kernel": W_r[..., :KD].astype(Wk.dtype)}
  layers["v_proj"] = {**layers["v_proj"], "kernel": W_r[..., KD:].astype(Wv.dtype)}
  layers["latent_up"] = up.astype(jnp.dtype(m.param_dtype))
  new_cfg = config_lib.apply_overrides(cfg, {"model.latent_rank": rank, "cache.layout": "latent"})
  return new_cfg, {**params, "layers": layers}
