"""kvjax.lab.convert.distill: training a mean-pooled MQA's attention toward the original's
next-token distributions lowers their held-out KL and changes nothing but q/k/v/o; an
interrupted run resumes from OUT/partial to the very params of an uninterrupted one; and
`kvjax convert --method distill` records its recipe and refuses what it cannot distill."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model_files as mf
from conftest import tiny_config, tiny_params
from kvjax import cli
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint
from kvjax.lab import convert
from kvjax.lab.convert import distill
from kvjax.model import Transformer

TOKENS = np.random.default_rng(0).integers(0, 64, size=(20, 24)).astype(np.int32)
SETTINGS = distill.DistillSettings(minutes=60, max_steps=8, lr=3e-3, batch=4)


@pytest.fixture(scope="module")
def models():
  cfg = tiny_config(**{"model.n_kv_heads": 2, "model.qkv_bias": True, "seed": 5})
  params = dict(tiny_params(cfg))  # a random head's logits are near uniform: sharpen them
  params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 30}
  mqa_cfg, pooled = convert.mean_pool(cfg, params, 1)
  return cfg, params, mqa_cfg, pooled


def _kl(cfg, params, tcfg, teacher, tokens):
  """KL(teacher || student) per token from the full logits, the plain way."""
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  lp = lambda c, p: jax.nn.log_softmax(  # noqa: E731
      Transformer(c.model).apply({"params": p}, jnp.asarray(tokens), pos)[0], axis=-1)
  t, s = lp(tcfg, teacher), lp(cfg, params)
  return float(jnp.mean(jnp.sum(jnp.exp(t) * (t - s), axis=-1)))


def test_distilling_lowers_the_held_out_kl_and_trains_only_attention(models):
  cfg, params, mqa_cfg, pooled = models
  held = TOKENS[-2:]
  got, r = distill.distill(mqa_cfg, pooled, cfg, params, TOKENS,
                           dataclasses.replace(SETTINGS, max_steps=30))
  assert r.steps == 30 and r.resumed_from == 0
  assert r.before == pytest.approx(_kl(mqa_cfg, pooled, cfg, params, held), rel=1e-3)
  assert r.after == pytest.approx(_kl(mqa_cfg, got, cfg, params, held), rel=1e-3)
  assert r.after < 0.7 * r.before, r
  flat = jax.tree_util.tree_flatten_with_path
  for (path, a), (_, b) in zip(flat(got)[0], flat(pooled)[0]):
    name = jax.tree_util.keystr(path)
    assert a.dtype == b.dtype
    if any(f"'{n}'" in name for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
      assert np.abs(np.asarray(a) - np.asarray(b)).max() > 0, name
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)


def test_an_interrupted_run_resumes_to_the_uninterrupted_params(models, tmp_path, monkeypatch,
                                                                 capsys):
  cfg, params, mqa_cfg, pooled = models
  whole, _ = distill.distill(mqa_cfg, pooled, cfg, params, TOKENS, SETTINGS)
  partial, recipe = tmp_path / "partial", {"method": "distill", "calib": "x"}
  monkeypatch.setattr(distill, "SAVE_EVERY", 2)

  def stop_at_5(step, loss):
    if step == 5:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    distill.distill(mqa_cfg, pooled, cfg, params, TOKENS, SETTINGS, partial, recipe, stop_at_5)
  assert checkpoint.latest_step(partial) == 4
  seen = []
  got, r = distill.distill(mqa_cfg, pooled, cfg, params, TOKENS, SETTINGS, partial, recipe,
                           lambda step, loss: seen.append(step))
  assert "resuming the distillation after step 4" in capsys.readouterr().out
  assert seen == [5, 6, 7, 8] and r.resumed_from == 4 and r.steps == 8
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(KvjaxError, match="another recipe") as e:
    distill.distill(mqa_cfg, pooled, cfg, params, TOKENS, SETTINGS, partial,
                    {**recipe, "calib": "y"})
  assert "\n" not in str(e.value)


def test_each_step_reads_the_windows_of_its_seed_and_step():
  a = [distill.batch_rows(0, s, 3, 7) for s in range(7)]  # three epochs of 7 windows
  distill._permutation.cache_clear()
  for s in (6, 2, 4):  # any step alone, in any order, reads the same windows
    np.testing.assert_array_equal(distill.batch_rows(0, s, 3, 7), a[s])
  flat = np.concatenate(a)
  for epoch in range(3):
    assert sorted(flat[7 * epoch:7 * epoch + 7]) == list(range(7))
  assert not np.array_equal(flat[:7], flat[7:14])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """A tiny GQA-2 GGUF with a tokenizer (the teacher) and its mean-pooled MQA checkpoint."""
  root = tmp_path_factory.mktemp("distill")
  cfg = tiny_config(**{"model.n_kv_heads": 2, "model.max_seq_len": 128, "seed": 4})
  path = mf.write_gguf(root / "m.gguf", cfg, tiny_params(cfg))
  mqa = root / "mqa"
  assert cli.main(["convert", "--gguf", str(path), "--kv-heads", "1", "--method", "pool", "--out", str(mqa)]) == 0
  text = root / "calib.txt"
  text.write_text(" ".join(f"abcd ef {i} {i * i % 97}" for i in range(2000)))
  return path, mqa, text


def _args(mqa, out, *extra, text):
  return ["convert", "--checkpoint", str(mqa), "--method", "distill", "--calib", str(text),
          "--calib-tokens", "1024", "--steps", "3", "--out", str(out), *extra]


def test_cli_distills_toward_the_model_it_was_converted_from(converted, tmp_path, capsys):
  path, mqa, text = converted
  out = tmp_path / "d"
  assert cli.main(_args(mqa, out, text=text)) == 0
  assert "held-out KL" in capsys.readouterr().out
  meta = checkpoint.read_meta(out)
  assert meta["method"] == "distill" and meta["converted_from"] == f"gguf:{path}"
  recipe = meta["recipe"]
  assert recipe["teacher"] == f"gguf:{path}" and recipe["source"] == f"checkpoint:{mqa}"
  assert recipe["steps"] == 3 and recipe["calib_seq_len"] == 128
  assert recipe["student_recipe"] == "mean_pool"
  assert meta["steps"] == 3 and meta["held_kl_after"] < meta["held_kl_before"]
  assert not (out / "partial").exists()
  got_cfg, _ = checkpoint.load(out)
  assert got_cfg.model.variant == "MQA"


def test_calib_len_sets_the_distillation_windows(converted, tmp_path):
  """`--calib-len` is the window the student is trained on (a distillation sees no position
  beyond it), capped by the model's context; 0 is refused in one line."""
  _, mqa, text = converted
  assert cli.main(_args(mqa, tmp_path / "d", "--calib-len", "64", text=text)) == 0
  assert checkpoint.read_meta(tmp_path / "d")["recipe"]["calib_seq_len"] == 64
  assert cli.main(_args(mqa, tmp_path / "e", "--calib-len", "0", text=text)) == 2


