"""One decoder layer (RMSNorm, RoPE, grouped attention over the cache, SwiGLU), written once
for every way of holding its weights, and the named input it reads (`LayerInput`).

Parameter names follow Hugging Face Llama (q_proj, ..., input_layernorm) so checkpoint
import is a rename and a transpose.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from kvjax import attention, kernels, progress
from kvjax.attention import rope
from kvjax.attention.rope import apply_rope
from kvjax.cache import base as cache_base
from kvjax.codecs import rotate
from kvjax.config import ModelConfig


@struct.dataclass
class LayerInput:
  """What every layer reads besides its own weights and x: the same for all layers."""

  positions_BT: jax.Array   # [B, T] absolute position of each new token, -1 = padding
  cos_BTD: jax.Array        # [B, T, D] RoPE tables at those positions
  sin_BTD: jax.Array
  lengths_B: Any = None     # [B] tokens the cache held before this call (None: no cache)
  store: Any = None         # the cache's stacked leaves (`Layout.store`), None: no cache
  spec: Any = struct.field(pytree_node=False, default=None)  # its CacheSpec
  bucket: int = struct.field(pytree_node=False, default=0)  # slots a one-block read covers
                                                            # (0: all; `decode.bucket_for`)
  queries: bool = struct.field(pytree_node=False, default=False)  # return the rotated queries
  cos_local: Any = None     # [B, T, D] the local layers' RoPE tables (model.rope_local_theta)
  sin_local: Any = None
  rope_keep: Any = None     # [L, K, D/2] the pairs each KV head rotates (model.rope_pairs)


def rms_norm(x, weight, eps: float, dtype):
  """RMSNorm in float32, cast like HF: `weight * normalized(x)` in `dtype`."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(dtype) * x32.astype(dtype)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    return rms_norm(x, weight, self.eps, self.dtype)


def dense(cfg: ModelConfig, features: int, name: str, bias: bool = False) -> nn.Dense:
  return nn.Dense(features, use_bias=bias, dtype=jnp.dtype(cfg.dtype),
                  param_dtype=jnp.dtype(cfg.param_dtype), name=name,
                  kernel_init=nn.initializers.normal(0.02))


def linears(h, ps, dtype):
  """What `nn.Dense` computes from each of its params `ps` ({"kernel", optional "bias"}),
  all of one input `h`. float32 activations go through `kernels.weight_dots` (kernels
  stored in bfloat16 or float32), which for a decode step's few rows reads every weight at
  its stored bytes, the matrices of one call in one dispatch; XLA multiplies elsewhere
  (widening a bf16 matrix whole first)."""
  ys = kernels.weight_dots(h.astype(dtype), [p["kernel"] for p in ps])
  return tuple(y + p["bias"].astype(dtype) if "bias" in p else y for y, p in zip(ys, ps))


def linear(h, p, dtype):
  """`linears` of one param dict."""
  return linears(h, (p,), dtype)[0]


class Head(nn.Module):
  """An untied lm_head: `nn.Dense`'s parameter (same name, shape and initialisation),
  multiplied by `linear`."""

  features: int
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x_BTE):
    kernel = self.param("kernel", nn.initializers.normal(0.02), (x_BTE.shape[-1], self.features),
                        self.param_dtype)
    return linear(x_BTE, {"kernel": kernel}, self.dtype)


def embed_rows(table_VE, tokens_BT, dtype):
  """The embedding rows of `tokens_BT` (as `nn.Embed` looks them up), widened to `dtype`
  after the lookup. As in `lm_head`, a barrier ties the table to the tokens: XLA would
  otherwise widen the whole table first and hoist that out of a decode loop."""
  if table_VE.dtype != jnp.dtype(dtype):
    table_VE, tokens_BT = jax.lax.optimization_barrier((table_VE, tokens_BT))
  return jnp.take(table_VE, tokens_BT, axis=0).astype(dtype)


def lm_head(x_BTE, table_VE, dtype):
  """Logits from a tied embedding table, as `nn.Embed.attend` computes them. Under float32
  activations the table goes through `kernels.weight_dot` (its table-rows form), which
  reads it at its stored bytes for a decode step's few rows. Where XLA multiplies it, a
  barrier ties the table to this call's activations, so that a decode loop cannot hoist
  the widening out of its body as a loop-invariant float32 copy of the table (made on
  every decode call, then read at twice the table's bytes on every step)."""
  x_BTE = x_BTE.astype(dtype)
  if table_VE.dtype != x_BTE.dtype:
    table_VE, x_BTE = jax.lax.optimization_barrier((table_VE, x_BTE))
  return kernels.weight_dot(x_BTE, table_VE, transposed=True)  # XLA's product elsewhere


