"""One definition per figure (kvjax.lab.figures): a ratio to a reference under one name per
estimator, a roof fraction under one name with a value above 1 flagged, the same figure
in the run summary and `kvjax results`; `--dry-run` lists every interleaved variant."""

import pytest

from kvjax.lab import figures, runner
from kvjax.lab.experiments import latency, roofline
from kvjax.lab.runner import table


def _row(setting, tpot, iqr, paired=None, roof=0.5, codec="bf16", variant="MHA"):
  m = {"tpot_s": tpot, "tpot_s_iqr": iqr, "ttft_s": 0.01, "tokens_per_s": 1 / tpot,
       "bytes_per_token": 100.0, "cache_bytes": 1000, "roof_fraction": roof,
       "roofline_fraction": roof / 2, "bound": "bytes", "achieved_Bps": 1e9,
       "bandwidth_Bps": 2e9}
  if paired:
    m["tpot_vs_ref"], m["tpot_vs_ref_ci95"] = paired
  return {"experiment": "latency", "variant": {"variant": variant, "codec": codec,
                                               "layout": "contiguous", "setting": setting},
          "workload": {"batch": 4, "context": 288}, "metrics": m}


def test_the_summary_shows_the_rows_paired_ratio_not_a_ratio_of_medians():
  rows = [_row("bf16", 1.0, 0.1, (1.0, [1.0, 1.0])),
          _row("int8", 0.8, 0.1, (0.8166, [0.70, 0.95]), codec="int8")]
  line = latency.summary(rows)[1]
  assert line["tpot_vs_ref"] == 0.8166 and "tpot_over_ref" not in line  # not 0.8 = 0.8 / 1.0
  assert line["vs_ref"] == "faster" and line["vs_ref_ci95"] == "[0.700, 0.950]"
  assert latency.summary(rows)[0]["vs_ref"] == "reference"
  rows[1]["metrics"]["tpot_vs_ref_ci95"] = [0.7, 1.05]
  assert latency.summary(rows)[1]["vs_ref"] == "not told apart"
  # cells timed apart: a ratio of medians under its own name, told apart by the IQRs
  apart = [_row("", 1.0, 0.1), _row("", 0.8, 0.5, codec="int8")]
  line = latency.summary(apart)[1]
  assert line["tpot_over_ref"] == pytest.approx(0.8) and "tpot_vs_ref" not in line
  assert line["vs_ref"] == "not told apart"  # 0.8 +- 0.25 against 1.0 +- 0.05
  apart[1]["metrics"]["tpot_s_iqr"] = 0.1
  assert latency.summary(apart)[1]["vs_ref"] == "faster"


def test_one_roof_fraction_and_a_value_above_one_is_flagged():
  good, bad = _row("bf16", 1.0, 0.1), _row("int8", 1.0, 0.1, roof=1.66, codec="int8")
  assert figures.roof_fields(good["metrics"]) == {"roof_fraction": 0.5, "roof_check": "ok"}
  fields = figures.roof_fields(bad["metrics"])
  assert fields["roof_fraction"] is None and "FAULT" in fields["roof_check"] \
      and "1.66" in fields["roof_check"]
  for rec in (table.flatten(bad), table.flatten(bad, all_metrics=True)):
    assert "roofline_fraction" not in rec and rec.get("roof_fraction") is None
    assert "FAULT" in rec["roof_check"]
  assert table.flatten(good, all_metrics=True)["roof_fraction"] == 0.5
  assert [line for line in figures.faults([good, bad])] and "1.66" in figures.faults([bad])[0]
  for summary in (latency.summary, roofline.summary):
    lines = summary([good, bad])
    assert lines[1]["roof_fraction"] is None and "FAULT" in lines[1]["roof_check"]
    assert all("roofline_fraction" not in line for line in lines)
  # an older row with only the bytes roof: read as the roof fraction, under that one name
  old = {"metrics": {"roofline_fraction": 0.4}}
  assert figures.roof_fields(old["metrics"])["roof_fraction"] == 0.4


def test_dry_run_lists_every_interleaved_variant(tmp_path, capsys):
  (tmp_path / "c.yaml").write_text(
      "name: p\nexperiment: roofline\nmodel: {d_model: 32, n_heads: 4, n_layers: 1}\n"
      "grid: {model.n_kv_heads: [4, 1]}\n"
      "params: {reference: bf16, interleave: {int4: {cache.codec: int4}, bf16: {cache.codec: "
      "bf16}, int8: {cache.codec: int8}}}\n")
  rep = runner.dry_run(tmp_path / "c.yaml", out_dir=tmp_path / "out")
  assert rep["cells"] == 2
  runs = [(r["cell"], r["interleaved"], r["k_codec"]) for r in rep["records"]]
  assert runs == [(0, "bf16", "bf16"), (0, "int4", "int4"), (0, "int8", "int8"),
                  (1, "bf16", "bf16"), (1, "int4", "int4"), (1, "int8", "int8")]
  assert "2 cells, 6 variants" in capsys.readouterr().out


def test_a_paired_row_is_read_against_its_own_reference_not_a_same_codec_row():
  """Two interleaved settings of one codec (Gemma's hybrid and full-attention caches, both
  bf16): the summary showed both as 'reference' because it looked the reference up by codec."""
  from kvjax.lab.experiments import roofline
  base = {"variant": {"variant": "MQA", "attention": "native", "codec": "bf16",
                      "k_codec": "bf16", "v_codec": "bf16", "layout": "contiguous"},
          "workload": {"batch": 8, "context": 8192}}
  rows = [{**base, "variant": {**base["variant"], "setting": s},
           "metrics": {"tpot_s": t, "tpot_s_iqr": 0.001, "tpot_vs_ref": r, "tpot_vs_ref_ci95": ci,
                       "achieved_Bps": 1e10, "bandwidth_Bps": 3e10, "roof_fraction": 0.4}}
          for s, t, r, ci in (("full", 0.2, 1.0, [1.0, 1.0]),
                              ("hybrid", 0.1, 0.5, [0.49, 0.51]))]
  got = {r["setting"]: r for r in roofline.summary(rows)}
  assert got["full"]["vs_ref"] == "reference"
  assert got["hybrid"]["tpot_vs_ref"] == 0.5 and got["hybrid"]["vs_ref"] == "faster"
