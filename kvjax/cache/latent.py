"""Latent (MLA-style) KV cache: one rank-A vector per token and layer instead of K and V.

A model with `model.latent_rank = A` has K/V projections of rank A: for each layer,

    [k_pre | v] = h @ W + b,   W = W_down @ U   (W_down: [E, A], U = `latent_up`: [A, Y],
                                                 Y = 2·K·D, rows orthonormal)

so the A numbers c = ([k_pre | v] - b) @ Uᵀ = h @ W_down determine the token's K and V.
The `latent` layout stores c (through the K codec, as an [L, B, 1, S, A] store: one "head"
of width A) and reads K and V back as c @ U + b.

RoPE, two forms (`model.rope_pairs`):

  r = 0: RoPE after the up-projection: `write` rotates the keys back (RoPE at -θ) before
      projecting them, and `read` up-projects every slot to a float32 [B, K, S, D] K and V
      and rotates its key again at the slot's position (slot = position) on every call:
      the latent saves memory held, not time.
  r > 0: decoupled RoPE, as MLA serves it. The model rotates only r frequency pairs of each
      KV head (partial RoPE: `rope_keep` marks them); those 2r rotated key columns per head
      are cached as they are, beside the latent, which compresses the other D - 2r key
      columns with the values (Y = K·(2D - 2r)). A slot holds one row [c ; k_rope] of
      W = A + 2·K·r numbers, and a layer reads it absorbed (`AbsorbedSegment`): each query
      head's non-rotated part is multiplied into latent space (q Ukᵀ: the key up-projection
      folded into the query), so a logit is q̃ · c + q_rope · k_rope; the values are the
      row itself (the latent's own storage, its rope columns ignored), and the probability-
      weighted latent is up-projected once per query head after the read (Uv: folded into
      the output). The whole read is one MQA-style read of W-wide rows by all H query
      heads: through the CPU read kernel, or the XLA read, never widened to K and V.

Bytes per token: L · (K codec bytes of one W-wide row; W = A at r = 0) — L · W · 4 with
fp32, against 2 · L · K · D · 4 for the dense cache. Codecs apply to the whole row.

`kvjax convert --latent-rank A` builds such a model from a dense one (`factor`): per
layer, the SVD of [W_k | W_v] ([E, Y]) gives U = the top A right singular vectors and
W ← W Uᵀ U (the best rank-A approximation); `rope_pairs` r > 0 first picks each KV head's r
pairs (the r highest frequencies, or by the weights' share of q·k: `weight_pairs`) and
factors the rest. At A = min(E, Y) and r = 0 or r = D/2 nothing is lost and the logits
equal the dense model's (tests/library/test_latent.py, tests/library/test_mla.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import codecs
from kvjax.cache import base
from kvjax.attention.base import MASKED
from kvjax.attention.native import merge
from kvjax.attention.rope import apply_rope, default_keep, pair_columns, rope_cos_sin
from kvjax.errors import KvjaxError


def width(m) -> int:
  """Y: the K/V columns the latent compresses (2·K·D, less 2r rotated key columns a head)."""
  return m.n_kv_heads * (2 * m.D - 2 * m.rope_pairs)


def row_width(m) -> int:
  """W: numbers a slot holds per layer, the latent and the rotated key columns."""
  return m.latent_rank + 2 * m.n_kv_heads * m.rope_pairs


def full_rank(m) -> int:
  """The rank at which the factorization is exact: min(E, Y)."""
  return min(m.d_model, width(m))


def check_config(c, m) -> None:
  """Host-side checks (`Latent.check`): the rank of any model, and what the layout needs."""
  if m.latent_rank < 0 or m.latent_rank > full_rank(m):
    raise KvjaxError(f"model.latent_rank={m.latent_rank} must be in [0, {full_rank(m)}] "
                     "(0: dense K/V; at most min(d_model, n_kv_heads * (2 * head_dim - 2 * "
                     "rope_pairs)))")
  if c.layout != "latent":
    return
  if not m.latent_rank:
    raise KvjaxError("cache.layout=latent needs a latent model (model.latent_rank > 0); build "
                     "one with `kvjax convert --latent-rank R`")
  if m.windowed or m.rope_local_theta:
    raise KvjaxError("cache.layout=latent reads one RoPE base and no window; this model has "
                     "local layers (model.sliding_window / rope_local_theta): use "
                     "cache.layout=contiguous or paged")
  if m.qk_norm:
    raise KvjaxError("cache.layout=latent holds keys as a linear map of the layer's input, and "
                     "this model normalizes each key head after its projection "
                     "(model.qk_norm); use cache.layout=contiguous or paged")
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
  up: Any = None         # [L, A, Y]: the model's up-projection, and [L, Y] its K/V bias,
  bias: Any = None       # attached for one model call only (`Latent.attach`; weights, not
                         # cache: `write` detaches them)
  rope: Any = None       # [L, K, 2r] and [L, K, D - 2r]: each head's rotated and other key
  rest: Any = None       # columns (model.rope_pairs > 0; attached like `up`)

  AXES: ClassVar[dict] = {"c": (base.LAYERS, base.BATCH, None, base.TOKENS),  # one row/token
                          "lengths": base.PER_SEQUENCE,
                          **dict.fromkeys(("up", "bias", "rope", "rest"), base.WEIGHTS)}


def weights(params, m) -> tuple[jax.Array, jax.Array]:
  """(up [L, A, Y], bias [L, Y]) from stacked (`layers`) or split (`layers_i`) params; with
  rope pairs, the bias of the key columns the latent holds (`columns`)."""
  def stacked(*path):  # the leaf at `path` of every layer, [L, ...]
    if "layers" in params:
      return functools.reduce(lambda a, k: a[k], path, params["layers"])
    return jnp.stack([functools.reduce(lambda a, k: a[k], path, params[f"layers_{i}"])
                      for i in range(m.n_layers)])
  up = stacked("latent_up")
  L, K, D = up.shape[0], m.n_kv_heads, m.D
  if not m.qkv_bias:
    return up.astype(jnp.float32), jnp.zeros((L, width(m)), jnp.float32)
  bk, bv = stacked("k_proj", "bias").astype(jnp.float32), stacked("v_proj", "bias")
  if m.rope_pairs:
    _, rest = columns(params, m)
    bk = jnp.take_along_axis(bk.reshape(L, K, D), rest, axis=-1).reshape(L, -1)
  return up.astype(jnp.float32), jnp.concatenate([bk, bv.astype(jnp.float32)], axis=-1)


def columns(params, m) -> tuple[jax.Array, jax.Array]:
  """(rope [L, K, 2r], rest [L, K, D - 2r]): the key columns each layer's heads rotate and
  cache as they are, and those the latent compresses (`rope.pair_columns` of `rope_keep`)."""
  return jax.vmap(lambda k: pair_columns(k, m.rope_pairs))(jnp.asarray(params["rope_keep"]))


def _take(x, idx_KC):
  """x [..., K, D] -> [..., K, C]: each head's columns `idx_KC` ([K, C], or any shape that
  broadcasts against x's leading axes)."""
  idx = jnp.broadcast_to(idx_KC, (*x.shape[:-1], idx_KC.shape[-1]))
  return jnp.take_along_axis(x, idx, axis=-1)


