"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU) as a Flax Linen module used as a pure function:

    logits_BTV, cache = Transformer(cfg).apply({"params": params}, tokens_BT, positions_BT, cache)

`positions_BT[b, t]` is the absolute position of token t of sequence b, or -1 for
right-padding (a ragged batch); padding is never attended to and never stored. With
`cache=None` the call is the full forward pass over `tokens` alone (the reference). With
a cache, its layout (`kvjax.cache`) attaches what it reads, every layer reads its segments
of the stacked store (`Layout.read`), and the new K/V are written after the layer loop
(`Layout.write`). `init` creates the layers' params stacked on a leading layer axis and
`Transformer(cfg)` runs them as one `nn.scan`, which copies each weight matrix out of the
stack on every step. Prefill, decode and the serving engine take params split per layer
once (`split_layers`, via `step.prepare_params`) and run `Transformer(layer_loop=
"switch")`: one `lax.scan` whose projections pick their layer's buffer by `lax.switch`
(`switched_layers`), so no weight is copied and the layer body is traced once; or, when
`unrolled(cfg)` (`model.scan_unroll >= n_layers`), `layer_loop="unrolled"`, a Python loop
whose compile time grows with depth (measurements in docs/methods.md, "The layer loop").
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.cache import base as cache_base
from kvjax.config import ModelConfig
from kvjax.model.layers import (EXTRA_NORMS, Block, Head, LayerInput, RMSNorm, block_forward,
                                embed_rows, linears, lm_head, rms_norm)
from kvjax.attention.rope import default_keep, rope_cos_sin


