"""Training, orbax checkpoints (restore, resume, corruption) and MHA->GQA/MQA conversion."""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax

from kvjax import cli
from kvjax import config as config_lib
from kvjax.decode import generate
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint
from kvjax.lab import convert, train
from kvjax.lab.convert import cli as convert_cli
from kvjax.model import Transformer, init_params


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "corpus.txt"
  words = ["alpha", "beta", "gamma", "delta", "import os", "return x", "def f():"]
  rng = np.random.default_rng(0)
  path.write_text("\n".join(" ".join(rng.choice(words, 6)) for _ in range(400)))
  return path


def _cfg(text_file, **over):
  base = {"model.d_model": 32, "model.n_layers": 1, "model.n_heads": 4, "model.n_kv_heads": 4,
          "model.max_seq_len": 128, "train.data": str(text_file), "train.batch": 4,
          "train.seq_len": 32, "train.steps": 30, "train.warmup": 3, "train.lr": 1e-2,
          "train.eval_every": 30, "train.eval_batches": 2, "train.checkpoint_every": 100,
          "train.log_every": 10}
  base.update(over)
  return config_lib.apply_overrides(config_lib.Config(), base)


def _logits(cfg, params, tokens):
  pos = jnp.arange(tokens.shape[1])[None].repeat(tokens.shape[0], 0)
  return Transformer(cfg.model).apply({"params": params}, tokens, pos, None)[0]


