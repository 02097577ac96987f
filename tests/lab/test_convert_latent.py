"""kvjax.lab.convert.latent: the latent basis chosen by the calibration keys and values keeps them
better than the weights' own SVD; the fitted rank-A model stays exact under the latent
cache; impossible conversions are one line."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params
from test_convert import gqa_gguf  # noqa: F401 (fixture)
from test_policies import run_cached

from kvjax import cli
from kvjax.cache import latent as latent_cache
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint
from kvjax.lab.convert import fit, latent, layerwise

CALIB = np.random.default_rng(0).integers(0, 64, size=(24, 24)).astype(np.int32)


def _kv_error(cfg, params, lparams, layer=1):
  """Relative error of layer `layer`'s keys and values on the original stream."""
  x = layerwise.embed(cfg.model, params, CALIB)
  x = layerwise.advance(cfg.model, params, 0, x)
  want = layerwise.keys_values(cfg.model, params, layer, x)
  got = layerwise.keys_values(cfg.model, lparams, layer, x)
  return sum(np.sum((g - w) ** 2) for g, w in zip(got, want)) / sum(np.sum(w ** 2) for w in want)


def test_the_activation_basis_keeps_the_calibration_keys_and_values_better():
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 3})
  params = tiny_params(cfg)
  _, by_weights = latent_cache.factor(cfg, params, 6)
  lcfg, by_acts = latent.factor(cfg, params, 6, CALIB)
  assert lcfg.model.latent_rank == 6 and lcfg.cache.layout == "latent"
  assert _kv_error(cfg, params, by_acts) < 0.9 * _kv_error(cfg, params, by_weights)
  full = latent_cache.full_rank(cfg.model)
  fcfg, exact = latent.factor(cfg, params, full, CALIB)
  want, _ = run_cached(cfg, params)
  got, _ = run_cached(fcfg, exact)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_the_fitted_latent_model_is_closer_and_its_cache_still_exact():
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 3})
  params = tiny_params(cfg)
  lcfg, lparams = latent.factor(cfg, params, 4, CALIB)
  parts = latent.Factored(lcfg.model)
  fitted, reports = fit.fit(lcfg, lparams, cfg, params, CALIB,
                            fit.FitSettings(max_steps=150, batch=8), parts=parts)
  for r in reports:
    assert r.after < 0.8 * r.before, r
  up = np.asarray(fitted["layers"]["latent_up"], np.float64)  # [L, A, Y], orthonormal rows
  np.testing.assert_allclose(np.einsum("lay,lby->lab", up, up),
                             np.broadcast_to(np.eye(4), (cfg.model.n_layers, 4, 4)), atol=1e-5)
  W = np.concatenate([np.asarray(fitted["layers"][n]["kernel"], np.float64)
                      for n in ("k_proj", "v_proj")], -1)
  np.testing.assert_allclose(np.einsum("ley,lay,laz->lez", W, up, up), W, atol=1e-5)
  dense_cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 3, "model.latent_rank": 4})
  got, _ = run_cached(lcfg, fitted)  # the latent cache holds the fitted model exactly
  want, _ = run_cached(dense_cfg, fitted)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  orig, _ = run_cached(cfg, params)
  before, _ = run_cached(lcfg, lparams)
  err = lambda a: float(jnp.mean(jnp.abs(jnp.asarray(a) - jnp.asarray(orig))))  # noqa: E731
  assert err(got) < 0.9 * err(before)


def test_cli_latent_fit_records_its_recipe(gqa_gguf, tmp_path, capsys):  # noqa: F811
  _, _, path = gqa_gguf
  out = tmp_path / "lat"
  rc = cli.main(["convert", "--gguf", str(path), "--latent-rank", "8", "--method", "fit",
                 "--calib-tokens", "1024", "--minutes", "0.02", "--steps", "3",
                 "--out", str(out)])
  assert rc == 0, capsys.readouterr().err
  lcfg, _ = checkpoint.load(out)
  meta = checkpoint.read_meta(out)
  assert lcfg.model.latent_rank == 8 and lcfg.cache.layout == "latent"
  assert meta["recipe"]["latent_rank"] == 8 and meta["recipe"]["method"] == "fit"
  assert len(meta["layers"]) == lcfg.model.n_layers and not (out / "partial").exists()


