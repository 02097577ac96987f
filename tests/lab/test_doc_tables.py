"""scripts/doc_tables.py: the docs' quality table and its 1 % sentence come from the rows."""

import copy
import importlib.util
from pathlib import Path

import pytest
from conftest import ruler_row

ROOT = Path(__file__).resolve().parents[2]


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
  assert "Within 1 % Δppl (point estimate) on every model that ran them: `int4`, `k8v4` " \
      "(run on MHA only)." in text
  assert "Above 1 % on at least one model: `int4_g8` (MHA +3.7 %). Of those, the whole " \
      "interval lies above 1 % for: none." in text
  assert "2 × 64 = 128 validation tokens fed 1 at a time" in text
  worse = copy.deepcopy(rows)
  worse[1]["metrics"]["dppl_rel"] = 0.02  # one row moves: the sentence moves with it
  assert "`int4` (MQA +2 %)" in doc_tables.quality_table(worse)
  # with intervals: printed beside the point, and a setting is named as surely above the
  # limit only where its whole interval is
  worse[1]["metrics"]["dppl_rel_ci95"] = [0.012, 0.03]
  worse[2]["metrics"]["dppl_rel_ci95"] = [0.005, 0.06]
  text = doc_tables.quality_table(worse)
  assert "`int4` (MQA +2 % [+1.2, +3])" in text and "(MHA +3.7 % [+0.5, +6])" in text
  assert "the whole interval lies above 1 % for: `int4` (MQA)." in text


def test_check_fails_when_the_docs_drift(doc_tables, tmp_path, monkeypatch):
  stale = tmp_path / "experiments.md"
  cell = "| +2.6 % [+1.1, +4.4] |"  # int4_g8 on MHA in the committed rows
  assert cell in doc_tables.DOC.read_text()
  stale.write_text(doc_tables.DOC.read_text().replace(cell, "| +0.9 % [+0.1, +1.7] |"))
  monkeypatch.setattr(doc_tables, "DOC", stale)
  monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
  assert doc_tables.main(["--check"]) == 1
  assert doc_tables.main([]) == 0 and doc_tables.main(["--check"]) == 0
  assert cell in stale.read_text()


def test_missing_markers_are_a_one_line_error(doc_tables):
  with pytest.raises(SystemExit, match="no <!-- doc_tables:quality begin/end --> markers"):
    doc_tables.render("no markers here\n", {"quality": "x"})


def lcruler_row(setting, task, context, depth, right, bpt, policy="full", ratio=0.0, codec="fp32"):
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
        rows.append(lcruler_row("fp32", task, ctx, d, ok, 46080))
        rows.append(lcruler_row("int8", task, ctx, d, ok, 11880, codec="int8"))
        rows.append(lcruler_row("window_50", task, ctx, d, ok, 23063, "window", 0.5))
        rows.append(lcruler_row("snapkv_50", task, ctx, d, 0, 23063, "snapkv", 0.5))
        rows.append(lcruler_row("sinks_50_int8", task, ctx, d, ok and ctx == 1024, 5900, "sinks",
                           0.5, "int8"))
  text = doc_tables.evict_table(rows)
  assert "| `window_50` | window, half of the prefix | 23,063 | 50.0% | 2/4 | 2/4 | 2/4 | 2/4 " \
      "| 4/8 | [0.22, 0.78] | 8/8 |" in text  # Wilson's interval of 4/8
  assert "| `sinks_50_int8` | sinks, half of the prefix, 4 sinks; int8 | 5,900 | 12.8% |" in text
  assert "the eviction setting with the most needles (then the most queries) is `window_50`" \
      in text and "It keeps the needle accuracy of the full cache, on the same needles" in text
  assert "the best combination of eviction and quantization is `sinks_50_int8`" in text
  assert "2/8 queries right (2/4 at 1k, 0/4 at 2k; Wilson 95 % [0.07, 0.59]), against 4/8 " \
      "for the full fp32 cache ([0.22, 0.78], overlapping: not told apart)" in text
  worse = [r for r in rows if r["variant"]["setting"] != "window_50"]
  text = doc_tables.evict_table(worse)  # 1/4 needles against 2/4: a count apart, no more
  assert "Its needle count differs from the full cache's, but the Wilson 95 % intervals " \
      "over both contexts overlap ([0.05, 0.70] against [0.15, 0.85]): no difference is " \
      "shown" in text and "It does not keep" not in text
  many = [dict(r, workload={**r["workload"], "seed": i}) for r in rows for i in range(30)
          if r["variant"]["setting"] in ("fp32", "sinks_50_int8")]
  for r in many:  # 30 times the queries: every needle right through fp32, a quarter here
    if r["workload"]["task"] == "niah":
      fp32 = r["variant"]["setting"] == "fp32"
      r["metrics"] = {**r["metrics"], "accuracy": float(fp32 or r["workload"]["seed"] % 4 == 0)}
  assert "It does not keep the needle accuracy" in doc_tables.evict_table(many)


