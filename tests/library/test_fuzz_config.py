"""Fuzzing what a user can write as a config: random YAML files (wrong types, extreme and
non-finite numbers, unknown and duplicate keys, alias cycles, bytes that are not UTF-8)
and random `--set` items, through the loader, the grid expansion and `kvjax size`.

Every case must end one of two ways: refused with a one-line KvjaxError (exit 2 with one
stderr line and no traceback, for the CLI), or accepted as a valid config whose numbers
are finite and whose `kvjax size --json` is valid JSON with finite numbers. Anything else
(a traceback, NaN in the JSON, a second line) fails. The counts of each outcome are
printed (`pytest -s`) and recorded as a test property, and both outcomes must occur, so a
harness that only ever refuses (or only ever accepts) is visible.

Hypothesis runs derandomized (the same cases every run) with no deadline and a small
budget; `KVJAX_FUZZ_EXAMPLES=2000 pytest tests/library/test_fuzz_config.py -s` runs longer.
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvjax import cli
from kvjax import config as config_lib
from kvjax.config import schema
from kvjax.errors import KvjaxError
from kvjax.lab.runner import grid

EXAMPLES = int(os.environ.get("KVJAX_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

KEYS = config_lib.known_keys()
UNKNOWN = ["model.d_modle", "cache.kodec", "modle", "params.settings.x", "grid.model.d_model",
           "model.rope_scaling.factor", "seed.x", "", "."]
EXTREME = [0, -1, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64, -2**63, 1e-300, 1e300,
           1e-45, 2.0**-126, 3.4028234663852886e38, 3.5e38, float("nan"), float("inf"),
           -float("inf"), 0.5, 1e-5]
WORDS = ["int8", "int4", "paged", "none", "h2o", "bfloat16", "llama3", "yarn", "memory",
         "quality", "stdlib", "true", "", "∞", "1e999"]


def _default(key: str):
  sec, _, name = key.rpartition(".")
  obj = getattr(schema.Config(), sec) if sec else schema.Config()
  return getattr(obj, name)


def _plausible(key: str):
  """Values a user might mean for `key`: its default or a small variation of it."""
  value = _default(key)
  if isinstance(value, bool):
    return st.booleans()
  if isinstance(value, int):
    return st.sampled_from([value, 1, 2, 4, 8, 2**31 - 1])
  if isinstance(value, float):
    return st.sampled_from([value, value / 2 if value else 0.5, 1e-5, 0.9, 2.0**-126])
  if key == "cache.codec":
    return st.sampled_from(["int8", "bf16", "fp32"])
  return st.just(value)


_SCALARS = st.one_of(st.sampled_from(EXTREME), st.integers(-2**70, 2**70), st.floats(),
                     st.booleans(), st.none(), st.sampled_from(WORDS), st.text(max_size=6))
_WILD = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(WORDS + ["factor", "rope_type"]), inner,
                                       max_size=3), max_leaves=6)


@st.composite
def items(draw) -> dict:
  """{dotted key: value}: known keys with plausible or wild values, and unknown keys."""
  out = {}
  for _ in range(draw(st.integers(0, 4))):
    key = draw(st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.sampled_from(UNKNOWN)))
    out[key] = draw(st.one_of(_plausible(key), _WILD) if key in KEYS else _WILD)
  return out


def _nest(flat: dict) -> dict:
  out: dict = {}
  for key, value in flat.items():
    sec, dot, name = key.partition(".")
    if dot and sec in schema.SECTIONS:
      section = out.setdefault(sec, {})
      if isinstance(section, dict):
        section[name] = value
    else:
      out[key] = value
  return out


@st.composite
def yaml_files(draw) -> bytes:
  """A config file's bytes: a random mapping, then maybe a duplicated section, an alias
  cycle, a byte that is not UTF-8 or a cut at a random point."""
  text = yaml.safe_dump(_nest(draw(items())), allow_unicode=True)
  damage = draw(st.sampled_from(["none", "none", "none", "duplicate", "cycle", "latin1", "cut"]))
  if damage == "duplicate":
    text += draw(st.sampled_from(["model:\n  n_layers: 1\n", "cache: {codec: int8}\n",
                                  "seed: 3\n"]))
  elif damage == "cycle":
    text += "params: &p\n  loop: [*p]\n"
  elif damage == "cut":
    text = text[:draw(st.integers(0, max(len(text) - 1, 0)))]
  data = text.encode()
  if damage == "latin1":
    data += "# café\n".encode("latin-1")
  return data


OUTCOMES: collections.Counter = collections.Counter()


def _refused(e: KvjaxError, where: str) -> None:
  text = str(e)
  assert text and "\n" not in text, (where, text)
  OUTCOMES["refused"] += 1


def _finite(value) -> bool:
  if isinstance(value, float):
    return math.isfinite(value)
  if isinstance(value, dict):
    return all(_finite(v) for v in value.values())
  if isinstance(value, (list, tuple)):
    return all(_finite(v) for v in value)
  return True


def _accepted(cfg: config_lib.Config, what: str = "accepted") -> None:
  assert config_lib.validate(cfg) is cfg
  assert _finite(cfg.to_dict())
  json.dumps(cfg.to_dict(), allow_nan=False, default=str)
  assert len(cfg.hash()) == 12
  OUTCOMES[what] += 1


def _size_runs(path: Path, capsys) -> None:
  """What `kvjax size` prints for an accepted config: finite JSON, or one error line."""
  rc = cli.main(["size", "--config", str(path), "--seq-len", "16", "--json"])
  out, err = capsys.readouterr()
  if rc == 0:
    res = json.loads(out)
    assert _finite(res) and "NaN" not in out and "Infinity" not in out, out
    OUTCOMES["size ran"] += 1
  else:
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    OUTCOMES["size refused"] += 1


def check_file(data: bytes, path: Path, capsys) -> None:
  path.write_bytes(data)
  try:
    cfg = config_lib.load(path)
  except KvjaxError as e:
    _refused(e, "load")
  else:
    _accepted(cfg)
    _size_runs(path, capsys)
  try:  # the runner's reading of the same file: grid axes, params, paired settings
    base, cells = grid.expand(path)
  except KvjaxError as e:
    OUTCOMES["expand refused"] += 1
    assert "\n" not in str(e)
  else:
    for cell in cells:
      _accepted(cell.cfg, "expanded cells")
    OUTCOMES["expand accepted"] += 1


def check_set(flat: dict) -> None:
  argv = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in flat.items()]
  try:
    cfg = config_lib.load(None, argv)
  except KvjaxError as e:
    _refused(e, f"--set {argv}")
  else:
    _accepted(cfg)


# The failing cases the reliability issue lists, always run first.
KNOWN_FILES = [
    b"model:\n  d_model: 32\ncache:\n  codec: int8\nmodel:\n  n_layers: 1\n",
    b"model: &m\n  x: *m\n",
    b"model:\n  d_model: 32  # caf\xe9\n",
    b"model: {rope_theta: 1.0e-300}\n",
    b"model: {norm_eps: 1.0e+300}\n",
    b"workload: {temperature: 1.0e-300}\n",
    b"model:\n  rope_scaling: {rope_type: yarn, factor: 4}\n",
    b"seed: 18446744073709551616\n",
    b"experiment: memory\nparams: {contexts: [4], settings: {a: {cache.codec: int8}}}\n"
    b"grid: {params.setting: [a]}\n",
    b"",
]
KNOWN_SETS = [{"model.rope_theta": 1e-300}, {"model.norm_eps": 1e300},
              {"workload.temperature": 1e-300}, {"seed": 18446744073709551616},
              {"model.rope_scaling": "{rope_type: yarn, factor: 4}"},
              {"params.settings.X": "{cache.codec: int8}"}, {}]


def test_fuzz_config_files(tmp_path, capsys, record_property):
  OUTCOMES.clear()
  path = tmp_path / "fuzz.yaml"
  run = given(yaml_files())(lambda data: check_file(data, path, capsys))
  for data in KNOWN_FILES:
    run = example(data)(run)
  FUZZ(run)()
  _report("files", record_property, capsys)
  assert OUTCOMES["refused"] >= len(KNOWN_FILES) - 3 and OUTCOMES["accepted"] >= 3
  assert OUTCOMES["size ran"] >= 3


def test_fuzz_set_items(record_property, capsys):
  OUTCOMES.clear()
  run = given(items())(check_set)
  for flat in KNOWN_SETS:
    run = example(flat)(run)
  FUZZ(run)()
  _report("--set", record_property, capsys)
  assert OUTCOMES["refused"] >= len(KNOWN_SETS) - 3 and OUTCOMES["accepted"] >= 2


FLAGS = [("--seed", "seed", int), ("--temperature", "workload.temperature", float),
         ("--top-p", "workload.top_p", float), ("--top-k", "workload.top_k", int),
         ("--max-new-tokens", None, int)]
_NUMBER_TEXT = st.one_of(st.sampled_from(EXTREME), st.integers(-2**70, 2**70),
                         st.floats()).map(str) | st.sampled_from(WORDS)


def check_flag(flag: tuple, text: str) -> None:
  """A generate flag parses to a value its config key also accepts, or is refused in one
  line naming the flag: flags and keys share one range (class 8 of the reliability issue)."""
  name, key, typ = flag
  try:
    args = cli.parse_args(["generate", "--prompt-ids", "1", name, text])
  except KvjaxError as e:
    assert str(e).startswith(f"{name} ") and "\n" not in str(e), str(e)
    OUTCOMES["refused"] += 1
    if key:  # what the flag refused, the key refuses too (when it is a number at all)
      try:
        value = typ(text)
      except ValueError:
        return
      with pytest.raises(KvjaxError):
        config_lib.check_number(key, value, config_lib.range_of(key), typ is int)
    return
  value = getattr(args, name[2:].replace("-", "_"))
  assert isinstance(value, typ) and math.isfinite(value)
  if key:
    config_lib.check_number(key, value, config_lib.range_of(key), typ is int)
  OUTCOMES["accepted"] += 1


def test_fuzz_generate_flags(record_property, capsys):
  OUTCOMES.clear()
  run = given(st.sampled_from(FLAGS), _NUMBER_TEXT)(check_flag)
  for flag, text in [(FLAGS[0], "18446744073709551616"), (FLAGS[1], "1e-300"),
                     (FLAGS[0], "4294967295")]:
    run = example(flag, text)(run)
  FUZZ(run)()
  _report("flags", record_property, capsys)
  assert OUTCOMES["refused"] >= 1 and OUTCOMES["accepted"] >= 2


def _report(what: str, record_property, capsys) -> None:
  counts = dict(sorted(OUTCOMES.items()))
  record_property(f"fuzz {what} outcomes", counts)
  with capsys.disabled():
    print(f"\nfuzz {what}: {EXAMPLES} generated + known cases -> {counts}")


def test_cli_subprocess_refusal_exits_cleanly(tmp_path):
  """Through a real process, where an exit-time traceback would show: a cyclic config is
  exit 2 with exactly one stderr line (the in-process cases above cover acceptance)."""
  path = tmp_path / "c.yaml"
  path.write_bytes(KNOWN_FILES[1])
  proc = subprocess.run([sys.executable, "-m", "kvjax.cli", "size", "--config", str(path),
                         "--seq-len", "16", "--json"], capture_output=True, text=True,
                        timeout=120, cwd=Path(__file__).resolve().parents[2])
  assert proc.returncode == 2 and proc.stdout == "", proc
  assert len(proc.stderr.strip().splitlines()) == 1 and "cycle" in proc.stderr, proc.stderr
