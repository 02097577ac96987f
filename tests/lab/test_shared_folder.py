"""Runs that share a results folder: two concurrent `kvjax run` into one `--out`, a claim
whose holder dies, `--shard I/N` parts (their files merged on read, cells that share work in
one part) and bad `--shard` values. The runs are forced to overlap (a first cell that waits
for the other run), never left to timing. The `memory` experiment on a tiny model: no
compilation, four cells of two rows each.
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvjax import cli
from kvjax.lab import runner
from kvjax.lab import claims
from kvjax.lab.runner import shard

ROOT = Path(__file__).resolve().parents[2]
CFG = """\
name: tiny
experiment: memory
model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4}
workload: {batch: 2, prompt_len: 4, gen_len: 3, repeats: 1}
params: {contexts: [4, 8]}
grid: {model.n_kv_heads: [4, 1], cache.codec: [fp32, int8]}
"""
WAIT_S = 30  # how long a gated cell waits for the other run before the test fails


@pytest.fixture
def cfg(tmp_path) -> Path:
  path = tmp_path / "tiny.yaml"
  path.write_text(CFG)
  return path


class Calls(list):
  """Every memory cell run, as (thread name, config hash); `gates[name] = (hash, release,
  entered)` makes that thread's run of that cell wait until another thread finishes one."""

  def __init__(self):
    super().__init__()
    self.gates: dict = {}

  def gate(self, name: str, cell_hash: str) -> threading.Event:
    """Gate `name`'s run of `cell_hash`; returns the event set once that run has begun."""
    entered = threading.Event()
    self.gates[name] = (cell_hash, threading.Event(), entered)
    return entered


@pytest.fixture
def calls(monkeypatch) -> Calls:
  import kvjax.lab.experiments.memory as memory
  real, seen = memory.run_cell, Calls()

  def gated(c):
    me = threading.current_thread().name
    seen.append((me, c.hash()))
    if me in seen.gates and seen.gates[me][0] == c.hash():
      _, release, entered = seen.gates[me]
      entered.set()  # this thread holds the gated cell now
      assert release.wait(WAIT_S), f"{me}: the other run never finished a cell"
    rows = real(c)
    for name, (_, release, _) in seen.gates.items():
      if name != me:
        release.set()  # another thread has finished a cell
    return rows
  monkeypatch.setattr(memory, "run_cell", gated)
  return seen


def start(name: str, fn, errors: list) -> threading.Thread:
  def body():
    try:
      fn()
    except BaseException as e:  # noqa: BLE001  (reported by the test)
      errors.append((name, e))
  t = threading.Thread(target=body, name=name, daemon=True)
  t.start()
  return t


def keys(rows) -> list:
  return [(r["config_hash"], r["cell"]["row"]) for r in rows]


def test_two_concurrent_runs_into_one_folder_write_one_row_per_cell(cfg, tmp_path, calls,
                                                                   capsys):
  out = tmp_path / "out"
  _, cells = runner.expand(cfg)
  entered = calls.gate("A", cells[0].hash)
  errors, reports = [], {}
  a = start("A", lambda: reports.setdefault("A", runner.run_file(cfg, out_dir=out,
                                                                 progress=False)), errors)
  assert entered.wait(WAIT_S), "run A never reached its first cell"
  b = start("B", lambda: reports.setdefault("B", runner.run_file(cfg, out_dir=out,
                                                                 progress=False)), errors)
  a.join(WAIT_S)
  b.join(WAIT_S)
  assert not errors and not a.is_alive() and not b.is_alive()
  ran = [h for _, h in calls]
  assert sorted(ran) == sorted(c.hash for c in cells)  # every cell run once, by one run
  assert ("A", cells[0].hash) in calls and any(name == "B" for name, _ in calls)
  rows = runner.read_rows(out / "memory.jsonl")
  assert len(rows) == 8 and len(set(keys(rows))) == 8
  assert reports["A"]["ran"] + reports["B"]["ran"] == 4
  assert reports["A"]["rows"] == reports["B"]["rows"] == 8
  assert not (out / claims.LOCK_DIR).exists()  # no lock file is left behind
  assert "being run by another process" in capsys.readouterr().err  # B waited for cell 0
  assert cli.main(["results", str(out), "--format", "csv"]) == 0
  assert len(list(csv.DictReader(io.StringIO(capsys.readouterr().out)))) == 8