def _place(parts, idxs, D):
  """[..., K, D] from column blocks [..., K, C_i] at each head's columns `idxs[i]` [K, C_i]."""
  x = jnp.concatenate(parts, axis=-1)
  idx = jnp.concatenate(idxs, axis=-1)
  inv = jnp.argsort(idx, axis=-1)  # each head's columns back in order
  return _take(x, inv)


@dataclasses.dataclass(frozen=True)
class AbsorbedSegment(base.LayerSegment):
  """One layer's latent rows [L, B, 1, S, W] (W = A + K·2r) read as MLA reads them: `k` and
  `v` are the same leaves, and `attend` transforms the queries into row space, reads the
  rows as one KV head of width W (the CPU read kernel or the XLA read), and brings the
  result back to each head's D values. `dense` is the up-projected read (the reference)."""

  up: Any = None        # [A, Y] this layer's up-projection, [Y] its K/V bias
  bias: Any = None
  rope: Any = None      # [K, 2r], [K, D - 2r] this layer's key columns
  rest: Any = None
  rank: int = 0         # A
  head_dim: int = 0     # D

  def _parts(self):
    K, N = self.rest.shape
    A, D = self.rank, self.head_dim
    up_k = self.up[:, :K * N].reshape(A, K, N)
    up_v = self.up[:, K * N:].reshape(A, K, D)
    return up_k, up_v, self.bias[:K * N].reshape(K, N), self.bias[K * N:].reshape(K, D)

  def attend(self, q_BKGTD, state, read):
    B, K, G, T, D = q_BKGTD.shape
    f32 = jnp.float32
    up_k, up_v, b_k, b_v = self._parts()
    q = q_BKGTD.astype(f32)
    q_nope = _take(q.transpose(0, 2, 3, 1, 4), self.rest).transpose(0, 3, 1, 2, 4)
    q_rope = _take(q.transpose(0, 2, 3, 1, 4), self.rope).transpose(0, 3, 1, 2, 4)
    q_lat = jnp.einsum("bkgtn,akn->bkgta", q_nope, up_k)
    const_BKGT = jnp.einsum("bkgtn,kn->bkgt", q_nope, b_k)  # q · (the keys' bias): the latent
    eye_KK = jnp.eye(K, dtype=f32)                          # holds the key less its bias
    q_pos = jnp.einsum("bkgtr,kj->bkgtjr", q_rope, eye_KK).reshape(B, K, G, T, -1)
    q_row = jnp.concatenate([q_lat, q_pos], axis=-1)
    W = q_row.shape[-1]
    q_rows = q_row.reshape(B, 1, K * G, T, W)
    rows = base.LayerSegment(self.k, self.v, self.mask_BS, self.k_codec, self.v_codec,
                             live=self.live, layer=self.layer)
    init = (jnp.full((B, 1, K * G, T), MASKED, f32), jnp.zeros((B, 1, K * G, T), f32),
            jnp.zeros((B, 1, K * G, T, W), f32))
    m, s, acc = read(q_rows, rows, init)
    m, s = m.reshape(B, K, G, T), s.reshape(B, K, G, T)
    acc_A = acc.reshape(B, K, G, T, W)[..., :self.rank]
    acc_D = jnp.einsum("bkgta,akd->bkgtd", acc_A, up_v) + s[..., None] * b_v[None, :, None, None]
    part = (jnp.where(s > 0, m + const_BKGT, m), s, acc_D)
    return merge(state, part)

  def dense(self):
    """The up-projected read: K and V [B, K, S, D] in float32 from the rows."""
    rows = self.cut(self.k, 0, self.mask_BS.shape[1])          # [B, 1, S, W]
    row = self.k_codec.decode(rows, jnp.float32)[:, 0]
    K, N = self.rest.shape
    D = self.head_dim
    B, S = row.shape[:2]
    kv = row[..., :self.rank] @ self.up + self.bias
    k_nope, v = kv[..., :K * N].reshape(B, S, K, N), kv[..., K * N:].reshape(B, S, K, D)
    k_rope = row[..., self.rank:].reshape(B, S, K, -1)
    k = _place([k_rope, k_nope], [self.rope, self.rest], D)
    f32 = codecs.get("fp32")
    return base.Segment(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), self.mask_BS, f32,
                        f32, live=self.live)


