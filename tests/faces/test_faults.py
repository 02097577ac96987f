"""Faults: a training run killed mid-way resumes with nothing lost or repeated; a results
file that cannot be written mid-sweep is one line with the finished rows intact; NaN/Inf in
what a cache stores propagates as documented (kvjax/quant.py, kvjax/codecs.py) and never
crashes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax import cli, config, model
from kvjax.io import checkpoint
from kvjax.lab import evaluate, train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "corpus.txt"
  words = ["alpha", "beta", "gamma", "delta", "import os", "return x", "def f():"]
  rng = np.random.default_rng(0)
  path.write_text("\n".join(" ".join(rng.choice(words, 6)) for _ in range(400)))
  return path


def _train_yaml(tmp_path, corpus, steps, every):
  path = tmp_path / "train.yaml"
  path.write_text(
      "model: {d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4, max_seq_len: 64}\n"
      f"train: {{data: {corpus}, batch: 4, seq_len: 32, steps: {steps}, warmup: 3, lr: 0.01,\n"
      f"        eval_every: {steps}, eval_batches: 1, checkpoint_every: {every}, log_every: 2}}\n")
  return path


def test_train_killed_after_a_checkpoint_resumes_exactly(tmp_path, corpus):
  """SIGKILL `kvjax train` once a checkpoint exists, rerun the same command: it resumes
  from that checkpoint, logs every step exactly once, and ends with the parameters of an
  uninterrupted run with the same seed. (24 steps: a checkpoint every 4 costs more than the
  steps between them, and 16 steps and 4 saves after the kill point leave ample time to kill.)"""
  steps = 24
  yaml_path = _train_yaml(tmp_path, corpus, steps, every=4)
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "kvjax.cli", "train", str(yaml_path), "--out", str(out)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and proc.poll() is None:
    if (out / "steps").is_dir() and (checkpoint.latest_step(out) or 0) >= 8:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  killed_at = checkpoint.latest_step(out)
  assert killed_at is not None and 8 <= killed_at < steps
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["resumed_from"] >= killed_at and summary["steps"] == steps
  logged = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
  assert logged == list(range(2, steps + 1, 2))  # none lost, none repeated
  cfg = config.load(yaml_path, {"train.checkpoint_every": 10_000})
  ref = train.train(cfg, tmp_path / "ref", progress=False)
  _, params = checkpoint.load(out)
  for a, b in zip(jax.tree.leaves(ref["final_params"]), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_resume_drops_log_rows_past_the_checkpoint(tmp_path, corpus):
  out = tmp_path / "run"
  cfg = config.load(_train_yaml(tmp_path, corpus, 8, every=4))
  train.train(cfg, out, progress=False)
  import shutil
  shutil.rmtree(out / "steps" / "8")  # as if killed after logging steps 6 and 8
  with open(out / "log.jsonl", "a") as f:
    f.write('{"step": 10, "loss"')  # and a torn line
  got = train.train(cfg, out, progress=False)
  assert got["resumed_from"] == 4
  logged = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
  assert logged == [2, 4, 6, 8]


class _FullDisk:
  """A results file whose writes fail with ENOSPC after `ok` successful writes."""

  def __init__(self, real, ok):
    self.real, self.ok = real, ok

  def write(self, text):
    if self.ok <= 0:
      raise OSError(28, "No space left on device", str(self.real.name))
    self.ok -= 1
    return self.real.write(text)

  def __getattr__(self, name):
    return getattr(self.real, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.real.close()


def test_disk_full_mid_sweep_is_one_line_and_finished_rows_stay(tmp_path, capsys, monkeypatch):
  """The 2nd cell's write fails: exit 2, one line after the erased progress bar, the 1st
  cell's row intact, and a rerun (disk freed) completes the sweep without redoing it."""
  from kvjax.lab import runner

  grid = tmp_path / "sweep.yaml"
  grid.write_text("experiment: latency\nmodel: {d_model: 32, n_layers: 1, n_heads: 4}\n"
                  "workload: {batch: 1, prompt_len: 8, gen_len: 3, repeats: 1}\n"
                  "grid:\n  model.n_kv_heads: [4, 1]\n")
  real_open = Path.open

  def full_open(self, mode="r", *a, **k):
    f = real_open(self, mode, *a, **k)
    return _FullDisk(f, ok=1) if self.suffix == ".jsonl" and "a" in mode else f
  monkeypatch.setattr(Path, "open", full_open)
  rc = cli.main(["run", str(grid), "--out", str(tmp_path / "res")])
  err = capsys.readouterr().err
  assert rc == 2
  last = err.replace("\r", "\n").strip().splitlines()[-1]
  assert last.startswith("kvjax: error: No space left on device") and "rows already" in last
  assert "Traceback" not in err
  rows = runner.read_rows(tmp_path / "res" / "latency.jsonl")
  assert len(rows) == 1 and rows[0]["cell"]["index"] == 0
  monkeypatch.setattr(Path, "open", real_open)
  assert cli.main(["run", str(grid), "--out", str(tmp_path / "res")]) == 0
  assert "1 already done, 1 to run" in capsys.readouterr().err
  rows = runner.read_rows(tmp_path / "res" / "latency.jsonl")
  assert sorted(r["cell"]["index"] for r in rows) == [0, 1]


