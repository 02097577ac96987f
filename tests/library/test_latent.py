"""The latent (MLA-style) cache (kvjax/latent.py) and `kvjax convert --latent-rank`."""

import json

import jax
import numpy as np
import pytest
from conftest import tiny_config, tiny_params
from test_policies import run_cached

from kvjax import cache as cache_lib, cli
from kvjax.io import checkpoint
from kvjax.cache import latent
from kvjax.errors import KvjaxError


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_full_rank_latent_cache_equals_the_dense_model(kv_heads):
  cfg = tiny_config(**{"model.n_kv_heads": kv_heads})
  params = tiny_params(cfg)
  r = latent.full_rank(cfg.model)  # min(E=32, 2·K·D)
  lcfg, lparams = latent.factor(cfg, params, r)
  assert lcfg.cache.layout == "latent" and lcfg.model.latent_rank == r
  want, _ = run_cached(cfg, params)
  got, caches = run_cached(lcfg, lparams)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  assert type(caches[-1]) is latent.LatentCache and caches[-1].up is None


def test_low_rank_latent_cache_holds_exactly_the_low_rank_model():
  """At rank 8 the latents lose nothing of the rank-8 model: its dense cache and its latent
  cache give the same logits, and both differ from the original model's."""
  cfg = tiny_config()
  params = tiny_params(cfg)
  lcfg, lparams = latent.factor(cfg, params, 8)
  dense_cfg = tiny_config(**{"model.latent_rank": 8})
  got, _ = run_cached(lcfg, lparams)
  want, _ = run_cached(dense_cfg, lparams)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  orig, _ = run_cached(cfg, params)
  assert np.max(np.abs(np.asarray(orig) - np.asarray(got))) > 1e-3


@pytest.mark.parametrize("codec,bytes_per", [("fp32", 4), ("bf16", 2)])
def test_latent_bytes_per_token_formula(codec, bytes_per):
  cfg = tiny_config(**{"model.latent_rank": 8, "cache.layout": "latent", "cache.codec": codec})
  c = cache_lib.init_cache(cfg, 3, 20)
  L, B, S, r = 2, 3, 20, 8
  assert cache_lib.tree_bytes(c) == L * B * S * r * bytes_per + 4 * B
  assert cache_lib.tree_bytes(c) == latent.Latent().closed_form_bytes(c.spec)
  dense = cache_lib.init_cache(tiny_config(**{"cache.codec": codec}), 3, 20)
  assert cache_lib.tree_bytes(dense) == L * B * S * 2 * 4 * 8 * bytes_per + 4 * B  # 2·K·D vs r


def test_size_reports_latent_bytes_per_token(capsys):
  rc = cli.main(["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                 "--seq-len", "100", "--codec", "fp32", "--set", "model.latent_rank=8",
                 "--set", "cache.layout=latent", "--json"])
  res = json.loads(capsys.readouterr().out)
  assert rc == 0 and res["bytes_per_token_asymptotic"] == 2 * 8 * 4
  assert res["total_bytes"] == 100 * res["bytes_per_token_asymptotic"] + 4
  assert res["bytes_per_token"] == res["total_bytes"] / 100


@pytest.mark.parametrize("over,needle", [
    ({"cache.layout": "latent"}, "needs a latent model"),
    ({"model.latent_rank": 33}, "must be in [0, 32]"),
    ({"model.latent_rank": 8, "cache.layout": "latent", "cache.residual": 4}, "cache.residual=0"),
])
def test_bad_latent_settings_are_one_line_errors(over, needle):
  with pytest.raises(KvjaxError) as e:
    tiny_config(**over)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_convert_latent_rank_cli(tmp_path, capsys):
  cfg = tiny_config()
  checkpoint.save(tmp_path / "dense", cfg, tiny_params(cfg), step=0)
  rc = cli.main(["convert", "--checkpoint", str(tmp_path / "dense"), "--latent-rank", "0",
                 "--out", str(tmp_path / "bad")])
  err = capsys.readouterr().err
  assert rc == 2 and "--latent-rank" in err and "got 0" in err and err.count("\n") == 1
  rc = cli.main(["convert", "--checkpoint", str(tmp_path / "dense"), "--latent-rank", "16",
                 "--out", str(tmp_path / "lat")])
  assert rc == 0
  lcfg, lparams = checkpoint.load(tmp_path / "lat")
  assert lcfg.model.latent_rank == 16 and lcfg.cache.layout == "latent"
  up = np.asarray(lparams["layers"]["latent_up"])  # [L, r, 2KD], orthonormal rows
  np.testing.assert_allclose(np.einsum("lrx,lsx->lrs", up, up),
                             np.broadcast_to(np.eye(16), (2, 16, 16)), atol=1e-5)
  for k in jax.tree.leaves(lparams["layers"]["k_proj"]):
    assert np.linalg.matrix_rank(np.asarray(k[0]), tol=1e-4) <= 16