class Latent(base.Layout):
  """`capacity` slots per sequence of one W-wide row per layer; position p in slot p."""

  name = "latent"

  def check(self, cache_cfg, model_cfg) -> None:
    check_config(cache_cfg, model_cfg)

  def init(self, spec: base.CacheSpec) -> LatentCache:
    m = spec.model_cfg
    shape = (spec.n_layers, spec.batch, 1, spec.capacity, row_width(m))
    return LatentCache(c=spec.kc.init(shape),
                       lengths=jnp.zeros((spec.batch,), jnp.int32), spec=spec)

  def attach(self, cache: LatentCache, params) -> LatentCache:
    m = cache.spec.model_cfg
    up, bias = weights(params, m)
    rope_cols, rest = columns(params, m) if m.rope_pairs else (None, None)
    return dataclasses.replace(cache, up=up, bias=bias, rope=rope_cols, rest=rest)

  def store(self, cache: LatentCache) -> Any:
    return (cache.c, cache.up, cache.bias, cache.rope, cache.rest)

  def read(self, spec, store, lengths_B, layer):
    c, up, bias, rope_cols, rest = store
    m = spec.model_cfg
    mask_BS = jnp.arange(spec.capacity)[None, :] < lengths_B[:, None]
    if m.rope_pairs:  # the rows read absorbed, as one W-wide head (`AbsorbedSegment`)
      return [AbsorbedSegment(c, c, mask_BS, spec.kc, spec.kc, live=jnp.max(lengths_B),
                              layer=layer, up=up[layer], bias=bias[layer],
                              rope=rope_cols[layer], rest=rest[layer],
                              rank=m.latent_rank, head_dim=m.D)]
    B, S, K, D = spec.batch, spec.capacity, spec.n_kv_heads, spec.head_dim
    c_B1SA = jax.tree.map(lambda a: a[layer], c)
    lat_BSA = spec.kc.decode(c_B1SA, jnp.float32)[:, 0]
    kv_BSY = jnp.einsum("bsa,ay->bsy", lat_BSA, up[layer]) + bias[layer]
    k_BSKD = kv_BSY[..., :K * D].reshape(B, S, K, D)
    v_BSKD = kv_BSY[..., K * D:].reshape(B, S, K, D)
    cos, sin = rope_cos_sin(jnp.arange(S, dtype=jnp.int32)[None, :], m)
    k_BSKD = apply_rope(k_BSKD, cos, sin)  # RoPE after the up-projection, at slot = position
    f32 = codecs.get("fp32")
    return [base.Segment(k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3), mask_BS,
                         f32, f32, live=jnp.max(lengths_B))]

  def write(self, cache: LatentCache, k_LBTKD, v_LBTKD, positions_BT) -> LatentCache:
    spec = cache.spec
    m = spec.model_cfg
    L, B, T, K, D = k_LBTKD.shape
    k32, v32 = k_LBTKD.astype(jnp.float32), v_LBTKD.astype(jnp.float32)
    if m.rope_pairs:  # the rotated columns kept as they are; the rest and V to the latent
      idx = lambda cols: cols[:, None, None]  # noqa: E731  [L, 1, 1, K, C]
      k_rope = _take(k32, idx(cache.rope))
      k_rest = _take(k32, idx(cache.rest))
      kv_LBTY = jnp.concatenate([k_rest.reshape(L, B, T, -1), v32.reshape(L, B, T, K * D)], -1)
    else:
      cos, sin = rope_cos_sin(positions_BT, m)
      # Undo RoPE (rotation by -θ): the latent holds the unrotated key.
      k_flat = jnp.moveaxis(k32, 0, 2).reshape(B, T, L * K, D)  # L·K heads
      k_pre = jnp.moveaxis(apply_rope(k_flat, cos, -sin).reshape(B, T, L, K, D), 2, 0)
      kv_LBTY = jnp.concatenate([k_pre.reshape(L, B, T, K * D), v32.reshape(L, B, T, K * D)],
                                axis=-1)
    rows = jnp.einsum("lbty,lay->lbta", kv_LBTY - cache.bias[:, None, None], cache.up)
    if m.rope_pairs:
      rows = jnp.concatenate([rows, k_rope.reshape(L, B, T, -1)], axis=-1)
    slots_BT = jnp.where(positions_BT >= 0, positions_BT, spec.capacity)  # padding: dropped
    new = spec.kc.encode(rows[:, :, None])
    c = jax.tree.map(base.scatter(slots_BT), cache.c, new)
    lengths = cache.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    return dataclasses.replace(cache, c=c, lengths=lengths, up=None, bias=None, rope=None,
                               rest=None)

  def asymptotic(self, cfg) -> float:
    """One W-wide row a layer through the K codec (the latent and its rotated columns)."""
    kc = codecs.for_role(cfg.cache.k_codec, cfg.cache, "k")
    return cfg.model.n_layers * kc.bytes_per_token(1, row_width(cfg.model))

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    per_token = spec.kc.bytes_per_token(1, row_width(spec.model_cfg))
    return int(round(spec.n_layers * spec.batch * spec.capacity * per_token)) + 4 * spec.batch


