"""`kvjax eval`: streamed perplexity equals the full forward pass with the fp32 cache, a
lossy codec moves it, the CLI prints one JSON object, and on SmolLM2 kvjax's perplexity
agrees with transformers' on the same tokens."""

import json

import jax
import numpy as np
import pytest
import yaml

from kvjax import cli
from kvjax import config as config_lib
from kvjax.io import sources
from kvjax.lab import evaluate

TINY = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 256}, "tokenizer": "bytes", "seed": 3}
TEXT = ("The cache keeps every key and value a decoder has seen, so each new token reads "
        "them back instead of recomputing them. " * 8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  root = tmp_path_factory.mktemp("eval")
  (root / "model.yaml").write_text(yaml.safe_dump(TINY))
  (root / "text.txt").write_text(TEXT)
  return root


@pytest.mark.parametrize("chunk", [1, 32])
def test_fp32_cache_gives_full_forward_perplexity(tiny, chunk):
  src = sources.parse(str(tiny / "model.yaml"))
  out = evaluate.eval_cli(src, {"cache.codec": "fp32"}, text=str(tiny / "text.txt"),
                          tokens=96, seqs=2, chunk=chunk, progress=False)
  cfg, params, tok = sources.load(src)
  windows = evaluate.text_windows(tok, TEXT, 96, 2)
  full = evaluate.full_logprobs(params, windows, model_cfg=cfg.model)
  assert out["ppl"] == pytest.approx(float(np.exp(evaluate.nll(full, windows))), rel=1e-5)
  assert out["dppl_rel"] == pytest.approx(0.0, abs=1e-6) and out["agreement"] == 1.0
  assert (out["tokens"], out["seqs"], out["chunk"]) == (96, 2, chunk)


def test_lossy_codec_changes_perplexity(tiny):
  src = sources.parse(str(tiny / "model.yaml"))
  # larger weights than the init so cache rounding reaches the logits
  cfg, params, _ = sources.load(src)
  params = jax.tree.map(lambda x: x * 4.0, params)
  tok = sources.load(src)[2]
  windows = evaluate.text_windows(tok, TEXT, 64, 2)
  ref = evaluate.reference_logprobs(cfg, params, windows)
  int2 = config_lib.apply_overrides(cfg, {"cache.codec": "int2"})
  m, nbytes = evaluate.compare_streamed(int2, params, windows, ref)
  assert m["kl"] > 1e-4 and m["ppl"] != m["ppl_ref"] and nbytes > 0
  # the streamed accumulation is the same arithmetic as `compare` on whole arrays
  lp, _ = evaluate.stream_logprobs(int2, params, windows)
  whole = evaluate.compare(lp, ref, windows)
  for key in ("ppl", "ppl_ref", "kl", "agreement"):
    assert m[key] == pytest.approx(whole[key], rel=1e-5), key
  for key in ("dppl_rel_ci95", "kl_ci95", "agreement_ci95"):  # same tokens, same resamples
    assert m[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-9), key
    point = m[key.removesuffix("_ci95")]
    assert m[key][0] <= point <= m[key][1] and m[key][0] < m[key][1], key


def test_eval_json_carries_intervals_around_its_points(tiny, capsys):
  argv = ["eval", "--config", str(tiny / "model.yaml"), "--text", str(tiny / "text.txt"),
          "--tokens", "80", "--seqs", "4", "--chunk", "16", "--codec", "int2"]
  assert cli.main(argv + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  for key in ("dppl_rel", "kl", "agreement"):
    lo, hi = out[f"{key}_ci95"]
    assert lo <= out[key] <= hi, key
  assert out["warnings"] == []  # 4 windows of 80 tokens: 12 blocks of 32, enough
  assert cli.main(argv) == 0  # the person's output prints the intervals
  text = capsys.readouterr().out
  assert "{:+.3f}".format(100 * out["dppl_rel_ci95"][0]) in text and "t interval over the windows" in text
  # the fp32 cache against itself: intervals of zero width at no difference
  ref = evaluate.eval_cli(sources.parse(str(tiny / "model.yaml")), {"cache.codec": "fp32"},
                          text=str(tiny / "text.txt"), tokens=96, seqs=1, progress=False)
  assert ref["dppl_rel_ci95"] == pytest.approx([0.0, 0.0], abs=1e-6)
  assert ref["agreement_ci95"] == [1.0, 1.0]
  assert any("bootstrap blocks" in w for w in ref["warnings"])  # 3 blocks: rough, said


def test_first_window_is_the_start_of_the_text(tiny):
  _, _, tok = sources.load(sources.parse(str(tiny / "model.yaml")))
  w = evaluate.text_windows(tok, TEXT, 40, 1)
  assert w.tolist() == [tok.encode(TEXT)[:40]]


def test_cli_json_is_one_object_and_bad_input_one_line(tiny, capsys):
  """In-process (`cli.main`, what `python -m kvjax.cli` calls; the process entry point has
  its own tests in test_cli.py)."""
  argv = ["eval", "--config", str(tiny / "model.yaml"), "--text", str(tiny / "text.txt"),
          "--tokens", "48", "--chunk", "8", "--k-codec", "int8", "--v-codec", "int4", "--json"]
  assert cli.main(argv) == 0
  stdout = capsys.readouterr().out
  out = json.loads(stdout)  # stdout holds exactly one JSON object
  for key in ("ppl", "ppl_ref", "dppl_rel", "kl", "agreement", "bytes_per_token", "tokens",
              "seqs", "chunk"):
    assert key in out
  assert (out["k_codec"], out["v_codec"], out["tokens"]) == ("int8", "int4", 48)
  for bad, needle in ((["--tokens", "100000"], "--tokens"), (["--chunk", "0"], "--chunk"),
                      (["--text", str(tiny / "absent.txt")], "absent.txt")):
    rc = cli.main(argv[:3] + ["--tokens", "48"] + bad)
    stdout, stderr = capsys.readouterr()
    assert rc == 2 and stdout == "" and stderr.count("\n") == 1 and needle in stderr, stderr


def test_smollm2_perplexity_agrees_with_transformers(smollm2):
  import torch

  cfg, params, tok, _, ref_model = smollm2
  windows = evaluate.text_windows(tok, evaluate.data.eval_text("stdlib"), 128, 1)
  lp, _ = evaluate.stream_logprobs(cfg, params, windows, chunk=16)
  ppl = float(np.exp(evaluate.nll(lp, windows)))
  with torch.no_grad():
    ids = torch.tensor(windows.tolist())
    loss = ref_model(ids, labels=ids).loss.item()
  assert ppl == pytest.approx(float(np.exp(loss)), rel=1e-3)
