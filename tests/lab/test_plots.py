"""Plots (kvjax.lab.plots, `kvjax plot`): from a small results folder, every experiment's plots are written as
non-empty PNG and SVG files, and `plot_all` keeps different configs apart.

Memory rows come from a real tiny run (no compilation, fast); timing rows are built in
the results schema with made-up times (plots only read rows, so the shape is what counts).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from kvjax.errors import KvjaxError
from kvjax.lab import plots, runner

ROOT = Path(__file__).resolve().parents[2]


def timing_row(experiment, variant, codec, layout, workload, tpot, name="tiny"):
  kv = {"MHA": 4, "GQA-2": 2, "MQA": 1}[variant]
  return {
      "experiment": experiment, "config_hash": f"{variant}{codec}{layout}{workload}",
      "cell": {"index": 0, "of": 1, "row": 0, "rows": 1, "grid": {}},
      "variant": {"variant": variant, "kv_heads": kv, "k_codec": codec, "v_codec": codec,
                  "codec": codec, "layout": layout},
      "workload": workload,
      "metrics": {"ttft_s": 10 * tpot, "ttft_s_iqr": tpot, "tpot_s": tpot,
                  "tpot_s_iqr": tpot / 10, "tokens_per_s": workload.get("batch", 1) / tpot,
                  "cache_bytes": 1000 * kv, "bytes_per_token": 64 * kv,
                  "speedup_vs_recompute": 3.0 if layout == "contiguous" else None},
      "config": {"name": name, "model": {"n_layers": 1, "d_model": 32, "n_heads": 4}},
      "env": {"backend": "cpu", "device_kind": "cpu"},
  }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
  folder = tmp_path_factory.mktemp("results")
  cfg = folder / "memory.yaml"
  cfg.write_text(
      "name: mem\nexperiment: memory\n"
      "model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4}\n"
      "grid: {model.n_kv_heads: [4, 1], cache.codec: [fp32, bf16]}\n"
      "params: {contexts: [8, 64], shapes: [llama3-8b], concurrency_contexts: [1024, 4096]}\n")
  runner.run_file(cfg, out_dir=folder / "memory", progress=False)
  rows = []
  for v in ("MHA", "GQA-2", "MQA"):
    for c in ("bf16", "int8"):
      for b in (1, 4):
        for ctx in (128, 512):
          rows.append(timing_row("latency", v, c, "contiguous",
                                 {"batch": b, "prompt_len": ctx - 16, "gen_len": 16,
                                  "context": ctx}, 1e-3 * ctx / 128 / (2 if v == "MQA" else 1)))
  for lay in ("none", "contiguous"):
    for p in (16, 32, 64):
      rows.append(timing_row("cache_vs_recompute", "MHA", "bf16", lay,
                             {"position": p, "capacity": p + 5, "batch": 1},
                             1e-4 * (p if lay == "none" else 1)))
  (folder / "timing").mkdir()
  (folder / "timing" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                                + '{"torn": ')
  return folder


def test_plot_all_writes_non_empty_png_and_svg_per_experiment(results, tmp_path):
  paths = plots.plot_all(results, tmp_path / "plots")
  names = {p.name for p in paths}
  for stem in ("memory_bytes_vs_context", "memory_bytes_per_token", "memory_max_concurrency",
               "latency_tpot_vs_context", "latency_ttft_vs_context",
               "latency_throughput_vs_batch", "latency_variants", "cache_vs_recompute_tpot",
               "cache_vs_recompute_speedup", "cache_vs_recompute_total"):
    assert {f"{stem}.png", f"{stem}.svg"} <= names, stem
  for p in paths:
    assert p.is_file() and p.stat().st_size > 1000
    if p.suffix == ".png":
      assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
      assert b"<svg" in p.read_bytes()[:2000]


def test_one_context_still_gives_the_variant_bars(results, tmp_path):
  from kvjax.lab.plots import latency

  rows = [r for r in plots.load_rows(results)["latency"] if r["workload"]["context"] == 512
          and r["workload"]["batch"] == 4]
  paths = latency.plot(rows, tmp_path)
  assert sorted(p.name for p in paths) == ["latency_variants.png", "latency_variants.svg"]


def test_rows_of_two_configs_are_plotted_apart(results, tmp_path):
  other = tmp_path / "more"
  other.mkdir()
  rows = [r for r in runner.read_rows(results / "timing" / "rows.jsonl")
          if r["experiment"] == "latency" and r["workload"]["context"] == 512
          and r["workload"]["batch"] == 4]  # one context and batch: only the bar chart
  renamed = [copy.deepcopy(r) for r in rows]
  for r in renamed:
    r["config"]["name"] = "quickstart"
  (other / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + renamed))
  plots.plot_all(other, tmp_path / "plots")
  assert (tmp_path / "plots" / "tiny" / "latency_variants.png").is_file()
  assert (tmp_path / "plots" / "quickstart" / "latency_variants.png").is_file()
  gpu = copy.deepcopy(renamed)  # one config on two devices: a subfolder per device
  for r in gpu:
    r["env"] = {"backend": "gpu", "device_kind": "NVIDIA H200"}
  two = tmp_path / "two_devices"
  (two / "gpu").mkdir(parents=True)  # (another machine's run: its own folder)
  (two / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
  (two / "gpu" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gpu))
  plots.plot_all(two, tmp_path / "two")
  for where in ("quickstart/cpu", "quickstart/gpu-nvidia-h200"):
    assert (tmp_path / "two" / where / "latency_variants.png").is_file(), where


def test_plot_all_on_an_empty_folder_is_a_one_line_error(tmp_path):
  with pytest.raises(KvjaxError) as err:
    plots.plot_all(tmp_path, tmp_path / "plots")
  assert "no results rows" in str(err.value)


def test_variant_colours_are_fixed_by_name():
  from kvjax.lab.plots.style import variant_color
  assert len({variant_color(v) for v in ("MHA", "GQA-2", "GQA-4", "MQA")}) == 4
  # a variant without a fixed colour gets the same one in every process (not hash())
  import subprocess
  import sys
  code = ("from kvjax.lab.plots.style import variant_color; "
          "print(variant_color('GQA-3'), variant_color('GQA-5'))")
  seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed}, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
          for seed in ("1", "2", "3")}
  assert seen == {f"{variant_color('GQA-3')} {variant_color('GQA-5')}\n"}


def test_points_are_keyed_by_the_whole_cache_variant(results, tmp_path):
  """Two settings of one codec (int4 whole-head vs int4 groups of 8, or two named settings)
  are two lines/bars, not one overwriting the other."""
  from kvjax.lab.plots import latency
  from kvjax.lab.plots.style import cache_label

  rows = [r for r in runner.read_rows(results / "timing" / "rows.jsonl")
          if r["experiment"] == "latency" and r["variant"]["codec"] == "int8"]
  grouped = copy.deepcopy(rows)
  for r in grouped:
    r["config"]["cache"] = {"k_axis": "channel", "group_size": 8, "residual": 32}
    r["metrics"]["tpot_s"] *= 3
  named = copy.deepcopy(rows)
  for r in named:
    r["variant"]["setting"] = "kivi"
  labels = {cache_label(r) for r in rows + grouped + named}
  assert labels == {"int8", "int8 Kch g8 R32", "kivi"}
  _, codecs, _ = latency._lines(rows + grouped + named)
  assert sorted(codecs) == sorted(labels)
  paths = latency.plot(rows + grouped + named, tmp_path)
  assert any(p.name == "latency_variants.png" for p in paths)


def test_plot_all_says_what_it_skipped_and_why(tmp_path, capsys):
  folder = tmp_path / "res"
  folder.mkdir()
  good = timing_row("latency", "MHA", "bf16", "contiguous",
                    {"batch": 1, "prompt_len": 16, "gen_len": 16, "context": 32}, 1e-3)
  nomod = {**good, "experiment": "no_such_plot"}
  (folder / "rows.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(nomod) + "\n"
                                     + '{"torn": \n')
  (folder / "bench.jsonl").write_text('{"bench": "x", "speedup": 2}\n' * 3)
  paths = plots.plot_all(folder, tmp_path / "plots")
  err = capsys.readouterr().err.splitlines()
  assert any(p.name == "latency_variants.png" for p in paths)
  assert any("bench.jsonl: 3 rows that are not `kvjax run` results rows" in line for line in err)
  assert any("rows.jsonl: 1 unreadable lines" in line for line in err)
  assert any("experiment 'no_such_plot' (1 rows): no plot module" in line for line in err)
  assert len(err) == 3


def test_rows_found_and_refused_are_one_line_naming_file_row_and_why(tmp_path):
  """A folder whose rows are all malformed once said 'no results rows' on two lines; rows a
  plot cannot read (an older schema) once exited 0 with nothing drawn."""
  folder = tmp_path / "res"
  folder.mkdir()
  (folder / "x.jsonl").write_text(json.dumps({"experiment": "quality", "variant": 3,
                                              "workload": {}, "metrics": {}}) + "\n")
  with pytest.raises(KvjaxError, match=r"x.jsonl: 1 unreadable lines .*line 1: variant is "
                     "not an object") as e:
    plots.plot_all(folder, tmp_path / "plots")
  assert "\n" not in str(e.value)
  old = tmp_path / "old"
  old.mkdir()
  (old / "p.jsonl").write_text(json.dumps({"experiment": "position", "variant": {},
                                           "workload": {"task": "text_by_position"},
                                           "metrics": {}}) + "\n")
  with pytest.raises(KvjaxError, match="no plot drawn: kvjax/lab/plots/position.py cannot "
                     "read the 1 position rows") as e:
    plots.plot_all(old, tmp_path / "plots2")
  assert "\n" not in str(e.value)


def test_titles_do_not_repeat_the_device():
  from kvjax.lab.plots.style import subtitle
  row = {"config": {"model": {"n_layers": 1, "d_model": 8, "n_heads": 2}},
         "env": {"backend": "cpu", "device_kind": "cpu"}}
  assert "cpu: cpu" not in subtitle([row]) and subtitle([row]).endswith("cpu")
  row["env"] = {"backend": "gpu", "device_kind": "NVIDIA H100"}
  assert subtitle([row]).endswith("gpu: NVIDIA H100")


def test_every_docs_image_is_redrawable_or_names_its_command(tmp_path):
  """docs/img/README.md lists every image; a `rows` image is drawn from its committed rows."""
  import shutil

  img = ROOT / "docs" / "img"
  table = {}
  for line in (img / "README.md").read_text().splitlines():
    if line.startswith("| `"):
      name, source, how = [c.strip() for c in line.strip("|").split("|")]
      table[name.strip("`")] = (source, how)
  assert set(table) == {p.name for p in img.glob("*.png")}
  by_rows: dict = {}
  for name, (source, how) in table.items():
    assert source in ("rows", "command", "before"), name
    if source == "command":
      assert "kvjax run configs/" in how or how == "as above", name
    elif source == "before":  # the look before a change, beside the image redrawn since
      assert name.endswith("_before.png") and table[how.strip("`")][0] != "before", name
    else:
      by_rows.setdefault(how.strip("`"), []).append(name)
  assert by_rows
  for rows_file, names in by_rows.items():
    src = ROOT / rows_file
    assert src.is_file(), rows_file
    where = rows_file.replace("/", "_")  # two rows files may share a name (long_context)
    folder = tmp_path / where
    folder.mkdir()
    shutil.copy(src, folder / src.name)
    drawn = {p.name for p in plots.plot_all(folder, tmp_path / "out" / where)}
    assert set(names) <= drawn, (rows_file, names, drawn)


def _capture(module, monkeypatch) -> list:
  """Figures a plot module would save, kept open for inspection."""
  figs = []
  monkeypatch.setattr(module, "save", lambda fig, out_dir, stem: figs.append((stem, fig)) or [])
  return figs


def _bars(ax) -> list:
  from matplotlib.container import ErrorbarContainer
  return [c for c in ax.containers if isinstance(c, ErrorbarContainer)]


def test_quality_plots_draw_intervals_where_rows_have_them(monkeypatch, tmp_path):
  from kvjax.lab.plots import quality

  def qrow(setting, dppl, kl, ci=True):
    m = {"dppl_rel": dppl, "kl": kl, "agreement": 0.9, "bytes_per_token": 100.0}
    if ci:
      m.update(dppl_rel_ci95=[dppl - 0.002, dppl + 0.003], kl_ci95=[kl / 2, kl * 2])
    return {"experiment": "quality", "variant": {"variant": "GQA-3", "setting": setting,
                                                 "k_codec": "int4", "v_codec": "int4"},
            "workload": {"task": "text", "batch": 2, "context": 64, "chunk": 1},
            "metrics": m}

  figs = _capture(quality, monkeypatch)
  quality.plot([qrow("a", 0.01, 1e-3), qrow("b", 0.02, 2e-3, ci=False)], tmp_path)
  (_, dppl), (_, kl) = figs
  (bar,) = _bars(dppl.axes[0])  # one interval: row b is an older row without one
  (seg,) = bar.lines[2][0].get_segments()
  assert [p[0] for p in seg] == pytest.approx([0.8, 1.3])  # 100 x [0.008, 0.013]
  (kbar,) = _bars(kl.axes[0])  # row b's bar has no interval
  segs = kbar.lines[2][0].get_segments()
  assert [tuple(p[1] for p in seg) for seg in segs] == [pytest.approx((5e-4, 2e-3))]


def test_long_context_accuracy_bars_are_wilson_intervals(monkeypatch, tmp_path):
  from kvjax.lab.plots import long_context

  from kvjax.lab import intervals

  rows = []
  for s, right in (("fp32", 7), ("int4", 3)):
    for i in range(10):
      rows.append({"experiment": "long_context",
                   "variant": {"setting": s, "codec": s, "k_codec": s, "v_codec": s,
                               "model": "m"},
                   "workload": {"task": "passkey", "context": 1024, "depth": 0.5, "seed": i,
                                "key": ""},
                   "metrics": {"accuracy": float(i < right), "bytes_per_token": 100.0
                               if s == "fp32" else 20.0, "output": str(i), "answer": "1"}})
  figs = _capture(long_context, monkeypatch)
  long_context.accuracy_vs_bytes(rows, tmp_path)
  ((_, fig),) = figs
  (bar,) = _bars(fig.axes[0])
  spans = sorted(tuple(p[1] for p in seg) for seg in bar.lines[2][0].get_segments())
  assert spans == [pytest.approx(intervals.wilson(3, 10)), pytest.approx(intervals.wilson(7, 10))]


def test_kvjax_plot_command_and_api(results, tmp_path, capsys):
  """`kvjax plot` draws what plot_all draws and says how many files; no folder or no rows is
  one line and exit 2; `kvjax.plot` is the same call, raising KvjaxError."""
  import kvjax
  from kvjax import cli

  sub = tmp_path / "res"
  sub.mkdir()
  rows = [r for r in runner.read_rows(results / "timing" / "rows.jsonl")
          if r["experiment"] == "latency" and r["workload"]["context"] == 512
          and r["workload"]["batch"] == 4]  # one figure: the bars
  (sub / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert cli.main(["plot", str(sub), "--out", str(tmp_path / "a")]) == 0
  out = capsys.readouterr().out
  assert "latency_variants.png" in out and out.strip().endswith(f"files in {tmp_path / 'a'}")
  paths = kvjax.plot(sub, out=tmp_path / "b", quiet=True)
  assert sorted(p.name for p in paths) == sorted(p.name for p in (tmp_path / "a").iterdir())
  for where in (tmp_path / "nothing", tmp_path / "empty"):
    (tmp_path / "empty").mkdir(exist_ok=True)
    assert cli.main(["plot", str(where)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvjax: error: no results"), err
    with pytest.raises(KvjaxError, match="no results"):
      kvjax.plot(where, out=tmp_path / "c")
