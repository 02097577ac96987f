"""Paired comparisons against any reference (kvjax.lab.compare): `kvjax eval --ref`, the Python
API's `evaluate(ref=)` and `compare`, and `kvjax.size` in closed form without weights.

A tiny byte-level model; int4 against bf16 is one paired figure equal to `compare` on the
two caches' own log-probabilities, the reference is streamed once for any number of
settings, and an MQA checkpoint made by `kvjax convert --kv-heads 1` is held to the
original on the same tokens."""

import json
import warnings

import jax
import numpy as np
import pytest
import yaml

import kvjax
from kvjax import cli
from kvjax import config as config_lib
from kvjax.io import checkpoint, sources
from kvjax.lab import evaluate

TINY = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 256}, "tokenizer": "bytes", "seed": 3}
TEXT = ("The cache keeps every key and value a decoder has seen, so each new token reads "
        "them back instead of recomputing them. " * 8)
ARGS = ["--tokens", "160", "--seqs", "2", "--chunk", "16"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  root = tmp_path_factory.mktemp("compare")
  (root / "model.yaml").write_text(yaml.safe_dump(TINY))
  (root / "text.txt").write_text(TEXT)
  cfg, params, _ = sources.load(sources.parse(str(root / "model.yaml")))
  params = jax.tree.map(lambda x: x * 4.0, params)  # so cache rounding reaches the logits
  checkpoint.save(root / "orig", cfg, params, step=0)
  return root


def _eval(tiny, capsys, *argv):
  rc = cli.main(["eval", "--text", str(tiny / "text.txt"), *ARGS, *argv, "--json"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  return json.loads(out)


def test_int4_against_bf16_is_one_paired_figure(tiny, capsys):
  got = _eval(tiny, capsys, "--checkpoint", str(tiny / "orig"), "--codec", "int4",
              "--ref", "bf16")
  assert got["ref"] == "bf16 cache" and got["ref_kind"] == "cache"
  # the same figure from the two caches' own log-probabilities on the same windows
  cfg, params, tok = sources.load(sources.Source("checkpoint", str(tiny / "orig")))
  windows = evaluate.text_windows(tok, TEXT, 160, 2)
  lp = {c: evaluate.stream_logprobs(config_lib.apply_overrides(
      evaluate.reference_config(cfg), {"cache.codec": c}), params, windows, 16)[0]
      for c in ("int4", "bf16")}
  want = evaluate.compare(lp["int4"], lp["bf16"], windows)
  for key in ("ppl", "ppl_ref", "dppl_rel", "kl", "agreement"):
    assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-9), key
  for key in ("dppl_rel", "kl", "agreement"):
    lo, hi = got[f"{key}_ci95"]
    assert lo <= got[key] <= hi and lo < hi, key
  # ...and from one Python call, the same numbers
  m = kvjax.load(f"checkpoint:{tiny / 'orig'}")
  r = m.evaluate(text=TEXT, cache="int4", ref="bf16", tokens=160, seqs=2, chunk=16)
  assert r.dppl_rel == pytest.approx(got["dppl_rel"], rel=1e-6)
  assert r.dppl_rel_ci95 == pytest.approx(got["dppl_rel_ci95"], rel=1e-6)
  # the default reference is still the fp32 cache, named
  plain = _eval(tiny, capsys, "--checkpoint", str(tiny / "orig"), "--codec", "int4")
  assert plain["ref"] == "fp32 cache" and plain["ppl"] == pytest.approx(got["ppl"], rel=1e-6)
  assert plain["ppl_ref"] != pytest.approx(got["ppl_ref"], rel=1e-9)


def test_the_reference_is_streamed_once_for_every_setting(tiny, monkeypatch):
  m = kvjax.load(f"checkpoint:{tiny / 'orig'}")
  seen, real = [], evaluate.stream_segments

  def counted(cfg, *a, **k):
    seen.append(cfg.cache.k_codec)
    return real(cfg, *a, **k)
  monkeypatch.setattr(evaluate, "stream_segments", counted)
  out = m.compare(["int8", "int4", "int2"], ref="bf16", text=TEXT, tokens=160, seqs=2,
                  chunk=16)
  assert seen == ["bf16", "int8", "int4", "int2"]
  assert list(out) == ["int8", "int4", "int2"]
  assert out["int2"].kl > out["int8"].kl and all(r.ref == "bf16 cache" for r in out.values())


def test_mqa_converted_against_the_original_on_the_same_tokens(tiny, capsys):
  mqa = tiny / "mqa"
  assert cli.main(["convert", "--checkpoint", str(tiny / "orig"), "--kv-heads", "1",
                   "--out", str(mqa)]) == 0
  capsys.readouterr()
  got = _eval(tiny, capsys, "--checkpoint", str(mqa), "--ref", f"checkpoint:{tiny / 'orig'}")
  assert got["ref_kind"] == "model" and got["variant"] == "MQA"
  lo, hi = got["dppl_rel_ci95"]
  assert lo <= got["dppl_rel"] <= hi and got["kl"] > 0 and got["agreement"] < 1
  # the original's perplexity is its own fp32-cache perplexity on those tokens
  orig = _eval(tiny, capsys, "--checkpoint", str(tiny / "orig"), "--codec", "fp32")
  assert got["ppl_ref"] == pytest.approx(orig["ppl"], rel=1e-5)
  # Python: a loaded Model as the reference gives the same figure
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    a, b = kvjax.load(f"checkpoint:{mqa}"), kvjax.load(f"checkpoint:{tiny / 'orig'}")
  r = a.evaluate(text=TEXT, ref=b, tokens=160, seqs=2, chunk=16)
  assert r.dppl_rel == pytest.approx(got["dppl_rel"], rel=1e-6)


@pytest.mark.parametrize("ref,needle", [("codec=", "KEY=VALUE"), ("nonsense_codec", "codec"),
                                        ("config:{other}", "vocabulary")])
def test_a_bad_reference_is_one_line(tiny, capsys, ref, needle):
  (tiny / "other.yaml").write_text(yaml.safe_dump(
      {**TINY, "tokenizer": "none", "model": {**TINY["model"], "vocab_size": 300}}))
  rc = cli.main(["eval", "--config", str(tiny / "model.yaml"), "--text", str(tiny / "text.txt"),
                 *ARGS, "--ref", ref.format(other=tiny / "other.yaml")])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and err.count("\n") == 1 and needle in err, err


def test_size_in_closed_form_without_weights(monkeypatch, capsys):
  def no_weights(*a, **k):
    raise AssertionError("kvjax.size read weights")
  monkeypatch.setattr(sources, "load", no_weights)
  r = kvjax.size("llama3-8b", cache="int4", seq_len=8192, batch=4, budget="24GiB")
  assert cli.main(["size", "--config", "llama3-8b", "--codec", "int4", "--seq-len", "8192",
                   "--batch", "4", "--budget", "24GiB", "--json"]) == 0
  want = json.loads(capsys.readouterr().out)
  assert r.to_dict() == want and r.max_sequences == want["budget"]["max_sequences"] > 0
  bf16 = kvjax.size("llama3-8b", seq_len=8192, batch=4)  # no codec named: bf16, as the CLI
  assert bf16.k_codec == "bf16" and bf16.total_bytes > 3 * r.total_bytes
  with pytest.raises(kvjax.KvjaxError, match="overrides="):
    kvjax.size("llama3-8b", overrides=["model.n_kv_heads=1"])


def test_quality_experiment_holds_every_setting_to_params_reference(tiny, tmp_path, capsys):
  from kvjax.lab import runner
  cfg = {"name": "q", "experiment": "quality",
         "model": {"d_model": 32, "n_heads": 4, "n_kv_heads": 2},
         "workload": {"gen_len": 0},
         "grid": {"params.setting": ["bf16", "int4"]},
         "params": {"checkpoints": [str(tiny / "orig")], "eval_tokens": 160, "eval_seqs": 2,
                    "chunk": 16, "gen_prompts": 0, "reference": "bf16",
                    "settings": {"bf16": {"cache.codec": "bf16"},
                                 "int4": {"cache.codec": "int4"}}}}
  (tmp_path / "q.yaml").write_text(yaml.safe_dump(cfg))
  runner.run_file(tmp_path / "q.yaml", out_dir=tmp_path / "out", progress=False)
  assert "reference" in capsys.readouterr().out  # the summary names what Δppl is against
  rows = {r["variant"]["setting"]: r for r in
          map(json.loads, (tmp_path / "out" / "quality.jsonl").read_text().splitlines())}
  assert {r["workload"]["reference"] for r in rows.values()} == {"bf16 cache"}
  m = {k: r["metrics"] for k, r in rows.items()}
  assert m["bf16"]["dppl_rel"] == 0.0 and m["bf16"]["kl"] == 0.0  # itself: no difference
  assert m["int4"]["ppl_ref"] == m["bf16"]["ppl"] and m["int4"]["kl"] > 0
  lo, hi = m["int4"]["dppl_rel_ci95"]
  assert lo <= m["int4"]["dppl_rel"] <= hi
  bad = {**cfg, "params": {**cfg["params"], "reference": "checkpoint:x"}}
  (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
  with pytest.raises(kvjax.KvjaxError, match="params.reference must be a cache setting"):
    runner.run_file(tmp_path / "bad.yaml", out_dir=tmp_path / "bad", progress=False)