def test_unwritable_results_file_is_one_line(tmp_path, capsys):
  """The results path is taken by a folder: one line naming it, nothing else written."""
  grid = tmp_path / "sweep.yaml"
  grid.write_text("experiment: latency\nmodel: {d_model: 32, n_layers: 1, n_heads: 4}\n"
                  "workload: {batch: 1, prompt_len: 8, gen_len: 3, repeats: 1}\n")
  (tmp_path / "res" / "latency.jsonl").mkdir(parents=True)
  assert cli.main(["run", str(grid), "--out", str(tmp_path / "res")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("kvjax: error:") and "latency.jsonl" in err[-1]


SETTINGS = {"fp32": {"cache.codec": "fp32"}, "bf16": {"cache.codec": "bf16"},
            "fp8_e4m3": {"cache.codec": "fp8_e4m3"},
            "int4_g8": {"cache.codec": "int4", "cache.group_size": 8},
            "int2_kivi": {"cache.codec": "int2", "cache.k_axis": "channel",
                          "cache.group_size": 4, "cache.residual": 4},
            "paged_int8": {"cache.codec": "int8", "cache.layout": "paged", "cache.page_size": 4}}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_non_finite_kv_propagates_through_the_cache(setting):
  """Tokens whose embeddings are NaN (sequence 0) and +Inf (sequence 1) write non-finite
  K/V into the cache. Documented: it propagates (the sequence's later predictions are NaN:
  the attention shows it), earlier positions and the clean sequence 2 are untouched, and
  nothing raises."""
  cfg = config.load(None, {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
                           "model.n_kv_heads": 2, **SETTINGS[setting]})
  params = model.init_params(cfg.model, 0)
  emb = np.asarray(params["embed_tokens"]["embedding"]).copy()
  emb[7], emb[8] = np.nan, np.inf
  poisoned = {**params, "embed_tokens": {"embedding": jax.numpy.asarray(emb)}}
  tokens = np.random.default_rng(0).integers(10, 200, (3, 12)).astype(np.int32)
  at = {0: 5, 1: 9}
  tokens[0, at[0]], tokens[1, at[1]] = 7, 8
  clean, _ = evaluate.stream_logprobs(cfg, params, tokens)
  got, _ = evaluate.stream_logprobs(cfg, poisoned, tokens)
  clean, got = np.asarray(clean), np.asarray(got)
  for b, t in at.items():
    np.testing.assert_array_equal(got[b, :t], clean[b, :t])
    assert np.all(np.isnan(got[b, t:]))
  np.testing.assert_array_equal(got[2], clean[2])
