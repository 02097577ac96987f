"""kvjax.lab.convert.align: aligning the heads a pooling will merge changes no output, and
heads that differ only by such a change of basis pool without loss."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax.errors import KvjaxError
from kvjax.lab import convert
from kvjax.lab.convert import align, layerwise
from kvjax.model import Transformer

CALIB = np.random.default_rng(0).integers(0, 64, size=(4, 24)).astype(np.int32)
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(2, 12)), jnp.int32)


def _logits(cfg, params):
  pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
  return np.asarray(Transformer(cfg.model).apply({"params": params}, TOKENS, pos)[0])


@pytest.mark.parametrize("kv, to", [(4, 1), (4, 2), (2, 1)])
def test_aligned_unmerged_model_has_the_same_logits(kv, to):
  cfg = tiny_config(**{"model.n_kv_heads": kv, "model.qkv_bias": True, "seed": 5})
  params = tiny_params(cfg)
  aligned = align.align(cfg, params, to, CALIB)
  np.testing.assert_allclose(_logits(cfg, aligned), _logits(cfg, params), atol=1e-4)
  moved = np.abs(np.asarray(aligned["layers"]["k_proj"]["kernel"])
                 - np.asarray(params["layers"]["k_proj"]["kernel"])).max()
  assert moved > 1e-2  # the heads were really rotated, not left alone


def _pair_rotation(rng, D):
  half = D // 2
  theta = rng.uniform(-np.pi, np.pi, half)
  R = np.zeros((D, D))
  i = np.arange(half)
  R[i, i], R[i + half, i + half] = np.cos(theta), np.cos(theta)
  R[i, i + half], R[i + half, i] = np.sin(theta), -np.sin(theta)
  return R


def test_heads_equal_up_to_a_rope_commuting_basis_pool_exactly_after_alignment():
  """KV head 1 is head 0 seen in another basis (keys: a rotation per frequency pair; values:
  any orthogonal map), its query heads and o_proj rows compensating, so the model is a
  GQA-2 that is really an MQA. Aligned, the two heads coincide and pool into that MQA
  exactly; pooled without alignment, the model changes."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 7})
  m = cfg.model
  H, D, G = m.n_heads, m.D, m.G
  rng = np.random.default_rng(3)
  params = tiny_params(cfg)
  layers = {n: dict(d) for n, d in params["layers"].items()}
  wq = np.array(layers["q_proj"]["kernel"]).reshape(m.n_layers, -1, H, D)
  wk = np.array(layers["k_proj"]["kernel"]).reshape(m.n_layers, -1, 2, D)
  wv = np.array(layers["v_proj"]["kernel"]).reshape(m.n_layers, -1, 2, D)
  wo = np.array(layers["o_proj"]["kernel"]).reshape(m.n_layers, H, D, -1)
  for layer in range(m.n_layers):
    R = _pair_rotation(rng, D)
    Q, _ = np.linalg.qr(rng.normal(size=(D, D)))
    wk[layer, :, 1] = wk[layer, :, 0] @ R
    wv[layer, :, 1] = wv[layer, :, 0] @ Q
    for h in range(G, 2 * G):  # head 1's query heads: query rotated alike, o_proj undoing Q
      wq[layer, :, h] = wq[layer, :, h - G] @ R
      wo[layer, h] = Q.T @ wo[layer, h - G]
  for name, w in (("q_proj", wq), ("k_proj", wk), ("v_proj", wv)):
    layers[name]["kernel"] = jnp.asarray(w.reshape(m.n_layers, m.d_model, -1), jnp.float32)
  layers["o_proj"]["kernel"] = jnp.asarray(wo.reshape(m.n_layers, H * D, -1), jnp.float32)
  params = {**params, "layers": layers}
  want = _logits(cfg, params)

  mqa_cfg, mqa = convert.mean_pool(cfg, align.align(cfg, params, 1, CALIB), 1)
  np.testing.assert_allclose(_logits(mqa_cfg, mqa), want, atol=1e-4)
  plain_cfg, plain = convert.mean_pool(cfg, params, 1)
  assert np.abs(_logits(plain_cfg, plain) - want).max() > 1e-2


def test_layerwise_stream_is_the_model_forward():
  """The layer-at-a-time forward the conversions read is the model's own."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 5})
  params = tiny_params(cfg)
  x = layerwise.embed(cfg.model, params, CALIB)
  for layer in range(cfg.model.n_layers):
    x = layerwise.advance(cfg.model, params, layer, x)
  pos = jnp.broadcast_to(jnp.arange(CALIB.shape[1]), CALIB.shape)
  logits = np.asarray(Transformer(cfg.model).apply({"params": params}, jnp.asarray(CALIB), pos)[0])
  from kvjax.model.layers import rms_norm
  h = rms_norm(jnp.asarray(x), params["norm"]["weight"], cfg.model.norm_eps, jnp.float32)
  table = params["embed_tokens"]["embedding"] if cfg.model.tie_embeddings else \
      params["lm_head"]["kernel"].T
  np.testing.assert_allclose(np.asarray(h @ table.T), logits, atol=1e-4)


@pytest.mark.parametrize("overrides, to, says", [
    ({"model.n_kv_heads": 2}, 2, "fewer than"),
    ({"model.n_kv_heads": 4, "model.qk_norm": True}, 2, "--method pool"),
])
def test_what_alignment_cannot_do_is_one_line(overrides, to, says):
  cfg = tiny_config(**overrides)
  with pytest.raises(KvjaxError) as e:
    align.check(cfg, to)
  assert says in str(e.value) and "\n" not in str(e.value)
