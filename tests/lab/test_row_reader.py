"""One reader of results rows (kvjax.lab.rowfile) for `kvjax plot`, `kvjax results`, a resumed
`kvjax run` and the API: a row one of them refuses, none of them uses, and none of them
raises a traceback on it. Each damaged row below once drew, crashed `plot` or `results`, or
counted as done on resume. Files that are not files (a FIFO, a folder named x.jsonl) are one
line or one skipped file, never a hang.
"""

from __future__ import annotations

import copy
import json
import os
import threading

import pytest

from kvjax import cli
from kvjax.errors import KvjaxError
from kvjax.lab import plots, rowfile, runner
from kvjax.lab.runner import results
from test_plots import timing_row
from test_shared_folder import CFG


def _good(i: int = 0) -> dict:
  return timing_row("latency", "MHA", "bf16", "contiguous",
                    {"batch": 1, "prompt_len": 16, "gen_len": 16, "context": 32 + i}, 1e-3)


def _bad_rows() -> dict[str, str]:
  """name -> the line of a damaged row (JSON text, as a hand edit or an old kvjax left it)."""
  out = {}

  def edited(name, fn):
    row = copy.deepcopy(_good(len(out) + 1))
    fn(row)
    out[name] = json.dumps(row)

  edited("list experiment", lambda r: r.update(experiment=["latency"]))
  edited("string config", lambda r: r.update(config="tiny"))
  edited("no variant", lambda r: r.pop("variant"))
  edited("no env", lambda r: r.pop("env"))
  edited("path experiment", lambda r: r.update(experiment="../../x"))
  edited("path config name", lambda r: r["config"].update(name="../../evil"))
  edited("config.cache a list", lambda r: r["config"].update(cache=[1, 2]))
  edited("config.model a number", lambda r: r["config"].update(model=3))
  out["NaN metric"] = json.dumps(_good(90)).replace('"tpot_s": 0.001', '"tpot_s": NaN')
  out["huge metric"] = json.dumps(_good(91)).replace('"tpot_s": 0.001', '"tpot_s": 1e999')
  out["long integer"] = json.dumps(_good(92)).replace('"cache_bytes": 4000',
                                                      '"cache_bytes": ' + "9" * 5000)
  out["deep nesting"] = json.dumps(_good(93)).replace('"grid": {}',
                                                      '"grid": ' + "[" * 5000 + "]" * 5000)
  good = _good(94)
  line = runner.encode(good)
  out["crc fails"] = line.replace('"tpot_s": 0.001', '"tpot_s": 0.002')
  assert out["crc fails"] != line
  return out


BAD = _bad_rows()


@pytest.mark.parametrize("name", list(BAD))
def test_a_damaged_row_is_skipped_by_every_reader(name, tmp_path, capsys):
  folder = tmp_path / "res"
  folder.mkdir()
  (folder / "rows.jsonl").write_text(json.dumps(_good()) + "\n" + BAD[name] + "\n")
  assert rowfile.scan(folder / "rows.jsonl").problems[0].startswith("line 2: ")
  groups, skipped = plots.scan_rows(folder)
  assert sum(map(len, groups.values())) == 1 and groups["latency"][0] == _good()
  assert len(skipped) == 1 and "1 unreadable lines" in skipped[0]
  paths = plots.plot_all(folder, tmp_path / "plots")
  assert paths and all(p.resolve().is_relative_to((tmp_path / "plots").resolve()) for p in paths)
  assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "x").exists()
  capsys.readouterr()
  assert len(results.load(folder)) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "line 2:" in err[0]
  assert cli.main(["results", str(folder), "--format", "csv"]) == 0


def test_a_damaged_section_does_not_count_as_done_on_resume(tmp_path, capsys):
  """An old row (no checksum) whose config.cache is a list: its cell runs again instead of
  counting as done, and `results` reads the other rows."""
  cfg = tmp_path / "tiny.yaml"
  cfg.write_text(CFG)
  out = tmp_path / "out"
  assert cli.main(["run", str(cfg), "--out", str(out)]) == 0
  path = out / "memory.jsonl"
  lines = path.read_text().splitlines()
  row = json.loads(lines[0])
  row.pop("crc32")
  row["config"]["cache"] = ["fp32"]
  path.write_text("\n".join([json.dumps(row)] + lines[1:]) + "\n")
  assert len(results.load(path)) == len(lines) - 1
  assert row["config_hash"] not in runner.complete_rows(runner.read_rows(path))[1]
  capsys.readouterr()
  assert cli.main(["run", str(cfg), "--out", str(out)]) == 0
  err = capsys.readouterr().err
  assert "1 to run" in err and "config.cache is not an object" in err
  assert len(results.load(path)) == len(lines)


def _no_hang(fn, seconds: float = 20):
  """fn() run in a thread; fails (instead of hanging the suite) when it does not return."""
  box = {}

  def target():
    try:
      box["value"] = fn()
    except BaseException as e:  # noqa: BLE001
      box["error"] = e
  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(seconds)
  assert not t.is_alive(), "blocked (a FIFO opened for reading or writing)"
  if "error" in box:
    raise box["error"]
  return box.get("value")


def test_a_fifo_is_never_opened(tmp_path, capsys):
  folder = tmp_path / "res"
  folder.mkdir()
  (folder / "rows.jsonl").write_text(json.dumps(_good()) + "\n")
  os.mkfifo(folder / "pipe.jsonl")
  groups, skipped = _no_hang(lambda: plots.scan_rows(folder))
  assert len(groups["latency"]) == 1 and any("FIFO" in s for s in skipped)
  assert len(_no_hang(lambda: results.load(folder))) == 1
  assert "FIFO" in capsys.readouterr().err
  with pytest.raises(KvjaxError, match="FIFO"):
    _no_hang(lambda: results.load(folder / "pipe.jsonl"))
  cfg = tmp_path / "tiny.yaml"
  cfg.write_text(CFG)
  out = tmp_path / "out"
  out.mkdir()
  os.mkfifo(out / "memory.jsonl")
  assert _no_hang(lambda: cli.main(["run", str(cfg), "--out", str(out)])) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "FIFO" in err[0] and "--out" in err[0]


def test_a_folder_named_like_the_results_file_is_one_line(tmp_path, capsys):
  cfg = tmp_path / "tiny.yaml"
  cfg.write_text(CFG)
  out = tmp_path / "out"
  (out / "memory.jsonl").mkdir(parents=True)
  assert cli.main(["run", str(cfg), "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is a folder, not a file" in err[0]


def test_a_file_where_the_lock_folder_belongs_is_one_line(tmp_path, capsys):
  cfg = tmp_path / "tiny.yaml"
  cfg.write_text(CFG)
  out = tmp_path / "out"
  out.mkdir()
  (out / ".kvjax-locks").write_text("")
  assert _no_hang(lambda: cli.main(["run", str(cfg), "--out", str(out)])) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and ".kvjax-locks is a file where kvjax keeps its lock files" in err[-1]