# The norms a layer may hold besides input_layernorm / post_attention_layernorm (the
# latter is the norm before the MLP, as Llama names it).
EXTRA_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_ffw_norm")
ACTS = {"silu": nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def per_layer(layer, values):
  """values[layer] for a Python int `layer` (an unrolled loop) or a traced one (a scan)."""
  return values[layer] if isinstance(layer, int) else jnp.asarray(values)[layer]


def window_floor(cfg: ModelConfig, layer, positions_BT):
  """[B, T] the lowest position each new token attends to in layer `layer` (its window
  `model.sliding_window`; 0 where the layer sees every token); None: no layer has a window."""
  if not cfg.windowed:
    return None
  W = per_layer(layer, [cfg.window_of(i) for i in range(cfg.n_layers)])
  return jnp.where(W > 0, positions_BT - W + 1, 0).astype(jnp.int32)


def block_forward(cfg: ModelConfig, dense, norm, x_BTE, layer, inp: LayerInput):
  """One decoder layer, written once for every way of holding its weights:
  `dense(h, [(name, features, bias), ...])` returns one projection of `h` per entry (the
  entries share their input), `norm(name, x)` applies a named RMSNorm. `layer` is this
  layer's index (a traced scalar inside a scan); the cache's layout reads its segments.
  Returns x and this layer's new (k, v), plus the rotated queries when the layout
  `wants_queries` (it scores tokens by attention when it writes) or the step asks for them
  (`inp.queries`: a policy's prefill selection); under `cache.rotate`
  k, v and those queries are in the rotated basis (`kvjax.codecs.rotate`)."""
  o_BTE, kv = attention_block(cfg, dense, norm, x_BTE, layer, inp)
  x_BTE = x_BTE + o_BTE
  x_BTE = x_BTE + mlp_rows(cfg, dense, norm, x_BTE)
  if progress.wanted(x_BTE.shape[1]):  # a long prompt: one tick a layer, once it is done
    jax.debug.callback(progress.tick, x_BTE[0, 0, 0])
  return x_BTE, kv


MLP_ROWS = 2048  # tokens a block of a long prompt's MLP (its gate, up and gated products)


def mlp_rows(cfg: ModelConfig, dense, norm, x_BTE):
  """`mlp_block`, MLP_ROWS tokens at a time (a `lax.map`) when a call has more: the MLP
  treats each token alone, so a long prompt's [T, 3F] products need never exist at once
  (a 32k-token prompt through Qwen2.5's F = 4,864 would hold 1.9 GB of them)."""
  B, T, E = x_BTE.shape
  if T <= MLP_ROWS:
    return mlp_block(cfg, dense, norm, x_BTE)
  n = -(-T // MLP_ROWS)
  x_NBRE = jnp.pad(x_BTE, [(0, 0), (0, n * MLP_ROWS - T), (0, 0)]) \
      .reshape(B, n, MLP_ROWS, E).swapaxes(0, 1)
  y_NBRE = jax.lax.map(lambda x: mlp_block(cfg, dense, norm, x), x_NBRE)
  return y_NBRE.swapaxes(0, 1).reshape(B, n * MLP_ROWS, E)[:, :T]


def attention_block(cfg: ModelConfig, dense, norm, x_BTE, layer, inp: LayerInput):
  """The attention half of `block_forward`: what it adds to the residual stream x, and the
  layer's new (k, v[, q]). Variant conversions (`kvjax.lab.convert.fit`) fit its projections
  against the original model's."""
  cos, sin = inp.cos_BTD, inp.sin_BTD
  if inp.cos_local is not None:  # local layers rotate with their own base
    local = per_layer(layer, [cfg.is_local(i) for i in range(cfg.n_layers)])
    cos, sin = jnp.where(local, inp.cos_local, cos), jnp.where(local, inp.sin_local, sin)
  B, T, _ = x_BTE.shape
  H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.D

  h = norm("input_layernorm", x_BTE)
  q, k, v = dense(h, [("q_proj", H * D, cfg.qkv_bias), ("k_proj", K * D, cfg.qkv_bias),
                      ("v_proj", K * D, cfg.qkv_bias)])
  q_BTHD, k_BTKD, v_BTKD = q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
  if cfg.qk_norm:
    q_BTHD, k_BTKD = norm("q_norm", q_BTHD), norm("k_norm", k_BTKD)
  if cfg.rope_pairs:  # partial RoPE: each KV head (and its queries) rotates its kept pairs
    keep_pairs = per_layer(layer, inp.rope_keep)
    cos_k, sin_k = rope.partial(cos, sin, keep_pairs)
    cos_q, sin_q = rope.partial(cos, sin, jnp.repeat(keep_pairs, H // K, axis=0))
    q_BTHD, k_BTKD = apply_rope(q_BTHD, cos_q, sin_q), apply_rope(k_BTKD, cos_k, sin_k)
  else:
    q_BTHD, k_BTKD = apply_rope(q_BTHD, cos, sin), apply_rope(k_BTKD, cos, sin)
  if cfg.query_scale and cfg.query_scale != D:  # the attention scales by D**-0.5
    q_BTHD = q_BTHD * jnp.asarray((D / cfg.query_scale) ** 0.5, q_BTHD.dtype)

  layout = None if inp.spec is None else cache_base.get(inp.spec.layout)
  # cache.rotate: K, Q and V in a rotated basis around the cache, the output rotated back
  rot_DD = None if layout is None else rotate.of(inp.spec.cache_cfg, D)
  if rot_DD is not None:
    q_BTHD, k_BTKD, v_BTKD = (rotate.apply(x, rot_DD) for x in (q_BTHD, k_BTKD, v_BTKD))
  segments = [] if layout is None else layout.read(inp.spec, inp.store, inp.lengths_B, layer)
  attend = attention.get(cfg.attention, cfg.program, inp.bucket)
  floor_BT = window_floor(cfg, layer, inp.positions_BT)
  window = {} if floor_BT is None else {"floor_BT": floor_BT, "band": cfg.sliding_window}
  attn_BTHD = attend(q_BTHD, k_BTKD, v_BTKD, inp.positions_BT, segments, **window)
  if rot_DD is not None:
    attn_BTHD = rotate.apply(attn_BTHD, rot_DD, back=True)
  (o,) = dense(attn_BTHD.reshape(B, T, H * D), [("o_proj", cfg.d_model, False)])
  if cfg.sandwich_norm:
    o = norm("post_attn_norm", o)
  kv = (k_BTKD, v_BTKD)
  if layout is not None and (inp.queries or layout.wants_queries(inp.spec)):
    kv += (q_BTHD,)  # for the layout's `write`, or asked for by the step (`kvjax.decode.step`)
  return o, kv


def mlp_block(cfg: ModelConfig, dense, norm, x_BTE):
  """The MLP half of `block_forward`: what it adds to the residual stream x."""
  h = norm("post_attention_layernorm", x_BTE)
  gate, up = dense(h, [("gate_proj", cfg.F, False), ("up_proj", cfg.F, False)])
  (down,) = dense(ACTS[cfg.mlp_act](gate) * up, [("down_proj", cfg.d_model, False)])
  if cfg.sandwich_norm:
    down = norm("post_ffw_norm", down)
  return down


def latent_width(cfg: ModelConfig) -> int:
  """Y: the key and value columns a latent compresses, 2·K·D, less the 2r rotated key columns
  per KV head the cache keeps beside it (`model.rope_pairs`)."""
  return cfg.n_kv_heads * (2 * cfg.D - 2 * cfg.rope_pairs)


class Block(nn.Module):
  """One decoder layer with its own params (Flax): x is the carry of a layer loop, `layer`
  its index, `inp` the same for every layer."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTE, layer, inp: LayerInput):
    cfg = self.cfg
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    proj = lambda h, outs: [dense(cfg, f, n, b)(h) for n, f, b in outs]  # noqa: E731
    norm = lambda name, x: RMSNorm(cfg.norm_eps, dtype, pdtype, name=name)(x)  # noqa: E731
    if cfg.latent_rank:  # the latent cache's up-projection (read by kvjax.cache.latent, not here)
      self.param("latent_up", nn.initializers.zeros, (cfg.latent_rank, latent_width(cfg)),
                 pdtype)
    return block_forward(cfg, proj, norm, x_BTE, layer, inp)
