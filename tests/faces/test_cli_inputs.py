"""Flags checked like their config keys, messages that name what the user wrote (checked
before any weight loads), experiment options nobody reads refused, and --json fields that
say what ran, for every model source. In-process and host-side; no model is compiled."""

from __future__ import annotations

import errno
import json
import re
import types
from pathlib import Path

import numpy as np
import pytest

from kvjax import cli
from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab import data, sizing
from kvjax.model import init_params as _INIT


def run_cli(capsys, *argv):
  rc = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return rc, out, err


def one_error_line(capsys, *argv) -> str:
  rc, out, err = run_cli(capsys, *argv)
  lines = err.strip().splitlines()
  assert rc == 2 and out == "" and len(lines) == 1, err
  assert lines[0].startswith("kvjax: error: ") and "Traceback" not in err
  return lines[0]


# -- flags ---------------------------------------------------------------------------------
GEN = ["generate", "--prompt-ids", "1,2"]
SIZE = ["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"]


@pytest.mark.parametrize("argv, flag, key", [
    (GEN + ["--seed", "18446744073709551616"], "--seed", "seed"),
    (GEN + ["--seed", "4294967296"], "--seed", "seed"),
    (GEN + ["--seed", "-1"], "--seed", "seed"),
    (GEN + ["--temperature", "1e39"], "--temperature", "workload.temperature"),
    (GEN + ["--temperature", "nan"], "--temperature", "workload.temperature"),
    (GEN + ["--top-p", "1e-300"], "--top-p", "workload.top_p"),
    (GEN + ["--top-k", "99999999999"], "--top-k", "workload.top_k"),
    (GEN + ["--max-new-tokens", "0"], "--max-new-tokens", None),
    (GEN + ["--max-new-tokens", str(2**40)], "--max-new-tokens", None),
    (SIZE + ["--seq-len", str(2**31)], "--seq-len", None),
    (SIZE + ["--seq-len", "8", "--batch", "0"], "--batch", "workload.batch"),
    (["size", "--layers", str(2**31), "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
      "--seq-len", "8"], "--layers", "model.n_layers"),
    (["eval", "--config", "x.yaml", "--tokens", "-5"], "--tokens", None),
    (["eval", "--config", "x.yaml", "--chunk", "0"], "--chunk", None),
    (["convert", "--checkpoint", "x", "--out", "y", "--kv-heads", "0"], "--kv-heads",
     "model.n_kv_heads"),
    (GEN + ["--seed", "1.5"], "--seed", None),
])
def test_every_numeric_flag_is_range_checked_naming_the_flag(capsys, argv, flag, key):
  line = one_error_line(capsys, *argv)
  assert re.match(rf"kvjax: error: {flag} (must be|expects) ", line), line
  if key:
    assert f"config key {key} has the same range" in line


def test_flag_and_config_key_share_one_range(capsys):
  """--seed and --set seed= accept and refuse the same values."""
  for bad in ("4294967296", "-1"):
    assert "--seed must be" in one_error_line(capsys, *GEN, "--seed", bad)
    assert "seed must be an integer" in one_error_line(capsys, *GEN, "--set", f"seed={bad}")
  args = cli.build_parser().parse_args(GEN + ["--seed", "4294967295", "--temperature", "0.7"])
  assert args.seed == 4294967295 and args.temperature == 0.7
  assert config_lib.load(None, {"seed": 4294967295}).seed == 4294967295


# -- messages --------------------------------------------------------------------------------
@pytest.fixture
def tiny_yaml(tmp_path):
  path = tmp_path / "tiny.yaml"
  path.write_text("model: {vocab_size: 260, d_model: 32, n_layers: 1, n_heads: 4, "
                  "n_kv_heads: 4}\n")
  return path


def test_eval_text_folder_without_text_names_text_not_train_data(capsys, tmp_path, tiny_yaml):
  (tmp_path / "empty").mkdir()
  line = one_error_line(capsys, "eval", "--config", tiny_yaml, "--text", tmp_path / "empty")
  assert "point --text at a text file" in line and "train.data" not in line
  line = one_error_line(capsys, "eval", "--config", tiny_yaml, "--text", tmp_path / "nope")
  assert f"--text '{tmp_path / 'nope'}' is neither" in line


