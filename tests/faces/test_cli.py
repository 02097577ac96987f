"""The CLI contract (README, Command line): forms, --json fields, one-line errors, no tracebacks."""

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
  assert rc == 0 and res["bytes_per_token_asymptotic"] == 2 * 32 * 8 * 128 * 2
  assert res["total_bytes"] == res["bytes_per_token_asymptotic"] * 8192 * 2 + 4 * 2
  assert res["bytes_per_token"] == res["total_bytes"] / (8192 * 2)  # held: the lengths too
  rc, out, _ = run_cli(capsys, "size", "--layers", "32", "--heads", "32", "--kv-heads", "32",
                       "--head-dim", "128", "--seq-len", "1", "--codec", "fp32", "--json")
  assert json.loads(out)["bytes_per_token_asymptotic"] == 2 * 32 * 32 * 128 * 4


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


# -- bad inputs that used to run silently or with a traceback ----------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--prompt-ids", "-1,2"], "token id -1 is outside the vocabulary"),
    (["--prompt-ids", "1,2", "--prompt-ids", "-5"], "token id -5"),
    (["--prompt-ids", "1", "--temperature", "nan"], "--temperature must be a finite"),
    (["--prompt-ids", "1", "--temperature", "-1"], "--temperature must be"),
    (["--prompt-ids", "1", "--top-p", "0"], "--top-p must be a finite number in [1.1754944e-38, 1]"),
    (["--prompt-ids", "1", "--top-p", "inf"], "workload.top_p"),
    (["--prompt-ids", "1", "--top-k", "-3"], "--top-k must be an integer >= 0"),
    (["--prompt-ids", "1", "--set", "model.norm_eps=nan"], "model.norm_eps must be a finite"),
    (["--prompt-ids", "1", "--set", "model.norm_eps=0"], "model.norm_eps must be"),
    (["--prompt-ids", "1", "--set", "model.rope_theta=-10000"], "model.rope_theta must be"),
    (["--prompt-ids", "1", "--set", "cache.capacity=8", "--set", "cache.residual=16"],
     "cache.residual=16 exceeds cache.capacity=8"),
    (["--prompt-ids", "1", "--set", "model.d_model=0"], "model.d_model must be an integer > 0"),
])
def test_bad_numbers_are_one_line_not_garbage(capsys, argv, needle):
  rc, out, err = run_cli(capsys, "generate", *QUICK, *argv)
  assert rc == 2 and out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], err


def test_prompt_ids_value_forms_still_parse(capsys):
  for argv in (["--prompt-ids=3,4"], ["--prompt-ids", "3,4"]):
    rc, out, _ = run_cli(capsys, "generate", *argv, "--max-new-tokens", "2", "--json", *QUICK)
    assert rc == 0 and json.loads(out)["batch"] == 1


