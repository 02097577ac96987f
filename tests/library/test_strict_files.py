"""One strict reader per kind of file: JSON through kvjax.config.jsonfile, YAML (configs and
a checkpoint's config.yaml) through the strict loader. What `json.loads` and
`yaml.safe_load` let through or turn into a traceback or a hang (NaN, over-long integers,
deep nesting, alias bombs, a FIFO) is one KvjaxError line naming the file."""

from __future__ import annotations

import json
import os
import time

import pytest

from kvjax import config as config_lib
from kvjax.config import jsonfile
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint, hf
from test_row_reader import _no_hang

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("text, why", [
    ("[" * 100 + "]" * 100, "nests deeper"),
    ("[" * 100000 + "]" * 100000, "nests deeper"),
    ("9" * 5000, "digits"),
    ('{"x": NaN}', "NaN"),
    ('{"x": -Infinity}', "infinity"),
    ('{"x": 1e999}', "infinity"),
    ('{"x": 1', "Expecting"),
    (b'{"x": "\xff"}', "UTF-8"),
])
def test_json_the_standard_reader_lets_through_is_refused(text, why):
  with pytest.raises(jsonfile.JsonProblem, match=why):
    jsonfile.loads(text)
  with pytest.raises(KvjaxError) as err:
    jsonfile.parse(text, "file x.json")
  assert str(err.value).startswith("malformed file x.json: ") and "\n" not in str(err.value)


def test_json_within_the_limits_reads_as_json():
  text = json.dumps({"a": [1, 2.5, -3e10, None, True, "x"], "b": [[[]]], "n": 10 ** 30})
  assert jsonfile.loads(text) == json.loads(text)


@pytest.mark.parametrize("body, needle", [
    ('{"hidden_size": NaN}', "NaN"),
    ('{"vocab_size": ' + "1" * 5000 + "}", "digits"),
    ('{"x": ' + "[" * 3000 + "]" * 3000 + "}", "nests deeper"),
])
def test_a_hugging_face_config_json_is_read_strictly(tmp_path, body, needle):
  (tmp_path / "config.json").write_text(body)
  with pytest.raises(KvjaxError, match=needle) as err:
    hf.read_hf_config(tmp_path)
  assert "config.json" in str(err.value) and "\n" not in str(err.value)


def test_files_that_are_not_files_are_one_line(tmp_path):
  os.mkfifo(tmp_path / "config.json")
  with pytest.raises(KvjaxError, match="FIFO"):
    _no_hang(lambda: hf.read_hf_config(tmp_path))
  os.mkfifo(tmp_path / "c.yaml")
  with pytest.raises(KvjaxError, match="FIFO"):
    _no_hang(lambda: config_lib.load(tmp_path / "c.yaml"))
  (tmp_path / "d.yaml").mkdir()
  with pytest.raises(KvjaxError, match="is a folder, not a file"):
    config_lib.read_yaml(tmp_path / "d.yaml")


@pytest.mark.parametrize("text, needle", [
    (BOMB, "expand to more than"),
    ("model: " + "[" * 5000 + "]" * 5000 + "\n", "nests"),
    ("model: " + "[" * 80 + "]" * 80 + "\n", "nests deeper"),
    ("model: {a: 1\n", "malformed YAML"),
])
def test_a_checkpoint_config_yaml_is_read_by_the_strict_loader(tmp_path, text, needle):
  (tmp_path / "config.yaml").write_text(text)
  start = time.monotonic()
  with pytest.raises(KvjaxError, match=needle) as err:
    checkpoint.read_config(tmp_path)
  assert time.monotonic() - start < 10
  msg = str(err.value)
  assert "\n" not in msg and "config.yaml is corrupt" in msg and "retrain or restore" in msg


def test_a_checkpoint_config_yaml_that_is_a_fifo_is_one_line(tmp_path):
  os.mkfifo(tmp_path / "config.yaml")
  with pytest.raises(KvjaxError, match="FIFO"):
    _no_hang(lambda: checkpoint.read_config(tmp_path))


@pytest.mark.parametrize("item, needle", [
    ("cache.codec=", "no value"), ("cache.codec=  ", "no value"),
    ("params.settings.x={", "malformed YAML"), ("params.settings={a: 1", "malformed YAML"),
    ('params.text="abc', "malformed YAML"),
    ("params.text='abc", "malformed YAML"),
])
def test_a_set_item_is_never_silently_empty_or_text(item, needle):
  """`--set cache.codec=` once emptied the codec (fp32 ran), `--set params.settings.x={`
  once set the text '{' and exited 0."""
  with pytest.raises(KvjaxError, match=needle):
    config_lib.parse_set([item])
  assert config_lib.parse_set(["train.data=my file.txt"]) == {"train.data": "my file.txt"}


def test_a_grid_too_large_is_counted_and_refused_before_it_expands(tmp_path):
  """A grid of millions of cells once hung `--dry-run`: its size is counted from the axes
  and refused in one line naming each axis's length."""
  import yaml

  from kvjax.lab.runner import grid
  axis = list(range(200))
  path = tmp_path / "big.yaml"
  path.write_text(yaml.safe_dump({"name": "big", "experiment": "quality",
                                  "grid": {"seed": axis, "workload.batch": axis[1:],
                                           "workload.prompt_len": axis[1:]}}))
  t0 = time.perf_counter()
  with pytest.raises(KvjaxError, match=r"7,920,200 cells \(200 seed x 199") as e:
    grid.expand(path)
  assert "\n" not in str(e.value) and time.perf_counter() - t0 < 30


def test_a_checkpoint_names_its_tokenizer_file_absolutely(tmp_path, monkeypatch):
  """A checkpoint written with a relative tokenizer path (`tokenizer: gguf:m.gguf`, or a
  tokenizer.json) once broke when used from another folder: the path is stored absolute."""
  (tmp_path / "m.gguf").write_bytes(b"GGUF")
  (tmp_path / "tokenizer.json").write_text("{}")
  monkeypatch.chdir(tmp_path)
  for name, want in (("gguf:m.gguf", f"gguf:{tmp_path / 'm.gguf'}"),
                     ("tokenizer.json", str(tmp_path / "tokenizer.json")),
                     ("bytes", "bytes"), ("gguf:missing.gguf", "gguf:missing.gguf")):
    cfg = config_lib.apply_overrides(config_lib.Config(), {"tokenizer": name})
    checkpoint.write_config(tmp_path / "ck", cfg)
    monkeypatch.chdir("/")
    assert checkpoint.read_config(tmp_path / "ck").tokenizer == want
    monkeypatch.chdir(tmp_path)
