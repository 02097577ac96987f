"""Conversions between attention variants (kvjax.lab.convert): the exact expansion to more KV
heads gives the same logits for r times the cache, pooling it back returns the original,
and a target that neither divides nor multiplies the heads is one line."""

import jax.numpy as jnp
import numpy as np
import pytest

import model_files as mf
from conftest import tiny_config, tiny_params
from kvjax import cache as cache_lib
from kvjax import cli
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint
from kvjax.lab import convert
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


@pytest.fixture(scope="module")
def gqa_gguf(tmp_path_factory):
  """A GQA-2 tiny model with its own (gpt2) tokenizer: the calibrated methods read text."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "model.max_seq_len": 128, "seed": 4})
  params = tiny_params(cfg)
  return cfg, params, mf.write_gguf(tmp_path_factory.mktemp("gqa") / "m.gguf", cfg, params)


def _fit_args(path, out, *extra):
  return ["convert", "--gguf", str(path), "--kv-heads", "1", "--method", "fit",
          "--calib-tokens", "1024", "--minutes", "0.02", "--out", str(out), *extra]


def test_cli_fit_records_its_recipe_and_resumes_an_interrupted_run(gqa_gguf, tmp_path, capsys,
                                                                    monkeypatch):
  from kvjax.lab.convert import fit
  _, _, path = gqa_gguf
  out = tmp_path / "mqa"
  real, calls = fit._fit_layer, []

  def interrupted(*args, **kwargs):
    calls.append(args[6])
    if len(calls) == 2:
      raise KeyboardInterrupt  # the second layer: the first is already checkpointed
    return real(*args, **kwargs)

  monkeypatch.setattr(fit, "_fit_layer", interrupted)
  assert cli.main(_fit_args(path, out)) == 130  # interrupted (Ctrl-C)
  assert checkpoint.latest_step(out) is None and checkpoint.latest_step(out / "partial") == 1
  first = checkpoint.restore(out / "partial")["meta"]["layers"]
  monkeypatch.setattr(fit, "_fit_layer", real)
  assert cli.main(_fit_args(path, out)) == 0
  assert "resuming the fit after layer 0" in capsys.readouterr().out
  meta = checkpoint.restore(out)["meta"]
  assert meta["method"] == "fit" and meta["recipe"]["calib"] == "stdlib"
  assert meta["recipe"]["calib_seq_len"] == 128 and meta["recipe"]["kv_heads"] == 1
  assert [r["layer"] for r in meta["layers"]] == [0, 1] and meta["layers"][0] == first[0]
  assert not (out / "partial").exists()
  got_cfg, _ = checkpoint.load(out)
  assert got_cfg.model.variant == "MQA"


def test_cli_refuses_to_mix_a_partial_fit_with_another_recipe(gqa_gguf, tmp_path, capsys):
  _, _, path = gqa_gguf
  out = tmp_path / "mqa"
  cfg = tiny_config(**{"model.n_kv_heads": 1, "model.max_seq_len": 128})
  checkpoint.save(out / "partial", cfg, tiny_params(cfg), step=1,
                  meta={"recipe": {"method": "fit", "calib": "other"}, "layers_done": 1,
                        "layers": []})
  assert cli.main(_fit_args(path, out)) == 2
  err = capsys.readouterr().err.strip()
  assert "another recipe" in err and "\n" not in err
  assert checkpoint.latest_step(out) is None


@pytest.mark.parametrize("extra, says", [
    (["--kv-heads", "1", "--method", "distil"], "--method 'distil' unknown"),
    (["--latent-rank", "4", "--method", "align"], "--latent-rank takes --method pool"),
    (["--kv-heads", "4", "--method", "align"], "fewer than"),
    (["--kv-heads", "1", "--method", "fit", "--minutes", "nan"], "--minutes"),
])
def test_cli_conversions_that_cannot_run_are_one_line(gqa_gguf, tmp_path, capsys, extra, says):
  _, _, path = gqa_gguf
  out = tmp_path / "x"
  assert cli.main(["convert", "--gguf", str(path), *extra, "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert says in err and "\n" not in err and "Traceback" not in err
  assert not out.exists()


def test_calibration_texts_share_the_windows_and_interleave(tmp_path):
  """--calib A,B: half the windows from each text, alternating (the fit's held-out tail
  then holds both), each window from its own text."""
  from kvjax.lab.convert import cli as convert_cli
  from kvjax.io import tokenizer

  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_text("a" * 5000)
  b.write_text("b" * 5000)
  tok = tokenizer.get_tokenizer("bytes")
  rows = convert_cli.calib_tokens(tok, f"{a},{b}", 6 * 64, 64)
  assert rows.shape[0] == 6
  firsts = [chr(int(r[r < 256][-1])) for r in rows]  # each window's text, by its bytes
  assert firsts == ["a", "b"] * 3
  with pytest.raises(KvjaxError, match="--calib"):
    convert_cli.calib_tokens(tok, ",", 256, 64)


def test_a_conversion_is_judged_on_retrieval_through_its_own_cache(tmp_path, capsys):
  """--judge-context N: 10 passkeys and 10 needles of N tokens, answered through the
  converted model's cache, recorded in its meta with Wilson intervals and printed; a length
  the model cannot hold is one line before anything is written."""
  from kvjax.lab import intervals
  from kvjax.lab.convert import judge
  cfg = tiny_config(**{"model.n_kv_heads": 2, "model.max_seq_len": 512, "seed": 4})
  path = mf.write_gguf(tmp_path / "m.gguf", cfg, tiny_params(cfg))
  out = tmp_path / "lat"
  rc = cli.main(["convert", "--gguf", str(path), "--latent-rank", "8", "--rope-pairs", "1",
                 "--judge-context", "256", "--out", str(out)])
  printed = capsys.readouterr().out
  assert rc == 0
  got = checkpoint.read_meta(out)["retrieval"]
  assert got["context"] == 256 and set(got) == {"context", *judge.TASKS}
  for task in judge.TASKS:
    r = got[task]
    assert r["n"] == len(judge.DEPTHS) * judge.SEEDS and 0 <= r["correct"] <= r["n"]
    lo, hi = intervals.wilson(r["correct"], r["n"])
    assert r["ci95"] == [round(lo, 4), round(hi, 4)]
    assert f"{task} {r['correct']}/{r['n']}" in printed
  rc = cli.main(["convert", "--gguf", str(path), "--latent-rank", "8", "--judge-context", "500",
                 "--out", str(tmp_path / "x")])
  err = capsys.readouterr().err
  assert rc == 2 and "--judge-context 500" in err and err.count("\n") == 1
  assert not (tmp_path / "x").exists()


def test_fewer_heads_default_to_align_and_pool_says_what_it_costs(gqa_gguf, tmp_path, capsys):
  _, _, path = gqa_gguf
  rc = cli.main(["convert", "--gguf", str(path), "--kv-heads", "1", "--calib-tokens", "1024",
                 "--out", str(tmp_path / "a")])
  printed = capsys.readouterr().out
  assert rc == 0 and "--method align (the default" in printed
  assert checkpoint.read_meta(tmp_path / "a")["method"] == "align"
  rc = cli.main(["convert", "--gguf", str(path), "--kv-heads", "1", "--method", "pool",
                 "--out", str(tmp_path / "p")])
  printed = capsys.readouterr().out
  assert rc == 0 and "--method pool: each group's K/V heads averaged" in printed
  assert checkpoint.read_meta(tmp_path / "p")["method"] == "mean_pool"
