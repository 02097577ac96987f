"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU) as a Flax Linen module used as a pure function:

    logits_BTV, cache = Transformer(cfg).apply({"params": params}, tokens_BT, positions_BT, cache)

`positions_BT[b, t]` is the absolute position of token t of sequence b, or -1 for
right-padding (a ragged batch); padding is never attended to and never stored. With
`cache=None` the call is the full forward pass over `tokens` alone (the reference).
With a cache, the layers read what the cache layout stores and the new K/V are written
after the layer loop. `init` creates the layers' params stacked on a leading layer axis
and `Transformer(cfg)` runs them as one `nn.scan`, which copies each weight matrix out of
the stack on every step. Prefill, decode and the serving engine take params split per
layer once (`split_layers`, via `decode.prepare_params`) and run
`Transformer(layer_loop="switch")`: one `lax.scan` whose projections pick their layer's
buffer by `lax.switch` (`switched_layers`), so no weight is copied and the layer body is
traced once; or, when `unrolled(cfg)` (`model.scan_unroll >= n_layers`),
`layer_loop="unrolled"`, a Python loop whose compile time grows with depth (measurements
in docs/architecture.md).

Parameter names follow Hugging Face Llama (q_proj, ..., input_layernorm) so checkpoint
import is a rename and a transpose.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax import attention
from kvjax.cache import LAYOUTS
from kvjax.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """Inverse frequencies [D/2], with Llama-3 `rope_scaling` when the config has it."""
  D = cfg.D
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
  scaling = dict(cfg.rope_scaling)
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "llama3":
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv = jnp.where(medium, smoothed, scaled)
  return inv


