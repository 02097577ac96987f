"""One writer per --out (kvjax.lab.claims.sole_writer): while a `kvjax train` or
`kvjax convert` writes a folder, a second one into the same folder is refused in one line
before it writes anything (two would race inside orbax). The lock is an flock held by the
writer's open file, so holding it here (another open file, as another process would) is
exactly what the second writer meets; a writer that dies lets go with its process."""

from __future__ import annotations

import pytest

from kvjax import cli
from kvjax.io import checkpoint
from kvjax.lab import claims

import model_files as mf
from conftest import tiny_config, tiny_params


@pytest.fixture
def train_yaml(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("def f(x):\n    return x + 1\n" * 100)
  path = tmp_path / "t.yaml"
  path.write_text(
      "model: {d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 2, max_seq_len: 64}\n"
      f"train: {{data: {text}, batch: 2, seq_len: 16, steps: 2, warmup: 1, eval_every: 2,\n"
      "        eval_batches: 1, checkpoint_every: 2, log_every: 1}\n")
  return path


def _one_line(capsys) -> str:
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  return err[0]


def test_a_second_train_into_a_held_folder_is_one_line(tmp_path, train_yaml, capsys):
  out = tmp_path / "ckpt"
  with claims.sole_writer(out, "train"):  # the first writer, mid-run
    assert cli.main(["train", str(train_yaml), "--out", str(out)]) == 2
    line = _one_line(capsys)
    assert f"another kvjax process is writing {out}" in line
    assert "give this train another --out" in line
    assert not (out / "steps").exists() and not (out / "log.jsonl").exists()
  assert not out.exists()  # the holder made the folder only for its lock: nothing left
  assert cli.main(["train", str(train_yaml), "--out", str(out)]) == 0  # free again
  assert checkpoint.latest_step(out) == 2
  assert not (out / claims.LOCK_DIR).exists()  # the lock folder is tidied away


def test_a_convert_into_a_folder_a_train_writes_is_one_line(tmp_path, capsys):
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  gguf = mf.write_gguf(tmp_path / "m.gguf", cfg, tiny_params(cfg), tokenizer=False)
  out = tmp_path / "mha"
  argv = ["convert", "--gguf", str(gguf), "--kv-heads", "4", "--out", str(out)]
  with claims.sole_writer(out, "train"):
    assert cli.main(argv) == 2
    line = _one_line(capsys)
    assert "another kvjax process is writing" in line and "give this convert another --out" in line
    assert checkpoint.latest_step(out) is None
  assert cli.main(argv) == 0
  assert checkpoint.latest_step(out) == 0 and not (out / claims.LOCK_DIR).exists()


def test_an_out_that_is_a_file_is_one_line_not_a_spin(tmp_path, train_yaml, capsys):
  out = tmp_path / "taken"
  out.write_text("not a folder")
  assert cli.main(["train", str(train_yaml), "--out", str(out / "sub")]) == 2
  assert f"{out} is a file where --out needs a folder" in _one_line(capsys)