def test_calibrated_rope_pairs_are_those_with_the_most_q_dot_k():
  """A pair whose key columns are scaled up carries more of q·k: the calibrated choice (qk) keeps
  it, and the converted model keeps it rotated (its cache holds it beside the latent)."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 3})
  params = tiny_params(cfg)
  D, P = cfg.model.D, cfg.model.D // 2
  k = np.array(params["layers"]["k_proj"]["kernel"])  # [L, E, K·D]
  for col in (3, 3 + P):                          # pair 3 of KV head 1, in every layer
    k[:, :, D + col] *= 8.0
  boosted = {**params, "layers": {**params["layers"],
                                  "k_proj": {**params["layers"]["k_proj"], "kernel": jnp.asarray(k)}}}
  lcfg, lparams = latent.factor(cfg, boosted, 8, CALIB, rope_pairs=1, choice="qk")
  keep = np.asarray(lparams["rope_keep"])
  assert lcfg.model.rope_pairs == 1 and keep.shape == (2, 2, P)
  assert (keep[:, 1, 3] == 1).all() and (keep.sum(-1) == 1).all()
  got, _ = run_cached(lcfg, lparams)  # absorbed latent = the same model's dense cache
  dense = tiny_config(**{"model.n_kv_heads": 2, "seed": 3, "model.latent_rank": 8,
                         "model.rope_pairs": 1})
  want, _ = run_cached(dense, lparams)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_the_fit_trains_a_rope_pair_latent_and_keeps_it_exact():
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 3})
  params = tiny_params(cfg)
  lcfg, lparams = latent.factor(cfg, params, 6, CALIB, rope_pairs=2)
  fitted, reports = fit.fit(lcfg, lparams, cfg, params, CALIB,
                            fit.FitSettings(max_steps=150, batch=8), parts=latent.Factored(lcfg.model))
  for r in reports:
    assert r.after < 0.8 * r.before, r
  np.testing.assert_array_equal(fitted["rope_keep"], lparams["rope_keep"])
  got, _ = run_cached(lcfg, fitted)
  dense = tiny_config(**{"model.n_kv_heads": 2, "seed": 3, "model.latent_rank": 6,
                         "model.rope_pairs": 2})
  np.testing.assert_allclose(got, run_cached(dense, fitted)[0], atol=1e-4, rtol=1e-4)


def test_cli_rope_pairs_pool_and_fit(gqa_gguf, tmp_path, capsys):  # noqa: F811
  _, _, path = gqa_gguf
  for method in ("pool", "fit"):
    out = tmp_path / method
    rc = cli.main(["convert", "--gguf", str(path), "--latent-rank", "8", "--rope-pairs", "2",
                   "--method", method, "--calib-tokens", "1024", "--minutes", "0.02",
                   "--steps", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    lcfg, lparams = checkpoint.load(out)
    assert lcfg.model.rope_pairs == 2 and lcfg.model.latent_rank == 8
    keep = np.asarray(lparams["rope_keep"])
    assert keep.shape == (lcfg.model.n_layers, lcfg.model.n_kv_heads, lcfg.model.D // 2)
    assert (keep.sum(-1) == 2).all() and (keep[..., :2] == 1).all()  # the highest frequencies
  recipe = checkpoint.read_meta(tmp_path / "fit")["recipe"]
  assert recipe["rope_pairs"] == 2 and recipe["rope_choice"] == "high"


@pytest.mark.parametrize("extra, says", [
    (["--latent-rank", "999", "--method", "fit"], "--latent-rank 999 must be in"),
    (["--latent-rank", "8", "--rope-pairs", "999"], "--rope-pairs 999 must be in"),
    (["--latent-rank", "8", "--rope-pairs", "999", "--method", "fit"],
     "--rope-pairs 999 must be in"),
    (["--kv-heads", "1", "--rope-pairs", "2"], "give --latent-rank R with it"),
    (["--latent-rank", "8", "--rope-pairs", "2", "--rope-choice", "low"],
     "--rope-choice 'low' unknown"),
])
def test_impossible_latent_conversions_are_one_line(gqa_gguf, tmp_path, capsys, extra,  # noqa: F811
                                                    says):
  _, _, path = gqa_gguf
  rc = cli.main(["convert", "--gguf", str(path), *extra, "--out", str(tmp_path / "x")])
  err = capsys.readouterr().err
  assert rc == 2 and says in err and err.count("\n") == 1, err
  assert not (tmp_path / "x").exists()


def test_a_model_with_local_layers_is_refused_before_its_weights():
  cfg = tiny_config(**{"model.sliding_window": 8, "model.global_every": 2})
  with pytest.raises(KvjaxError, match="one RoPE base, no window"):
    latent.check(cfg, 4)