def test_rows_follow_the_file_when_another_run_repairs_it(cfg, tmp_path, calls, capsys):
  """Run A has written a cell (its file open) when run B starts and repairs the file (a torn
  line a killed third run left): B replaces the file, and A's next rows go to the new one."""
  out = tmp_path / "out"
  _, cells = runner.expand(cfg)
  entered = calls.gate("A", cells[1].hash)
  errors = []
  a = start("A", lambda: runner.run_file(cfg, out_dir=out, progress=False), errors)
  assert entered.wait(WAIT_S)
  with (out / "memory.jsonl").open("a") as f:
    f.write('{"experiment": "memory", "cell": {"in')  # what a killed run left
  b = start("B", lambda: runner.run_file(cfg, out_dir=out, progress=False), errors)
  a.join(WAIT_S)
  b.join(WAIT_S)
  assert not errors and not a.is_alive() and not b.is_alive()
  assert "torn" in capsys.readouterr().err  # B repaired the file
  rows = runner.read_rows(out / "memory.jsonl")
  assert len(rows) == 8 and len(set(keys(rows))) == 8
  assert sorted(h for _, h in calls) == sorted(c.hash for c in cells)


def test_a_lock_folder_tidied_between_mkdir_and_its_check_is_made_again(tmp_path, monkeypatch):
  """Another run's `tidy` removes the lock folder just after this run's mkdir found it there
  (mkdir's EEXIST, then no folder: `Path.mkdir(exist_ok=True)` raises FileExistsError): the
  lock is still taken, the folder made again, and it is released and tidied as usual."""
  import os as os_mod
  real, raced = os_mod.mkdir, []

  def mkdir(path, *a, **kw):
    if str(path).endswith(claims.LOCK_DIR) and not raced:
      raced.append(path)  # the folder "existed", and is gone by the time it is checked
      raise FileExistsError(17, "File exists", str(path))
    return real(path, *a, **kw)

  monkeypatch.setattr(os_mod, "mkdir", mkdir)
  with claims.locked(tmp_path, "x.jsonl"):
    assert (tmp_path / claims.LOCK_DIR / "x.jsonl.lock").is_file()
  claims.tidy(tmp_path)
  assert raced and not (tmp_path / claims.LOCK_DIR).exists()


