"""scripts/doc_tables.py: the docs' quality table and its 1 % sentence come from the rows."""

import copy
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def doc_tables():
  spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts" / "doc_tables.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def row(setting, model, dppl, kl, **cache):
  variant = {"variant": model, "setting": setting, "model": model.lower(), "k_codec": "int4",
             "v_codec": "int4", "k_axis": "token", "group_size": 0, "residual": 0, **cache}
  return {"experiment": "quality", "variant": variant,
          "workload": {"task": "text", "batch": 2, "context": 64, "chunk": 1},
          "metrics": {"dppl_rel": dppl, "kl": kl}}


def test_committed_docs_match_the_committed_rows(doc_tables):
  assert doc_tables.main(["--check"]) == 0


def test_table_lists_every_setting_and_the_limit_sentence_follows_the_rows(doc_tables):
  rows = [row("int4", "MHA", 0.006, 4e-3), row("int4", "MQA", -0.001, 3e-3),
          row("int4_g8", "MHA", 0.037, 2.5e-3, group_size=8),
          row("k8v4", "MHA", 0.001, 7e-4, k_codec="int8")]
  text = doc_tables.quality_table(rows)
  assert "| `int4_g8` (int4, groups of 8) | +3.7 % | 0.0025 | not run |  |" in text
  assert "| `k8v4` (K int8 / V int4) | +0.1 % | 0.0007 | not run |  |" in text
  assert "| `int4` (int4, per token, whole head) | +0.6 % | 0.004 | −0.1 % | 0.003 |" in text
  assert "Within 1 % Δppl on every model that ran them: `int4`, `k8v4` (run on MHA only)." \
      in text
  assert "Above 1 % on at least one model: `int4_g8` (MHA +3.7 %)." in text
  assert "2 × 64 = 128 validation tokens fed 1 at a time" in text
  worse = copy.deepcopy(rows)
  worse[1]["metrics"]["dppl_rel"] = 0.02  # one row moves: the sentence moves with it
  assert "`int4` (MQA +2 %)" in doc_tables.quality_table(worse)


def test_check_fails_when_the_docs_drift(doc_tables, tmp_path, monkeypatch):
  stale = tmp_path / "experiments.md"
  cell = "| +2.2 % |"  # int4_g8 on MHA in the committed rows
  assert cell in doc_tables.DOC.read_text()
  stale.write_text(doc_tables.DOC.read_text().replace(cell, "| +0.9 % |"))
  monkeypatch.setattr(doc_tables, "DOC", stale)
  monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
  assert doc_tables.main(["--check"]) == 1
  assert doc_tables.main([]) == 0 and doc_tables.main(["--check"]) == 0
  assert cell in stale.read_text()


def test_missing_markers_are_a_one_line_error(doc_tables):
  with pytest.raises(SystemExit, match="no <!-- doc_tables:quality begin/end --> markers"):
    doc_tables.render("no markers here\n", {"quality": "x"})


def lc_row(setting, task, context, depth, right, bpt, policy="full", ratio=0.0, codec="fp32"):
  variant = {"variant": "GQA-3", "setting": setting, "model": "m", "k_codec": codec,
             "v_codec": codec, "codec": codec}
  if policy != "full":
    variant.update(policy=policy, ratio=ratio, window=16, sinks=4, budget=0)
  answer = "123"
  return {"experiment": "long_context", "variant": variant,
          "workload": {"task": task, "context": context, "depth": depth, "key": "",
                       "template": "chatml", "gen_len": 10},
          "metrics": {"accuracy": float(right), "bytes_per_token": bpt, "answer": answer,
                      "output": " 123." if right else " 9."}}


def test_evict_table_and_its_targets_follow_the_rows(doc_tables):
  rows = []
  for ctx in (1024, 2048):
    for d, ok in ((0.1, 0), (0.9, 1)):
      for task in ("passkey", "niah"):
        rows.append(lc_row("fp32", task, ctx, d, ok, 46080))
        rows.append(lc_row("int8", task, ctx, d, ok, 11880, codec="int8"))
        rows.append(lc_row("window_50", task, ctx, d, ok, 23063, "window", 0.5))
        rows.append(lc_row("snapkv_50", task, ctx, d, 0, 23063, "snapkv", 0.5))
        rows.append(lc_row("sinks_50_int8", task, ctx, d, ok and ctx == 1024, 5900, "sinks",
                           0.5, "int8"))
  text = doc_tables.evict_table(rows)
  assert "| `window_50` | window, half of the prefix | 23,063 | 50.0% | 2/4 | 2/4 | 2/4 | 2/4 " \
      "| 4/8 | 8/8 |" in text
  assert "| `sinks_50_int8` | sinks, half of the prefix, 4 sinks; int8 | 5,900 | 12.8% |" in text
  assert "the eviction setting with the most needles (then the most queries) is `window_50`" \
      in text and "It keeps the needle accuracy of the full cache, on the same needles" in text
  assert "the best combination of eviction and quantization is `sinks_50_int8`" in text
  assert "2/8 queries right (2/4 at 1k, 0/4 at 2k), against 4/8 for the full fp32 cache" in text
  worse = [r for r in rows if r["variant"]["setting"] != "window_50"]
  assert "It does not keep the needle accuracy" in doc_tables.evict_table(worse)