def test_eval_numbers_are_checked_before_any_weight_loads(capsys, monkeypatch, tiny_yaml):
  from kvjax.io import sources
  monkeypatch.setattr(sources, "load", lambda *a, **k: pytest.fail("weights loaded"))
  assert "--tokens must be >= 2" in one_error_line(capsys, "eval", "--config", tiny_yaml,
                                                   "--tokens", "1")
  line = one_error_line(capsys, "eval", "--config", tiny_yaml, "--tokens", "5000")
  assert "--tokens 5000 exceeds model.max_seq_len=4096" in line


def test_eval_of_an_eviction_policy_points_at_the_experiments(capsys, tiny_yaml):
  """Streaming keeps every token: an evicting policy is refused, naming where it is measured."""
  line = one_error_line(capsys, "eval", "--config", tiny_yaml, "--tokens", "16", "--set",
                        "cache.policy=snapkv", "--set", "cache.ratio=0.5")
  assert "configs/frontier_smollm2.yaml" in line and "configs/ruler_qwen.yaml" in line


def test_experiment_numbers_are_named_and_checked_before_models_load(tmp_path, monkeypatch):
  from kvjax.lab.experiments import quality
  from kvjax.lab.runner import run_file
  monkeypatch.setattr(quality, "load_model", lambda *a: pytest.fail("model loaded"))
  path = tmp_path / "q.yaml"
  path.write_text("experiment: quality\nparams: {models: [gguf:nowhere.gguf], eval_tokens: 1}\n")
  with pytest.raises(KvjaxError, match=r"params.eval_tokens must be an integer >= 2, got 1"):
    run_file(path, out_dir=tmp_path / "out", progress=False)
  with pytest.raises(KvjaxError, match=r"params.eval_seqs must be an integer >= 1, got 0"):
    run_file(path, ["params.eval_tokens=8", "params.eval_seqs=0"], out_dir=tmp_path / "out",
             progress=False)


@pytest.mark.parametrize("value, hint", [("[512, 1024]", "belongs in grid:"), ("0.5", ""),
                                         ("ten", ""), ("true", "")])
def test_an_experiment_number_of_another_type_is_one_line(capsys, tmp_path, value, hint):
  """A list, fraction, word or bool where an experiment reads a whole number (here
  long_context's params.context, which was a TypeError traceback) is one line naming it."""
  path = tmp_path / "lc.yaml"
  path.write_text("experiment: long_context\nparams: {models: [gguf:nowhere.gguf], "
                  "context: 512, tasks: [passkey]}\n")
  line = one_error_line(capsys, "run", path, "--out", tmp_path / "out",
                        "--set", f"params.context={value}")
  assert "params.context must be a whole number, got " in line and hint in line


def test_param_int_reads_whole_numbers_in_every_spelling():
  cfg = config_lib.from_dict({"params": {"a": 3, "b": 4.0, "c": "12"}})
  assert (cfg.param_int("a"), cfg.param_int("b"), cfg.param_int("c"), cfg.param_int("d", 7)) \
      == (3, 4, 12, 7)


def test_text_windows_name_the_keys_that_set_them():
  tok = types.SimpleNamespace(encode=lambda s: list(s.encode()))
  with pytest.raises(KvjaxError, match=r"fewer than params.eval_tokens 99; lower "
                                       r"params.eval_tokens or pass a longer params.text"):
    from kvjax.lab import evaluate
    evaluate.text_windows(tok, "short", 99, 1, ("params.eval_tokens", "params.eval_seqs",
                                                "params.text"))


def test_window_arithmetic_is_right_at_the_edge():
  """seq_len + 1 tokens make exactly one window; one fewer is refused, in true words."""
  stream = np.arange(16, dtype=np.int32)
  win = data.windows(stream, 3, 15, np.random.default_rng(0))
  assert win.shape == (3, 16) and (win == stream).all()
  assert data.eval_windows(stream, 2, 15).shape == (2, 16)
  with pytest.raises(KvjaxError) as err:
    data.windows(stream[:15], 3, 15, np.random.default_rng(0))
  assert str(err.value) == ("the corpus split holds 15 tokens, but a window of train.seq_len=15 "
                            "needs 16 (its inputs and the next token); lower train.seq_len or "
                            "add text")


@pytest.mark.parametrize("hf, expect", [
    ({"torch_dtype": "bfloat16"}, ("bfloat16", "config.json torch_dtype")),
    ({}, ("float32", "float32 assumed: config.json names no torch_dtype")),
    ({"torch_dtype": "float64"}, "config.json torch_dtype 'float64' is not a dtype"),
    ({"torch_dtype": ["bfloat16"]}, "config.json torch_dtype ['bfloat16'] is not a dtype"),
    ({"dtype": 16}, "config.json dtype 16 is not a dtype"),
])
def test_bad_torch_dtype_is_named_not_reported_missing(hf, expect):
  if isinstance(expect, tuple):
    assert sizing.hf_param_dtype(hf) == expect
  else:
    with pytest.raises(KvjaxError, match=re.escape(expect)):
      sizing.hf_param_dtype(hf)