base.register(Latent())


def weight_pairs(m, params) -> jax.Array:
  """[L, K, D/2] the pairs each KV head keeps rotating by the weights (`--rope-choice qk`):
  |Wk's columns of the pair| times the summed |Wq's| over the head's query group."""
  layers = params["layers"]
  L, E = layers["k_proj"]["kernel"].shape[:2]
  K, G, D, P = m.n_kv_heads, m.G, m.D, m.D // 2
  pair = lambda w: jnp.sqrt(jnp.sum(w[..., :P] ** 2 + w[..., P:] ** 2, axis=1))  # noqa: E731
  wk = pair(layers["k_proj"]["kernel"].astype(jnp.float32).reshape(L, E, K, D))
  wq = pair(layers["q_proj"]["kernel"].astype(jnp.float32).reshape(L, E, K * G, D))
  return keep_top(wk * wq.reshape(L, K, G, P).sum(axis=2), m.rope_pairs)


def keep_top(scores, r: int) -> jax.Array:
  """[L, K, P] 1.0 at each head's r highest-scoring pairs, 0.0 elsewhere."""
  top = jnp.argsort(-scores, axis=-1)[..., :r]
  keep = jnp.zeros(scores.shape, jnp.float32)
  return jnp.put_along_axis(keep, top, 1.0, axis=-1, inplace=False)


