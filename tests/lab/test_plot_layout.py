"""Plots that read at a glance: every plot module draws from a small synthetic results folder
into its own fixed canvas with no text outside it (a clipped title, label, legend or
colour-bar label fails, naming the text), settings of one figure never share a marker, a
codec family shares one colour, legends name the model, a single context is drawn as bars
with the ratio printed.

The rows are made up in the results schema (plots read rows only); their numbers are
arbitrary, their fields the ones each plot reads.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import matplotlib
import matplotlib.figure
import matplotlib.pyplot as plt
import pytest

from kvjax.lab import plots
from kvjax.lab.plots import style, texts

PKG = Path(plots.__file__).resolve().parent
SETTINGS = {"fp32": "fp32", "bf16": "bf16", "int8": "int8", "int4": "int4",
            "int4_kivi": "int4", "int4_rot": "int4", "int2": "int2", "nf4": "nf4"}
MODELS = {"MHA": 4, "GQA-2": 2}
BPT = {"fp32": 4096, "bf16": 2048, "int8": 1100, "int4": 600, "int4_kivi": 640,
       "int4_rot": 610, "int2": 340, "nf4": 620}


_HASH = itertools.count()  # every made-up row its own cell (readers keep one row a cell)


def row(experiment, variant, setting, workload, metrics, config="cfg", **extra):
  codec = SETTINGS.get(setting, setting)
  return {"experiment": experiment, "config_hash": f"{experiment}-{next(_HASH)}",
          "cell": {"index": 0, "of": 1, "row": 0, "rows": 1, "grid": {}},
          "variant": {"variant": variant, "heads": 4, "kv_heads": MODELS.get(variant, 1),
                      "codec": codec, "k_codec": codec, "v_codec": codec, "layout": "contiguous",
                      "setting": setting, "model": "toy", **extra},
          "workload": workload,
          "metrics": {"bytes_per_token": BPT.get(setting, 500),
                      "bytes_per_token_asymptotic": 0.8 * BPT.get(setting, 500), **metrics},
          "config": {"name": config, "model": {"n_layers": 2, "d_model": 64, "n_heads": 4,
                                               "vocab_size": 256}},
          "env": {"backend": "cpu", "device_kind": "cpu"}}


def synthetic_rows() -> list[dict]:
  rows = []
  for i, (v, s) in enumerate((v, s) for v in MODELS for s in SETTINGS):
    q = {"ppl": 10.0, "ppl_ref": 10.0, "dppl_rel": 0.002 * i, "kl": 1e-4 * (i + 1) if s != "fp32" else 0.0,
         "kl_ci95": [5e-5 * (i + 1), 2e-4 * (i + 1)], "dppl_rel_ci95": [0.0, 0.004 * i],
         "agreement": 0.9}
    rows.append(row("quality", v, s, {"task": "text", "batch": 2, "context": 64, "chunk": 8}, q))
    for ctx in (256, 512):
      rows.append(row("quality", v, s, {"task": "recall", "context": ctx, "n_pairs": 8},
                      {"recall": 0.5, "recall_ref": 0.6}))
      for config in ("roof", "roof1") if ctx == 512 else ("roof",):
        rows.append(row("roofline", v, s, {"batch": 4, "context": ctx},
                        {"roofline_fraction": 0.3 + 0.01 * i, "tpot_s": 1e-3 * (i + 1),
                         "bandwidth_Bps": 3e10}, config=config, attention="grouped"))
      rows.append(row("latency", v, s, {"batch": 2, "context": ctx, "prompt_len": ctx - 8,
                                         "gen_len": 8},
                      {"tpot_s": 1e-3 * (i + 1), "tpot_s_iqr": 1e-4, "ttft_s": 1e-2,
                       "ttft_s_iqr": 1e-3, "tokens_per_s": 100.0}))
    rows.append(row("budget", v, s, {"context": 1024},
                    {"tokens_per_s": 50.0 + i, "tokens_per_s_ci95": [45.0 + i, 55.0 + i],
                     "batch": 8 - i % 4, "budget_bytes": 2 ** 30}))
  for s in ("fp32", "int8", "int4_kivi", "int2"):  # long_context: a plain run ...
    for ctx in (1024, 4096):
      for depth in (0.1, 0.9):
        for seed in range(2):
          rows.append(row("long_context", "GQA-2", s,
                          {"task": "passkey", "context": ctx, "depth": depth, "seed": seed,
                           "key": ""},
                          {"accuracy": float(seed == 0), "output": str(seed)},
                          config="lc", model="smollm2-135m"))
  for pol, ratio in (("full", 0.0), ("snapkv", 0.5), ("window", 0.25)):  # ... and an eviction run
    for ctx in (1024, 2048):
      for seed in range(2):
        rows.append(row("long_context", "GQA-2", f"{pol}_{ratio}",
                        {"task": "passkey", "context": ctx, "depth": 0.5, "seed": seed,
                         "key": "", "prefix_tokens": ctx},
                        {"accuracy": float(seed == 0), "output": str(seed),
                         "held_tokens": int(ctx * (ratio or 1))},
                        config="lce", model="smollm2-135m", policy=pol, ratio=ratio,
                        codec="fp32", k_codec="fp32"))
  for i, s in enumerate(("full", "snapkv_0.5", "latent")):
    rows.append(row("compression", "GQA-2", s, {"task": "text", "context": 512,
                                                 "continuation": 64},
                    {"ppl": 10.0 + i, "ppl_ref": 10.0}, codec="fp32",
                    policy="snapkv" if "snap" in s else "full",
                    latent_rank=16 if s == "latent" else 0))
  for lay, prefix in (("contiguous", False), ("paged", False), ("paged", True)):
    for s in ("bf16", "int8"):
      m = {"memory_utilization": 0.5, "mean_concurrency": 2.0, "max_concurrency": 3,
           "tokens_per_s": 80.0, "steps": 40, "prefix_hit_rate": 0.3, "gather_overhead": 1.2,
           "bench_batch": 2, "bench_context": 64}
      rows.append(row("paged_workload", "MHA", s, {"requests": 6, "budget_bytes": 32768,
                                                   "max_len": 64, "page_size": 8},
                      m, layout=lay, prefix_cache=prefix))
  for i, peer in enumerate(("kvjax", "dynamic", "static")):
    for b in (1, 4):
      rows.append(row("peer", "GQA-2", "fp32", {"batch": b, "prompt_len": 64, "gen_len": 32,
                                                 "threads": 1},
                      {"tpot_s": 1e-3 * (i + 1), "ttft_s": 1e-2 * (i + 1), "tpot_s_iqr": 1e-4,
                       "ttft_s_iqr": 1e-3, "tpot_vs_kvjax": i + 1.0, "ttft_vs_kvjax": i + 1.0},
                      peer=peer))
  for text in ("shakespeare", "stdlib"):  # position: a row per bucket
    for s in ("int8", "int4", "int4_kivi"):
      for i, b in enumerate(((0, 1024), (1024, 4096), (4096, 8192))):
        d = 0.01 * (i + 1) * (2 if s == "int4" else 1)
        rows.append(row("position", "GQA-3", s, {"task": "text_by_position", "data": text,
                                                 "context": 8192, "chunk": 512,
                                                 "bucket": list(b), "batch": 1},
                        {"dppl_rel": d, "dppl_rel_ci95": [d / 2, 1.5 * d], "kl": 1e-3,
                         "agreement": 0.9}, model="smollm2-135m"))
  for n in (8192, 16384):  # ruler: a row per question, cache and protocol
    for fam, task in (("niah", "niah_single_1"), ("vt", "vt")):
      for s, protocol in (("fp32", "blind"), ("int4", "blind"), ("snapkv_25", "blind"),
                          ("snapkv_25", "aware")):
        for q in range(3):
          rows.append(row("ruler", "GQA-2", s, {"task": task, "family": fam, "context": n,
                                                "sample": q, "key": str(q),
                                                "protocol": protocol},
                          {"score": 1.0 if (s == "fp32" or q) else 0.0},
                          protocol=protocol, model="qwen2.5-coder-0.5b"))
  for v, method, frac, ppl in (("MHA", "mha", 0.0, 5.0), ("GQA-2", "converted", 0.0, 7.0),
                               ("GQA-2", "uptrained", 0.05, 5.5), ("GQA-2", "scratch", 0.0, 5.4)):
    rows.append(row("uptrain", v, "fp32", {"task": "uptrain"}, {"ppl": ppl}, method=method,
                    uptrain_fraction=frac))
  for v in MODELS:  # cache_vs_recompute and memory
    for lay in ("none", "contiguous"):
      for p in (16, 64):
        rows.append(row("cache_vs_recompute", v, "bf16", {"position": p, "batch": 1},
                        {"tpot_s": 1e-4 * p, "speedup_vs_recompute": 3.0}, layout=lay))
    for s in ("bf16", "int8", "int4"):
      for ctx in (64, 256):
        rows.append(row("memory", v, s, {"part": "cache_bytes", "context": ctx, "batch": 1,
                                         "measured": "allocated"},
                        {"cache_bytes": BPT[s] * ctx, "closed_form_bytes": BPT[s] * ctx}))
        rows.append(row("memory", v, s, {"part": "max_concurrency", "context": ctx * 16,
                                         "budget_gib": 80},
                        {"max_concurrency": 1000 // ctx, "weight_bytes": 2 ** 33},
                        model="llama3-8b"))
  return rows


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
  """(stem, figure) of every plot drawn from the synthetic folder, kept open past save."""
  folder = tmp_path_factory.mktemp("synthetic")
  (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows()))
  figs, close = [], plt.close
  mp = pytest.MonkeyPatch()
  mp.setattr(style.plt, "close", lambda fig=None: figs.append(fig))
  # the files themselves are test_plots' business: here only the layout, which drawing
  # computes (clipped_text), so nothing is written
  mp.setattr(matplotlib.figure.Figure, "savefig", lambda *a, **k: None)
  mp.setitem(matplotlib.rcParams, "figure.max_open_warning", 0)
  try:
    paths = plots.plot_all(folder, tmp_path_factory.mktemp("out"), log=lambda _: None)
  finally:
    mp.undo()
  pngs = [p for p in paths if p.suffix == ".png"]
  assert len(pngs) == len(figs)
  yield list(zip([p.relative_to(p.parents[1]) for p in pngs], figs))
  for fig in figs:
    close(fig)


def test_every_plot_module_draws_from_the_synthetic_folder(drawn):
  modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"
             and plots.plot_module(p.stem) is not None}
  stems = {str(path.name).removesuffix(".png") for path, _ in drawn}
  for name in modules:
    assert any(s.startswith(name) for s in stems), (name, sorted(stems))
  assert {"roofline_b4", "long_context_heatmap", "long_context_evict_depth", "quality_kl",
          "quality_recall", "latency_variants", "memory_max_concurrency"} <= stems


def test_no_text_outside_its_canvas(drawn):
  clipped = {str(path): texts.clipped_text(fig) for path, fig in drawn}
  assert not {k: v for k, v in clipped.items() if v}


def test_the_check_fails_on_a_clipped_figure():
  fig, ax = plt.subplots(figsize=(3, 2))
  ax.set_title("a title far too long for a canvas three inches wide, cut at both edges")
  im = ax.imshow([[0, 1]])
  fig.colorbar(im, ax=ax, label="a colour-bar label")
  found = texts.clipped_text(fig)
  plt.close(fig)
  assert any(t.startswith("a title far too long") for t in found), found
  fig, ax = plt.subplots(figsize=(3, 2))
  im = ax.imshow([[0, 1]])
  fig.colorbar(im, ax=ax, label="accuracy").ax.yaxis.label.set_fontsize(40)
  assert "accuracy" in texts.clipped_text(fig)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(4, 3), layout="constrained")
  ax.set_title("short")
  assert texts.clipped_text(fig) == []
  plt.close(fig)


def test_settings_never_share_a_marker_and_a_family_shares_a_colour():
  rows = [r for r in synthetic_rows() if r["experiment"] == "roofline"]
  look = style.Look(rows)
  markers = [(look.marker(s)["marker"], look.marker(s)["mfc"]) for s in look.settings]
  assert len(set(markers)) == len(look.settings) == len(SETTINGS)
  colors = {s: look.color(s) for s in look.settings}
  assert colors["int4"] == colors["int4_kivi"] == colors["int4_rot"] != colors["int2"]
  assert colors["nf4"] != colors["int4"] and colors["bf16"] != colors["fp32"]
  many = [dict(r, variant={**r["variant"], "setting": f"int4_{i}"}) for i, r in
          enumerate(rows[:1] * 20)]
  look = style.Look(many)
  assert len({(look.marker(s)["marker"], look.marker(s)["mfc"]) for s in look.settings}) == 20


def test_legends_and_titles_name_the_model(drawn):
  figs = {str(path.name): fig for path, fig in drawn}
  texts = {name: " ".join(t.get_text() for t in fig.findobj(plt.Text)) for name, fig in
           figs.items()}
  assert "smollm2-135m (GQA-2)" in texts["long_context_heatmap.png"]
  for name in ("quality_kl.png", "roofline_b4.png", "latency_variants.png"):
    assert "toy (MHA)" in texts[name] and "toy (GQA-2)" in texts[name], name
  assert style.model_label({"variant": {"variant": "GQA-3", "model": "gguf:smollm2-135m"}}) \
      == "smollm2-135m (GQA-3)"


def test_a_single_context_roofline_is_bars_with_the_ratio_printed(drawn):
  from matplotlib.container import BarContainer
  (fig,) = [f for path, f in drawn if str(path) == "roof1/roofline_b4.png"]
  frac, tpot = fig.axes
  assert [c for c in frac.containers if isinstance(c, BarContainer)]
  labels = [t.get_text() for t in tpot.texts]
  assert len(labels) == len(SETTINGS) * len(MODELS) and "1.00x" in labels
  assert all(lab.endswith("x") for lab in labels)


def test_quality_bytes_agree_with_the_run_summary(drawn):
  """The bytes per token a quality plot prints are the run table's (what the cache held at
  the row's context), not the long-context asymptote the rows also carry."""
  import re

  from kvjax.lab.experiments import quality
  (fig,) = [f for path, f in drawn if path.name == "quality_dppl_vs_bytes.png"]
  table = {(line["model"], line["setting"]): line["bytes_per_token"] for line in
           quality.summary([r for r in synthetic_rows() if r["experiment"] == "quality"])}
  labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
  assert len(labels) == len(SETTINGS)
  for text in labels:
    setting, numbers = re.fullmatch(r"(\S+)  \((\S+) B/token\)", text).groups()
    assert numbers.split("/") == [str(round(table[(v, setting)])) for v in MODELS], text