def test_os_errors_advise_about_the_path_they_concern(tmp_path):
  out = tmp_path / "out"
  run = types.SimpleNamespace(command="run", out=str(out))
  read = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "in.txt"))
  write = PermissionError(errno.EACCES, "Permission denied", str(out / "memory.jsonl"))
  full = OSError(errno.ENOSPC, "No space left on device", str(out / "memory.jsonl"))
  assert cli._os_message(read, run) == (f"Permission denied: {tmp_path / 'in.txt'}; check "
                                        "that this path exists and is readable by you")
  assert "choose another --out" in cli._os_message(write, run)
  assert "free space" in cli._os_message(full, run)
  assert "--out" not in cli._os_message(read, types.SimpleNamespace(command="eval"))


def test_unreadable_input_through_main_is_one_line_about_the_input(capsys, monkeypatch,
                                                                   tiny_yaml):
  def deny(*a, **k):
    raise PermissionError(errno.EACCES, "Permission denied", "/data/corpus.txt")
  monkeypatch.setattr(data, "eval_text", deny)
  line = one_error_line(capsys, "eval", "--config", tiny_yaml, "--text", "/data/corpus.txt")
  assert "/data/corpus.txt; check that this path exists" in line and "--out" not in line


# -- experiment options ------------------------------------------------------------------------
def _memory_yaml(tmp_path) -> Path:
  path = tmp_path / "m.yaml"
  path.write_text("experiment: memory\nmodel: {vocab_size: 64, d_model: 32, n_layers: 1, "
                  "n_heads: 4, n_kv_heads: 4}\nparams: {contexts: [4]}\n")
  return path


def test_options_the_experiment_does_not_read_are_refused(capsys, tmp_path):
  path = _memory_yaml(tmp_path)
  line = one_error_line(capsys, "run", path, "--dry-run", "--set", "params.contxts=[8]")
  assert "params.contxts is not an option of experiment memory; it reads " in line
  assert "contexts" in line
  line = one_error_line(capsys, "run", path, "--dry-run", "--set", "params.contexts.x=1")
  assert "only params.settings.NAME reaches inside an option" in line


def test_set_params_settings_name_adds_a_setting_that_takes_effect(capsys, tmp_path):
  path = _memory_yaml(tmp_path)
  rc, out, err = run_cli(capsys, "run", path, "--dry-run",
                         "--set", "params.settings.k8={cache.k_codec: int8}",
                         "--set", "params.setting=k8")
  assert rc == 0, err
  assert re.search(r"\bk8\b.*\bint8\b.*\bfp32\b", out), out
  assert "no cell selects" not in err
  rc, out, err = run_cli(capsys, "run", path, "--dry-run",
                         "--set", "params.settings.k8={cache.k_codec: int8}")
  assert rc == 0 and "kvjax run: note: no cell selects params.settings k8;" in err, err


def test_every_experiment_declares_the_options_its_source_reads():
  import importlib
  from kvjax.lab.runner import available_experiments
  for name in available_experiments():
    module = importlib.import_module(f"kvjax.lab.experiments.{name}")
    text = Path(module.__file__).read_text()
    read = set(re.findall(r"""(?:param|\bp)\(\s*["']([a-z_0-9]+)""", text))
    missing = read - set(module.PARAMS) - {"setting", "settings"}
    assert not missing, (name, missing)


def _option_names(raw: dict) -> set[str]:
  """The params.NAME options a config file names: its params:, its grid's params.* axes and
  its paired settings' params.* keys (read from the YAML, nothing expanded)."""
  params = raw.get("params") or {}
  names = set(params)
  names |= {k[7:] for k in (raw.get("grid") or {}) if str(k).startswith("params.")}
  for bundle in (params.get("settings") or {}).values():
    names |= {k[7:] for k in bundle if str(k).startswith("params.")}
  return names


def test_committed_configs_use_only_options_their_experiment_reads():
  import importlib
  configs = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))
  checked = 0
  for path in configs:
    raw = config_lib.read_yaml(path)
    if raw.get("experiment"):
      module = importlib.import_module(f"kvjax.lab.experiments.{raw['experiment']}")
      extra = _option_names(raw) - set(module.PARAMS) - {"setting", "settings"}
      assert not extra, (path.name, extra)
      checked += 1
  assert checked >= 5