def rope_cos_sin(positions_BT: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables [B, T, D] in the rotate-half convention of HF Llama (float32)."""
  freqs = jnp.maximum(positions_BT, 0)[..., None].astype(jnp.float32) * rope_inv_freq(cfg)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTND: jax.Array, cos_BTD: jax.Array, sin_BTD: jax.Array) -> jax.Array:
  x = x_BTND.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_BTD[:, :, None, :] + rotated * sin_BTD[:, :, None, :]
  return out.astype(x_BTND.dtype)


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


def _dense(cfg: ModelConfig, features: int, name: str, bias: bool = False) -> nn.Dense:
  return nn.Dense(features, use_bias=bias, dtype=jnp.dtype(cfg.dtype),
                  param_dtype=jnp.dtype(cfg.param_dtype), name=name,
                  kernel_init=nn.initializers.normal(0.02))


def linear(h, p, dtype):
  """What `nn.Dense` computes from its params `p` ({"kernel", optional "bias"})."""
  kernel = p["kernel"].astype(dtype)
  y = jax.lax.dot_general(h.astype(dtype), kernel, (((h.ndim - 1,), (0,)), ((), ())))
  return y + p["bias"].astype(dtype) if "bias" in p else y


def block_forward(cfg: ModelConfig, spec, dense, norm, x_BTE, xs, ctx):
  """One decoder layer, written once for every way of holding its weights:
  `dense(h, [(name, features, bias), ...])` returns one projection of `h` per entry (the
  entries share their input), `norm(name, x)` applies a named RMSNorm."""
  layer, layer_store = xs
  positions_BT, cos, sin, lengths_B, stacked = ctx
  B, T, _ = x_BTE.shape
  H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.D

  h = norm("input_layernorm", x_BTE)
  q, k, v = dense(h, [("q_proj", H * D, cfg.qkv_bias), ("k_proj", K * D, cfg.qkv_bias),
                      ("v_proj", K * D, cfg.qkv_bias)])
  q_BTHD, k_BTKD, v_BTKD = q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
  q_BTHD, k_BTKD = apply_rope(q_BTHD, cos, sin), apply_rope(k_BTKD, cos, sin)

  if spec is None:
    segments = []
  elif stacked is not None:  # the layout slices (layer, block) itself: no per-layer copy
    segments = LAYOUTS[spec.layout].segments(spec, stacked, lengths_B, layer=layer)
  else:
    segments = LAYOUTS[spec.layout].segments(spec, layer_store, lengths_B)
  attn_BTHD = attention.ATTENTIONS[cfg.attention](q_BTHD, k_BTKD, v_BTKD, positions_BT, segments)
  (o,) = dense(attn_BTHD.reshape(B, T, H * D), [("o_proj", cfg.d_model, False)])
  x_BTE = x_BTE + o

  h = norm("post_attention_layernorm", x_BTE)
  gate, up = dense(h, [("gate_proj", cfg.F, False), ("up_proj", cfg.F, False)])
  (down,) = dense(nn.silu(gate) * up, [("down_proj", cfg.d_model, False)])
  return x_BTE + down, (k_BTKD, v_BTKD)


class Block(nn.Module):
  """One decoder layer with its own params (Flax). Scanned over layers: carry is x, xs is
  (layer index, this layer's cache store), or the whole stacked store rides in ctx when
  the layout reads it directly."""

  cfg: ModelConfig
  spec: object = None  # CacheSpec of the cache being read, or None (full forward)

  @nn.compact
  def __call__(self, x_BTE, xs, ctx):
    cfg = self.cfg
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    dense = lambda h, outs: [_dense(cfg, f, n, b)(h) for n, f, b in outs]  # noqa: E731
    norm = lambda name, x: RMSNorm(cfg.norm_eps, dtype, pdtype, name=name)(x)  # noqa: E731
    if cfg.latent_rank:  # the latent cache's up-projection (read by kvjax.cache.latent, not here)
      self.param("latent_up", nn.initializers.zeros,
                 (cfg.latent_rank, 2 * cfg.n_kv_heads * cfg.D), pdtype)
    return block_forward(cfg, self.spec, dense, norm, x_BTE, xs, ctx)


def switched_layers(cfg: ModelConfig, spec, layers: list, x_BTE, stores, ctx):
  """The layer loop over per-layer weight trees (`split_layers`) as one `lax.scan`, with no
  weight copied: XLA:CPU's dot reads an operand only as a whole buffer, so a scan that
  slices layer i's matrix out of a stacked [L, ...] param (nn.scan, or weights as scan xs)
  copies every matrix on every step (a `dynamic-slice` fusion per matrix). Here each
  projection is a `lax.switch` on the layer index whose branch i multiplies by layer i's
  own buffer: a conditional selects the buffer, nothing is copied. Projections sharing an
  input share a switch (q/k/v, o, gate/up, down: four per layer step, each of L branches
  of one to three dots). The rest of the layer is traced once, so compile time grows only
  by those small branches. Weights stored in another dtype than `cfg.dtype` are widened
  inside the branch, as `nn.Dense` does (one matrix-sized temporary at a time). Norm
  weights (vectors) are stacked and indexed. Returns x and the stacked new (k, v)."""
  dtype = jnp.dtype(cfg.dtype)
  norms = {n: jnp.stack([p[n]["weight"] for p in layers])
           for n in ("input_layernorm", "post_attention_layernorm")}

  def body(x_BTE, xs):
    layer = xs[0]

    def dense(h, outs):
      def branch(i, h_ME):
        return tuple(linear(h_ME, layers[i][n], dtype) for n, _, _ in outs)
      ys = jax.lax.switch(layer, [functools.partial(branch, i) for i in range(len(layers))],
                          h.reshape(-1, h.shape[-1]))
      return [y.reshape(*h.shape[:-1], y.shape[-1]) for y in ys]

    norm = lambda name, x: rms_norm(x, norms[name][layer], cfg.norm_eps, dtype)  # noqa: E731
    return block_forward(cfg, spec, dense, norm, x_BTE, xs, ctx)

  return jax.lax.scan(body, x_BTE, (jnp.arange(len(layers)), stores), unroll=cfg.scan_unroll)


class Transformer(nn.Module):
  """`logits_last=True` returns logits only at each row's last non-padding token, [B, 1, V]
  (what prefill samples from): the lm_head is the largest matmul of a prompt pass (T x
  d_model x vocab), and every other position's logits would be discarded."""

  cfg: ModelConfig
  logits_last: bool = False
  # How the layers run: "scan" (nn.scan over stacked params, the form `init` creates),
  # "switch" (one lax.scan over per-layer weights from `split_layers`, no weight copied:
  # `switched_layers`; the default of prefill and decode) or "unrolled" (a Python loop
  # over per-layer weights, `model.scan_unroll >= n_layers`).
  layer_loop: str = "scan"

  @nn.compact
  def __call__(self, tokens_BT, positions_BT, cache=None, logits_at=None):
    """`logits_at` [B, N] (optional): the token indices (into T) whose logits are needed;
    the final norm and lm_head run on those rows only."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                     param_dtype=jnp.dtype(cfg.param_dtype), name="embed_tokens",
                     embedding_init=nn.initializers.normal(0.02))
    x_BTE = embed(tokens_BT)
    cos, sin = rope_cos_sin(positions_BT, cfg)
    spec = None if cache is None else cache.spec
    stores = None if cache is None else cache.layer_stores()
    lengths = None if cache is None else cache.lengths
    stacked = None
    if cache is not None and getattr(LAYOUTS[spec.layout].segments, "stacked", False):
      stores, stacked = None, stores

    ctx = (positions_BT, cos, sin, lengths, stacked)
    if self.layer_loop == "unrolled":  # a Python loop, one weight tree per layer
      kv = []
      for i in range(cfg.n_layers):
        store = None if stores is None else jax.tree.map(lambda a: a[i], stores)  # noqa: B023
        x_BTE, kv_i = Block(cfg, spec, name=f"layers_{i}")(x_BTE, (i, store), ctx)
        kv.append(kv_i)
      k_LBTKD, v_LBTKD = (jnp.stack(a) for a in zip(*kv))
    elif self.layer_loop == "switch":
      layers = [self.variables["params"][f"layers_{i}"] for i in range(cfg.n_layers)]
      x_BTE, (k_LBTKD, v_LBTKD) = switched_layers(cfg, spec, layers, x_BTE, stores, ctx)
    else:
      layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(0, nn.broadcast), length=cfg.n_layers, unroll=cfg.scan_unroll)
      x_BTE, (k_LBTKD, v_LBTKD) = layers(cfg, spec, name="layers")(
          x_BTE, (jnp.arange(cfg.n_layers), stores), ctx)

    if logits_at is None and self.logits_last:  # right padding: the last valid index
      logits_at = jnp.maximum(jnp.sum(positions_BT >= 0, axis=1) - 1, 0)[:, None]
    if logits_at is not None:
      x_BTE = jnp.take_along_axis(x_BTE, logits_at[..., None].astype(jnp.int32), axis=1)
    x_BTE = RMSNorm(cfg.norm_eps, dtype, jnp.dtype(cfg.param_dtype), name="norm")(x_BTE)
    if cfg.tie_embeddings:
      logits_BTV = embed.attend(x_BTE)
    else:
      logits_BTV = _dense(cfg, cfg.vocab_size, "lm_head")(x_BTE)
    if cache is not None:
      write_BT = positions_BT
      if self.layer_loop == "unrolled":
        # Unrolled, nothing orders the write after the last layer's read of the old cache,
        # so XLA may schedule it first and copy the whole cache to keep the old values.
        # No float exceeds +inf, so `tie` is 0, but XLA cannot fold it: the write waits.
        # (An optimization_barrier did not order it; tests/test_decode.py checks the HLO.)
        tie_B1 = (jnp.max(x_BTE, axis=(1, 2)) > jnp.inf).astype(jnp.int32)[:, None]
        write_BT = positions_BT + tie_B1
      cache = cache.layout.write(cache, k_LBTKD, v_LBTKD, write_BT)
    return logits_BTV.astype(jnp.float32), cache


def init_params(cfg: ModelConfig, seed: int = 0):
  """Random parameters (normal(0.02) projections, unit norms)."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  positions = jnp.arange(2, dtype=jnp.int32)[None]
  return jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(seed), tokens, positions)["params"]


def unrolled(cfg: ModelConfig) -> bool:
  """Run the layers as a Python loop over per-layer weights (`model.scan_unroll >= n_layers`,
  more than one layer) instead of `nn.scan`."""
  return cfg.n_layers > 1 and cfg.scan_unroll >= cfg.n_layers


def split_layers(params):
  """The scanned layers' stacked weights as one tree per layer (`layers_0`, `layers_1`,
  ...), the params `Transformer(layer_loop="switch" | "unrolled")` reads; params already
  split come back as they are. A second copy of the layer weights: `decode.prepare_params` makes it once per
  model, where the nn.scan program slices (copies) its weights on every step."""
  if "layers" not in params:
    return params
  stacked = params["layers"]
  n = jax.tree.leaves(stacked)[0].shape[0]
  return {**{k: v for k, v in params.items() if k != "layers"},
          **{f"layers_{i}": jax.tree.map(lambda a: a[i], stacked) for i in range(n)}}  # noqa: B023


def param_bytes(params) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))
