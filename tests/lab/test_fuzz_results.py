"""Corrupt results files: a corrupt line is named by its file and line number and skipped
with one warning line (its cell runs again on resume), never a traceback, and the other rows
stay intact; with no row left, `kvjax results` exits 2 with one line.

The fuzz harness (hypothesis, derandomized) applies random byte flips, insertions,
deletions, truncations and wrong-typed fields to a small results file (two cells of two
rows), then reads it with `kvjax results` and resumes it with `kvjax run`, in process, both
for checksummed rows and for rows written before checksums (checked by shape only, so a
changed digit there goes unseen: those cases assert no traceback and a complete resume). It
prints how many cases took each outcome and fails if only one outcome was ever seen.
`KVJAX_FUZZ_EXAMPLES=500` runs a longer campaign.
"""

from __future__ import annotations

import collections
import csv
import io
import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvjax import cli
from kvjax.lab import runner
from kvjax.lab.runner import results
from test_shared_folder import CFG as SHARED_CFG

# The shared-folder tests' tiny `memory` grid, without its codec axis.
CFG = SHARED_CFG.replace(", cache.codec: [fp32, int8]", "")
assert CFG != SHARED_CFG
EXAMPLES = int(os.environ.get("KVJAX_FUZZ_EXAMPLES", "30"))
FUZZ = settings(derandomize=True, deadline=None, max_examples=EXAMPLES, database=None)
_CRC = re.compile(rb', "crc32": "[0-9a-f]{8}"\}$')


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """(config path, the results file's bytes, each cell's rows as its run_cell returned them)."""
  folder = tmp_path_factory.mktemp("fuzz")
  cfg = folder / "tiny.yaml"
  cfg.write_text(CFG)
  runner.run_file(cfg, out_dir=folder / "out", progress=False)
  data = (folder / "out" / "memory.jsonl").read_bytes()
  canned: dict = {}
  for row in runner.read_rows(folder / "out" / "memory.jsonl"):
    canned.setdefault(row["config_hash"], []).append(
        {k: row[k] for k in ("variant", "workload", "metrics")})
  return cfg, data, canned


@pytest.fixture
def canned_cells(base, monkeypatch):
  """memory's run_cell replaced by the rows it returned (the runner is what is fuzzed);
  returns the list of cells it is asked to run."""
  import kvjax.lab.experiments.memory as memory
  asked = []

  def run_cell(cfg):
    asked.append(cfg.hash())
    return [dict(r) for r in base[2][cfg.hash()]]
  monkeypatch.setattr(memory, "run_cell", run_cell)
  return asked


@pytest.fixture
def expand_once(monkeypatch):
  """The grid expanded once (the config is not what is fuzzed, and expanding is most of a
  resume's time)."""
  from kvjax.lab.runner import run
  real, memo = run.expand, {}

  def expand(path, overrides=None):
    key = (str(path), tuple(overrides or ()))
    if key not in memo:
      memo[key] = real(path, overrides)
    return memo[key]
  monkeypatch.setattr(run, "expand", expand)


def legacy(data: bytes) -> bytes:
  """The same rows as an older kvjax wrote them: no checksum."""
  return b"".join(_CRC.sub(b"}", line) + b"\n" for line in data.splitlines())


def edit(data: bytes, op: str, pos: int, byte: int) -> bytes:
  lines = data.splitlines(keepends=True)
  i = pos % len(data)
  if op == "flip":
    return data[:i] + bytes([byte if byte != data[i] else (byte + 1) % 256]) + data[i + 1:]
  if op == "insert":
    return data[:i] + bytes([byte]) + data[i:]
  if op == "delete":
    return data[:i] + data[i + 1:]
  if op == "truncate":
    return data[:i]
  k = pos % len(lines)  # "retype": a field of the wrong type in one row
  field = [b'"rows": 2', b'"cell": {', b'"metrics": {', b'"row": 1', b'"config_hash": "'][byte % 5]
  bad = {b'"rows": 2': b'"rows": "2"', b'"cell": {': b'"cell": 7, "c": {',
         b'"metrics": {': b'"metrics": [], "m": {', b'"row": 1': b'"row": 5',
         b'"config_hash": "': b'"config_hash": 3, "h": "'}[field]
  lines[k] = lines[k].replace(field, bad, 1)
  return b"".join(lines)


EDITS = st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "retype"]),
                  st.integers(0, 10 ** 6), st.integers(0, 255))


def intact_lines(original: bytes, data: bytes) -> tuple[list[bytes], bool]:
  """(the original lines still whole in `data`, whether `data` has any other non-blank
  line)."""
  whole = set(original.splitlines())
  lines = [line for line in data.split(b"\n") if line.strip()]
  return [line for line in lines if line in whole], any(line not in whole for line in lines)


def stderr_lines(capsys) -> tuple[str, list[str]]:
  out, err = capsys.readouterr()
  return out, [line for line in err.replace("\r", "\n").splitlines() if line.strip()]


