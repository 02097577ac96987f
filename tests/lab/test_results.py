"""`kvjax results`: rows flattened into a CSV or markdown table, one line per row."""

import csv
import io
import json

import pytest

from kvjax import cli
from kvjax.lab import runner


@pytest.fixture(scope="module")
def rows_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("res")
  cfg = folder / "tiny.yaml"
  cfg.write_text("name: tiny\nexperiment: memory\n"
                 "model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4}\n"
                 "grid: {model.n_kv_heads: [4, 1], cache.codec: [fp32, int8]}\n"
                 "params: {contexts: [4, 8]}\n")
  runner.run_file(cfg, out_dir=folder / "out", progress=False)
  other = {"experiment": "latency", "config_hash": "x", "variant": {"variant": "MQA"},
           "workload": {"batch": 1, "context": 8}, "metrics": {"tpot_s": 0.002, "extra": 7,
                                                            "tokens_per_s_ci95": [480.0, 520.0]}}
  (folder / "out" / "lat.jsonl").write_text(json.dumps(other) + "\n")
  return folder / "out"


def test_csv_has_one_line_per_row_with_raw_values(rows_dir, capsys):
  assert cli.main(["results", str(rows_dir / "memory.jsonl"), "--format", "csv"]) == 0
  table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
  rows = runner.read_rows(rows_dir / "memory.jsonl")
  assert len(table) == len(rows) == 8
  for rec, row in zip(table, rows):
    assert rec["experiment"] == "memory"
    assert rec["variant"] == row["variant"]["variant"]
    assert (rec["k_codec"], rec["context"]) == (row["variant"]["k_codec"],
                                                str(row["workload"]["context"]))
    assert int(rec["cache_bytes"]) == row["metrics"]["cache_bytes"]
    assert float(rec["measured_bytes_per_token"]) == row["metrics"]["measured_bytes_per_token"]


def test_markdown_is_one_table_per_experiment(rows_dir, capsys):
  assert cli.main(["results", str(rows_dir)]) == 0
  out = capsys.readouterr().out
  sections = {part.split("\n", 1)[0]: [line for line in part.splitlines() if line.startswith("|")]
              for part in out.split("### ")[1:]}
  assert set(sections) == {"memory", "latency"}
  mem, lat = sections["memory"], sections["latency"]
  assert len(mem) == 2 + 8 and len({line.count("|") for line in mem}) == 1
  assert mem[1].startswith("|---|") and "kv_heads" in mem[0]
  head = [c.strip() for c in lat[0].strip("|").split("|")]
  cells = [c.strip() for c in lat[2].strip("|").split("|")]
  assert dict(zip(head, cells))["tpot_ms"] == "2"  # 0.002 s shown in ms
  assert cli.main(["results", str(rows_dir), "--experiment", "latency", "--format", "csv"]) == 0
  table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
  assert len(table) == 1 and table[0]["extra"] == "7" and table[0]["tpot_s"] == "0.002"
  # an interval ([lo, hi]) becomes two columns
  assert (table[0]["tokens_per_s_ci95_lo"], table[0]["tokens_per_s_ci95_hi"]) == ("480.0", "520.0")


def test_markdown_reads_relative_metrics_in_percent_with_their_intervals(tmp_path, capsys):
  """dppl_rel 0.0123 [0.004, 0.021] reads `+1.23 [+0.40, +2.10]` under `dppl_%` in markdown,
  KL carries its interval in its cell; CSV keeps the raw fraction and the interval columns."""
  row = {"experiment": "compression", "config_hash": "x", "variant": {"setting": "int4"},
         "workload": {"context": 8},
         "metrics": {"dppl_rel": 0.0123, "dppl_rel_ci95": [0.004, 0.021], "kl": 0.5,
                     "kl_ci95": [0.25, 0.75], "ppl": 9.0}}
  path = tmp_path / "r.jsonl"
  path.write_text(json.dumps(row) + "\n")
  assert cli.main(["results", str(path)]) == 0
  head, _, line = capsys.readouterr().out.splitlines()[:3]
  split = lambda text: [c.strip() for c in text.strip().strip("|").split("|")]  # noqa: E731
  cells = dict(zip(split(head), split(line)))
  assert cells["dppl_%"] == "+1.23 [+0.40, +2.10]"
  assert cells["kl"] == "0.50 [0.25, 0.75]" and "dppl_rel_ci95_lo" not in head
  assert cli.main(["results", str(path), "--columns", "dppl_%"]) == 0
  assert "+1.23 [+0.40, +2.10]" in capsys.readouterr().out
  assert cli.main(["results", str(path), "--format", "csv"]) == 0
  rec = next(csv.DictReader(io.StringIO(capsys.readouterr().out)))
  assert float(rec["dppl_rel"]) == 0.0123 and float(rec["dppl_rel_ci95_lo"]) == 0.004


@pytest.mark.parametrize("argv,needle", [
    (["results", "/no/such/dir"], "no results file or folder"),
    (["results", "{d}", "--experiment", "quality"], "no rows of experiment 'quality'"),
    (["results", "{d}", "--format", "xls"], "invalid choice"),
])
def test_bad_input_is_one_line(rows_dir, capsys, argv, needle):
  assert cli.main([a.format(d=rows_dir) for a in argv]) == 2
  err = capsys.readouterr().err.strip()
  assert needle in err and len(err.splitlines()) == 1
