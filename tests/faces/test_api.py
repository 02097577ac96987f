"""The Python API's own parts on a tiny model: cache settings, results = the CLI's JSON,
one-line errors, and an `import kvjax` that loads nothing heavy."""

import dataclasses
import json
import subprocess
import sys
import warnings

import pytest

import kvjax
from kvjax import cli, config as config_lib
from kvjax.api_types import cache_items

TINY_YAML = """model: {vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, d_ff: 48}
tokenizer: bytes
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("api") / "tiny.yaml"
  path.write_text(TINY_YAML)
  with pytest.warns(kvjax.RandomWeightsWarning, match="random weights"):
    m = kvjax.load(f"config:{path}")
  return m, path


def test_cache_config_has_every_cache_key_and_forms_agree():
  names = {f.name for f in dataclasses.fields(kvjax.CacheConfig)}
  assert names == {f.name for f in dataclasses.fields(config_lib.CacheConfig)}
  c = kvjax.CacheConfig(codec="int4", residual=32)
  assert cache_items(c) == cache_items({"codec": "int4", "cache.residual": 32}) == \
      {"cache.codec": "int4", "cache.residual": 32}
  assert cache_items("int8") == {"cache.codec": "int8"}
  assert cache_items(config_lib.CacheConfig(k_codec="int8")) == {"cache.k_codec": "int8"}
  with pytest.raises(kvjax.KvjaxError, match="cache= expects"):
    cache_items(8)


def test_generate_is_the_cli_generate(tiny, capsys):
  m, path = tiny
  assert m.random_weights and "random weights" in repr(m)
  out = m.generate([1, 2, 3], cache={"codec": "int8"}, max_new_tokens=4)
  assert out.tokens == out.to_dict()["tokens"][0] and len(out.tokens) == 4
  assert (out.k_codec, out.v_codec, out.cache_bytes > 0) == ("int8", "int8", True)
  assert cli.main(["generate", "--config", str(path), "--prompt-ids", "1,2,3", "--codec",
                   "int8", "--max-new-tokens", "4", "--json"]) == 0
  printed = json.loads(capsys.readouterr().out)
  timing = {"ttft_s", "tpot_s", "compile_s"}
  assert {k: v for k, v in printed.items() if k not in timing} == \
      {k: v for k, v in out.to_dict().items() if k not in timing}
  batch = m.generate(["ab", [4, 5, 6, 7]], max_new_tokens=2)
  assert len(batch.tokens) == 2 and isinstance(batch.text, list)


def test_size_is_the_cli_size(tiny, capsys):
  m, path = tiny
  s = m.size(cache="int4", seq_len=128, batch=2, budget="1MiB")
  assert cli.main(["size", "--config", str(path), "--seq-len", "128", "--batch", "2",
                   "--codec", "int4", "--budget", "1MiB", "--json"]) == 0
  assert s.to_dict() == json.loads(capsys.readouterr().out)
  assert s.max_sequences == s.to_dict()["budget"]["max_sequences"] > 0
  assert s.bits_per_element == s.to_dict()["bits_per_element"]


def test_size_of_a_checkpoint_is_read_from_its_config(tmp_path):
  """A checkpoint is sized from its own config.yaml (no weights read), a latent's rank
  included: as the same config given as a file, and apart from the dense cache of its
  head shape."""
  from kvjax.io import checkpoint
  yaml = tmp_path / "latent.yaml"
  yaml.write_text(TINY_YAML.replace("d_ff: 48}", "d_ff: 48, latent_rank: 8}")
                  + "cache: {layout: latent}\n")
  checkpoint.write_config(tmp_path / "ckpt", config_lib.load(str(yaml)))
  got = kvjax.size(f"checkpoint:{tmp_path / 'ckpt'}", cache="bf16", seq_len=64)
  want = kvjax.size(f"config:{yaml}", cache="bf16", seq_len=64)
  dense = kvjax.size(f"config:{yaml}", cache={"codec": "bf16", "layout": "contiguous"},
                     seq_len=64, overrides={"model.latent_rank": 0})
  assert got.bytes_per_token == want.bytes_per_token < dense.bytes_per_token
  assert got.to_dict()["layout"] == "latent"


@pytest.mark.parametrize("call, words", [
    (lambda m: m.generate("x", cache={"group_size": -1}), "cache.group_size"),
    (lambda m: m.generate("x", cache={"codec": "int5"}), "unknown codec 'int5'"),
    (lambda m: m.generate([], max_new_tokens=2), "at least one token"),
    (lambda m: m.generate("x", chat=True), "no chat template"),
    (lambda m: m.size(seq_len=0), "seq_len must be an integer > 0"),
    (lambda m: m.size(batch=1.5), "batch must be an integer in (0, "),
    (lambda m: m.evaluate(chunk=0), "chunk must be positive"),
])
def test_errors_are_the_cli_lines(tiny, call, words):
  with pytest.raises(kvjax.KvjaxError, match=r"^[^\n]*$") as e:
    call(tiny[0])
  assert words in str(e.value)


def test_load_names(tmp_path):
  from kvjax import api
  assert str(api.resolve_source("llama3-8b")) == "config:llama3-8b"   # a packaged shape
  assert str(api.resolve_source("shape:smollm2-135m")) == "config:smollm2-135m"
  assert str(api.resolve_source("smollm2-135m")) == "gguf:smollm2-135m"  # the real model wins
  with pytest.raises(kvjax.KvjaxError, match="cannot tell what model"):
    kvjax.load(str(tmp_path / "nothing"))
  with pytest.raises(kvjax.KvjaxError, match="no results file or folder"):
    kvjax.results(tmp_path / "none")


def test_import_kvjax_is_light():
  code = ("import sys, kvjax; assert 'jax' not in sys.modules and 'kvjax.api' not in "
          "sys.modules; kvjax.CacheConfig; assert 'jax' not in sys.modules; kvjax.load")
  subprocess.run([sys.executable, "-c", code], check=True)
  with warnings.catch_warnings():
    assert {"load", "CacheConfig", "run", "plot"} <= set(dir(kvjax))
