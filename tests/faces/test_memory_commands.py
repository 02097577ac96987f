"""Every allocating command checks memory on the host, before it allocates: `eval` and
`train` refuse a KVJAX_MEMORY_LIMIT that `generate` refuses, instead of running past it,
each in one line naming the estimate, the limit and the fix."""

from __future__ import annotations

import pytest

from kvjax import cli, footprint, memory
from kvjax import config as config_lib

TINY = "model: {vocab_size: 260, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4, " \
    "max_seq_len: 512}\ntokenizer: bytes\n"


@pytest.fixture
def tiny(tmp_path):
  path = tmp_path / "tiny.yaml"
  path.write_text(TINY)
  return path


def test_eval_refuses_a_limit_the_weights_fit_but_its_caches_do_not(tiny, tmp_path,
                                                                   monkeypatch, capsys):
  cfg = config_lib.load(tiny)
  weights = footprint.param_bytes(cfg.model)
  need = sum(memory.estimate(cfg, 1, 384, 1).values())
  assert need > weights  # a limit between the two: the weights load, the eval cannot run
  text = tmp_path / "t.txt"
  text.write_text("abc " * 400)
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(max(weights, need // 2)))
  argv = ["eval", "--config", str(tiny), "--text", str(text), "--tokens", "384"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "not enough memory for this eval" in err[0]
  assert "KVJAX_MEMORY_LIMIT" in err[0]
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(need // 2))  # generate refuses it too
  assert cli.main(["generate", "--config", str(tiny), "--prompt-ids", ",".join(["1"] * 120),
                   "--max-new-tokens", "8"]) == 2
  assert "not enough memory for this generate" in capsys.readouterr().err


def test_train_refuses_a_limit_before_making_weights(tmp_path, monkeypatch, capsys):
  text = tmp_path / "corpus.txt"
  text.write_text("alpha beta gamma\n" * 200)
  cfg = tmp_path / "train.yaml"
  cfg.write_text(TINY + f"train: {{data: {text}, batch: 4, seq_len: 32, steps: 2}}\n")
  loaded = config_lib.load(cfg)
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(4 * footprint.param_bytes(loaded.model) - 1))
  out = tmp_path / "ckpt"
  assert cli.main(["train", str(cfg), "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "not enough memory for this training run" in err[0]
  assert "train.batch" in err[0] and not (out / "steps").exists()
