"""`kvjax run`: grid expansion, results rows, resume after errors and kills, bad configs.

Most tests drive the `memory` experiment on a tiny model: it builds caches without
compiling anything, so a whole grid runs in well under a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvjax import cli, config, runner
from kvjax.errors import KvjaxError

TINY = """\
name: tiny
experiment: {experiment}
model: {{vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4}}
workload: {{batch: 2, prompt_len: 4, gen_len: 3, repeats: 1}}
params: {{contexts: [4, 8]}}
"""


def write_cfg(tmp_path: Path, grid: str | None = "", experiment: str = "memory",
              name: str = "tiny.yaml") -> Path:
  text = TINY.format(experiment=experiment)
  if grid is None:
    pass
  elif grid == "":
    text += "grid:\n  model.n_kv_heads: [4, 2, 1]\n  cache.codec: [fp32, bf16]\n"
  else:
    text += textwrap.dedent(grid)
  path = tmp_path / name
  path.write_text(text)
  return path


def lines(path: Path) -> list[str]:
  return [line for line in path.read_text().splitlines() if line.strip()]


def test_grid_is_a_cartesian_product_over_dotted_keys(tmp_path):
  base, cells = runner.expand(write_cfg(tmp_path))
  assert len(cells) == 6
  got = {(c.cfg.model.n_kv_heads, c.cfg.cache.k_codec, c.cfg.cache.v_codec) for c in cells}
  assert got == {(k, c, c) for k in (4, 2, 1) for c in ("fp32", "bf16")}
  assert len({c.hash for c in cells}) == 6
  assert all(c.cfg.grid == () and c.cfg.model.d_model == 32 for c in cells)
  assert [c.coords for c in cells][:2] == [{"model.n_kv_heads": 4, "cache.codec": "fp32"},
                                           {"model.n_kv_heads": 4, "cache.codec": "bf16"}]


def test_a_base_valid_only_per_cell_expands_and_bad_cells_still_fail(tmp_path):
  """The YAML's own n_heads/n_kv_heads (8/3) are inconsistent; every cell fixes them."""
  path = tmp_path / "heads.yaml"
  path.write_text(TINY.format(experiment="memory").replace("n_heads: 4, n_kv_heads: 4",
                                                             "n_heads: 8, n_kv_heads: 3")
                  + "grid:\n  model.n_kv_heads: [8, 2, 1]\n")
  _, cells = runner.expand(path)
  assert [c.cfg.model.n_kv_heads for c in cells] == [8, 2, 1]
  path.write_text(path.read_text().replace("[8, 2, 1]", "[8, 3]"))
  with pytest.raises(KvjaxError, match="not divisible"):
    runner.expand(path)


def test_overrides_pin_replace_and_add_axes(tmp_path):
  path = write_cfg(tmp_path)
  _, cells = runner.expand(path, ["model.n_kv_heads=2"])  # pins a swept key
  assert {c.cfg.model.n_kv_heads for c in cells} == {2} and len(cells) == 2
  _, cells = runner.expand(path, ["grid.cache.codec=[fp16]", "grid.params.contexts=[[16]]"])
  assert {c.cfg.cache.k_codec for c in cells} == {"fp16"}
  assert all(c.cfg.param("contexts") == (16,) for c in cells) and len(cells) == 3
  _, cells = runner.expand(path, ["workload.batch=3"])
  assert {c.cfg.workload.batch for c in cells} == {3}


def test_a_value_listed_twice_is_one_cell_and_no_grid_is_one_cell(tmp_path):
  _, cells = runner.expand(write_cfg(tmp_path, "grid:\n  cache.codec: [fp32, fp32]\n"))
  assert len(cells) == 1
  _, cells = runner.expand(write_cfg(tmp_path, None))
  assert len(cells) == 1 and cells[0].coords == {}