def test_real_table_prints_intervals_when_rows_have_them(doc_tables):
  rows = [row("fp32", "GQA-3", 0.0, 0.0, k_codec="fp32", v_codec="fp32"),
          row("int4", "GQA-3", 0.022, 4e-3)]
  for r in rows:
    r["variant"]["heads"], r["variant"]["kv_heads"] = 9, 3
    r["metrics"].update(agreement=0.95, bytes_per_token=100.0, cache_bytes=12800,
                        bytes_per_token_asymptotic=100.0, bits_per_element=4.5)
    r["workload"]["data"] = "stdlib"
  old = doc_tables.real_table(rows)
  assert "[" not in old.split("\n\n")[0]  # rows without intervals: the table as before
  rows[1]["metrics"].update(dppl_rel_ci95=[0.018, 0.026], kl_ci95=[3.5e-3, 4.5e-3],
                            agreement_ci95=[0.94, 0.96])
  text = doc_tables.real_table(rows)
  assert "| +2.2 % [+1.8, +2.6] | 0.004 [0.0035, 0.0045] | 0.950 [0.940, 0.960] |" in text
  assert "| +2.2 % [" in doc_tables.quality_table(rows)
  peer = row("quanto_int4", "transformers", 0.016, 5e-3, k_codec="quanto-int4",
             v_codec="quanto-int4", peer="quanto", residual=128)
  peer["metrics"].update(agreement=0.94, bytes_per_token=90.0, bytes_per_token_asymptotic=None,
                         bits_per_element=4.0, dppl_rel_ci95=[0.012, 0.020])
  text = doc_tables.real_table(rows + [peer])  # +2.2 % [1.8, 2.6] against +1.6 % [1.2, 2.0]
  assert "The 95 % intervals of Δppl, [+1.8, +2.6] % and [+1.2, +2] %, are overlapping: " \
      "not told apart." in text
  peer["metrics"]["dppl_rel_ci95"] = [0.012, 0.017]
  assert "are separated." in doc_tables.real_table(rows + [peer])


def test_paired_table_has_a_column_per_cell_and_follows_the_rows(doc_tables):
  def paired(setting, batch, context, tpot, ratio, ci, bound="bytes", frac=0.5):
    return {"experiment": "roofline", "variant": {"setting": setting},
            "workload": {"batch": batch, "context": context},
            "metrics": {"tpot_s": tpot, "tpot_vs_ref": ratio, "tpot_vs_ref_ci95": ci,
                        "roof_fraction": frac, "bound": bound, "bits_per_element": 4.5,
                        "bandwidth_Bps": 15e9, "repeats": 7},
            "env": {"cpu_count": 2, "git_commit": "abc1234", "load_avg": [1.5, 1.0, 1.0]}}
  rows = [paired("bf16", 1, 1024, 0.05, 1.0, [1.0, 1.0]),
          paired("int4", 1, 1024, 0.045, 0.9, [0.85, 0.95]),
          paired("bf16", 8, 4096, 0.3, 1.0, [1.0, 1.0], "flops", 0.42),
          paired("int4", 8, 4096, 0.27, 0.9, [0.8, 1.02], "flops", 0.47)]
  text = doc_tables.paired_table(rows)
  assert "| setting | bits/elt at 4k | batch 1 × 1k | batch 8 × 4k |" in text
  assert "| int4 | 4.5 | 45.0 ms, 0.90× [0.85, 0.95] (0.50 b) | " \
      "270.0 ms, 0.90× [0.80, 1.02] (0.47 f) |" in text
  assert text.index("| bf16 |") < text.index("| int4 |")  # the reference first
  assert "`, 7 repeats per cell, ratios to `bf16`" in text
  # the commit and the host's load stay in the rows' NOTES.md, which the footer names
  assert "abc1234" not in text and "load" not in text and "`results/cpu/NOTES.md`" in text
  rows[3]["metrics"]["tpot_vs_ref"] = 0.7  # one row moves: its cell moves with it
  assert "0.70× [0.80, 1.02]" in doc_tables.paired_table(rows)
  assert "| int4 |  | 45.0 ms, 0.90× [0.85, 0.95] (0.50 b) | not run |" in \
      doc_tables.paired_table(rows[:3])


