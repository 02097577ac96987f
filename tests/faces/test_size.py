"""`kvjax size`: one answer per model whatever its description, --budget against the closed
form, max_seq_len warnings, --help contents, and a quiet exit into a closed pipe."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax import cli
from kvjax.errors import KvjaxError
from kvjax.lab import sizing

ROOT = Path(__file__).resolve().parents[2]
LLAMA3 = ROOT / "kvjax" / "shapes" / "llama3-8b.yaml"
L, H, K, D, E, F, V = 32, 32, 8, 128, 4096, 14336, 128256
PARAMS = 2 * V * E + L * (E * H * D + 2 * E * K * D + H * D * E + 3 * E * F + 2 * E) + E


def size(capsys, *argv):
  rc = cli.main(["size", *argv, "--json"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  return json.loads(out), err


@pytest.fixture
def hf_llama3(tmp_path) -> Path:
  (tmp_path / "config.json").write_text(json.dumps({
      "model_type": "llama", "hidden_size": E, "num_attention_heads": H,
      "num_key_value_heads": K, "num_hidden_layers": L, "intermediate_size": F,
      "vocab_size": V, "max_position_embeddings": 8192, "rope_theta": 500000.0,
      "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
  return tmp_path


def test_one_model_one_answer_whatever_its_description(capsys, hf_llama3):
  shape, _ = size(capsys, "--layers", "32", "--heads", "32", "--kv-heads", "8", "--head-dim",
                  "128", "--seq-len", "4096", "--batch", "8")
  conf, _ = size(capsys, "--config", str(LLAMA3), "--seq-len", "4096", "--batch", "8")
  hf, _ = size(capsys, "--hf", str(hf_llama3), "--seq-len", "4096", "--batch", "8")
  for res in (shape, conf, hf):
    assert (res["k_codec"], res["v_codec"]) == ("bf16", "bf16")
    assert res["bytes_per_token_asymptotic"] == 2 * L * K * D * 2
    assert res["bytes_per_token"] == res["total_bytes"] / (8 * 4096)
    assert res["total_bytes"] == shape["total_bytes"]
    assert any("bf16 cache assumed" in n for n in res["notes"])
  # parameters in the stored dtype (bf16: 2 bytes each), the same from YAML and config.json
  assert conf["param_bytes"] == hf["param_bytes"] == 2 * PARAMS
  assert "bfloat16" in hf["param_dtype"] and "torch_dtype" in hf["param_dtype"]
  coded, _ = size(capsys, "--config", str(LLAMA3), "--seq-len", "4096", "--dtype", "float32")
  assert coded["bytes_per_token_asymptotic"] == 2 * L * K * D * 4 and not coded["notes"]


def test_seq_len_past_max_seq_len_warns_in_one_line(capsys):
  res, err = size(capsys, "--config", str(LLAMA3), "--seq-len", "32768")
  assert res["warnings"] and res["max_seq_len"] == 8192
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "exceeds this model's max_seq_len 8192" in lines[0]
  _, err = size(capsys, "--config", str(LLAMA3), "--seq-len", "8192")
  assert err == ""


@pytest.mark.parametrize("text,n", [("80GiB", 80 * 2 ** 30), ("80GB", 80 * 10 ** 9),
                                    ("1.5 TiB", int(1.5 * 2 ** 40)), ("512MB", 512 * 10 ** 6),
                                    ("64kib", 64 * 1024), ("7TB", 7 * 10 ** 12)])
def test_budget_units(text, n):
  got, unit = sizing.parse_bytes(text)
  assert got == n and ("2^" in unit) == ("i" in text.lower())


@pytest.mark.parametrize("text", ["80", "80 gigs", "-1GB", "0GiB", "GiB"])
def test_bad_budgets_are_one_line_errors(text, capsys):
  with pytest.raises(KvjaxError, match="^budget ") as e:  # the library names the keyword
    sizing.parse_bytes(text)
  assert e.value.arg == "budget"
  rc = cli.main(["size", "--config", str(LLAMA3), "--seq-len", "1024", "--budget", text])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and "--budget" in err


SHAPE = {"--layers": "32", "--heads": "32", "--kv-heads": "8", "--head-dim": "128"}


@pytest.mark.parametrize("flag, value, words", [
    ("--heads", "1000000000", "--heads 1000000000 x --head-dim 128 = 128000000000 is wider"),
    ("--head-dim", "1000000000", "--heads 32 x --head-dim 1000000000 = 32000000000 is wider"),
    ("--kv-heads", "1000000000", "--kv-heads 1000000000 does not divide --heads 32"),
    ("--kv-heads", "3", "--kv-heads 3 does not divide --heads 32"),
    ("--head-dim", "127", "--head-dim 127 is odd"),
    ("--layers", "99999999999", "--layers must be an integer in (0, 2147483647]"),
])
def test_absurd_shape_flags_name_the_flag_given(flag, value, words, capsys):
  """One line naming the flags set: never model.d_model, which size derives from them."""
  argv = [a for k, v in {**SHAPE, flag: value}.items() for a in (k, v)]
  assert cli.main(["size", *argv, "--seq-len", "4096"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and words in err[0] and "d_model" not in err[0], err


def test_shape_flags_beside_a_model_source_are_refused_not_ignored(capsys):
  assert cli.main(["size", "--config", str(LLAMA3), "--seq-len", "64", "--heads", "8"]) == 2
  err = capsys.readouterr().err.strip()
  assert "--heads is for the shape-only form" in err and "--set model.n_heads=N" in err


@pytest.mark.parametrize("budget,seq,codec,bpe", [("80GiB", 32768, "bf16", 2),
                                                  ("80GB", 8192, "fp32", 4),
                                                  ("40GiB", 131072, "bf16", 2)])
def test_budget_matches_the_closed_form(capsys, budget, seq, codec, bpe):
  res, _ = size(capsys, "--config", str(LLAMA3), "--seq-len", str(seq), "--batch", "8",
                "--codec", codec, "--budget", budget)
  b = res["budget"]
  total = sizing.parse_bytes(budget)[0]
  per_seq = 2 * L * K * D * seq * bpe + 4  # K and V, all layers; + the int32 length
  assert b["weight_bytes"] == 2 * PARAMS and b["seq_bytes"] == per_seq
  assert b["max_sequences"] == max((total - 2 * PARAMS) // per_seq, 0)
  assert b["batch_fits"] == (2 * PARAMS + 8 * per_seq <= total)
  assert b["max_sequences_by_codec"][codec] == b["max_sequences"]
  assert b["max_sequences_by_codec"]["int4"] > b["max_sequences_by_codec"]["int8"] \
      >= b["max_sequences_by_codec"]["bf16"]
  assert "activations" in b["not_counted"]


def test_budget_human_output_states_unit_and_what_is_counted(capsys):
  rc = cli.main(["size", "--config", str(LLAMA3), "--seq-len", "32768", "--batch", "8",
                 "--budget", "80GiB"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "85,899,345,920 bytes (GiB = 2^30 bytes" in out
  assert "fits 16 concurrent sequences of 32768 tokens" in out  # (80 - 14.96) GiB / 4 GiB
  assert "not counted: activations" in out
  rc = cli.main(["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                 "--seq-len", "64", "--budget", "1MB", "--json"])
  b = json.loads(capsys.readouterr().out)["budget"]
  assert b["weight_bytes"] is None and "weights (no model given" in b["not_counted"]
  assert b["max_sequences"] == 10 ** 6 // (2 * 2 * 2 * 16 * 64 * 2 + 4)


def test_help_describes_every_flag_and_lists_codecs_and_layouts(capsys):
  from kvjax import cache, codecs
  # the names come from the registries ("compacted" is what a cache.policy builds, not a
  # cache.layout one chooses)
  assert cli.codec_names() == list(codecs.CODECS)
  assert set(cli.layout_names()) == {n for n, lay in cache.LAYOUTS.items()
                                     if not getattr(lay, "internal", False)}
  assert "paged" in cli.layout_names() and "compacted" not in cli.layout_names()
  parser = cli.build_parser()
  size_parser = parser._subparsers._group_actions[0].choices["size"]
  for action in size_parser._actions:
    assert action.help, action.option_strings
  with pytest.raises(SystemExit):
    cli.build_parser().parse_args(["size", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  for name in cli.codec_names() + cli.layout_names():
    assert name in text


def test_size_into_a_closed_pipe_exits_quietly():
  """`kvjax size ... | head -1`: a reader that has gone is not an error (deterministic: the
  read end is closed before the command writes)."""
  import os
  r, w = os.pipe()
  os.close(r)
  proc = subprocess.Popen([sys.executable, "-m", "kvjax.cli", "size", "--config", str(LLAMA3),
                           "--seq-len", "1024", "--budget", "80GiB"], stdout=w,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT)
  os.close(w)
  err = proc.communicate(timeout=120)[1]
  assert "Broken pipe" not in err and "Traceback" not in err and "--out" not in err, err
  assert proc.returncode == 0


def test_budget_on_a_mesh_is_refused_in_one_line(capsys):
  rc = cli.main(["size", "--config", str(LLAMA3), "--seq-len", "1024", "--budget", "80GiB",
                 "--set", "mesh.model=8"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and "--budget sizes one device" in err


@pytest.mark.parametrize("policy,layout,extra", [
    ("h2o", "contiguous", 2 * 2 * 24 * (4 + 4)),  # acc float32 + pos int32 [L, B, K, S]
    ("tova", "contiguous", 0),
    ("knorm", "contiguous", 0),
    ("knorm", "paged", None),  # a pool of whole pages and a block table
])
def test_bytes_per_device_is_the_cache_the_policy_builds(capsys, policy, layout, extra):
  """On one device `bytes_per_device` is `total_bytes`: the compacted cache with its own
  leaves (held, budget, and h2o's acc/pos), not a plain cache of the held tokens."""
  res, _ = size(capsys, "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                "--seq-len", "100", "--codec", "fp32", "--set", f"cache.policy={policy}",
                "--set", "cache.budget=24", "--set", f"cache.layout={layout}")
  assert res["held_tokens"] == 24
  assert res["bytes_per_device"] == res["ideal_bytes_per_device"] == res["total_bytes"]
  if extra is not None:
    assert res["total_bytes"] == 2 * 24 * (2 * 2 * 8 * 4) + extra + 3 * 4
