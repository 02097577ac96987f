"""The uptrain and paged_workload experiments end to end at tiny size, through `kvjax run`
(rows, resume, summary) and their plots."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvjax import cli, config
from kvjax.io import checkpoint
from kvjax.lab import runner, train

ROOT = Path(__file__).resolve().parents[2]


def _plot(results: Path, out: Path) -> list[str]:
  proc = subprocess.run([sys.executable, "-m", "kvjax.cli", "plot", str(results), "--out", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return sorted(p.name for p in out.rglob("*.png"))


PAGED = """experiment: paged_workload
model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4}
cache: {layout: paged, codec: bf16, capacity: 64, page_size: 8}
params: {budget_kib: 32, max_slots: 4, chunk: 8, prefill_rows: 2, requests: 6,
         arrival_rate: 2.0, prompt_mean: 12, prompt_max: 24, output_mean: 6, output_max: 12,
         shared_fraction: 0.5, system_prompts: 2, system_len: 8, serve_repeats: 1,
         gather_bench: true, bench_batch: 2, bench_context: 32, bench_repeats: 1}
grid:
  cache.layout: [contiguous, paged]
"""


def test_paged_workload_end_to_end(tmp_path, capsys):
  (tmp_path / "pw.yaml").write_text(PAGED)
  out = tmp_path / "res"
  assert cli.main(["run", str(tmp_path / "pw.yaml"), "--out", str(out)]) == 0
  assert "memory_utilization" in capsys.readouterr().out  # the experiment's own summary
  rows = runner.read_rows(out / "paged_workload.jsonl")
  got = [(r["variant"]["layout"], r["variant"]["prefix_cache"]) for r in rows]
  assert got == [("contiguous", False), ("paged", True), ("paged", False)]
  budget = 32 * 1024
  from kvjax.lab.experiments import paged_workload
  want = sum(r.max_new_tokens for r in paged_workload.stream(config.load(tmp_path / "pw.yaml")))
  for r in rows:
    m = r["metrics"]
    assert m["requests"] == 6 and m["output_tokens"] == want  # every request served in full
    assert 1 <= m["max_concurrency"] <= m["slots"]
    assert 0 < m["cache_bytes"] <= budget + 4096  # pool (or reservations) + block tables
    assert m["tokens_per_s"] > 0 and m["bytes_per_token"] == 1 * 2 * 4 * 8 * 2
  contiguous, paged_prefix, paged = (r["metrics"] for r in rows)
  assert contiguous["slots"] == budget // (64 * 128) == 4
  assert paged["token_capacity"] == budget // 128  # the whole budget, in pages
  assert paged_prefix["gather_overhead"] > 0 and "gather_overhead" not in paged
  # a rerun finds every cell done; the plots redraw from the rows alone
  assert cli.main(["run", str(tmp_path / "pw.yaml"), "--out", str(out)]) == 0
  assert "2 already done, 0 to run" in capsys.readouterr().err
  assert any(name.startswith("paged") for name in _plot(out, tmp_path / "plots"))


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
  """A tiny trained MHA checkpoint (4 heads) on a small text file."""
  root = tmp_path_factory.mktemp("mha")
  words = ["alpha", "beta", "gamma", "delta", "import os", "return x", "def f():"]
  rng = np.random.default_rng(0)
  (root / "text.txt").write_text("\n".join(" ".join(rng.choice(words, 6)) for _ in range(300)))
  cfg = config.load(None, {
      "model.d_model": 32, "model.n_layers": 1, "model.n_heads": 4, "model.n_kv_heads": 4,
      "model.max_seq_len": 64, "train.data": str(root / "text.txt"), "train.batch": 4,
      "train.seq_len": 32, "train.steps": 8, "train.warmup": 2, "train.eval_every": 8,
      "train.eval_batches": 1, "train.checkpoint_every": 8, "train.log_every": 4,
      "train.recall_pairs": 2})
  train.train(cfg, root / "ckpt", progress=False)
  return root / "ckpt"


def test_uptrain_end_to_end(tmp_path, mha, capsys):
  (tmp_path / "up.yaml").write_text(
      "experiment: uptrain\nmodel: {d_model: 32, n_layers: 1, n_heads: 4}\n"
      "grid:\n  model.n_kv_heads: [2, 1]\n"
      f"params: {{mha: {mha}, scratch: {{1: {mha}}}, fractions: [0.5], recall_contexts: [16],\n"
      f"         recall_seqs: 2, work_dir: {tmp_path / 'work'}, progress: false}}\n")
  out = tmp_path / "res"
  rc = cli.main(["run", str(tmp_path / "up.yaml"), "--out", str(out)])
  err = capsys.readouterr().err
  # the MQA cell's scratch model is the 4-KV-head MHA: refused in one line, after the GQA cell
  assert rc == 2 and err.strip().splitlines()[-1].startswith(
      "kvjax: error: grid cell (model.n_kv_heads=1): params.scratch[1]")
  rows = runner.read_rows(out / "uptrain.jsonl")
  assert [(r["variant"]["method"], r["variant"]["kv_heads"]) for r in rows] == [
      ("mha", 4), ("converted", 2), ("uptrained", 2)]
  up = rows[2]
  assert up["workload"]["uptrain_steps"] == 4 and up["variant"]["uptrain_fraction"] == 0.5
  for r in rows:
    m = r["metrics"]
    assert np.isclose(m["ppl"], np.exp(m["val_loss"])) and 0 <= m["recall@16"] <= 1
    assert m["recall"] == m["recall@16"]
  assert checkpoint.latest_step(tmp_path / "work" / "kv2_f0.5") == 4
  # the converted model is the pooled MHA: uptraining it changes its loss
  assert rows[1]["metrics"]["val_loss"] != up["metrics"]["val_loss"]
  assert _plot(out, tmp_path / "plots")
  json.dumps(rows)  # rows are plain JSON


@pytest.mark.parametrize("edit, needle", [
    (("tokenizer: bytes", "tokenizer: gguf:/models/real.gguf"), "byte-level ids"),
    (("n_kv_heads: 4", "n_kv_heads: 2"), "not MHA"),
])
def test_uptrain_refuses_a_source_it_would_mislabel_or_feed_wrong_ids(tmp_path, mha, capsys,
                                                                      edit, needle):
  """A real model (its own tokenizer) trained on byte ids, or a GQA source labelled 'mha',
  exited 0 with meaningless rows."""
  import shutil
  src = tmp_path / "src"
  shutil.copytree(mha, src)
  text = (src / "config.yaml").read_text()
  assert edit[0] in text
  (src / "config.yaml").write_text(text.replace(edit[0], edit[1]))
  (tmp_path / "up.yaml").write_text(
      "experiment: uptrain\nmodel: {d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 1}\n"
      f"params: {{mha: {src}, fractions: [0.5], work_dir: {tmp_path / 'work'}}}\n")
  rc = cli.main(["run", str(tmp_path / "up.yaml"), "--out", str(tmp_path / "res")])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and needle in err, err
  assert not (tmp_path / "work").exists()