# -- every plot `kvjax plot` draws from the committed rows reads at a glance ------------------
ROOT = Path(__file__).resolve().parents[2]  # the repository


def draw_all(folder) -> list:
  """(path, figure) of every plot `kvjax plot` draws from `folder`, kept open, no files."""
  figs, close = [], plt.close
  mp = pytest.MonkeyPatch()
  mp.setattr(style.plt, "close", lambda fig=None: figs.append(fig))
  mp.setattr(matplotlib.figure.Figure, "savefig", lambda *a, **k: None)
  mp.setitem(matplotlib.rcParams, "figure.max_open_warning", 0)
  try:
    paths = plots.plot_all(folder, Path("plots-not-written"), log=lambda _: None)
  finally:
    mp.undo()
  pngs = [p for p in paths if p.suffix == ".png"]
  assert len(pngs) == len(figs)
  return list(zip(pngs, figs)), close


@pytest.fixture(scope="module")
def committed():
  drawn, close = draw_all(ROOT / "results")
  yield drawn
  for _, fig in drawn:
    close(fig)


def test_every_committed_plot_reads_at_a_glance(committed):
  from kvjax.lab.plots import check
  assert len(committed) > 30  # every experiment with a plot module, every config
  found = {str(path): check.problems(fig) for path, fig in committed}
  assert not {k: v for k, v in found.items() if v}