def test_codec_speed_table_has_a_line_per_read_and_context(doc_tables):
  def lat(setting, attention, context, ratio, ci, tpot=0.002):
    return {"experiment": "latency", "variant": {"setting": setting, "attention": attention},
            "workload": {"context": context},
            "metrics": {"tpot_s": tpot, "tpot_vs_ref": ratio, "tpot_vs_ref_ci95": ci,
                        "bound": "bytes", "repeats": 11},
            "env": {"cpu_count": 2, "git_commit": "abc1234", "load_avg": [1.0, 1.0, 1.0]}}
  rows = [lat("bf16", "grouped", 256, 1.0, [1.0, 1.0], 0.004), lat("int8", "grouped", 256, 0.9, [0.85, 0.95]),
          lat("bf16", "native", 4096, 1.0, [1.0, 1.0]), lat("int8", "native", 4096, 0.8, [0.75, 0.82]),
          lat("bf16", "native", 256, 1.0, [1.0, 1.0])]
  text = doc_tables.codec_speed_table(rows)
  assert "| read, context | int8 | bf16 step | bf16 bound |" in text
  lines = [ln for ln in text.splitlines() if ln.startswith("| native") or ln.startswith("| grouped")]
  assert lines == ["| native, 256 | not run | 2.00 ms | bytes |",  # native first, by context
                   "| native, 4k | 0.80 [0.75, 0.82] | 2.00 ms | bytes |",
                   "| grouped (XLA), 256 | 0.90 [0.85, 0.95] | 4.00 ms | bytes |"]
  assert "abc1234" not in text and "load" not in text and "`results/cpu/NOTES.md`" in text


def test_layer_bits_table_describes_each_setting(doc_tables):
  def lb(setting, bits, dppl, ci):
    return {"experiment": "layer_bits",
            "variant": {"setting": setting, "base": "int4", "rotate": "hadamard"},
            "workload": {"model": "gguf:m", "seqs": 2, "tokens": 64, "text": "stdlib", "chunk": 8},
            "metrics": {"bits_per_element": bits, "dppl_rel": dppl, "dppl_rel_ci95": ci}}
  text = doc_tables.layer_bits_table([lb("all4", 4.5, 0.0139, [0.0102, 0.0176]),
                                      lb("k8:10-29", 5.75, 0.0027, [0.0008, 0.0046]),
                                      lb("only:3", 27.4, 0.001, [-0.001, 0.002])])
  assert "| all4 | int4 (rotated) on every layer, K and V | 4.50 | +1.4 % [+1, +1.8] |" in text
  assert "| k8:10-29 | all4, keys of layers 10–29 in int8 | 5.75 | +0.27 % [+0.08, +0.46] |" in text
  assert "| only:3 | int4 (rotated) on layer 3 only, float32 elsewhere |" in text
  assert "2 × 64 stdlib tokens fed 8 per step" in text


def _frontierruler_row(setting, of_bf16, dppl, ci, **variant):
  return {"experiment": "compression", "variant": {"setting": setting, "model": "m",
          "variant": "GQA-3", "k_codec": "int4", "v_codec": "int4", **variant},
          "workload": {"data": "stdlib", "batch": 8, "context": 1792, "continuation": 256},
          "metrics": {"of_bf16": of_bf16, "dppl_rel": dppl, "dppl_rel_ci95": ci, "kl": 0.01}}


def test_shrink_table_names_each_budgets_winner_and_whether_it_is_told_apart(doc_tables):
  rows = [_frontierruler_row("a", 0.30, 0.01, [0.0, 0.02]),
          _frontierruler_row("b", 0.24, 0.05, [0.04, 0.06]),
          _frontierruler_row("c", 0.20, 0.08, [0.03, 0.13]),
          _frontierruler_row("d", 0.10, 0.50, [0.40, 0.60], conversion="fit", kv_heads=1, **{"variant": "MQA"})]
  lines = doc_tables.shrink_table(rows).splitlines()
  at = {line.split("|")[3].strip(): line for line in lines[2:6]}
  assert "`a`" in at["0.5"] and "`b`" in at["0.5"] and "| yes |" in at["0.5"]  # apart
  assert at["0.25"].index("`b`") < at["0.25"].index("`c`") and "**no**" in at["0.25"]
  assert "`d`" in at["0.125"] and "MQA (fit)" in at["0.125"] and at["0.125"].endswith("| — |")
  assert "none this small" in at["0.0625"]


