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

RoPE (`--rope-pairs r`, `model.rope_pairs`): r = 0 keeps every pair rotated, and the latent
layout up-projects, then rotates keys at their positions when it reads. r > 0 converts to
MLA's form: each KV head keeps rotating r frequency pairs (`--rope-choice high`, the
default: the r highest frequencies; `qk`: those that carry most of its q·k on the
calibration text, per pair the mean over tokens of |q_pair| |k_pair| summed over the head's
query group, MHA2MLA's 2-norm criterion), stops rotating the others, and
the latent compresses those unrotated key columns with the values, so the layout caches
the rotated columns beside the latent and reads it absorbed. Unrotating pairs changes the
model: r < D/2 needs the fit (and distillation) to recover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax import config as config_lib
from kvjax.attention.rope import default_keep
from kvjax.cache import latent as latent_cache
from kvjax.errors import KvjaxError
from kvjax.lab.convert import layerwise


def check(cfg, rank: int, rope_pairs: int = 0, choice: str = "high") -> None:
  """Host-side refusals before any weight is read."""
  m = cfg.model
  if m.latent_rank:
    raise KvjaxError("this model is already latent; convert the dense model it came from")
  latent_cache.check_conversion(m, rank, rope_pairs, choice)
  if m.windowed or m.rope_local_theta or m.qk_norm:
    raise KvjaxError("a calibrated latent conversion needs one RoPE base, no window and no "
                     "q/k norm (the latent layout reads neither); this model has them")


def pair_scores(m, p: dict, h_NE: np.ndarray) -> np.ndarray:
  """[K, D/2] each KV head's pairs scored by their share of q·k on the normed inputs h: the
  mean over tokens of |q_pair| |k_pair|, summed over the head's query group (biases in)."""
  K, G, D, P = m.n_kv_heads, m.G, m.D, m.D // 2

  def proj(name, heads):
    y = h_NE @ np.asarray(p[name]["kernel"], np.float64)
    if "bias" in p[name]:
      y = y + np.asarray(p[name]["bias"], np.float64)
    y = y.reshape(len(h_NE), heads, D)
    return np.sqrt(y[..., :P] ** 2 + y[..., P:] ** 2)  # [N, heads, P]
  q, k = proj("q_proj", K * G).reshape(len(h_NE), K, G, P), proj("k_proj", K)
  return np.mean(q.sum(axis=2) * k, axis=0)


