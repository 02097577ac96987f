"""A latent (MLA-style) model from a dense one, chosen by the activations and then fitted.

`kvjax.cache.latent.factor` keeps, per layer, the rank-A subspace the K/V *weights* span
most: W = [W_k | W_v] ([E, Y], Y = 2·K·D) becomes W Uᵀ U with U the top A right singular
vectors of W. What the cache must keep is the subspace the keys and values *use*: here U
is the top A right singular vectors of the activations [k | v] = h W (h: the layer's
normed input on the original model's stream over the calibration windows; biases apart,
they are added outside the latent), which minimises the error of the projected keys and
values themselves, |h W - h W Uᵀ U|.

`Factored` then lets `kvjax.lab.convert.fit` train the layer as a rank-A model: q_proj, a
down-projection [E, A] and an up-projection [A, Y], whose product is the K/V kernel.
After a layer's fit, `store` writes that product and the orthonormal basis of its rows as
`latent_up`, so the latent layout's c = ([k | v] - b) Uᵀ and [k | v] = c U + b stay exact.

RoPE: the latent layout up-projects, then rotates keys at their positions when it reads,
so every frequency pair keeps its rotation and none needs to be cached apart (a read that
folds U into the query, which needs keys without RoPE in part of their width, is not
built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax import config as config_lib
from kvjax.cache import latent as latent_cache
from kvjax.errors import KvjaxError
from kvjax.lab.convert import layerwise


def check(cfg, rank: int) -> None:
  """Host-side refusals before any weight is read."""
  m = cfg.model
  if m.latent_rank:
    raise KvjaxError("this model is already latent; convert the dense model it came from")
  if not 1 <= rank <= latent_cache.full_rank(m):
    raise KvjaxError(f"--latent-rank {rank} must be in [1, {latent_cache.full_rank(m)}] for this "
                     "model (min(d_model, 2 * n_kv_heads * head_dim))")
  if m.windowed or m.rope_local_theta or m.qk_norm:
    raise KvjaxError("a calibrated latent conversion needs one RoPE base, no window and no "
                     "q/k norm (the latent layout reads neither); this model has them")


def factor(cfg, params: Any, rank: int, tokens_NS: np.ndarray):
  """(latent config, params) with each layer's K/V kernel projected onto the top-`rank`
  directions of its calibration keys and values."""
  check(cfg, rank)
  m = cfg.model
  if "layers" not in params:
    raise KvjaxError("latent conversion needs stacked layer params (a scanned model)")
  new_cfg = config_lib.apply_overrides(cfg, {"model.latent_rank": rank,
                                             "cache.layout": "latent"})
  KD = m.n_kv_heads * m.D
  layers = dict(params["layers"])
  W_LEY = np.concatenate([np.asarray(layers[n]["kernel"], np.float32)
                          for n in ("k_proj", "v_proj")], axis=-1)
  ups, x = [], layerwise.embed(m, params, tokens_NS)
  for layer in range(m.n_layers):
    h = layerwise.normed_input(m, params, layer, x).reshape(-1, m.d_model)
    kv = h.astype(np.float64) @ W_LEY[layer].astype(np.float64)  # [N·S, Y], without bias
    _, vecs = np.linalg.eigh(kv.T @ kv)
    ups.append(vecs[:, ::-1][:, :rank].T)  # [A, Y], the top directions first
    x = layerwise.advance(m, params, layer, x)
  up_LAY = np.stack(ups).astype(np.float32)
  W_r = (W_LEY @ up_LAY.transpose(0, 2, 1)) @ up_LAY  # W Uᵀ U, layer by layer
  for name, part in (("k_proj", W_r[..., :KD]), ("v_proj", W_r[..., KD:])):
    layers[name] = {**layers[name], "kernel": jnp.asarray(part, layers[name]["kernel"].dtype)}
  layers["latent_up"] = jnp.asarray(up_LAY, jnp.dtype(m.param_dtype))
  return new_cfg, {**params, "layers": layers}


@dataclass(frozen=True)
class Factored:
  """A latent layer's trainable parts for `kvjax.lab.convert.fit`: q_proj, down [E, A], up [A, Y]."""
  kv_width: int  # K·D: where the K columns end in [k | v]

  def theta(self, p: dict) -> dict:
    W = jnp.concatenate([p["k_proj"]["kernel"], p["v_proj"]["kernel"]], -1).astype(jnp.float32)
    up = jnp.asarray(p["latent_up"], jnp.float32)
    return {"q_proj": {leaf: jnp.asarray(a, jnp.float32) for leaf, a in p["q_proj"].items()},
            "down": W @ up.T, "up": up}  # W = W Uᵀ U: the product is the layer as it is

  def weights(self, theta: dict, p: dict) -> dict:
    W = theta["down"] @ theta["up"]
    return {"q_proj": theta["q_proj"],
            "k_proj": {**p["k_proj"], "kernel": W[:, :self.kv_width]},
            "v_proj": {**p["v_proj"], "kernel": W[:, self.kv_width:]}}

  def store(self, params: Any, layer: int, theta: dict) -> Any:
    W = np.asarray(theta["down"] @ theta["up"], np.float64)
    rank = theta["up"].shape[0]
    up = np.linalg.svd(W, full_matrices=False)[2][:rank]  # the rows W spans, orthonormal
    theta = {"q_proj": theta["q_proj"], "down": jnp.asarray(W @ up.T, jnp.float32),
             "up": jnp.asarray(up, jnp.float32)}
    p = layerwise.layer_params(params, layer)
    params = layerwise.set_layer(params, layer, self.weights(theta, p))
    layers = dict(params["layers"])
    layers["latent_up"] = layers["latent_up"].at[layer].set(
        theta["up"].astype(layers["latent_up"].dtype))
    return {**params, "layers": layers}
