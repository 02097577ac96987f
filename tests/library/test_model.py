"""The model as a pure function: cached prefill + decode equals the full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.decode import step
from kvjax.model import Transformer, apply_rope, rope_cos_sin

RAGGED = [9, 5, 12]     # prompt lengths of a ragged batch
TOTAL = 16              # prompt + continuation per row


def _ragged_batch(vocab, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(len(RAGGED), TOTAL)).astype(np.int32)
  return jnp.asarray(tokens)


def _full_forward(cfg, params, tokens):
  B, T = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits, _ = Transformer(cfg.model).apply({"params": params}, tokens, pos, None)
  return logits


def _cached_forward(cfg, params, tokens, layout="contiguous"):
  """Ragged prefill of each row's prompt, then one decode step per remaining token."""
  cfg = config_lib.replace(cfg, **{"cache.layout": layout})
  static = step.Static.of(cfg)
  lengths = jnp.asarray(RAGGED, jnp.int32)
  B, T = tokens.shape
  t = jnp.arange(T, dtype=jnp.int32)[None]
  cache = cache_lib.init_cache(cfg, B, TOTAL)
  run = jax.jit(lambda p, tok, pos, c: step.run(static, p, tok, pos, c))
  fwd = lambda *a: (lambda o: (o.logits, o.cache))(run(*a))  # noqa: E731
  prompt_pos = jnp.where(t < lengths[:, None], t, -1)
  logits, cache = fwd(params, tokens, prompt_pos, cache)
  out = np.zeros((B, TOTAL, cfg.model.vocab_size), np.float32)
  for b, n in enumerate(RAGGED):
    out[b, :n] = logits[b, :n]
  for _ in range(TOTAL - min(RAGGED)):
    pos = cache.lengths
    tok = jnp.take_along_axis(tokens, jnp.minimum(pos, TOTAL - 1)[:, None], axis=1)
    live = pos < TOTAL
    logits, cache = fwd(params, tok, jnp.where(live, pos, -1)[:, None], cache)
    for b in range(B):
      if live[b]:
        out[b, int(pos[b])] = logits[b, 0]
  return out, cache


@pytest.mark.parametrize("layout", ["contiguous", "none"])
def test_prefill_plus_decode_equals_full_forward(variant_cfg, layout):
  params = tiny_params(variant_cfg)
  tokens = _ragged_batch(variant_cfg.model.vocab_size)
  ref = np.asarray(_full_forward(variant_cfg, params, tokens))
  got, cache = _cached_forward(variant_cfg, params, tokens, layout)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  assert cache.lengths.tolist() == [TOTAL] * len(RAGGED)


def test_cache_holds_only_kv_heads():
  cfg = tiny_config(**{"model.n_kv_heads": 1})
  cache = cache_lib.init_cache(cfg, 3, 10)
  L, K, D = cfg.model.n_layers, 1, cfg.model.D
  assert cache.k.shape == cache.v.shape == (L, 3, K, 10, D)


def test_gqa_equals_mha_with_repeated_kv_heads():
  """The grouped path is exact: GQA weights repeated per group give the same MHA model."""
  gqa = tiny_config(**{"model.n_kv_heads": 2})
  mha = tiny_config(**{"model.n_kv_heads": 4})
  p = jax.tree.map(lambda x: x, tiny_params(gqa))
  D, G = gqa.model.D, gqa.model.G
  for name in ("k_proj", "v_proj"):
    w = p["layers"][name]["kernel"]                     # [L, E, K*D]
    L, E, _ = w.shape
    w = jnp.repeat(w.reshape(L, E, 2, 1, D), G, axis=3).reshape(L, E, 4 * D)
    p = {**p, "layers": {**p["layers"], name: {"kernel": w}}}
  tokens = _ragged_batch(gqa.model.vocab_size)
  np.testing.assert_allclose(_full_forward(mha, p, tokens),
                             _full_forward(gqa, tiny_params(gqa), tokens), rtol=1e-5, atol=1e-6)


def test_padding_is_never_attended():
  cfg = tiny_config()
  params = tiny_params(cfg)
  tokens = _ragged_batch(cfg.model.vocab_size)[:1, :8]
  pos = jnp.arange(8, dtype=jnp.int32)[None]
  model = Transformer(cfg.model)
  ref, _ = model.apply({"params": params}, tokens, pos, None)
  junk = jnp.concatenate([tokens, jnp.full((1, 4), 7, jnp.int32)], axis=1)
  pos_pad = jnp.concatenate([pos, jnp.full((1, 4), -1, jnp.int32)], axis=1)
  got, _ = model.apply({"params": params}, junk, pos_pad, None)
  np.testing.assert_allclose(got[:, :8], ref, rtol=1e-6, atol=1e-6)
  assert np.isfinite(np.asarray(got)).all()


def test_attention_matches_jax_dot_product_attention():
  """Cross-check the grouped attention against jax.nn.dot_product_attention (causal)."""
  from kvjax.attention import grouped
  rng = np.random.default_rng(1)
  B, T, H, K, D = 2, 7, 6, 2, 8
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D)))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(grouped(q, k, v, pos, []), ref, rtol=1e-5, atol=1e-5)


def test_scan_unroll_changes_nothing_but_the_program():
  cfg = tiny_config()
  unrolled = tiny_config(**{"model.scan_unroll": cfg.model.n_layers})
  tokens = _ragged_batch(cfg.model.vocab_size)
  np.testing.assert_allclose(_full_forward(cfg, tiny_params(cfg), tokens),
                             _full_forward(unrolled, tiny_params(cfg), tokens), rtol=1e-6,
                             atol=1e-6)


def test_remat_recomputes_the_same_forward_and_gradient():
  """`remat=True` (a distillation on long windows) trades memory for a second forward in the
  backward pass: the loss and every parameter's gradient are those of the plain scan."""
  cfg = tiny_config()
  params = tiny_params(cfg)
  tokens = _ragged_batch(cfg.model.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

  def loss(p, remat):
    logits, _ = Transformer(cfg.model, remat=remat).apply({"params": p}, tokens, pos)
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

  (l0, g0), (l1, g1) = (jax.value_and_grad(loss)(params, r) for r in (False, True))
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7), g0, g1)
  grad_norm = sum(float(jnp.sum(jnp.abs(g))) for g in jax.tree.leaves(g0))
  assert grad_norm > 0


def test_rope_is_a_rotation_that_depends_on_relative_position():
  """<rope(q, m), rope(k, n)> depends only on m - n (the property RoPE exists for)."""
  cfg = tiny_config()
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, cfg.model.D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, cfg.model.D)), jnp.float32)

  def dot(m, n):
    cq, sq = rope_cos_sin(jnp.array([[m]]), cfg.model)
    ck, sk = rope_cos_sin(jnp.array([[n]]), cfg.model)
    return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

  assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4, abs=1e-5)
  assert np.linalg.norm(apply_rope(q, *rope_cos_sin(jnp.array([[9]]), cfg.model))) == \
      pytest.approx(float(np.linalg.norm(q)), rel=1e-5)