TOKENS = jnp.array([[104, 101, 108, 108, 111, 32, 119, 111]], jnp.int32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
  out = tmp_path_factory.mktemp("run")
  cfg = _cfg(text_file)
  summary = train.train(cfg, out, progress=False)
  return cfg, out, summary


def test_training_reduces_loss_and_writes_artifacts(trained):
  cfg, out, summary = trained
  from kvjax.lab import data
  corpus = data.load_corpus(cfg.train.data)
  before = train.validation_loss(cfg, init_params(cfg.model, cfg.seed), corpus)
  assert summary["val_loss"] < before - 0.5
  assert summary["val_loss"] < summary["unigram_entropy"]
  assert (out / "config.yaml").is_file() and (out / "summary.json").is_file()
  log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
  assert [r["step"] for r in log] == [10, 20, 30] and "val_loss" in log[-1]
  assert checkpoint.latest_step(out) == 30


def test_checkpoint_restore_gives_identical_logits(trained):
  cfg, out, summary = trained
  cfg2, params = checkpoint.load(out)
  assert cfg2 == cfg
  np.testing.assert_array_equal(_logits(cfg, summary["final_params"], TOKENS),
                                _logits(cfg2, params, TOKENS))
  # and the CLI runs it
  assert cli.main(["generate", "--checkpoint", str(out), "--prompt", "alpha",
                   "--max-new-tokens", "3", "--json"]) == 0


def test_resume_continues_the_step_count_and_matches_an_uninterrupted_run(tmp_path, text_file):
  full = train.train(_cfg(text_file, **{"train.steps": 6}), tmp_path / "full", progress=False)
  part = tmp_path / "part"
  train.train(_cfg(text_file, **{"train.steps": 6, "train.checkpoint_every": 4}), part,
              progress=False)
  # simulate an interruption after step 4: drop the final step
  import shutil
  shutil.rmtree(part / "steps" / "6")
  assert checkpoint.latest_step(part) == 4
  resumed = train.train(_cfg(text_file, **{"train.steps": 6, "train.checkpoint_every": 4}), part,
                        progress=False)
  assert resumed["resumed_from"] == 4 and checkpoint.latest_step(part) == 6
  for a, b in zip(jax.tree.leaves(full["final_params"]), jax.tree.leaves(resumed["final_params"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_missing_and_corrupt_checkpoints_give_one_line_errors(tmp_path, trained, capsys):
  with pytest.raises(KvjaxError, match="not a kvjax checkpoint"):
    checkpoint.load(tmp_path / "nothing")
  assert cli.main(["generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("kvjax: error:") and "\n" not in err
  # corrupt: copy a good checkpoint and damage its parameter files
  import shutil
  bad = tmp_path / "bad"
  shutil.copytree(trained[1], bad)
  for f in (bad / "steps" / "30" / "params").rglob("*"):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b"garbage")
  assert cli.main(["generate", "--checkpoint", str(bad), "--prompt", "x"]) == 2
  err = capsys.readouterr().err.strip()
  assert "corrupt" in err and "\n" not in err
  (bad / "config.yaml").write_text("model: [unclosed")
  assert cli.main(["generate", "--checkpoint", str(bad), "--prompt", "x"]) == 2
  assert "\n" not in capsys.readouterr().err.strip()


def test_mean_pool_group_size_one_is_identity(trained):
  cfg, _, summary = trained
  params = summary["final_params"]
  new_cfg, new_params = convert.mean_pool(cfg, params, cfg.model.n_kv_heads)
  assert new_cfg == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
    np.testing.assert_array_equal(a, b)


def test_mean_pool_to_gqa_and_mqa(trained, tmp_path):
  cfg, out, summary = trained
  params = summary["final_params"]
  L, E, D = cfg.model.n_layers, cfg.model.d_model, cfg.model.D
  k = params["layers"]["k_proj"]["kernel"].reshape(L, E, 4, D)
  gcfg, gp = convert.mean_pool(cfg, params, 2)
  np.testing.assert_allclose(gp["layers"]["k_proj"]["kernel"].reshape(L, E, 2, D)[:, :, 1],
                             (k[:, :, 2] + k[:, :, 3]) / 2, rtol=1e-6)
  # MQA through the CLI: expected shapes and a working model
  args = argparse.Namespace(checkpoint=str(out), hf=None, kv_heads=1, out=str(tmp_path / "mqa"),
                            set=[], method="pool")
  assert convert_cli.convert_cli(args)["to"] == "MQA"
  mcfg, mp = checkpoint.load(tmp_path / "mqa")
  assert mcfg.model.n_kv_heads == 1 and mcfg.model.variant == "MQA"
  for name in ("k_proj", "v_proj"):
    assert mp["layers"][name]["kernel"].shape == (L, E, D)
  assert mp["layers"]["q_proj"]["kernel"].shape == params["layers"]["q_proj"]["kernel"].shape
  logits = _logits(mcfg, mp, TOKENS)
  assert logits.shape == (1, 8, mcfg.model.vocab_size) and bool(jnp.isfinite(logits).all())
  got = generate.generate(mcfg, mp, [[1, 2, 3]], 4, timed=False)
  assert len(got["tokens"][0]) == 4
  with pytest.raises(KvjaxError, match="must divide"):
    convert.mean_pool(cfg, params, 3)
  assert cli.main(["convert", "--checkpoint", str(out), "--kv-heads", "1",
                   "--out", str(tmp_path / "mqa")]) == 2  # refuses to overwrite


def test_resume_with_a_different_recipe_is_refused(tmp_path):
  from kvjax import config as config_lib
  from kvjax.errors import KvjaxError
  from kvjax.lab.train import _check_resume
  a = config_lib.load(None, {"train.lr": 1e-3, "train.steps": 10})
  _check_resume(a, config_lib.replace(a, **{"train.steps": 20}), tmp_path)  # longer run: fine
  with pytest.raises(KvjaxError, match="train.lr"):
    _check_resume(a, config_lib.replace(a, **{"train.lr": 2e-3}), tmp_path)
  with pytest.raises(KvjaxError, match="model.n_kv_heads"):
    _check_resume(a, config_lib.replace(a, **{"model.n_kv_heads": 1}), tmp_path)


def test_a_model_with_its_own_tokenizer_is_not_trained_on_byte_ids(tmp_path, text_file):
  cfg = config_lib.apply_overrides(_cfg(text_file), {"tokenizer": "gguf:/models/real.gguf"})
  with pytest.raises(KvjaxError, match="byte-level ids"):
    train.train(cfg, tmp_path / "out", progress=False)
  assert not (tmp_path / "out").exists()


def test_a_window_longer_than_a_query_block_trains():
  """Windows over xla.NEW_BLOCK tokens: the forward reads a long prompt in blocks whose loop
  reverse-mode differentiation cannot cross, so training takes its gradient through the
  reference attention (`model.trainable`), with the same loss as the decode path's."""
  from conftest import tiny_config, tiny_params
  from kvjax.attention import xla
  from kvjax.model import Transformer
  cfg = tiny_config()
  params = tiny_params(cfg)
  T = xla.NEW_BLOCK + 72
  x = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, T)), jnp.int32)
  loss, grads = jax.value_and_grad(train.loss_fn)(params, cfg.model, x, x, jnp.ones_like(x))
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  logits, _ = Transformer(cfg.model).apply({"params": params}, x, pos, None)  # blocked reads
  want = optax.softmax_cross_entropy_with_integer_labels(logits, x).mean()
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