def test_console_script_out_of_memory_is_exactly_one_line(tmp_path):
  """Through the real entry point (XLA and absl logging as a user gets them)."""
  proc = subprocess.run([sys.executable, "-m", "kvjax.cli", "generate", "--prompt-ids", "1",
                         *QUICK, "--set", "cache.capacity=2000000000",
                         "--set", "model.max_seq_len=2000000000"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.count("\n") == 1 and "not enough memory" in proc.stderr


def test_train_through_the_cli(tmp_path, capsys):
  text = tmp_path / "text.txt"
  text.write_text("def f(x):\n    return x + 1\n" * 300)
  yaml_path = tmp_path / "t.yaml"
  yaml_path.write_text(
      "model: {d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 2, max_seq_len: 64}\n"
      f"train: {{data: {text}, batch: 4, seq_len: 32, steps: 6, warmup: 1, eval_every: 6,\n"
      "        eval_batches: 1, checkpoint_every: 3, log_every: 3}\n")
  out = tmp_path / "ckpt"
  rc, stdout, _ = run_cli(capsys, "train", str(yaml_path), "--out", str(out),
                          "--set", "train.lr=0.01")
  assert rc == 0 and "GQA-2: val_loss" in stdout and str(out) in stdout
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 6 and summary["resumed_from"] == 0 and summary["variant"] == "GQA-2"
  logged = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
  assert logged == [3, 6]
  from kvjax.io import checkpoint
  assert checkpoint.latest_step(out) == 6 and checkpoint.read_config(out).train.lr == 0.01
  rc, stdout, _ = run_cli(capsys, "generate", "--checkpoint", str(out), "--prompt", "def",
                          "--max-new-tokens", "3", "--json")
  assert rc == 0 and len(json.loads(stdout)["tokens"][0]) == 3
  # bad training input: one line, the finished checkpoint untouched
  rc, _, err = run_cli(capsys, "train", str(yaml_path), "--out", str(out), "--set", "train.lr=nan")
  assert rc == 2 and err.count("\n") == 1 and "train.lr must be a finite number in [" in err
  assert checkpoint.latest_step(out) == 6


def test_keyboard_interrupt_mid_run_keeps_rows_and_exits_130(tmp_path, capsys, monkeypatch):
  from kvjax.lab.experiments import latency

  grid = tmp_path / "g.yaml"
  grid.write_text("experiment: latency\nmodel: {d_model: 32, n_layers: 1, n_heads: 4}\n"
                  "workload: {batch: 1, prompt_len: 8, gen_len: 3, repeats: 1}\n"
                  "grid:\n  model.n_kv_heads: [4, 2, 1]\n")
  real, calls = latency.run_cell, []

  def interrupted(cfg):
    calls.append(cfg)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(cfg)
  monkeypatch.setattr(latency, "run_cell", interrupted)
  rc, _, err = run_cli(capsys, "run", str(grid), "--out", str(tmp_path / "res"))
  assert rc == 130
  last = err.replace("\r", "\n").strip().splitlines()[-1]
  assert last == "kvjax: interrupted; rows already written are kept"
  from kvjax.lab import runner
  assert len(runner.read_rows(tmp_path / "res" / "latency.jsonl")) == 1


def test_error_with_a_live_progress_bar_is_on_its_own_line(capsys, monkeypatch):
  """A command fails while a progress bar is still open (referenced, so nothing closes it on
  the way out): main closes it before printing, so the error is its own last line of stderr
  rather than glued onto the bar."""
  from tqdm import tqdm

  from kvjax.decode import generate
  from kvjax.errors import KvjaxError
  live = []

  def fails(*a, **k):
    live.append(tqdm(total=10, desc="work", file=sys.stderr))
    live[-1].update(3)
    raise KvjaxError("boom")
  monkeypatch.setattr(generate, "generate", fails)
  rc, _, err = run_cli(capsys, "generate", "--prompt-ids", "1", *QUICK)
  assert rc == 2 and err.endswith("kvjax: error: boom\n")
  assert err.split("\n")[-2].split("\r")[-1] == "kvjax: error: boom"
  assert "work:  30%" in err  # the bar's final state is kept above the error


def test_generate_on_random_weights_says_so_in_human_mode_only(capsys):
  argv = ["generate", "--config", "configs/quickstart.yaml", *QUICK, "--prompt", "hi",
          "--max-new-tokens", "2"]
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 0 and out.startswith("[0]")
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "random weights" in lines[0] and "--checkpoint" in lines[0]
  rc, out, err = run_cli(capsys, *argv, "--json")
  assert rc == 0 and json.loads(out)["random_weights"] is True and "random weights" not in err


def test_generate_prompt_file_and_one_run_without_warmup(capsys, tmp_path, monkeypatch):
  """--prompt-file reads the same text --prompt takes; by default the program runs once (a
  long prompt prefilled once, not twice) and says its timings are not warm; --warmup runs
  it untimed first."""
  from kvjax.decode import generate

  runs = []
  real = generate.Compiled.run
  monkeypatch.setattr(generate.Compiled, "run", lambda self: runs.append(1) or real(self))
  f = tmp_path / "prompt.txt"
  f.write_text("héllo there")
  common = ["generate", "--config", "configs/quickstart.yaml", *QUICK, "--max-new-tokens", "4",
            "--greedy", "--json"]
  rc, out, _ = run_cli(capsys, *common, "--prompt", "héllo there", "--warmup")
  assert rc == 0 and len(runs) == 2 and json.loads(out)["warm"] is True
  rc, out2, _ = run_cli(capsys, *common, "--prompt-file", str(f))
  assert rc == 0 and len(runs) == 3
  a, b = json.loads(out), json.loads(out2)
  assert a["tokens"] == b["tokens"] and b["warm"] is False
  rc, _, _ = run_cli(capsys, *common, "--prompt-file", str(f), "--no-warmup")  # as before
  assert rc == 0 and len(runs) == 4


@pytest.mark.parametrize("content,match", [(None, "cannot read --prompt-file"),
                                           (b"\xff\xfe bad", "is not UTF-8 text"),
                                           (b"", "is empty")])
def test_generate_bad_prompt_file_one_line(capsys, tmp_path, content, match):
  f = tmp_path / "p.txt"
  if content is not None:
    f.write_bytes(content)
  rc, out, err = run_cli(capsys, "generate", "--config", "configs/quickstart.yaml", *QUICK,
                         "--prompt-file", str(f))
  assert rc == 2 and match in err and len(err.strip().splitlines()) == 1 and out == ""