# -- --json says what ran, for every model source -------------------------------------------
def _fake_generate(cfg, params, prompts, max_new_tokens, seed=None, stop=(), timed=True):
  assert params is not None
  return {"tokens": [[1] * max_new_tokens for _ in prompts], "cache_bytes": 1,
          "cache_bytes_per_device": 1, "ttft_s": 0.0, "tpot_s": 0.0, "compile_s": 0.0,
          "capacity": 8}


def _random_params(model_cfg, seed: int = 0):
  """The model's parameter tree filled with random numbers, without compiling its
  initialiser (these tests are about what is reported, not about the weights)."""
  import jax
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: _INIT(model_cfg, seed))
  return jax.tree.map(lambda s: rng.normal(0, 0.2, s.shape).astype(s.dtype), shapes)


def _write_sources(tmp_path) -> dict[str, list[str]]:
  """A tiny model written as each source kind kvjax reads (the weights really load)."""
  from kvjax.io import checkpoint
  from test_gguf import SHAPE, write_gguf
  cfg = config_lib.apply_overrides(config_lib.Config(), SHAPE)
  npp = _random_params(cfg.model)
  write_gguf(tmp_path / "m.gguf", cfg, npp)
  checkpoint.save(tmp_path / "ckpt", cfg, npp, step=0)
  _write_hf(tmp_path / "hf", cfg, npp)
  (tmp_path / "c.yaml").write_text("model: {vocab_size: 64, d_model: 32, n_layers: 1, "
                                   "n_heads: 4, n_kv_heads: 4}\n")
  return {"config": ["--config", tmp_path / "c.yaml"], "gguf": ["--gguf", tmp_path / "m.gguf"],
          "hf": ["--hf", tmp_path / "hf"], "checkpoint": ["--checkpoint", tmp_path / "ckpt"]}


def _write_hf(folder: Path, cfg, params) -> None:
  from safetensors.numpy import save_file
  m = cfg.model
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.F,
      "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
      "num_key_value_heads": m.n_kv_heads, "max_position_embeddings": m.max_seq_len,
      "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "torch_dtype": "float32",
      "tie_word_embeddings": m.tie_embeddings}))
  L, t = params["layers"], {}
  for i in range(m.n_layers):
    for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                        ("mlp", ("gate_proj", "up_proj", "down_proj"))):
      for n in names:
        t[f"model.layers.{i}.{part}.{n}.weight"] = L[n]["kernel"][i].T
    for n in ("input_layernorm", "post_attention_layernorm"):
      t[f"model.layers.{i}.{n}.weight"] = L[n]["weight"][i]
  t["model.embed_tokens.weight"] = params["embed_tokens"]["embedding"]
  t["model.norm.weight"] = params["norm"]["weight"]
  if "lm_head" in params:
    t["lm_head.weight"] = params["lm_head"]["kernel"].T
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in t.items()},
            str(folder / "model.safetensors"))


def test_generate_json_and_note_say_which_weights_ran(capsys, tmp_path, monkeypatch):
  from kvjax import model
  from kvjax.decode import generate
  monkeypatch.setattr(generate, "generate", _fake_generate)
  monkeypatch.setattr(model, "init_params", _random_params)
  for kind, flags in _write_sources(tmp_path).items():
    rc, out, err = run_cli(capsys, "generate", *flags, "--prompt-ids", "1,2",
                           "--max-new-tokens", "2", "--json")
    assert rc == 0, (kind, err)
    res = json.loads(out)
    assert res["random_weights"] is (kind == "config"), kind
    assert res["source"] == f"{kind}:{flags[1]}", res["source"]
    from kvjax.cli import show
    show.print_human("generate", res)
    assert ("random weights" in capsys.readouterr().err) is (kind == "config"), kind


@pytest.mark.parametrize("argv", [
    ["run", "configs/quickstart.yaml", "--dry-run", "--out", "/tmp/kvjax-\udcff"],
    ["run", "/tmp/\udcfe.yaml"],
    ["generate", "--checkpoint", "/tmp/\udcff", "--prompt", "hi"],
])
def test_arguments_that_are_not_utf8_are_one_line(argv, capsys):
  """Undecodable bytes in a path (they arrive as lone surrogates) once reached orbax, pybind
  or a JSON row and raised a traceback."""
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert "is not UTF-8 text" in err and len(err.splitlines()) == 1