def factor(cfg, params: Any, rank: int, tokens_NS: np.ndarray, rope_pairs: int = 0,
           choice: str = "high"):
  """(latent config, params) with each layer's K/V kernel projected onto the top-`rank`
  directions of its calibration keys and values (with rope pairs: the unrotated key
  columns and the values, after each head's pairs are chosen by `pair_scores`)."""
  check(cfg, rank, rope_pairs, choice)
  m = cfg.model
  if "layers" not in params:
    raise KvjaxError("latent conversion needs stacked layer params (a scanned model)")
  new_cfg = config_lib.apply_overrides(cfg, {"model.latent_rank": rank,
                                             "model.rope_pairs": rope_pairs,
                                             "cache.layout": "latent"})
  nm = new_cfg.model
  layers = dict(params["layers"])
  keeps, ups, x = [], [], layerwise.embed(m, params, tokens_NS)
  for layer in range(m.n_layers):
    h = layerwise.normed_input(m, params, layer, x).reshape(-1, m.d_model).astype(np.float64)
    p = layerwise.layer_params(params, layer)
    keep = None
    if rope_pairs and choice == "qk":
      keep = latent_cache.keep_top(jnp.asarray(pair_scores(m, p, h))[None], rope_pairs)
      keeps.append(np.asarray(keep[0]))
    elif rope_pairs:  # the r highest frequencies, every head
      keep = default_keep(1, m.n_kv_heads, m.D // 2, rope_pairs)
      keeps.append(np.asarray(keep[0]))
    W, _, _ = latent_cache.split_kv(nm, {n: {"kernel": jnp.asarray(p[n]["kernel"])[None]}
                                         for n in ("k_proj", "v_proj")}, keep)
    kv = h @ np.asarray(W[0], np.float64)  # [N·S, Y], without bias
    _, vecs = np.linalg.eigh(kv.T @ kv)
    ups.append(vecs[:, ::-1][:, :rank].T)  # [A, Y], the top directions first
    x = layerwise.advance(m, params, layer, x)
  keep_all = jnp.asarray(np.stack(keeps), jnp.float32) if rope_pairs else None
  W, w_rope, cols = latent_cache.split_kv(nm, layers, keep_all)
  up_LAY = np.stack(ups).astype(np.float32)
  W = np.asarray(W, np.float32)
  W_r = (W @ up_LAY.transpose(0, 2, 1)) @ up_LAY  # W Uᵀ U, layer by layer
  Wk, Wv = latent_cache.join_kv(nm, jnp.asarray(W_r), w_rope, cols)
  for name, part in (("k_proj", Wk), ("v_proj", Wv)):
    layers[name] = {**layers[name], "kernel": jnp.asarray(part, layers[name]["kernel"].dtype)}
  layers["latent_up"] = jnp.asarray(up_LAY, jnp.dtype(m.param_dtype))
  out = {**params, "layers": layers}
  if rope_pairs:
    out["rope_keep"] = keep_all
  return new_cfg, out


@dataclass(frozen=True)
class Factored:
  """A latent layer's trainable parts for `kvjax.lab.convert.fit`: q_proj, down [E, A], up
  [A, Y], and with rope pairs the rotated key columns [E, K, 2r] kept beside the latent."""
  model: Any  # the latent model's config (its rank, rope pairs, heads)

  def _keep(self, p):
    return jnp.asarray(p["rope_keep"])[None] if self.model.rope_pairs else None

  def theta(self, p: dict) -> dict:
    W, w_rope, _ = latent_cache.split_kv(
        self.model, {n: {"kernel": jnp.asarray(p[n]["kernel"])[None]}
                     for n in ("k_proj", "v_proj")}, self._keep(p))
    up = jnp.asarray(p["latent_up"], jnp.float32)
    theta = {"q_proj": {leaf: jnp.asarray(a, jnp.float32) for leaf, a in p["q_proj"].items()},
             "down": W[0] @ up.T, "up": up}  # W = W Uᵀ U: the product is the layer as it is
    if self.model.rope_pairs:
      theta["rope"] = w_rope[0]
    return theta

  def weights(self, theta: dict, p: dict) -> dict:
    W = (theta["down"] @ theta["up"])[None]
    keep = self._keep(p)
    w_rope = theta["rope"][None] if self.model.rope_pairs else None
    cols = latent_cache.columns({"rope_keep": keep}, self.model) if self.model.rope_pairs \
        else None
    Wk, Wv = latent_cache.join_kv(self.model, W, w_rope, cols)
    return {"q_proj": theta["q_proj"],
            "k_proj": {**p["k_proj"], "kernel": Wk[0]},
            "v_proj": {**p["v_proj"], "kernel": Wv[0]}}

  def store(self, params: Any, layer: int, theta: dict) -> Any:
    W = np.asarray(theta["down"] @ theta["up"], np.float64)
    rank = theta["up"].shape[0]
    up = np.linalg.svd(W, full_matrices=False)[2][:rank]  # the rows W spans, orthonormal
    theta = {**theta, "down": jnp.asarray(W @ up.T, jnp.float32),
             "up": jnp.asarray(up, jnp.float32)}
    p = layerwise.layer_params(params, layer)
    params = layerwise.set_layer(params, layer, self.weights(theta, p))
    layers = dict(params["layers"])
    layers["latent_up"] = layers["latent_up"].at[layer].set(
        theta["up"].astype(layers["latent_up"].dtype))
    return {**params, "layers": layers}
