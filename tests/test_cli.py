"""The CLI contract from DESIGN.md: forms, --json fields, one-line errors, no tracebacks."""

import json
import subprocess
import sys

import pytest

from kvjax import cli

QUICK = ["--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.n_heads=4",
         "--set", "model.n_kv_heads=2"]


def run_cli(capsys, *argv):
  rc = cli.main(list(argv))
  out, err = capsys.readouterr()
  return rc, out, err


def test_size_json_matches_formula(capsys):
  rc, out, _ = run_cli(capsys, "size", "--layers", "32", "--heads", "32", "--kv-heads", "8",
                       "--head-dim", "128", "--seq-len", "8192", "--batch", "2",
                       "--dtype", "bfloat16", "--json")
  res = json.loads(out)
  assert rc == 0 and res["bytes_per_token"] == 2 * 32 * 8 * 128 * 2
  assert res["total_bytes"] == res["bytes_per_token"] * 8192 * 2 + 4 * 2
  rc, out, _ = run_cli(capsys, "size", "--layers", "32", "--heads", "32", "--kv-heads", "32",
                       "--head-dim", "128", "--seq-len", "1", "--codec", "fp32", "--json")
  assert json.loads(out)["bytes_per_token"] == 2 * 32 * 32 * 128 * 4


def test_generate_json_fields_and_ragged_batch(capsys):
  rc, out, _ = run_cli(capsys, "generate", "--config", "configs/quickstart.yaml", *QUICK,
                       "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "5",
                       "--greedy", "--json")
  assert rc == 0
  res = json.loads(out)  # stdout holds exactly one JSON object
  assert [len(t) for t in res["tokens"]] == [5, 5]
  for key in ("cache_bytes", "ttft_s", "tpot_s", "compile_s"):
    assert res[key] > 0
  assert len(res["text"]) == 2  # the quickstart model uses the byte tokenizer


def test_generate_prompt_text_uses_byte_tokenizer(capsys):
  rc, out, _ = run_cli(capsys, "generate", "--config", "configs/quickstart.yaml", *QUICK,
                       "--prompt", "hi", "--max-new-tokens", "3", "--codec", "bf16", "--json")
  res = json.loads(out)
  assert rc == 0 and res["k_codec"] == res["v_codec"] == "bf16" and len(res["tokens"][0]) == 3


def test_codec_flags_refine_codec_and_kivi_set_is_checked_once(capsys):
  """--codec < --k-codec/--v-codec, and KIVI settings given with --set are validated against
  the final codecs (a per-channel int4 key with an int8 value is a valid K/V pair)."""
  rc, out, err = run_cli(capsys, "generate", "--config", "configs/quickstart.yaml", *QUICK,
                         "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--codec", "int8",
                         "--k-codec", "int4", "--set", "cache.k_axis=channel",
                         "--set", "cache.group_size=4", "--set", "cache.residual=8", "--json")
  assert rc == 0, err
  res = json.loads(out)
  assert (res["k_codec"], res["v_codec"]) == ("int4", "int8")
  rc, out, _ = run_cli(capsys, "size", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--seq-len", "64", "--k-codec", "int4",
                       "--v-codec", "int8", "--set", "cache.k_axis=channel",
                       "--set", "cache.group_size=8", "--set", "cache.residual=16", "--json")
  res = json.loads(out)
  assert rc == 0 and (res["k_codec"], res["v_codec"]) == ("int4", "int8")


def test_seed_seeds_sampling_not_the_weights(capsys):
  base = ["generate", "--config", "configs/quickstart.yaml", *QUICK, "--prompt-ids", "1,2,3",
          "--max-new-tokens", "6", "--json"]
  greedy = [json.loads(run_cli(capsys, *base, "--greedy", "--seed", s)[1])["tokens"]
            for s in ("1", "2")]
  assert greedy[0] == greedy[1]  # same model whatever the sampling seed
  hot = ["--temperature", "5.0"]
  sampled = [json.loads(run_cli(capsys, *base, *hot, "--seed", s)[1])["tokens"]
             for s in ("1", "1", "2")]
  assert sampled[0] == sampled[1] != sampled[2]


def test_unwritable_out_is_a_one_line_error(capsys, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  rc, out, err = run_cli(capsys, "run", "configs/quickstart.yaml", "--out", str(blocker / "x"))
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "9", "--set", "cache.capacity=8"],
     "capacity"),
    (["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "5000"], "max_seq_len"),
    (["generate", "--prompt-ids", "1,2,x"], "comma-separated"),
    (["generate", "--prompt-ids", "1,2,300"], "outside the vocabulary"),
    (["generate", "--prompt-ids", "1", "--set", "model.n_kv_heads=3"], "not divisible"),
    (["generate", "--prompt-ids", "1", "--codec", "int9"], "unknown codec"),
    (["generate", "--config", "missing.yaml", "--prompt-ids", "1"], "not found"),
    (["generate", "--max-new-tokens", "2"], "give a prompt"),
    (["size", "--layers", "2", "--seq-len", "4"], "missing"),
    (["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
      "--seq-len", "4", "--dtype", "int3"], "unknown --dtype"),
    (["frobnicate"], "invalid choice"),
])
def test_user_errors_are_one_line(capsys, argv, needle):
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 2 and out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def test_console_script_bad_yaml_no_traceback(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("model:\n  d_model: [64\n")
  proc = subprocess.run([sys.executable, "-m", "kvjax.cli", "generate", "--config", str(bad),
                         "--prompt-ids", "1"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "malformed YAML" in proc.stderr
  assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_generate_on_random_weights_says_so_in_human_mode_only(capsys):
  argv = ["generate", "--config", "configs/quickstart.yaml", *QUICK, "--prompt", "hi",
          "--max-new-tokens", "2"]
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 0 and out.startswith("[0]")
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "random weights" in lines[0] and "--checkpoint" in lines[0]
  rc, out, err = run_cli(capsys, *argv, "--json")
  assert rc == 0 and json.loads(out)["random_weights"] is True and "random weights" not in err