def test_rows_follow_the_results_contract(tmp_path, capsys):
  out = tmp_path / "out"
  report = runner.run_file(write_cfg(tmp_path), out_dir=out, progress=False)
  rows = runner.read_rows(out / "memory.jsonl")
  assert report["rows"] == len(rows) == 6 * 2  # 6 cells x 2 contexts
  for row in rows:
    assert {"experiment", "config", "config_hash", "cell", "variant", "workload", "metrics",
            "env"} <= set(row)
    assert row["experiment"] == "memory"
    assert {"jax", "backend", "device_kind", "device_count", "git_commit", "time"} <= set(row["env"])
    assert {"variant", "kv_heads", "k_codec", "v_codec", "layout"} <= set(row["variant"])
    # the stored config reproduces the cell: same hash when loaded back
    assert config.from_dict(row["config"]).hash() == row["config_hash"]
    m = row["metrics"]
    assert m["cache_bytes"] == m["closed_form_bytes"] > 0
  table = capsys.readouterr().out
  assert "bytes_per_token" in table and "MQA" in table and "GQA-2" in table


def test_rerun_skips_finished_cells_and_extends_a_grown_grid(tmp_path):
  out = tmp_path / "out"
  path = write_cfg(tmp_path)
  runner.run_file(path, out_dir=out, progress=False)
  before = lines(out / "memory.jsonl")
  report = runner.run_file(path, out_dir=out, progress=False)
  assert report["ran"] == 0 and lines(out / "memory.jsonl") == before
  report = runner.run_file(path, ["grid.cache.codec=[fp32, bf16, fp16]"], out_dir=out,
                           progress=False)
  assert report["ran"] == 3 and report["cells"] == 9
  assert len(lines(out / "memory.jsonl")) == 18


def test_an_error_mid_grid_keeps_finished_rows_and_resume_completes(tmp_path, monkeypatch):
  import experiments.memory as memory

  out = tmp_path / "out"
  path = write_cfg(tmp_path)
  real, calls = memory.run_cell, []

  def flaky(cfg):
    calls.append(cfg)
    if len(calls) == 3:
      raise RuntimeError("injected failure")
    return real(cfg)

  monkeypatch.setattr(memory, "run_cell", flaky)
  with pytest.raises(RuntimeError):
    runner.run_file(path, out_dir=out, progress=False)
  assert len(runner.read_rows(out / "memory.jsonl")) == 2 * 2  # two finished cells
  monkeypatch.setattr(memory, "run_cell", real)
  report = runner.run_file(path, out_dir=out, progress=False)
  assert report["ran"] == 4
  rows = runner.read_rows(out / "memory.jsonl")
  keys = [(r["config_hash"], r["cell"]["row"]) for r in rows]
  assert len(keys) == len(set(keys)) == 12


def test_a_torn_line_and_a_half_cell_are_dropped_and_rerun(tmp_path):
  out = tmp_path / "out"
  path = write_cfg(tmp_path)
  runner.run_file(path, out_dir=out, progress=False)
  good = lines(out / "memory.jsonl")
  # What a kill mid-cell leaves: the last cell's second row missing, a torn line at the end.
  (out / "memory.jsonl").write_text("\n".join(good[:-1]) + "\n" + good[-1][:40])
  report = runner.run_file(path, out_dir=out, progress=False)
  assert report["ran"] == 1
  rows = runner.read_rows(out / "memory.jsonl")
  assert len(lines(out / "memory.jsonl")) == len(rows) == 12
  keys = [(r["config_hash"], r["cell"]["row"]) for r in rows]
  assert len(set(keys)) == 12