# -- the known cases, one each -------------------------------------------------------------
def test_a_non_utf8_byte_is_named_and_skipped_by_results_and_resume(base, canned_cells,
                                                                   tmp_path, capsys):
  cfg, data, _ = base
  lines = data.splitlines(keepends=True)
  out = tmp_path / "out"
  out.mkdir()
  bad = lines[1][:30] + b"\xff" + lines[1][31:]
  (out / "memory.jsonl").write_bytes(lines[0] + bad + b"".join(lines[2:]))
  assert cli.main(["results", str(out / "memory.jsonl"), "--format", "csv"]) == 0
  text, err = stderr_lines(capsys)
  assert len(list(csv.DictReader(io.StringIO(text)))) == 3
  assert len(err) == 1 and err[0].startswith("kvjax: warning:") and "memory.jsonl" in err[0]
  assert "line 2: not UTF-8 text" in err[0]
  assert cli.main(["run", str(cfg), "--out", str(out)]) == 0
  _, err = stderr_lines(capsys)
  warned = [line for line in err if line.startswith("kvjax: warning:")]
  assert len(warned) == 1 and "line 2: not UTF-8 text" in warned[0]
  assert "1 rows of unfinished or repeated cells" in warned[0]  # line 1, the cell's other row
  assert len(canned_cells) == 1  # only the damaged cell ran again
  rows = runner.read_rows(out / "memory.jsonl")
  assert len(rows) == 4 and len({(r["config_hash"], r["cell"]["row"]) for r in rows}) == 4
  assert (out / "memory.jsonl.rejected").read_bytes() == lines[0] + bad


def test_rows_of_the_wrong_shape_are_skipped_not_raised(base, tmp_path, capsys):
  _, data, _ = base
  old = legacy(data).splitlines(keepends=True)
  old[2] = old[2].replace(b'"rows": 2', b'"rows": "2"')
  path = tmp_path / "memory.jsonl"
  path.write_bytes(b"".join(old))
  rows = runner.read_rows(path)
  assert len(rows) == 3
  odd = [{"cell": 5, "config_hash": [1]}, {"cell": {"row": "0", "rows": 2}, "config_hash": "a"},
         {"config_hash": "b", "cell": {"index": 0, "of": 1, "row": 0, "rows": 1, "grid": {}}}, 7]
  assert runner.complete_rows(odd) == ([], set())  # nothing counts, nothing raises
  assert cli.main(["results", str(path)]) == 0
  _, err = stderr_lines(capsys)
  assert len(err) == 1 and "line 3: cell.rows is not an integer >= 1" in err[0]


def test_a_changed_digit_in_a_checksummed_row_is_found(base, tmp_path, capsys):
  _, data, _ = base
  lines = data.splitlines(keepends=True)
  lines[3] = lines[3].replace(b'"cache_bytes": ', b'"cache_bytes": 9', 1)
  path = tmp_path / "memory.jsonl"
  path.write_bytes(b"".join(lines))
  assert len(runner.read_rows(path)) == 3
  assert runner.scan(path).problems[0].startswith("line 4: checksum mismatch")


def test_a_file_with_no_readable_row_is_one_line(tmp_path, capsys):
  path = tmp_path / "memory.jsonl"
  path.write_bytes(b'{"experiment": "memory", "cell": \n\xff\xfe\n')
  assert cli.main(["results", str(path)]) == 2
  _, err = stderr_lines(capsys)
  assert len(err) == 1 and err[0].startswith("kvjax: error: no readable results rows")
  assert "line 1: not valid JSON" in err[0] and "line 2: not UTF-8 text" in err[0]


def test_a_file_two_old_runs_both_wrote_reads_once(base, canned_cells, tmp_path, capsys):
  """What two runs without locks left: every row twice. Readers keep the first of each;
  resume drops the repeats (kept in .rejected) and runs nothing."""
  cfg, data, _ = base
  out = tmp_path / "out"
  out.mkdir()
  (out / "memory.jsonl").write_bytes(data + data)
  assert len(results.load(out)) == 4
  assert cli.main(["run", str(cfg), "--out", str(out)]) == 0
  _, err = stderr_lines(capsys)
  assert any("dropped 4 rows of unfinished or repeated cells" in line for line in err)
  assert not canned_cells and (out / "memory.jsonl").read_bytes() == data


def test_a_summary_that_cannot_read_an_old_row_falls_back_to_the_plain_table(
    base, canned_cells, tmp_path, capsys):
  """A renamed key in a row without a checksum passes every shape check; memory's summary
  raises on it, and the run prints the plain table after one warning line instead."""
  cfg, data, _ = base
  out = tmp_path / "out"
  out.mkdir()
  (out / "memory.jsonl").write_bytes(legacy(data).replace(b'"part"', b'"pbrt"', 1))
  assert cli.main(["run", str(cfg), "--out", str(out)]) == 0
  text, err = stderr_lines(capsys)
  assert [line for line in err if "warning" in line] == [
      "kvjax: warning: the memory summary cannot read these rows (KeyError: 'part'): a row of "
      "another shape (an older kvjax's, or corrupt); the plain table follows"]
  assert "bytes_per_token" in text and not canned_cells