def test_a_claim_whose_holder_dies_does_not_block(cfg, tmp_path, calls, capsys):
  """Another process claims cell 0 and is killed before it writes a row: the run takes the
  other cells, waits for cell 0, and runs it once its holder is gone."""
  out = tmp_path / "out"
  _, cells = runner.expand(cfg)
  lock = out / claims.LOCK_DIR / f"{cells[0].hash}.claim"
  lock.parent.mkdir(parents=True)
  holder = subprocess.Popen(
      [sys.executable, "-c", "import fcntl, os, sys, time\n"
       f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
       "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
      stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    errors, report = [], {}
    t = start("B", lambda: report.update(runner.run_file(cfg, out_dir=out, progress=False)),
              errors)
    for _ in range(WAIT_S * 20):  # until B has run every cell it could claim
      if len(calls) == 3:
        break
      t.join(0.05)
    assert sorted(h for _, h in calls) == sorted(c.hash for c in cells[1:])
    assert t.is_alive()  # waiting on cell 0
  finally:
    holder.kill()
    holder.wait()
  t.join(WAIT_S)
  assert not errors and not t.is_alive()
  assert calls[-1] == ("B", cells[0].hash) and report["ran"] == 4
  rows = runner.read_rows(out / "memory.jsonl")
  assert len(rows) == 8 and len(set(keys(rows))) == 8


def test_shards_cover_the_grid_once_and_merge_on_read(cfg, tmp_path, calls, capsys):
  out = tmp_path / "out"
  _, cells = runner.expand(cfg)
  part1 = runner.dry_run(cfg, out_dir=out, shard="1/2")["records"]
  first = next(c for c in cells if c.index == part1[0]["cell"])
  entered = calls.gate("s1", first.hash)  # shard 1 waits until shard 2 has a cell done
  errors, reports = [], {}
  s1 = start("s1", lambda: reports.setdefault(1, runner.run_file(
      cfg, out_dir=out, progress=False, shard="1/2")), errors)
  assert entered.wait(WAIT_S)
  s2 = start("s2", lambda: reports.setdefault(2, runner.run_file(
      cfg, out_dir=out, progress=False, shard="2/2")), errors)
  s1.join(WAIT_S)
  s2.join(WAIT_S)
  assert not errors and not s1.is_alive() and not s2.is_alive()
  files = sorted(p.name for p in out.glob("*.jsonl"))
  assert files == ["memory.shard-1-of-2.jsonl", "memory.shard-2-of-2.jsonl"]
  one, two = (runner.read_rows(out / f) for f in files)
  assert len(one) == len(two) == 4  # two cells each
  assert not {h for h, _ in keys(one)} & {h for h, _ in keys(two)}  # disjoint
  assert sorted(set(keys(one + two))) == sorted((c.hash, j) for c in cells for j in (0, 1))
  assert sorted(h for _, h in calls) == sorted(c.hash for c in cells)
  assert reports[1]["cells"] == reports[2]["cells"] == 2
  capsys.readouterr()
  assert cli.main(["results", str(out), "--format", "csv"]) == 0
  assert len(list(csv.DictReader(io.StringIO(capsys.readouterr().out)))) == 8
  report = runner.run_file(cfg, out_dir=out, progress=False)  # the whole grid: all done
  assert report["ran"] == 0 and report["rows"] == 8
  assert "its 2 memory files merged" in capsys.readouterr().err


def test_a_shard_skips_cells_another_file_in_the_folder_holds(cfg, tmp_path):
  out = tmp_path / "out"
  runner.run_file(cfg, out_dir=out, progress=False)
  report = runner.run_file(cfg, out_dir=out, progress=False, shard="2/2")
  assert report["ran"] == 0 and report["rows"] == 4
  assert not (out / "memory.shard-2-of-2.jsonl").exists() or \
      not runner.read_rows(out / "memory.shard-2-of-2.jsonl")


def test_long_context_keeps_the_settings_of_a_context_in_one_shard():
  import kvjax.lab.experiments.long_context as lc
  _, cells = runner.expand(ROOT / "configs" / "long_context.yaml",
                           ["grid.params.setting=[fp32, int8, int4]"])  # 4 contexts x 3
  contexts = {c.cfg.param("context") for c in cells}
  for n in (1, 2, 3, 5):
    parts = [shard.select(cells, lc, (i, n)) for i in range(1, n + 1)]
    assert sorted(c.hash for p in parts for c in p) == sorted(c.hash for c in cells)
    owner = {}
    for i, part in enumerate(parts):
      for c in part:
        assert owner.setdefault(c.cfg.param("context"), i) == i  # one part per context
    assert set(owner) == contexts
  assert [len(shard.select(cells, lc, (i, 5))) for i in range(1, 6)] == [3, 3, 3, 3, 0]


@pytest.mark.parametrize("value,needle", [
    ("0/2", "I must be between 1 and N=2"), ("3/2", "I must be between 1 and N=2"),
    ("x", "is not I/N"), ("1/0", "N, the number of parts, must be at least 1"),
    ("1/2/3", "is not I/N"), ("", "is not I/N"),
    ("-1/2", "is not I/N"), ("9" * 5000 + "/2", "is not I/N"),  # once argparse, a traceback
])
def test_bad_shard_values_are_one_line(cfg, tmp_path, capsys, value, needle):
  out = tmp_path / "out"
  for extra in ([], ["--dry-run"]):
    assert cli.main(["run", str(cfg), "--out", str(out), "--shard", value, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("kvjax: error:")
  assert not out.exists()


def test_every_reader_reads_a_cell_written_twice_once(cfg, tmp_path, capsys):
  """A folder two old runs (no locks) both wrote, plus a shard file repeating them: the
  table and the plots read each cell's rows once, the first file's. The same cell in a
  subfolder (another machine's run) is another measurement and is kept."""
  from kvjax.lab import plots
  out = tmp_path / "out"
  runner.run_file(cfg, out_dir=out, progress=False)
  data = (out / "memory.jsonl").read_bytes()
  (out / "memory.jsonl").write_bytes(data + data)
  (out / "memory.shard-1-of-2.jsonl").write_bytes(data)
  (out / "gpu").mkdir()
  (out / "gpu" / "memory.jsonl").write_bytes(data)
  from kvjax.lab.runner import results
  first = runner.read_rows(out / "memory.jsonl")[:8]
  assert results.load(out) == first + first
  rows, skipped = plots.scan_rows(out)
  assert rows["memory"] == first + first
  assert [s.split(":")[0] for s in skipped if "8 rows of cells already read" in s] == \
      ["memory.jsonl", "memory.shard-1-of-2.jsonl"]