def split_kv(m, layers, keep_all) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(W [L, E, Y]: the key columns the latent holds then the values, the key columns of
  each head it does not hold [L, E, K, 2r] (empty at r = 0), rest [L, K, D - 2r])."""
  Wk, Wv = (layers[n]["kernel"].astype(jnp.float32) for n in ("k_proj", "v_proj"))
  (L, E, _), K, D = Wk.shape, m.n_kv_heads, m.D
  if not m.rope_pairs:
    return jnp.concatenate([Wk, Wv], -1), jnp.zeros((L, E, K, 0)), jnp.zeros((L, K, D), int)
  rope_cols, rest = columns({"rope_keep": keep_all}, m)
  Wk4 = Wk.reshape(L, E, K, D)
  w_rest, w_rope = _take(Wk4, rest[:, None]).reshape(L, E, -1), _take(Wk4, rope_cols[:, None])
  return jnp.concatenate([w_rest, Wv], -1), w_rope, (rope_cols, rest)


def join_kv(m, W_LEY, w_rope, cols) -> tuple[jax.Array, jax.Array]:
  """(k_proj, v_proj kernels) from `split_kv`'s parts (W possibly of lower rank)."""
  (L, E, _), K, D = W_LEY.shape, m.n_kv_heads, m.D
  if not m.rope_pairs:
    return W_LEY[..., :K * D], W_LEY[..., K * D:]
  rope_cols, rest = cols
  N = rest.shape[-1]
  k_rest = W_LEY[..., :K * N].reshape(L, E, K, N)
  k = _place([w_rope, k_rest], [rope_cols[:, None], rest[:, None]], D)
  return k.reshape(L, E, K * D), W_LEY[..., K * N:]