def test_quality_intervals_are_drawn_whole_or_cut_with_an_arrow(committed):
  """Every Δppl interval of the committed rows is drawn to its true ends, or runs past the
  axis where an arrow marks the cut: never capped at the cut as if it ended there."""
  from kvjax.lab.plots import check
  from kvjax.lab.runner import results as results_lib
  rows = [r for r in results_lib.load(ROOT / "results" / "real", "quality")
          if r["workload"].get("task") == "text" and r["metrics"].get("dppl_rel_ci95")]
  (fig,) = [f for p, f in committed if str(p).endswith("real_quality/quality_dppl_vs_bytes.png")]
  ax = fig.axes[0]
  segs = check._error_segments(ax)
  ends = {(round(s[0][0], 9), round(s[1][0], 9)) for s in segs}
  right = ax.get_xlim()[1]
  assert len(rows) > 20
  for r in rows:
    lo, hi = (100 * x for x in r["metrics"]["dppl_rel_ci95"])
    if 100 * r["metrics"]["dppl_rel"] <= right:
      assert (round(lo, 9), round(hi, 9)) in ends, (r["variant"]["setting"], lo, hi)
  assert not check.uncut_intervals(fig)


def _fig(**kw):
  fig, ax = plt.subplots(figsize=(4, 3), **kw)
  return fig, ax


