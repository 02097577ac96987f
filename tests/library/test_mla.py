"""The latent cache served as MLA (kvjax/cache/latent.py, model.rope_pairs > 0): partial RoPE,
the rotated key columns cached beside the latent, and the decode read absorbed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params
from test_policies import CONT, PROMPTS, run_cached

from kvjax import cache as cache_lib, config as config_lib, kernels
from kvjax.cache import latent
from kvjax.decode import generate, step
from kvjax.errors import KvjaxError
from kvjax.model import Transformer


def mla(cfg, rank, pairs, params=None):
  """The latent model of rank `rank` keeping `pairs` rotated pairs a head, from `cfg`."""
  return latent.factor(cfg, tiny_params(cfg) if params is None else params, rank, pairs)


def full(m, pairs):
  return latent.full_rank(dataclasses.replace(m, rope_pairs=pairs))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_every_pair_kept_at_full_rank_equals_the_dense_model(kv_heads):
  cfg = tiny_config(**{"model.n_kv_heads": kv_heads})
  P = cfg.model.D // 2
  lcfg, lparams = mla(cfg, full(cfg.model, P), P)
  assert lcfg.model.rope_pairs == P and lcfg.cache.layout == "latent"
  want, _ = run_cached(cfg, tiny_params(cfg))
  got, caches = run_cached(lcfg, lparams)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  assert caches[-1].up is None and caches[-1].rope is None  # weights detached after a call


def forward_at(cfg, params, prompts=PROMPTS, cont=CONT):
  """The full forward pass (no cache) over prompt + continuation, logits where `run_cached`
  returns them: each prompt's last token, then every continuation token."""
  seqs = [p + c for p, c in zip(prompts, cont)]
  tokens, lengths = generate.pad_prompts(seqs)
  T = tokens.shape[1]
  positions = np.where(np.arange(T)[None] < np.asarray(lengths)[:, None], np.arange(T)[None], -1)
  logits, _ = Transformer(cfg.model).apply({"params": params}, jnp.asarray(tokens),
                                           jnp.asarray(positions, jnp.int32))
  idx = [[len(p) - 1 + i for i in range(len(c) + 1)] for p, c in zip(prompts, cont)]
  return np.take_along_axis(np.asarray(logits), np.asarray(idx)[..., None], axis=1)


@pytest.mark.parametrize("kv_heads,pairs,rank", [(2, 1, 10), (4, 2, 16), (1, 3, 5)])
def test_partial_rope_latent_cache_decodes_as_the_full_forward_pass(kv_heads, pairs, rank):
  """A partial-RoPE model of lower rank differs from the original; its latent cache (read
  absorbed) gives the logits of its own full forward pass and of its dense cache."""
  cfg = tiny_config(**{"model.n_kv_heads": kv_heads})
  lcfg, lparams = mla(cfg, rank, pairs)
  got, _ = run_cached(lcfg, lparams)
  np.testing.assert_allclose(got, forward_at(lcfg, lparams), atol=1e-4, rtol=1e-4)
  dense = config_lib.apply_overrides(lcfg, {"cache.layout": "contiguous"})
  np.testing.assert_allclose(got, run_cached(dense, lparams)[0], atol=1e-4, rtol=1e-4)
  orig, _ = run_cached(cfg, tiny_params(cfg))
  assert np.max(np.abs(np.asarray(orig) - np.asarray(got))) > 1e-3


def test_the_highest_frequencies_are_kept_by_default():
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  _, lparams = mla(cfg, 8, 2)
  np.testing.assert_array_equal(lparams["rope_keep"],
                                np.broadcast_to([1.0, 1.0, 0.0, 0.0], (2, 2, 4)))


def test_pairs_are_chosen_per_head_and_stored_as_a_mask():
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  _, lparams = latent.factor(cfg, tiny_params(cfg), 8, 2, "qk")
  keep = np.asarray(lparams["rope_keep"])
  assert keep.shape == (2, 2, 4) and set(np.unique(keep)) <= {0.0, 1.0}
  assert (keep.sum(-1) == 2).all()
  rope_cols, rest = latent.columns(lparams, dataclasses.replace(cfg.model, rope_pairs=2))
  for l in range(2):  # noqa: E741
    for k in range(2):
      kept = np.flatnonzero(keep[l, k])
      assert sorted(rope_cols[l, k].tolist()) == sorted([*kept, *(kept + 4)])
      assert sorted(rope_cols[l, k].tolist() + rest[l, k].tolist()) == list(range(8))


def one_step(cfg, params, attention, codec, cache=None):
  """Prefill the prompts into a latent cache of `codec`, then one decode step's logits under
  `attention` (the cache is shared, so every attention reads the same codes)."""
  cfg = config_lib.apply_overrides(cfg, {"model.attention": attention, "cache.codec": codec})
  tokens, lengths = generate.pad_prompts(PROMPTS)
  if cache is None:
    c0 = cache_lib.init_cache(cfg, len(PROMPTS), tokens.shape[1] + 2)
    pos = np.where(np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None],
                   np.arange(tokens.shape[1])[None], -1)
    cache = step.run(step.Static.of(cfg), params, jnp.asarray(tokens),
                     jnp.asarray(pos, jnp.int32), c0).cache
  new = jnp.array([[c[0]] for c in CONT], jnp.int32)
  res = jax.jit(lambda c: step.run(step.Static.of(cfg), params, new, c.lengths[:, None], c))(cache)
  return np.asarray(res.logits), cache


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("attention", ["grouped", "native"])
def test_absorbed_read_equals_the_up_projected_read(codec, attention):
  """The reference attention reads the rows up-projected to K and V (`dense`); the XLA read
  and the native read read them absorbed. Same codes, same logits within 1e-5."""
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  lcfg, lparams = mla(cfg, 10, 2)
  want, cache = one_step(lcfg, lparams, "reference", codec)
  got, _ = one_step(lcfg, lparams, attention, codec, cache)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def wide(d_model, head_dim):
  """A model of 2 KV heads of `head_dim` keeping 2 rotated pairs each (8 columns a row)."""
  return tiny_config(**{"model.d_model": d_model, "model.n_heads": 4, "model.n_kv_heads": 2,
                        "model.head_dim": head_dim})