def test_cli_distillations_that_cannot_run_are_one_line(converted, tmp_path, capsys):
  path, mqa, text = converted
  other = tiny_config(**{"model.n_kv_heads": 2, "model.n_layers": 1})
  checkpoint.save(tmp_path / "other", other, tiny_params(other), step=0)
  plain = tiny_config(**{"model.n_kv_heads": 1, "model.max_seq_len": 128, "tokenizer": "none"})
  checkpoint.save(tmp_path / "notok", plain, tiny_params(plain), step=0,
                  meta={"converted_from": f"gguf:{path}"})
  cases = [
      (_args(mqa, tmp_path / "x", "--minutes", "-1", text=text), "--minutes"),
      (_args(mqa, tmp_path / "x", "--teacher", f"checkpoint:{tmp_path / 'other'}", text=text),
       "differ in n_layers"),
      (_args(mqa, tmp_path / "x", "--kv-heads", "2", text=text), "drop --kv-heads 2"),
      (["convert", "--gguf", str(path), "--method", "distill", "--out", str(tmp_path / "x")],
       "--teacher SOURCE"),
      (_args(tmp_path / "notok", tmp_path / "x", text=text), "has no tokenizer"),
  ]
  for argv, says in cases:
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err, err
    assert checkpoint.latest_step(tmp_path / "x") is None


@pytest.mark.parametrize("pairs", [0, 2])
def test_a_latent_student_trains_in_its_rank_and_its_cache_stays_exact(models, pairs):
  """A rank-6 latent (with or without rope pairs): distilling lowers its held-out KL, its
  K/V kernel keeps rank 6 with `latent_up` an orthonormal basis of its rows, the pair mask
  is unchanged, and its latent cache still gives the model's own logits."""
  from kvjax.cache import latent
  from kvjax import config as config_lib
  from test_policies import run_cached
  cfg, params, _, _ = models
  lcfg, lparams = latent.factor(cfg, params, 6, pairs)
  got, r = distill.distill(lcfg, lparams, cfg, params, TOKENS,
                           dataclasses.replace(SETTINGS, max_steps=30))
  assert r.after < 0.8 * r.before, r
  up = np.asarray(got["layers"]["latent_up"], np.float64)
  np.testing.assert_allclose(np.einsum("lay,lby->lab", up, up),
                             np.broadcast_to(np.eye(6), (2, 6, 6)), atol=1e-5)
  m = lcfg.model
  W, _, _ = latent.split_kv(m, got["layers"], got.get("rope_keep"))
  W = np.asarray(W, np.float64)
  np.testing.assert_allclose(np.einsum("ley,lay,laz->lez", W, up, up), W, atol=1e-5)
  assert np.abs(W - np.asarray(latent.split_kv(m, lparams["layers"],
                                               lparams.get("rope_keep"))[0])).max() > 1e-4
  if pairs:
    np.testing.assert_array_equal(got["rope_keep"], lparams["rope_keep"])
  dense = config_lib.apply_overrides(lcfg, {"cache.layout": "contiguous"})
  np.testing.assert_allclose(run_cached(lcfg, got)[0], run_cached(dense, got)[0],
                             atol=1e-4, rtol=1e-4)

def test_windows_longer_than_a_query_block_distill_and_fit(models):
  """Calibration windows over xla.NEW_BLOCK tokens (a real conversion's are 512): the fit's
  layer outputs and the distillation's forward are differentiated through them."""
  from kvjax.attention import xla
  from kvjax.lab.convert import fit
  cfg, params, mqa_cfg, pooled = models
  long = np.random.default_rng(1).integers(0, 64, size=(4, xla.NEW_BLOCK + 40)).astype(np.int32)
  _, r = distill.distill(mqa_cfg, pooled, cfg, params, long,
                         dataclasses.replace(SETTINGS, max_steps=2, batch=1))
  assert r.steps == 2 and np.isfinite(r.after)
  _, reports = fit.fit(mqa_cfg, pooled, cfg, params, long, fit.FitSettings(max_steps=2, batch=2))
  assert len(reports) == cfg.model.n_layers and all(np.isfinite(x.after) for x in reports)