def switched_layers(cfg: ModelConfig, layers: list, x_BTE, inp: LayerInput):
  """The layer loop over per-layer weight trees (`split_layers`) as one `lax.scan`, with no
  weight copied: XLA:CPU's dot reads an operand only as a whole buffer, so a scan that
  slices layer i's matrix out of a stacked [L, ...] param (nn.scan, or weights as scan xs)
  copies every matrix on every step (a `dynamic-slice` fusion per matrix). Here each
  projection is a `lax.switch` on the layer index whose branch i multiplies by layer i's
  own buffer: a conditional selects the buffer, nothing is copied. Projections sharing an
  input share a switch (q/k/v, o, gate/up, down: four per layer step, each of L branches
  of one to three dots). The rest of the layer is traced once, so compile time grows only
  by those small branches. Each branch multiplies through `linears`: a decode step's few
  rows by the CPU kernel, one call per switch, every weight read at its stored bytes;
  elsewhere XLA's dots, a weight stored in another dtype than `cfg.dtype` widened inside
  the branch as `nn.Dense` does (one matrix-sized temporary at a time). Norm
  weights (vectors) are stacked and indexed. Returns x and the stacked new (k, v)."""
  dtype = jnp.dtype(cfg.dtype)
  norms = {n: jnp.stack([p[n]["weight"] for p in layers])
           for n in ("input_layernorm", "post_attention_layernorm", *EXTRA_NORMS)
           if n in layers[0]}

  def body(x_BTE, layer):
    def dense(h, outs):
      def branch(i, h):  # h: [B·T, E], the rows of this call flattened
        return linears(h, [layers[i][n] for n, _, _ in outs], dtype)
      ys = jax.lax.switch(layer, [functools.partial(branch, i) for i in range(len(layers))],
                          h.reshape(-1, h.shape[-1]))
      return [y.reshape(*h.shape[:-1], y.shape[-1]) for y in ys]

    norm = lambda name, x: rms_norm(x, norms[name][layer], cfg.norm_eps, dtype)  # noqa: E731
    return block_forward(cfg, dense, norm, x_BTE, layer, inp)

  return jax.lax.scan(body, x_BTE, jnp.arange(len(layers)), unroll=cfg.scan_unroll)


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
  read_bucket: int = 0  # > 0: the accelerator program's reads cover that many stored slots
  # True: also return the new tokens' rotated queries [L, B, T, H, D] (`kvjax.decode.step.run`)
  return_queries: bool = False
  # True (layer_loop "scan" only): each layer's activations are recomputed in the backward
  # pass, so a gradient through T tokens holds one layer's [T, T] attention at a time, not
  # every layer's (a distillation on long windows)
  remat: bool = False

  @nn.compact
  def __call__(self, tokens_BT, positions_BT, cache=None, logits_at=None):
    """`logits_at` [B, n] (optional): for each row, the n token indices (into this call's
    tokens) whose logits are needed; the final norm and lm_head run on those rows only."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                     param_dtype=jnp.dtype(cfg.param_dtype), name="embed_tokens",
                     embedding_init=nn.initializers.normal(0.02))
    x_BTE = embed_rows(embed.embedding, tokens_BT, dtype)  # not `embed(...)`: see there
    if cfg.embed_scale:
      x_BTE = x_BTE * jnp.asarray(cfg.d_model ** 0.5, dtype)
    cos, sin = rope_cos_sin(positions_BT, cfg)
    local = rope_cos_sin(positions_BT, cfg, local=True) if cfg.rope_local_theta else (None,) * 2
    keep = None
    if cfg.rope_pairs:  # which frequency pairs each layer's KV heads rotate (partial RoPE)
      L, K, P = cfg.n_layers, cfg.n_kv_heads, cfg.D // 2
      keep = self.param("rope_keep", lambda _, shape: default_keep(*shape, cfg.rope_pairs),
                        (L, K, P))
    inp = LayerInput(positions_BT, cos, sin, cos_local=local[0], sin_local=local[1],
                     rope_keep=keep)
    if cache is not None:  # the layers read the whole stacked store, each at its own layer
      layout = cache_base.layout_of(cache)
      cache = layout.attach(cache, self.variables.get("params", {}))
      inp = LayerInput(positions_BT, cos, sin, cache.lengths, layout.store(cache), cache.spec,
                       self.read_bucket, self.return_queries, *local, rope_keep=keep)

    if self.layer_loop == "unrolled":  # a Python loop, one weight tree per layer
      kv = []
      for i in range(cfg.n_layers):
        x_BTE, kv_i = Block(cfg, name=f"layers_{i}")(x_BTE, i, inp)
        kv.append(kv_i)
      k_LBTKD, v_LBTKD, *q = (jnp.stack(a) for a in zip(*kv))
    elif self.layer_loop == "switch":
      layers = [self.variables["params"][f"layers_{i}"] for i in range(cfg.n_layers)]
      x_BTE, (k_LBTKD, v_LBTKD, *q) = switched_layers(cfg, layers, x_BTE, inp)
    else:
      block = nn.remat(Block, prevent_cse=False) if self.remat else Block
      layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(0, nn.broadcast), length=cfg.n_layers, unroll=cfg.scan_unroll)
      x_BTE, (k_LBTKD, v_LBTKD, *q) = layers(cfg, name="layers")(
          x_BTE, jnp.arange(cfg.n_layers), inp)

    if logits_at is None and self.logits_last:  # right padding: the last valid index
      logits_at = jnp.maximum(jnp.sum(positions_BT >= 0, axis=1) - 1, 0)[:, None]
    if logits_at is not None:
      x_BTE = jnp.take_along_axis(x_BTE, logits_at[..., None].astype(jnp.int32), axis=1)
    x_BTE = RMSNorm(cfg.norm_eps, dtype, jnp.dtype(cfg.param_dtype), name="norm")(x_BTE)
    if cfg.tie_embeddings:
      logits_BTV = lm_head(x_BTE, embed.embedding, dtype)
    else:
      logits_BTV = Head(cfg.vocab_size, dtype, jnp.dtype(cfg.param_dtype), name="lm_head")(x_BTE)
    if cache is not None:
      write_BT = positions_BT
      if self.layer_loop == "unrolled":
        # Unrolled, nothing orders the write after the last layer's read of the old cache,
        # so XLA may schedule it first and copy the whole cache to keep the old values.
        # No float exceeds +inf, so `tie` is 0, but XLA cannot fold it: the write waits.
        # (An optimization_barrier did not order it; tests/library/test_decode.py checks the HLO.)
        tie_B1 = (jnp.max(x_BTE, axis=(1, 2)) > jnp.inf).astype(jnp.int32)[:, None]
        write_BT = positions_BT + tie_B1
      wants = layout.wants_queries(cache.spec)
      cache = layout.write(cache, k_LBTKD, v_LBTKD, write_BT, *(q if wants else ()))
    if self.return_queries:
      return logits_BTV.astype(jnp.float32), cache, q[0]
    return logits_BTV.astype(jnp.float32), cache


def trainable(cfg: ModelConfig) -> ModelConfig:
  """The config a gradient is taken through (training, a conversion's fit and distillation):
  the same model with the `reference` attention, one softmax over every key. The blocked
  reads of a long prompt (`kvjax.attention.xla`) loop a data-dependent number of times,
  which reverse-mode differentiation cannot cross; the windows trained on are short enough
  for their [T, T] logits."""
  return dataclasses.replace(cfg, attention="reference")


def init_params(cfg: ModelConfig, seed: int = 0):
  """Random parameters (normal(0.02) projections, unit norms)."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  positions = jnp.arange(2, dtype=jnp.int32)[None]
  return _init(cfg)(jax.random.PRNGKey(seed), tokens, positions)["params"]


@functools.lru_cache(maxsize=8)
def _init(cfg: ModelConfig):
  """The jitted init of one model config, kept: a second model of the same config (another
  seed, another command) runs the compiled program instead of tracing again."""
  return jax.jit(Transformer(cfg).init)


def unrolled(cfg: ModelConfig) -> bool:
  """Run the layers as a Python loop over per-layer weights (`model.scan_unroll >= n_layers`,
  more than one layer) instead of `nn.scan`."""
  return cfg.n_layers > 1 and cfg.scan_unroll >= cfg.n_layers


def split_layers(params):
  """The scanned layers' stacked weights as one tree per layer (`layers_0`, `layers_1`,
  ...), the params `Transformer(layer_loop="switch" | "unrolled")` reads; params already
  split come back as they are. A second copy of the layer weights: `step.prepare_params` makes it once
  per model, where the nn.scan program slices (copies) its weights on every step."""
  if "layers" not in params:
    return params
  stacked = params["layers"]
  n = jax.tree.leaves(stacked)[0].shape[0]
  return {**{k: v for k, v in params.items() if k != "layers"},
          **{f"layers_{i}": jax.tree.map(lambda a: a[i], stacked) for i in range(n)}}  # noqa: B023
