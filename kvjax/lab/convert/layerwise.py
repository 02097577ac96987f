"""One layer at a time of a model's full forward pass, for conversions that read or fit a
layer's activations on calibration text: the residual stream x entering each layer, the
attention block's output, the normed input the K/V projections read.

The layer is `kvjax.model.layers.attention_block` / `mlp_block` (the decode path's own
code) with plain float32 products in place of the CPU kernels, so it can be
differentiated (`kvjax.lab.convert.fit`). Shapes: N calibration sequences of S tokens each.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.rope import rope_cos_sin
from kvjax.config import ModelConfig
from kvjax.model import trainable
from kvjax.model.layers import LayerInput, attention_block, mlp_block, rms_norm

CHUNK = 8  # sequences per forward call: bounds the [chunk, H, S, S] attention weights


def layer_params(params: Any, layer: int) -> dict:
  """Layer `layer`'s weights out of the stacked [L, ...] tree (with its row of `rope_keep`,
  the pairs its heads rotate, where the model has partial RoPE)."""
  p = jax.tree.map(lambda a: a[layer], params["layers"])
  if "rope_keep" in params:
    p["rope_keep"] = params["rope_keep"][layer]
  return p


def set_layer(params: Any, layer: int, layer_p: dict) -> Any:
  """params with layer `layer`'s weights replaced (leaves of `layer_p` only)."""
  layers = dict(params["layers"])
  for name, leaves in layer_p.items():
    layers[name] = {**layers[name], **{leaf: layers[name][leaf].at[layer].set(
        a.astype(layers[name][leaf].dtype)) for leaf, a in leaves.items()}}
  return {**params, "layers": layers}


def _dense(p):
  def dense(h, outs):
    return [h @ p[n]["kernel"].astype(jnp.float32)
            + (p[n]["bias"].astype(jnp.float32) if "bias" in p[n] else 0.0) for n, _, _ in outs]
  return dense


def _norm(cfg: ModelConfig, p):
  return lambda name, x: rms_norm(x, p[name]["weight"], cfg.norm_eps, jnp.float32)


def layer_input(cfg: ModelConfig, S: int, n: int) -> LayerInput:
  """What every layer reads for n unpadded sequences of S tokens at positions 0..S-1."""
  positions_BT = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (n, S))
  cos, sin = rope_cos_sin(positions_BT, cfg)
  local = rope_cos_sin(positions_BT, cfg, local=True) if cfg.rope_local_theta else (None, None)
  return LayerInput(positions_BT, cos, sin, cos_local=local[0], sin_local=local[1])


def attention_out(cfg: ModelConfig, p: dict, x_NSE, layer) -> jax.Array:
  """What layer `layer`'s attention adds to the residual stream x (float32), through the
  attention a gradient can cross (`kvjax.model.trainable`: the fit differentiates it)."""
  cfg = trainable(cfg)
  inp = layer_input(cfg, x_NSE.shape[1], x_NSE.shape[0])
  if cfg.rope_pairs:  # every layer index reads this layer's pairs
    keep = p["rope_keep"]
    inp = inp.replace(rope_keep=jnp.broadcast_to(keep, (cfg.n_layers, *keep.shape)))
  o, _ = attention_block(cfg, _dense(p), _norm(cfg, p), x_NSE.astype(jnp.float32), layer, inp)
  return o.astype(jnp.float32)


@functools.lru_cache(maxsize=8)
def _fns(cfg: ModelConfig):
  def attn(x, p, layer):
    return attention_out(cfg, p, x, layer)

  def mlp(x, p):
    return mlp_block(cfg, _dense(p), _norm(cfg, p), x).astype(jnp.float32)

  def kv(x, p):  # the layer's K and V before RoPE (and before any q/k norm)
    h = _norm(cfg, p)("input_layernorm", x)
    k, v = _dense(p)(h, [("k_proj", 0, 0), ("v_proj", 0, 0)])
    return (k.reshape(*x.shape[:2], cfg.n_kv_heads, cfg.D),
            v.reshape(*x.shape[:2], cfg.n_kv_heads, cfg.D))

  def normed(x, p):
    return _norm(cfg, p)("input_layernorm", x)

  return jax.jit(attn), jax.jit(mlp), jax.jit(kv), jax.jit(normed)


def chunked(fn, x_NSE: np.ndarray, *args) -> np.ndarray:
  """fn over x in chunks of CHUNK sequences, as one host array (or a tuple of them)."""
  outs = [fn(jnp.asarray(x_NSE[i:i + CHUNK]), *args) for i in range(0, len(x_NSE), CHUNK)]
  if isinstance(outs[0], tuple):
    return tuple(np.concatenate([np.asarray(o[j]) for o in outs]) for j in range(len(outs[0])))
  return np.concatenate([np.asarray(o) for o in outs])


def embed(cfg: ModelConfig, params: Any, tokens_NS: np.ndarray) -> np.ndarray:
  """The residual stream entering layer 0 (float32)."""
  x = np.asarray(params["embed_tokens"]["embedding"], np.float32)[tokens_NS]
  return x * np.float32(cfg.d_model ** 0.5) if cfg.embed_scale else x


def attend(cfg: ModelConfig, params: Any, layer: int, x_NSE: np.ndarray) -> np.ndarray:
  """Layer `layer`'s attention output for x (all sequences, in chunks)."""
  return chunked(_fns(cfg)[0], x_NSE, layer_params(params, layer), jnp.int32(layer))


def advance(cfg: ModelConfig, params: Any, layer: int, x_NSE: np.ndarray,
            o_NSE: np.ndarray | None = None) -> np.ndarray:
  """The residual stream leaving layer `layer` (its attention output `o` if computed)."""
  p = layer_params(params, layer)
  x = x_NSE + (attend(cfg, params, layer, x_NSE) if o_NSE is None else o_NSE)
  return x + chunked(_fns(cfg)[1], x, p)


def keys_values(cfg: ModelConfig, params: Any, layer: int,
                x_NSE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Layer `layer`'s pre-RoPE keys and values [N, S, K, D] for x."""
  return chunked(_fns(cfg)[2], x_NSE, layer_params(params, layer))


def normed_input(cfg: ModelConfig, params: Any, layer: int, x_NSE: np.ndarray) -> np.ndarray:
  """What layer `layer`'s q/k/v projections read: its input norm of x [N, S, E]."""
  return chunked(_fns(cfg)[3], x_NSE, layer_params(params, layer))