# -- the fuzz harness --------------------------------------------------------------------
def report(name: str, outcomes: collections.Counter) -> None:
  print(f"\n{name}: {sum(outcomes.values())} cases: " +
        ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
  assert len(outcomes) >= 2, f"{name}: every case took one outcome: {dict(outcomes)}"


def test_fuzz_kvjax_results_on_corrupt_files(base, tmp_path, capsys):
  _, data, _ = base
  outcomes: collections.Counter = collections.Counter()
  path = tmp_path / "memory.jsonl"

  @FUZZ
  @given(change=EDITS, old=st.booleans())
  @example(change=("flip", 200, 0xFF), old=False)   # one non-UTF-8 byte in row 1
  @example(change=("retype", 2, 0), old=True)       # "rows": "2" in an unchecksummed row
  @example(change=("truncate", len(data) - 7, 0), old=False)  # the last line torn
  @example(change=("flip", len(data.splitlines()[0]), ord("x")), old=False)  # a lost newline
  def case(change, old):
    original = legacy(data) if old else data
    broken = edit(original, *change)
    path.write_bytes(broken)
    capsys.readouterr()
    rc = cli.main(["results", str(path), "--format", "csv"])
    text, err = stderr_lines(capsys)
    assert "Traceback" not in text + "".join(err)
    intact, damaged = intact_lines(original, broken)
    if rc == 2:
      assert len(err) == 1 and err[0].startswith("kvjax: error: no readable results rows")
      assert not intact
      outcomes["exit 2, one line"] += 1
      return
    assert rc == 0 and len(err) <= 1 and all(line.startswith("kvjax: warning:") for line in err)
    got = list(csv.DictReader(io.StringIO(text)))
    if old:  # shape checks only: a changed row may still read; the intact ones all do
      assert len(intact) <= len(got) <= len(original.splitlines())
    else:
      assert bool(err) == damaged  # warned exactly when a line changed
      assert results.load(path) == [json.loads(line) for line in intact]
      capsys.readouterr()
      assert len(got) == len(intact)
    outcomes["warning, others intact" if err else "clean"] += 1

  case()
  report("kvjax results", outcomes)


def test_fuzz_resume_on_corrupt_files(base, canned_cells, expand_once, tmp_path, capsys):
  cfg, data, canned = base
  outcomes: collections.Counter = collections.Counter()
  n = [0]

  @FUZZ
  @given(change=EDITS, old=st.booleans())
  @example(change=("flip", 200, 0xFF), old=False)
  @example(change=("retype", 2, 0), old=True)
  @example(change=("truncate", len(data) - 7, 0), old=False)
  @example(change=("delete", len(data.splitlines()[0]), 0), old=True)
  def case(change, old):
    original = legacy(data) if old else data
    broken = edit(original, *change)
    n[0] += 1
    out = tmp_path / f"case{n[0]}"
    out.mkdir()
    (out / "memory.jsonl").write_bytes(broken)
    canned_cells.clear()
    capsys.readouterr()
    rc = cli.main(["run", str(cfg), "--out", str(out)])
    text, err = stderr_lines(capsys)
    assert rc == 0 and "Traceback" not in text + "".join(err)
    warned = [line for line in err if line.startswith("kvjax: warning:")]
    assert len(warned) <= (2 if old else 1)
    after = (out / "memory.jsonl").read_bytes()
    rows = runner.read_rows(out / "memory.jsonl")
    assert len(after.splitlines()) == len(rows) == 4
    assert {(r["config_hash"], r["cell"]["row"]) for r in rows} == \
        {(h, j) for h in canned for j in (0, 1)}
    intact, damaged = intact_lines(original, broken)
    whole = {json.loads(line)["config_hash"] for line in intact}
    whole = {h for h in whole if sum(json.loads(x)["config_hash"] == h for x in intact) == 2}
    for line in intact:  # a cell whose rows all survived is kept as it was, not rerun
      if json.loads(line)["config_hash"] in whole:
        assert line in after.splitlines()
    if not old:
      assert sorted(canned_cells) == sorted(set(canned) - whole)
      assert bool(warned) == (damaged or len(intact) > 2 * len(whole))
    outcomes[f"resumed, {len(canned_cells)} cells rerun" + (", warned" if warned else "")] += 1

  case()
  report("kvjax run (resume)", outcomes)


def test_the_committed_results_read_without_a_warning(capsys):
  """Every committed row (written before checksums, or with them) passes the checks: no
  false alarm on real files, and the same rows as a plain JSON read of the run rows."""
  root = Path(__file__).resolve().parents[2] / "results"
  rows = results.load(root)
  assert capsys.readouterr().err == ""
  plain = [json.loads(line) for p in sorted(root.rglob("*.jsonl"))
           for line in p.read_text().splitlines() if line.strip()]
  assert len(rows) == sum("experiment" in r and "metrics" in r for r in plain)
