"""Fuzzing every model file kvjax reads: random byte corruptions and truncations of a tiny
GGUF (with a tokenizer), a tiny Hugging Face folder (safetensors, config.json and
tokenizer.json) and a tiny orbax checkpoint, plus field-level damage (GGUF metadata,
tokenizer merges, config.json values) seeded with the cases that raised tracebacks
before. Every case must end one of two ways:

  error    a KvjaxError whose message is one line, and nothing written to stderr (a Rust
           panic in tokenizers prints there); in a subprocess: exit 2, exactly one stderr
           line, no traceback
  success  the model loads with every weight finite and its tokenizer encodes and decodes

Anything else (another exception, a multi-line message, a NaN weight) fails the test. The
outcomes are counted per file kind and printed (so a harness that only ever succeeds, or
only ever errs, shows), and both must occur for each kind. Hypothesis is derandomized (the
same cases every run) with a small budget here; `KVJAX_FUZZ_EXAMPLES=2000` (or
`scripts/fuzz.py`) runs a long search. Whether a loaded model's forward pass stays finite
is the model's range checks' business, not the readers': it is not asserted here.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import model_files as mf
from kvjax.errors import KvjaxError
from kvjax.io import sources

EXAMPLES = int(os.environ.get("KVJAX_FUZZ_EXAMPLES", "6"))
FUZZ = settings(derandomize=True, deadline=None, max_examples=EXAMPLES, database=None,
                suppress_health_check=list(HealthCheck))
OUTCOMES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
  """The three intact files (bytes per relative path), written once. The checkpoint holds
  the suite's tiny model: its arrays are over orbax's 1 kB inline limit, so they sit in data
  files that orbax reads concurrently (the exit-time traceback risk)."""
  from conftest import tiny_config, tiny_params

  root = tmp_path_factory.mktemp("fuzz-originals")
  cfg, params = mf.tiny_model()
  mf.write_gguf(root / "m.gguf", cfg, params)
  mf.write_hf(root / "hf", cfg, params)
  ckpt_cfg = tiny_config()
  mf.write_checkpoint(root / "ckpt", ckpt_cfg, tiny_params(ckpt_cfg))

  def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}
  return _Originals({"gguf": (cfg, params, (root / "m.gguf").read_bytes()),
                     "hf": files(root / "hf"), "checkpoint": files(root / "ckpt")})


class _Originals(dict):
  def __repr__(self) -> str:  # hypothesis prints a failing case's arguments: not the bytes
    return "<the intact model files>"


def _outcome(kind: str, ref: str, capfd) -> str:
  """Load the source in-process; 'error' or 'success', or fail the test."""
  capfd.readouterr()
  message = None
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", RuntimeWarning)
    try:
      _, params, tok = sources.load(sources.parse(f"{kind}:{ref}"))
    except KvjaxError as e:
      message = str(e)
    gc.collect()  # what a failed load left behind warns when collected ("coroutine ...
    # was never awaited" from orbax): on the CLI's stderr, a second line
  assert [str(w.message) for w in caught if w.category is RuntimeWarning] == []
  if message is not None:
    assert "\n" not in message and message, repr(message)
    assert capfd.readouterr().err == ""
    OUTCOMES[kind]["error"] += 1
    return "error"
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    assert np.isfinite(np.asarray(leaf, np.float32)).all(), f"non-finite {path} loaded"
  if tok is not None:
    tok.decode(tok.encode("abcdef ghijkl"))
  assert capfd.readouterr().err == ""
  OUTCOMES[kind]["success"] += 1
  return "success"


# -- byte-level damage ----------------------------------------------------------------------
def _damage(data: bytes, flips: list[tuple[int, int]], cut: float | None) -> bytes:
  buf = bytearray(data)
  for pos, val in flips:
    buf[pos % len(buf)] = val
  if cut is not None:
    buf = buf[: int(cut * len(buf))]
  return bytes(buf)


FLIPS = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6)
CUT = st.none() | st.floats(0.0, 0.999)


@FUZZ
@given(flips=FLIPS, cut=CUT)
@example(flips=[], cut=0.5)           # truncated mid-tensor
@example(flips=[(8, 255), (15, 127)], cut=None)  # the tensor count: claims more than the file
@example(flips=[], cut=None)          # the intact file loads
def test_fuzz_gguf_bytes(originals, capfd, flips, cut):
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "m.gguf"
    path.write_bytes(_damage(originals["gguf"][2], flips, cut))
    _outcome("gguf", str(path), capfd)


GGUF_FIELDS = ["llama.attention.head_count", "llama.block_count", "llama.embedding_length",
               "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
               "llama.context_length", "llama.vocab_size", "tokenizer.ggml.model",
               "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token",
               "llama.rope.scaling.type", "llama.attention.head_count_kv"]
VALUES = (st.text(max_size=6) | st.integers(0, 1 << 31) | st.booleans()
          | st.floats(allow_nan=True, allow_infinity=True, width=32))


@FUZZ
@given(key=st.sampled_from(GGUF_FIELDS), value=VALUES,
       merges=st.none() | st.lists(st.sampled_from(mf.TOKENS + ["z", "", " "]).flatmap(
           lambda a: st.sampled_from([a, f"{a} b", f"a {a}", f"{a}  c"])), max_size=4))
@example(key="llama.attention.head_count", value="four", merges=None)  # ValueError in int()
@example(key="llama.block_count", value=1, merges=["a b", "abcd"])      # tokenizers panicked
@example(key="llama.block_count", value=1, merges=None)                  # the intact values
def test_fuzz_gguf_fields(originals, capfd, key, value, merges):
  cfg, params, _ = originals["gguf"]
  with tempfile.TemporaryDirectory() as tmp:
    path = mf.write_gguf(Path(tmp) / "m.gguf", cfg, params, meta={key: value}, merges=merges)
    _outcome("gguf", str(path), capfd)


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
  for rel, data in files.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)


@FUZZ
@given(target=st.sampled_from(["model.safetensors", "config.json", "tokenizer.json"]),
       flips=FLIPS, cut=CUT)
@example(target="model.safetensors", flips=[(0, 255), (1, 255)], cut=None)  # header length
@example(target="model.safetensors", flips=[], cut=0.9)                    # truncated data
@example(target="tokenizer.json", flips=[], cut=0.5)                      # truncated JSON
@example(target="config.json", flips=[], cut=None)                         # intact
def test_fuzz_hf_bytes(originals, capfd, target, flips, cut):
  files = dict(originals["hf"])
  files[target] = _damage(files[target], flips, cut)
  with tempfile.TemporaryDirectory() as tmp:
    _write_tree(Path(tmp), files)
    _outcome("hf", tmp, capfd)


HF_FIELDS = ["rope_scaling", "layer_types", "tie_word_embeddings", "num_attention_heads",
             "hidden_size", "rms_norm_eps", "rope_theta", "sliding_window", "torch_dtype",
             "model_type", "head_dim", "rope_parameters", "attention_bias", "vocab_size"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.text(max_size=5)
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.sampled_from(["rope_type", "factor", "type",
                                                       "rope_theta"]), kids, max_size=3),
                    max_leaves=6)


@FUZZ
@given(key=st.sampled_from(HF_FIELDS), value=JSON)
@example(key="rope_scaling", value=[1, 2])                       # TypeError before
@example(key="layer_types", value=3)                             # TypeError before
@example(key="tie_word_embeddings", value=True)                  # a valid change
def test_fuzz_hf_config_fields(originals, capfd, key, value):
  files = dict(originals["hf"])
  config = json.loads(files["config.json"])
  config[key] = value
  if key == "layer_types":
    config.update(model_type="qwen2", sliding_window=16)
  files["config.json"] = json.dumps(config).encode()
  with tempfile.TemporaryDirectory() as tmp:
    _write_tree(Path(tmp), files)
    _outcome("hf", tmp, capfd)


CKPT_TARGET = st.sampled_from(["config.yaml", "steps/1/params/_METADATA",
                               "steps/1/params/manifest.ocdbt", "steps/1/meta/metadata",
                               "steps/1/_CHECKPOINT_METADATA", "data"])


def _checkpoint(originals, target: str, flips, cut, remove: bool) -> dict[str, bytes]:
  files = dict(originals["checkpoint"])
  if target == "data":  # the largest array data file orbax wrote (their names are random)
    target = max((k for k in files if "/d/" in k), key=lambda k: len(files[k]))
  if remove:
    files.pop(target)
  else:
    files[target] = _damage(files[target], flips, cut)
  return files


@FUZZ
@given(target=CKPT_TARGET, flips=FLIPS, cut=CUT, remove=st.booleans())
@example(target="config.yaml", flips=[(3, 0xFF), (4, 0xFE)], cut=None, remove=False)  # not UTF-8
@example(target="data", flips=[], cut=0.3, remove=False)    # a truncated array file
@example(target="steps/1/params/_METADATA", flips=[(18764, 32)], cut=None, remove=False)
# ^ orbax fails before its gather: a coroutine never awaited warned at collection
@example(target="config.yaml", flips=[], cut=None, remove=False)  # intact
def test_fuzz_checkpoint_files(originals, capfd, target, flips, cut, remove):
  with tempfile.TemporaryDirectory() as tmp:
    _write_tree(Path(tmp), _checkpoint(originals, target, flips, cut, remove))
    _outcome("checkpoint", tmp, capfd)


# A process start costs seconds: the suite runs the seeded case only, a long run generates
# one case per ten of the others.
@settings(FUZZ, max_examples=max(1, EXAMPLES // 10),
          phases=[Phase.explicit] if EXAMPLES < 10 else list(Phase))
@given(target=CKPT_TARGET, flips=FLIPS, cut=CUT, remove=st.booleans())
@example(target="data", flips=[], cut=0.3, remove=False)
def test_fuzz_checkpoint_cli(originals, target, flips, cut, remove):
  """Through the CLI in a subprocess: what orbax leaves running prints at exit, after the
  error line, so only a whole process shows it. Exit 2 with one stderr line and nothing on
  stdout, or exit 0 with one strict JSON object (no NaN) and nothing on stderr."""
  with tempfile.TemporaryDirectory() as tmp:
    _write_tree(Path(tmp), _checkpoint(originals, target, flips, cut, remove))
    run = subprocess.run([sys.executable, "-m", "kvjax.cli", "generate", "--checkpoint", tmp,
                          "--prompt-ids", "1,2", "--max-new-tokens", "1", "--json"],
                         capture_output=True, text=True, timeout=240,
                         cwd=Path(__file__).resolve().parents[2])
  if run.returncode == 2:
    assert run.stdout == "" and run.stderr.count("\n") == 1, run.stderr[-3000:]
    assert run.stderr.startswith("kvjax: error: ")
    OUTCOMES["checkpoint (CLI)"]["error"] += 1
  else:
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json"))
    assert result["tokens"] and run.stderr.count("kvjax: note") == run.stderr.count("\n")
    OUTCOMES["checkpoint (CLI)"]["success"] += 1


def test_fuzz_outcomes_show_both_ways(capsys):
  """Printed whatever the verbosity; runs after the fuzz tests above (file order)."""
  with capsys.disabled():
    print("\nfuzz outcomes (KVJAX_FUZZ_EXAMPLES=%d): " % EXAMPLES + "; ".join(
        f"{kind}: {c['error']} error, {c['success']} success" for kind, c in OUTCOMES.items()))
  for kind in ("gguf", "hf", "checkpoint"):
    if OUTCOMES[kind]:  # run alone (-k), a kind may not have run
      assert OUTCOMES[kind]["error"] and OUTCOMES[kind]["success"], (kind, OUTCOMES[kind])
