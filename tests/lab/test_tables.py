"""Tables keep identity: every cache key that differs between cells is a column of the run
summary, --dry-run and `kvjax results`; one number format per column; markdown escaped."""

import csv
import io
import json

import pytest

from kvjax import cli
from kvjax.errors import KvjaxError
from kvjax.lab.runner import results, table

CFG = """name: tm
experiment: memory
model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 2}
params:
  contexts: [8, 16]
  settings:
    plain: {cache.codec: int8}
    grouped: {cache.codec: int8, cache.group_size: 4}
    window: {cache.codec: int8, cache.residual: 8}
    sinks_50: {cache.policy: sinks, cache.ratio: 0.5, cache.sinks: 2}
grid:
  params.setting: [plain, grouped, window]
"""


def columns(text: str, header_startswith: str) -> list[dict]:
  lines = text.splitlines()
  i = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [header_startswith])
  head = lines[i].split()
  body = []
  for ln in lines[i + 2:]:
    if not ln.strip() or ln.startswith("kvjax"):
      break
    body.append(dict(zip(head, ln.split())))
  return body


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tables")
  path = folder / "tm.yaml"
  path.write_text(CFG)
  return path, folder / "out"


def test_run_summary_shows_the_keys_that_differ(ran, capsys):
  path, out = ran
  assert cli.main(["run", str(path), "--out", str(out)]) == 0
  text = capsys.readouterr().out
  body = columns(text, "setting")
  assert [(b["setting"], b["group_size"], b["residual"]) for b in body] == \
      [("plain", "0", "0"), ("grouped", "4", "0"), ("window", "0", "8")]
  assert text.count(" KiB") == 6 and " B " not in text  # one unit in each bytes column


def test_dry_run_shows_policy_ratio_and_sinks(ran, capsys):
  path, out = ran
  assert cli.main(["run", str(path), "--out", str(out), "--dry-run", "--set",
                   "grid.params.setting=[plain, sinks_50]"]) == 0
  body = columns(capsys.readouterr().out, "cell")
  assert [(b["setting"], b["k_codec"], b["policy"], b["ratio"], b["sinks"]) for b in body] == \
      [("plain", "int8", "full", "0.0", "4"), ("sinks_50", "fp32", "sinks", "0.5", "2")]


def test_markdown_is_compact_and_csv_complete(ran, capsys):
  path, out = ran
  assert cli.main(["results", str(out)]) == 0
  md = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
  head = [c.strip() for c in md[0].strip("|").split("|")]
  assert {"setting", "group_size", "residual", "bytes_per_token"} <= set(head)
  assert len(head) <= 12 and "closed_form_bytes" not in head
  assert cli.main(["results", str(out), "--format", "csv"]) == 0
  full = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
  assert {"closed_form_bytes", "group_size", "residual", "cache_bytes"} <= set(full[0])
  assert cli.main(["results", str(out), "--columns", "setting,residual"]) == 0
  md = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
  assert md[0] == "| setting | residual |" and "| window | 8 |" in md
  assert cli.main(["results", str(out), "--columns", "nope"]) == 2
  assert "--columns names no column 'nope'" in capsys.readouterr().err


def test_markdown_escapes_newlines_and_bars(tmp_path, capsys):
  row = {"experiment": "gen", "config_hash": "h", "variant": {"variant": "MHA"},
         "workload": {"text": "a|b\nc"}, "metrics": {"tpot_s": 0.0021, "ppl": 12.5}}
  (tmp_path / "gen.jsonl").write_text(json.dumps(row) + "\n")
  assert cli.main(["results", str(tmp_path), "--columns", "text,tpot_ms"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[2] == "| a\\|b\\nc | 2.1 |" and len(lines) == 3


def test_one_number_format_per_column():
  assert table.column_text("bytes_per_token", [7200, 11881.7, None]) == ["7,200", "11,882", "-"]
  assert table.column_text("cache_bytes", [11796484, 512 * 1024]) == ["11.25 MiB", "0.50 MiB"]
  assert table.column_text("tpot_s", [0.002, 0.0105]) == ["2.0", "10.5"]  # in ms
  assert table.column_text("n", [7200, 11880]) == ["7,200", "11,880"]
  assert table.column_text("ppl", [14.2345, 1234.5]) == ["14.23", "1,234.50"]
  assert table.column_text("dppl_rel", [-1e-7, 0.5]) == ["0.0", "0.5"]  # no "-0.0"
  assert table.column_text("kl", [3e-6, 1e-5]) == ["3.00e-06", "1.00e-05"]


def test_identity_and_its_matching():
  cfgs = [{"cache": {"k_codec": "int4", "v_codec": "int4", "residual": 0, "policy": "full"}},
          {"cache": {"k_codec": "int8", "v_codec": "int4", "residual": 0, "policy": "sinks"},
           "params": {"setting": "s"}}]
  ids = table.identity(cfgs)
  assert ids == [{"setting": None, "codec": "int4", "policy": "full"},
                 {"setting": "s", "codec": "Kint8/Vint4", "policy": "sinks"}]
  rows = [{"config": c, "metrics": {"kl": k}, "workload": {}} for c, k in zip(cfgs, (1, 2))]
  got = table.with_identity([{"codec": "a", "kl": 1}, {"codec": "s", "kl": 2}], rows)
  assert got == [{"setting": None, "cache.codec": "int4", "policy": "full", "codec": "a", "kl": 1},
                 {"setting": "s", "cache.codec": "Kint8/Vint4", "policy": "sinks",
                  "codec": "s", "kl": 2}]  # a record's own `codec` stays; the real one beside
  aggregated = [{"codec": "a", "kl": 1.5}]  # matches no row: left as it is
  assert table.with_identity(aggregated, rows) == aggregated
  # two settings with the same figures (a policy's bytes at one ratio): each record stands
  # beside its own setting's rows, not the first rows whose figures it shares
  named = [{"config": {"cache": {"policy": p}, "params": {"setting": p}},
            "variant": {"setting": p}, "metrics": {"accuracy": a, "bytes_per_token": 10},
            "workload": {"task": "niah"}}
           for p, a in (("window", 1.0), ("window", 0.0), ("snapkv", 1.0), ("snapkv", 0.0))]
  recs = [{"setting": p, "task": "niah", "accuracy": 0.5, "bytes_per_token": 10}
          for p in ("window", "snapkv")]
  assert [r["policy"] for r in table.with_identity(recs, named)] == ["window", "snapkv"]
  with pytest.raises(KvjaxError):
    results.choose([{"a": 1}], "b", lambda r: [])