def test_each_check_fails_on_its_defect():
  from matplotlib.lines import Line2D
  from kvjax.lab.plots import check
  # an interval past the axis with no arrow, then with the arrow `save` draws
  fig, ax = _fig()
  ax.errorbar([1.0], [0.0], xerr=[[0.5], [9.0]], capsize=2)
  ax.set_xlim(0, 5)
  assert any("beyond the axis" in p for p in check.problems(fig))
  style.cut_arrows(fig)
  assert not any("beyond the axis" in p for p in check.problems(fig))
  plt.close(fig)
  # a label on an interval, text on text, a title over the plot
  fig, ax = _fig()
  ax.errorbar([1.0], [0.5], xerr=[[0.5], [0.5]])
  ax.text(1.0, 0.5, " 1 %")
  ax.text(0.2, 0.9, "first label")
  ax.text(0.22, 0.9, "second label")
  ax.set_xlim(0, 2)
  ax.set_ylim(0, 1)
  fig.suptitle("one\ntwo\nthree\nfour lines of title", y=0.9)
  found = check.problems(fig)
  assert any("text on an interval: ' 1 %'" in p for p in found), found
  assert any("text overlaps text" in p for p in found), found
  assert any("title over a plot area" in p for p in found), found
  plt.close(fig)
  # a legend entry that draws nothing, and a colour key over one grey entry
  fig, ax = _fig()
  ax.plot([0, 1], [0, 1], color="C1")
  ax.legend(handles=[Line2D([], [], ls="none", color="#555555", label="nothing"),
                     Line2D([], [], marker="o", ls="none", color="#555555", label="model")],
            title="model (colour: codec family)")
  found = check.problems(fig)
  assert any("draws nothing: 'nothing'" in p for p in found), found
  assert any("colour key over one colour" in p for p in found), found
  plt.close(fig)
  # one category (a single context) spread to the panel's edges by a small jitter
  fig, ax = _fig()
  for jit in (0.985, 1.0, 1.015):
    ax.plot([1024 * jit], [0.5], "o")
  ax.set_xscale("log", base=2)
  ax.set_xticks([1024], ["1k"])
  assert any("between categories" in p for p in check.problems(fig))
  ax.set_xlim(1024 / 1.5, 1024 * 1.5)  # what long_context_evict does
  assert not check.problems(fig)
  plt.close(fig)


def test_the_tick_and_legend_checks_fail_on_their_defects():
  """A log axis over a narrow range labels its minor ticks 1.7×10⁰ by default; `plain_log`
  reads them as numbers; two legend entries of one name are caught."""
  from kvjax.lab.plots import check
  fig, ax = _fig()
  ax.plot([1.0, 2.0], [1.3, 1.9], "o")
  ax.set_yscale("log")
  found = check.problems(fig)
  assert any("mantissa-times-power" in p for p in found), found
  style.plain_log(ax.yaxis)
  assert not check.problems(fig)
  ax.plot([1.5], [1.5], "s", label="int4")
  ax.plot([1.2], [1.6], "^", label="int4")
  ax.legend()
  assert any("legend label given twice: 'int4'" in p for p in check.problems(fig))
  plt.close(fig)
