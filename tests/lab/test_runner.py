"""`kvjax run`: grid expansion, results rows, resume after errors and kills, bad configs.

Most tests drive the `memory` experiment on a tiny model: it builds caches without
compiling anything, so a whole grid runs in well under a second.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvjax import cli, config
from kvjax.errors import KvjaxError
from kvjax.lab import runner

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
  if experiment != "memory":  # params.contexts is memory's option; others refuse it
    text = text.replace("params: {contexts: [4, 8]}\n", "")
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
  import kvjax.lab.experiments.memory as memory

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
      import time, kvjax.lab.experiments.memory as m
      from kvjax.lab import runner
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
  runner.run_file(write_cfg(tmp_path, grid, experiment="latency"), ["params.bandwidth_mib=4"],
                  out_dir=out, progress=False)
  (row,) = runner.read_rows(out / "latency.jsonl")
  m = row["metrics"]
  assert m["ttft_s"] > 0 and m["tpot_s"] > 0 and m["tokens_per_s"] > 0
  # the step's two roofs, as the roofline rows carry them
  assert m["ideal_s"] == pytest.approx(m["step_bytes"] / m["bandwidth_Bps"])
  assert m["roof_s"] == max(m["ideal_s"], m["flops_s"]) > 0
  assert m["bound"] == ("bytes" if m["ideal_s"] >= m["flops_s"] else "flops")
  assert m["roof_fraction"] == pytest.approx(m["roof_s"] / m["tpot_s"])
  assert m["cache_bytes"] == m["closed_form_bytes"]
  assert row["workload"]["context"] == 4 + 3 and row["variant"]["variant"] == "GQA-2"
  runner.run_file(write_cfg(tmp_path, grid, experiment="cache_vs_recompute"),
                  ["params.steps=2"], out_dir=out, progress=False)
  rows = runner.read_rows(out / "cache_vs_recompute.jsonl")
  assert {r["variant"]["layout"] for r in rows} == {"none", "contiguous"}
  cached = next(r for r in rows if r["variant"]["layout"] == "contiguous")
  assert cached["metrics"]["speedup_vs_recompute"] > 0
  assert all(r["workload"]["position"] == 4 for r in rows)


def test_latency_interleaves_paired_variants_from_one_prefill(tmp_path):
  """`params.interleave`: one row per variant, timed round-robin in one cell; an evicting
  policy decodes from its compacted cache, which holds fewer bytes than the full one."""
  out = tmp_path / "out"
  text = TINY.format(experiment="latency").replace(
      "workload: {batch: 2, prompt_len: 4, gen_len: 3, repeats: 1}",
      "workload: {batch: 1, prompt_len: 16, gen_len: 3, repeats: 2}") + textwrap.dedent("""\
      params:
        interleave:
          full: {}
          window_50: {cache.policy: window, cache.ratio: 0.5}
          snapkv_50: {cache.policy: snapkv, cache.ratio: 0.5, cache.window: 2}
          int8: {cache.codec: int8}
        bandwidth_mib: 4
      """)
  path = tmp_path / "inter.yaml"
  path.write_text(text.replace("params: {contexts: [4, 8]}\n", ""))
  runner.run_file(path, out_dir=out, progress=False)
  rows = runner.read_rows(out / "latency.jsonl")
  by = {r["variant"]["setting"]: r for r in rows}
  assert list(by)[0] == "full" and set(by) == {"full", "window_50", "snapkv_50", "int8"}
  assert by["full"]["metrics"]["tpot_vs_ref"] == 1.0
  for r in rows:  # the median of per-repeat ratios, inside its interval
    m, ref = r["metrics"], by["full"]["metrics"]["tpot_s_samples"]
    paired = sorted(a / b for a, b in zip(m["tpot_s_samples"], ref))
    assert m["tpot_vs_ref"] == pytest.approx((paired[0] + paired[1]) / 2)
    assert m["tpot_vs_ref_ci95"][0] <= m["tpot_vs_ref"] <= m["tpot_vs_ref_ci95"][1]
  assert by["window_50"]["variant"]["policy"] == "window"
  assert all(r["metrics"]["tpot_s"] > 0 and r["metrics"]["repeats"] == 2 for r in rows)
  full, win = by["full"]["metrics"]["cache_bytes"], by["window_50"]["metrics"]["cache_bytes"]
  assert win < full and by["snapkv_50"]["metrics"]["cache_bytes"] < full
  assert by["int8"]["metrics"]["bytes_per_token"] < by["full"]["metrics"]["bytes_per_token"]
  # each variant's roofs from its own bytes: the int8 step reads fewer than the full one
  assert by["int8"]["metrics"]["kv_bytes"] < by["full"]["metrics"]["kv_bytes"]
  assert all(r["metrics"]["roof_fraction"] == pytest.approx(r["metrics"]["roof_s"] /
                                                            r["metrics"]["tpot_s"]) for r in rows)
  assert "load_avg" in rows[0]["env"] and len(rows[0]["env"]["load_avg"]) == 3
  # the CPU's own name: on x86, the vendor /proc/cpuinfo gives (GenuineIntel, AuthenticAMD)
  model = rows[0]["env"]["cpu_model"]
  assert isinstance(model, str) and model and model != "unknown"
  if platform.machine() in ("x86_64", "AMD64"):
    assert model.startswith(("GenuineIntel", "AuthenticAMD")), model


def test_every_shipped_config_expands():
  root = Path(__file__).resolve().parents[2] / "configs"
  for name in ("memory", "latency", "cache_vs_recompute", "quickstart"):
    for path in (root / f"{name}.yaml", root / "accel" / f"{name}.yaml"):
      base, cells = runner.expand(path)
      assert cells and base.experiment in runner.available_experiments()


# -- one codec precedence rule; rows record what ran; --dry-run; paired settings ------------
def kv(cells) -> set:
  return {(c.cfg.cache.k_codec, c.cfg.cache.v_codec) for c in cells}


@pytest.mark.parametrize("grid,sets,want", [
    # --set K/V beat a grid codec axis (the axis collapses: one cell per kv head)
    ("grid:\n  model.n_kv_heads: [2, 1]\n  cache.codec: [bf16, int8]\n",
     ["cache.k_codec=int8", "cache.v_codec=int4"], {("int8", "int4")}),
    # a grid K axis beats a grid codec axis: K int8, V from the codec axis
    ("grid:\n  cache.codec: [bf16, fp16]\n  cache.k_codec: [int8]\n", [],
     {("int8", "bf16"), ("int8", "fp16")}),
    # a YAML K codec beats a --set codec
    ("cache: {k_codec: int4}\n", ["cache.codec=int8"], {("int4", "int8")}),
    # a --set codec on a swept codec key pins it
    ("grid:\n  cache.codec: [bf16, int8]\n", ["cache.codec=fp16"], {("fp16", "fp16")}),
])
def test_explicit_kv_codecs_beat_codec_from_any_layer(tmp_path, grid, sets, want):
  _, cells = runner.expand(write_cfg(tmp_path, grid), sets)
  assert kv(cells) == want
  for c in cells:  # the recorded coordinates never name a codec that did not run
    if "cache.codec" in c.coords:
      assert c.coords["cache.codec"] in (c.cfg.cache.k_codec, c.cfg.cache.v_codec)


def test_config_load_and_cli_follow_the_same_rule(tmp_path, capsys):
  path = tmp_path / "c.yaml"
  path.write_text("cache: {codec: bf16, v_codec: int8}\n")
  cfg = config.load(path)
  assert (cfg.cache.k_codec, cfg.cache.v_codec) == ("bf16", "int8")
  cfg = config.load(path, ["cache.codec=fp16", "cache.k_codec=int4"])
  assert (cfg.cache.k_codec, cfg.cache.v_codec) == ("int4", "int8")
  rc = cli.main(["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                 "--seq-len", "8", "--set", "cache.k_codec=int8", "--codec", "int4", "--json"])
  import json
  res = json.loads(capsys.readouterr().out)
  assert rc == 0 and (res["k_codec"], res["v_codec"]) == ("int8", "int4")


def test_a_rows_config_rebuilds_the_cache_spec_that_ran(tmp_path, monkeypatch):
  """Run cells through the runner, capture the config each experiment call received, and
  rebuild the config from each written row: same cache spec, same config."""
  import kvjax.lab.experiments.memory as memory

  from kvjax import cache as cache_lib
  seen = {}
  real = memory.run_cell

  def spy(cfg):
    seen[cfg.hash()] = cfg
    return real(cfg)

  monkeypatch.setattr(memory, "run_cell", spy)
  out = tmp_path / "out"
  path = write_cfg(tmp_path, "grid:\n  cache.codec: [bf16, int8]\n  params.setting: [plain, k4]\n"
                   "  model.n_kv_heads: [2]\n")
  path.write_text(path.read_text().replace(
      "params: {contexts: [4, 8]}",
      "params: {contexts: [4, 8], settings: {plain: {}, k4: {cache.k_codec: int4}}}"))
  runner.run_file(path, ["cache.v_codec=fp16"], out_dir=out, progress=False)
  rows = runner.read_rows(out / "memory.jsonl")
  # k4 overrides K and --set V: its two codec coordinates are one cell, recorded without one
  assert len(seen) == 3 and len(rows) == 6
  for row in rows:
    ran = seen[row["config_hash"]]
    rebuilt = config.from_dict(row["config"])
    assert rebuilt == ran
    spec = lambda c: cache_lib.CacheSpec.from_config(c, 2, 8)  # noqa: E731
    assert spec(rebuilt) == spec(ran)
    if row["variant"]["setting"] == "k4":
      want_k = "int4"
      assert "cache.codec" not in row["cell"]["grid"]
    else:
      want_k = row["cell"]["grid"]["cache.codec"]
    assert (ran.cache.k_codec, ran.cache.v_codec) == (want_k, "fp16")
    assert row["variant"]["k_codec"] == want_k and row["variant"]["v_codec"] == "fp16"


def test_paired_settings_work_for_any_experiment(tmp_path, capsys):
  path = write_cfg(tmp_path, "grid:\n  params.setting: [k8v4, kivi]\n")
  path.write_text(path.read_text().replace(
      "params: {contexts: [4, 8]}",
      "params:\n  contexts: [8]\n  settings:\n"
      "    k8v4: {cache.k_codec: int8, cache.v_codec: int4}\n"
      "    kivi: {cache.codec: int2, cache.k_axis: channel, cache.group_size: 4,"
      " cache.residual: 4}\n"))
  _, cells = runner.expand(path)
  got = {c.cfg.param("setting"): c.cfg.cache for c in cells}
  assert (got["k8v4"].k_codec, got["k8v4"].v_codec) == ("int8", "int4")
  assert (got["kivi"].k_codec, got["kivi"].k_axis, got["kivi"].residual) == ("int2", "channel", 4)
  assert all(c.cfg.param("settings") is None for c in cells)  # the table is not in the row
  _, cells = runner.expand(path, ["cache.residual=8"])  # --set pins over a setting
  assert next(c for c in cells if c.cfg.param("setting") == "kivi").cfg.cache.residual == 8
  out = tmp_path / "out"
  capsys.readouterr()
  runner.run_file(path, out_dir=out, progress=False)
  assert {r["variant"]["setting"] for r in runner.read_rows(out / "memory.jsonl")} == \
      {"k8v4", "kivi"}
  table = capsys.readouterr().out  # the summary names the setting, not just its codec
  assert "k8v4" in table and "kivi" in table
  with pytest.raises(KvjaxError, match="unknown params.setting 'nope'.*known: k8v4, kivi"):
    runner.expand(path, ["grid.params.setting=[nope]"])


def test_dry_run_lists_resolved_cells_and_runs_nothing(tmp_path, capsys):
  path = write_cfg(tmp_path, "grid:\n  model.n_kv_heads: [2, 1]\n  cache.codec: [bf16, int8]\n")
  out = tmp_path / "out"
  rc = cli.main(["run", str(path), "--out", str(out), "--dry-run", "--set", "cache.k_codec=int8",
                 "--set", "cache.v_codec=int4", "--set", "cache.layout=paged"])
  text, err = capsys.readouterr()
  assert rc == 0 and not out.exists()
  lines_ = text.strip().splitlines()
  assert "2 cells" in lines_[0] and "nothing run" in lines_[0]
  head = lines_[1].split()
  for col in ("k_codec", "v_codec", "k_axis", "group_size", "residual", "layout", "status"):
    assert col in head
  body = [dict(zip(head, line.split())) for line in lines_[3:]]
  assert [(b["variant"], b["k_codec"], b["v_codec"], b["layout"]) for b in body] == \
      [("GQA-2", "int8", "int4", "paged"), ("MQA", "int8", "int4", "paged")]
  assert "cache.codec axis has no effect" in err
  runner.run_file(path, out_dir=out, progress=False)  # a finished cell is listed as done
  cli.main(["run", str(path), "--out", str(out), "--dry-run"])
  text = capsys.readouterr().out
  assert "4 cells (4 cells already in" in text and "to run" not in text


def test_a_row_the_experiment_named_keeps_its_name_beside_the_cells_setting(tmp_path):
  """A cell chosen by params.setting whose experiment names its own rows (interleaved
  variants, each row one of them) keeps the rows' names; an unnamed row takes the cell's."""
  import json
  import types
  from kvjax.lab.runner import grid, run
  cfg = config.from_dict({"params": {"setting": "b1_8k"}})
  rows = [{"variant": {"variant": "MHA", "setting": "int8"}, "workload": {}, "metrics": {"x": 1.0}},
          {"variant": {"variant": "MHA", "setting": ""}, "workload": {}, "metrics": {"x": 2.0}},
          {"variant": {"variant": "MHA"}, "workload": {}, "metrics": {"x": 3.0}}]
  module = types.SimpleNamespace(run_cell=lambda c: rows)
  lines = run._run_cell(module, "fake", grid.Cell(0, {"params.setting": "b1_8k"}, cfg), 1,
                        tmp_path)
  assert [json.loads(line)["variant"]["setting"] for line in lines] == ["int8", "b1_8k", "b1_8k"]