@pytest.mark.skipif(not kernels.available(), reason="needs the CPU read kernel (g++)")
@pytest.mark.parametrize("codec,d_model,head_dim,rank,width", [
    ("fp32", 64, 16, 24, 32), ("int8", 64, 16, 24, 32), ("fp32", 128, 32, 88, 96),
    ("bf16", 128, 32, 88, 96), ("int8", 128, 32, 88, 96), ("int4", 128, 32, 88, 96),
    ("fp32", 128, 32, 104, 112), ("int8", 128, 32, 104, 112)])
def test_absorbed_decode_goes_through_the_read_kernel_without_up_projecting(
    codec, d_model, head_dim, rank, width):
  """Rows of the widths the kernel's fused scan takes: read by the kernel, as the
  reference reads them up-projected, with no [B, S, Y] up-projection in the step."""
  cfg = wide(d_model, head_dim)
  lcfg, lparams = mla(cfg, rank, 2)
  assert latent.row_width(lcfg.model) == width
  want, cache = one_step(lcfg, lparams, "reference", codec)
  got, _ = one_step(lcfg, lparams, "native", codec, cache)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  new = jnp.array([[c[0]] for c in CONT], jnp.int32)

  def hlo(attention):
    ncfg = config_lib.apply_overrides(lcfg, {"model.attention": attention, "cache.codec": codec})
    return jax.jit(lambda c: step.run(step.Static.of(ncfg), lparams, new, c.lengths[:, None], c)
                   ).lower(cache).as_text()
  S, Y = cache.spec.capacity, latent.width(lcfg.model)
  up_projected = f"tensor<{len(PROMPTS)}x{S}x{Y}xf32>"  # every held row widened to K and V
  native, reference = hlo("native"), hlo("reference")
  assert kernels.TARGET in native and up_projected not in native
  assert up_projected in reference and kernels.TARGET not in reference


@pytest.mark.parametrize("codec,bytes_per", [("fp32", 4), ("bf16", 2)])
def test_row_bytes_are_the_latent_and_the_rotated_columns(codec, bytes_per):
  lcfg = config_lib.apply_overrides(
      tiny_config(**{"model.n_kv_heads": 2}),
      {"model.latent_rank": 6, "model.rope_pairs": 1, "cache.layout": "latent",
       "cache.codec": codec})
  c = cache_lib.init_cache(lcfg, 3, 20)
  L, B, S, W = 2, 3, 20, 6 + 2 * 2 * 1
  assert latent.row_width(lcfg.model) == W
  assert cache_lib.tree_bytes(c) == L * B * S * W * bytes_per + 4 * B
  assert cache_lib.tree_bytes(c) == latent.Latent().closed_form_bytes(c.spec)


@pytest.mark.parametrize("over,needle", [
    ({"model.rope_pairs": 5}, "exceeds the 4 frequency pairs"),
    ({"model.n_kv_heads": 2, "model.rope_pairs": 1, "model.latent_rank": 29},
     "must be in [0, 28]"),
    ({"model.rope_pairs": 1, "model.sliding_window": 8}, "takes one RoPE base and no window"),
    ({"model.latent_rank": 8, "model.qk_norm": True, "cache.layout": "latent"},
     "normalizes each key head after its projection"),
])
def test_bad_rope_pair_settings_are_one_line_errors(over, needle):
  with pytest.raises(KvjaxError) as e:
    tiny_config(**over)
  assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("rank,pairs,needle", [(8, 5, "--rope-pairs 5 must be in [0, 4]"),
                                               (29, 1, "--latent-rank 29 must be in [1, 28]"),
                                               (0, 1, "--latent-rank 0 must be in")])
def test_bad_conversions_are_refused_before_any_weight_is_touched(rank, pairs, needle):
  """(A model whose norms forbid the transform is refused by the same check.)"""
  cfg = tiny_config(**{"model.n_kv_heads": 2})  # Y = 2 heads x (16 - 2 pairs' columns) = 28
  with pytest.raises(KvjaxError) as e:
    latent.factor(cfg, tiny_params(cfg), rank, pairs)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_model_with_key_norms_is_refused_before_its_weights():
  cfg = tiny_config(**{"model.qk_norm": True})
  with pytest.raises(KvjaxError, match="normalizes each key head") as e:
    latent.factor(cfg, tiny_params(cfg), 8, 1)
  assert "\n" not in str(e.value)


def test_a_row_wider_than_the_kernel_takes_is_read_by_xla():
  """A full-rank latent of heads of 64 keeps rows over the kernel's widest (256): the native
  read hands them to XLA instead of failing at run time."""
  cfg = tiny_config(**{"model.d_model": 320, "model.n_heads": 4, "model.n_kv_heads": 4,
                       "model.head_dim": 64})
  lcfg, lparams = mla(cfg, 300, 1)  # W = 300 + 2 x 4 x 1 = 308
  assert latent.row_width(lcfg.model) > kernels.MAX_WIDTH
  want, cache = one_step(lcfg, lparams, "reference", "fp32")
  got, _ = one_step(lcfg, lparams, "native", "fp32", cache)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
