"""Conversions between attention variants (kvjax.io.convert): the exact expansion to more KV
heads gives the same logits for r times the cache, pooling it back returns the original,
and a target that neither divides nor multiplies the heads is one line."""

import jax.numpy as jnp
import numpy as np
import pytest

import model_files as mf
from conftest import tiny_config, tiny_params
from kvjax import cli
from kvjax import cache as cache_lib
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint, convert
from kvjax.model import Transformer

TOKENS = jnp.array([[3, 14, 15, 9, 2, 6, 5, 35, 8, 9]], jnp.int32)


def _logits(cfg, params):
  pos = jnp.arange(TOKENS.shape[1])[None]
  return np.asarray(Transformer(cfg.model).apply({"params": params}, TOKENS, pos)[0])


@pytest.mark.parametrize("kv, to", [(1, 2), (1, 4), (2, 4)])
def test_expanded_twin_has_the_same_logits_and_more_cache(kv, to):
  cfg = tiny_config(**{"model.n_kv_heads": kv, "model.qkv_bias": True, "seed": 3})
  params = tiny_params(cfg)
  big_cfg, big = convert.expand(cfg, params, to)
  assert big_cfg.model.n_kv_heads == to and big_cfg.model.variant == ("MHA" if to == 4 else "GQA-2")
  np.testing.assert_allclose(_logits(big_cfg, big), _logits(cfg, params), atol=1e-5)
  small = cache_lib.init_cache(cfg, 1, 16)
  assert cache_lib.tree_bytes(cache_lib.init_cache(big_cfg, 1, 16).k) == \
      to // kv * cache_lib.tree_bytes(small.k)
  back_cfg, back = convert.mean_pool(big_cfg, big, kv)  # the round trip is the identity
  assert back_cfg.model == cfg.model
  for name in ("k_proj", "v_proj"):
    for leaf in ("kernel", "bias"):
      np.testing.assert_array_equal(back["layers"][name][leaf], params["layers"][name][leaf])


@pytest.mark.parametrize("to", [0, 3, 8])
def test_a_head_count_that_neither_divides_nor_multiplies_is_one_line(to):
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  with pytest.raises(KvjaxError) as e:
    convert.expand(cfg, tiny_params(cfg), to)
  assert "\n" not in str(e.value) and "--kv-heads" in str(e.value)


def test_cli_expands_a_gguf_model_to_its_mha_twin(tmp_path, capsys):
  cfg = tiny_config(**{"model.n_kv_heads": 2, "model.tie_embeddings": True})
  params = tiny_params(cfg)
  path = mf.write_gguf(tmp_path / "m.gguf", cfg, params, tokenizer=False)
  out = tmp_path / "mha"
  assert cli.main(["convert", "--gguf", str(path), "--kv-heads", "4", "--out", str(out)]) == 0
  assert "GQA-2 -> MHA" in capsys.readouterr().out
  got_cfg, got = checkpoint.load(out)
  assert got_cfg.model.n_kv_heads == 4
  np.testing.assert_allclose(_logits(got_cfg, got), _logits(cfg, params), atol=1e-5)