def test_shrink_speed_table_joins_passkey_and_decode_time_to_each_frontier_setting(doc_tables):
  """Each frontier setting on one line with its bytes and Δppl per text; the passkey rows
  matched by model (or converted checkpoint) and cache setting, whatever the setting's name;
  the speed row by the speed config's name and the setting; 'not timed' and '—' where a
  column has no rows."""
  cache = {"k_codec": "int8", "v_codec": "int8", "k_axis": "token", "group_size": 0,
           "residual": 0, "rotate": "none", "clip": "none", "policy": "full", "ratio": 0.0}
  rows = []
  for setting, of, conv in (("bf16", 1.0, None), ("int8", 0.5, None), ("mqa_int8", 0.17, "ck/m-mqa")):
    for text, d in (("stdlib", 0.02), ("shakespeare", 0.01)):
      r = _frontierruler_row(setting, of, d, [d / 2, 2 * d])
      r["workload"]["data"] = text
      r["config"] = {"name": "frontier_m", "cache": {**cache, "k_codec": setting[-4:],
                                                     "v_codec": setting[-4:]},
                     "params": {"converted": conv} if conv else {}}
      rows.append(r)
  for model, right in (("m", 9), ("m-mqa", 2)):  # the passkey run names its own settings
    for i in range(10):
      r = lcruler_row("q8", "passkey", 1024, 0.5, i < right, 100, codec="int8")
      r["variant"]["model"], r["config"] = model, {"cache": cache}
      rows.append(r)
  rows.append({"experiment": "roofline", "config": {"name": "frontier_speed_m"},
               "variant": {"setting": "int8"},
               "workload": {"batch": 8, "context": 4096, "held": 1024},
               "metrics": {"tpot_s": 0.05, "tpot_vs_ref": 0.8, "tpot_vs_ref_ci95": [0.75, 0.85],
                           "roof_fraction": 0.9, "bound": "bytes"}})
  lines = {line.split("|")[2].strip(): line for line in
           doc_tables.shrink_speed_table(rows).splitlines()[2:5]}
  assert list(lines) == ["`bf16`", "`int8`", "`mqa_int8`"]  # most bytes first
  assert "| 9/10 [" in lines["`int8`"] and "| 2/10 [" in lines["`mqa_int8`"]
  assert "| — | not timed |" in lines["`bf16`"]
  assert "| 0.80× [0.75, 0.85] | 50.0 ms | 1,024 | 0.90 (bytes) |" in lines["`int8`"]
  assert "+2 % [+1, +4] | +1 % [+0.5, +2]" in lines["`int8`"]


def test_lc_models_table_has_a_line_per_model_and_a_column_per_setting(doc_tables):
  """Each model's settings against its own fp32 cache: right in all with the Wilson
  interval, '*' where it is apart from fp32's, right per task, bytes per prefix token."""
  rows = []
  for model, variant, fp32_right in (("gemma3-270m", "MQA", 20), ("smollm2-135m", "GQA-3", 18)):
    for setting, codec, right in (("fp32", "fp32", fp32_right),
                                  ("int4", "int4", 4 if model == "gemma3-270m" else 17)):
      for i in range(20):
        r = lcruler_row(setting, "passkey" if i < 10 else "niah", 1024, 0.5, i < right, 0,
                   codec=codec)
        r["variant"].update(model=model, variant=variant)
        r["workload"]["template"] = "model"
        r["config"] = {"cache": {"policy": "full"}}
        rows.append(r)
  held = {(r["variant"]["model"], r["variant"]["setting"]): f"{doc_tables._bpt(r):,.0f} B"
          for r in rows}  # kvjax.footprint's count of the row's setting
  lines = doc_tables.lc_models_table(rows).splitlines()
  assert lines[0] == "| model | variant | `fp32` | `int4` |"
  assert lines[2] == (
      f"| gemma3-270m | MQA | 20/20 [0.84, 1.00] (niah 10/10, passkey 10/10; "
      f"{held['gemma3-270m', 'fp32']}) | 4/20* [0.08, 0.42] (niah 0/10, passkey 4/10; "
      f"{held['gemma3-270m', 'int4']}) |")
  assert lines[3] == (
      f"| smollm2-135m | GQA-3 | 18/20 [0.70, 0.97] (niah 8/10, passkey 10/10; "
      f"{held['smollm2-135m', 'fp32']}) | 17/20 [0.64, 0.95] (niah 7/10, passkey 10/10; "
      f"{held['smollm2-135m', 'int4']}) |")
  with pytest.raises(SystemExit, match="configs/long_context_models.yaml"):
    doc_tables.lc_models_table([])


def test_ruler_table_ranks_calibrated_tasks(doc_tables):
  """A family's cells read only the tasks fp32 answers; the others are listed."""
  rows = [ruler_row("niah_single_1", "fp32", 1.0), ruler_row("niah_single_1", "int4", 0.0),
          ruler_row("niah_multikey_3", "fp32", 0.0), ruler_row("niah_multikey_3", "int4", 1.0)]
  text = doc_tables.ruler_table(rows)
  assert "niah (1 of 2 tasks)" in text and "niah_multikey_3 (0.00)" in text
  assert "| `int4` | blind | 1.00 | 0.00" in text