def test_a_killed_process_keeps_finished_rows(tmp_path):
  """SIGKILL a real run mid-grid (its third cell hangs); finished cells survive, resume ends."""
  out = tmp_path / "out"
  path = write_cfg(tmp_path)
  script = textwrap.dedent(f"""
      import time, experiments.memory as m
      from kvjax import runner
      real, n = m.run_cell, [0]
      def slow(cfg):
        n[0] += 1
        if n[0] == 3:
          time.sleep(120)
        return real(cfg)
      m.run_cell = slow
      runner.run_file({str(path)!r}, out_dir={str(out)!r}, progress=False)
  """)
  proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
  try:
    deadline = time.time() + 60
    results = out / "memory.jsonl"
    while time.time() < deadline and (not results.exists() or len(lines(results)) < 4):
      time.sleep(0.1)
    assert len(lines(results)) == 4, "the run did not finish two cells in time"
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  report = runner.run_file(path, out_dir=out, progress=False)
  assert report["ran"] == 4 and len(runner.read_rows(out / "memory.jsonl")) == 12


@pytest.mark.parametrize("grid,experiment,message", [
    ("grid:\n  cache.codec: [fp32]\n", "no_such_experiment", "unknown experiment"),
    ("grid:\n  cache.colour: [red]\n", "memory", "unknown grid key 'cache.colour'"),
    ("grid: {}\n", "memory", "grid: is empty"),
    ("grid:\n", "memory", "grid: is empty"),
    ("grid:\n  cache.codec: []\n", "memory", "has no values"),
    ("grid:\n  cache.codec: [fp32, nope]\n", "memory", "unknown codec 'nope'"),
    ("grid:\n  model.n_kv_heads: [3]\n", "memory", "not divisible"),
    ("grid:\n  params.contexts: [[0]]\n", "memory", "params.contexts must be positive"),
])
def test_bad_configs_fail_with_one_line_and_lose_no_rows(tmp_path, grid, experiment, message):
  out = tmp_path / "out"
  runner.run_file(write_cfg(tmp_path, name="good.yaml"), out_dir=out, progress=False)
  before = (out / "memory.jsonl").read_text()
  bad = write_cfg(tmp_path, grid, experiment=experiment, name="bad.yaml")
  with pytest.raises(KvjaxError) as err:
    runner.run_file(bad, out_dir=out, progress=False)
  assert message in str(err.value) and "\n" not in str(err.value)
  assert (out / "memory.jsonl").read_text() == before


def test_cli_reports_a_bad_config_as_one_line(tmp_path, capsys):
  bad = write_cfg(tmp_path, "grid:\n  cache.codec: [fp32]\n", experiment="nope")
  assert cli.main(["run", str(bad), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("kvjax: error: unknown experiment 'nope'") and "\n" not in err
  assert "memory" in err and "latency" in err  # lists what exists


def test_timed_experiments_write_timing_rows(tmp_path):
  """One tiny compiled cell each of latency and cache_vs_recompute."""
  out = tmp_path / "out"
  grid = "grid:\n  model.n_kv_heads: [2]\n"
  runner.run_file(write_cfg(tmp_path, grid, experiment="latency"), out_dir=out, progress=False)
  (row,) = runner.read_rows(out / "latency.jsonl")
  m = row["metrics"]
  assert m["ttft_s"] > 0 and m["tpot_s"] > 0 and m["tokens_per_s"] > 0
  assert m["cache_bytes"] == m["closed_form_bytes"]
  assert row["workload"]["context"] == 4 + 3 and row["variant"]["variant"] == "GQA-2"
  runner.run_file(write_cfg(tmp_path, grid, experiment="cache_vs_recompute"),
                  ["params.steps=2"], out_dir=out, progress=False)
  rows = runner.read_rows(out / "cache_vs_recompute.jsonl")
  assert {r["variant"]["layout"] for r in rows} == {"none", "contiguous"}
  cached = next(r for r in rows if r["variant"]["layout"] == "contiguous")
  assert cached["metrics"]["speedup_vs_recompute"] > 0
  assert all(r["workload"]["position"] == 4 for r in rows)


def test_every_shipped_config_expands():
  root = Path(__file__).resolve().parent.parent / "configs"
  for name in ("memory", "latency", "cache_vs_recompute", "quickstart"):
    for path in (root / f"{name}.yaml", root / "accel" / f"{name}.yaml"):
      base, cells = runner.expand(path)
      assert cells and base.experiment in runner.available_experiments()