ROPE_CHOICES = ("high", "qk")  # the r highest-frequency pairs; or those with the most q·k


def check_conversion(m, rank: int, rope_pairs: int, choice: str = "high") -> None:
  """Host-side refusals of `--latent-rank A --rope-pairs r --rope-choice C` for model `m`."""
  if choice not in ROPE_CHOICES:
    raise KvjaxError(f"--rope-choice '{choice}' unknown; use one of {', '.join(ROPE_CHOICES)}")
  if not 0 <= rope_pairs <= m.D // 2:
    raise KvjaxError(f"--rope-pairs {rope_pairs} must be in [0, {m.D // 2}] for heads of "
                     f"{m.D} (the frequency pairs each key head keeps rotating)")
  if rope_pairs and (m.rope_local_theta or m.windowed):
    raise KvjaxError("--rope-pairs needs one RoPE base and no window; this model has local "
                     "layers (model.rope_local_theta / sliding_window)")
  if m.qk_norm:
    raise KvjaxError("a latent conversion needs keys linear in the layer's input; this model "
                     "normalizes each key head after its projection (model.qk_norm)")
  full = full_rank(dataclasses.replace(m, rope_pairs=rope_pairs))
  if not 1 <= rank <= full:
    raise KvjaxError(f"--latent-rank {rank} must be in [1, {full}] for this model "
                     "(min(d_model, n_kv_heads * (2 * head_dim - 2 * rope_pairs)))")



def factor(cfg, params, rank: int, rope_pairs: int = 0, choice: str = "high"):
  """(config with model.latent_rank = rank (and model.rope_pairs) and cache.layout = latent,
  params whose K/V projections are their best rank-`rank` approximation, with `latent_up`,
  and with rope pairs `rope_keep` (`weight_pairs`)), per layer."""
  from kvjax import config as config_lib
  check_conversion(cfg.model, rank, rope_pairs, choice)
  new_cfg = config_lib.apply_overrides(cfg, {"model.latent_rank": rank,
                                             "model.rope_pairs": rope_pairs,
                                             "cache.layout": "latent"})
  m = new_cfg.model
  if cfg.model.rope_pairs and cfg.model.rope_pairs != rope_pairs:
    raise KvjaxError("this model already rotates part of its pairs (model.rope_pairs); "
                     "convert the model it came from")
  if "layers" not in params:
    raise KvjaxError("latent conversion needs stacked layer params (a scanned model)")
  layers = dict(params["layers"])
  keep = None if not rope_pairs else params["rope_keep"] if "rope_keep" in params else \
      weight_pairs(m, params) if choice == "qk" else \
      default_keep(m.n_layers, m.n_kv_heads, m.D // 2, rope_pairs)
  W, w_rope, cols = split_kv(m, layers, keep)
  up = jnp.linalg.svd(W, full_matrices=False)[2][:, :rank]  # [L, A, Y], orthonormal rows
  W_r = jnp.einsum("lex,lax,lay->ley", W, up, up)
  Wk, Wv = join_kv(m, W_r, w_rope, cols)
  layers["k_proj"] = {**layers["k_proj"], "kernel": Wk.astype(layers["k_proj"]["kernel"].dtype)}
  layers["v_proj"] = {**layers["v_proj"], "kernel": Wv.astype(layers["v_proj"]["kernel"].dtype)}
  layers["latent_up"] = up.astype(jnp.dtype(m.param_dtype))
  out = {**params, "layers": layers}
  if rope_pairs:
    out["rope_keep"] = jnp.asarray(keep, jnp.float32)
  return new_cfg, out
