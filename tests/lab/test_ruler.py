"""The RULER-style suite: its generators and scoring, question-aware eviction, the experiment."""

import collections
import re

import jax
import numpy as np
import pytest
from conftest import ruler_row, tiny_config, tiny_params

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.io.tokenizer import ByteTokenizer
from kvjax.lab import evaluate, intervals, tasks
from kvjax.lab.tasks import calibration, haystack, ruler, through_cache

ENC = ByteTokenizer().encode
PROSE = " ".join(f"Sentence number {i} of the story went on. It was a quiet day {i}!"
                 for i in range(400))


def _words(text: str) -> list[str]:
  """A coarser 'tokenizer' (one id per word): generators take any encode function."""
  return text.split()


def _make(task, target=6000, seed=0, encode=ENC, template=haystack.PLAIN):
  return ruler.make(task, encode, target, seed=seed, template=template, prose=PROSE)


# -- generators --------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ruler.TASKS)
def test_deterministic_and_seeded(task):
  a, b, c = _make(task), _make(task), _make(task, seed=1)
  assert a == b and a.context != c.context
  assert a.family == ruler.FAMILY[task] and all(q.expected for q in a.asks)


@pytest.mark.parametrize("encode", [ENC, _words], ids=["bytes", "words"])
@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("target", [5000, 12000])
def test_fitted_to_target(task, target, encode):
  """Context + the longest question fill the target, within one haystack piece."""
  e = _make(task, target, encode=encode)
  longest = max(len(encode(q.tail)) for q in e.asks)
  assert e.context_tokens == len(encode(e.context))
  assert e.n_tokens == e.context_tokens + longest <= target
  assert e.n_tokens > target - (120 if encode is ENC else 25)


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if ruler.FAMILY[t] == "niah"])
def test_needles_hold_what_the_questions_ask(task):
  """Every expected value is in the context once, in a needle line naming the asked key,
  and the fact's token offset points at it; multikey prompts ask each needle in turn."""
  e = _make(task)
  for q in e.asks:
    for v in q.expected:
      assert e.context.count(v) == 1
      line = re.search(r"One of the special magic \w+ for ([\w-]+) is: " + re.escape(v), e.context)
      assert line and line.group(1) in q.tail
    assert e.context.count(q.key if "," not in q.key else q.key.split(",")[0]) >= 1
    where = ENC(e.context)[q.fact_token:q.fact_token + 20]
    assert bytes(where).decode(errors="ignore").startswith("One of the special")
  asked = {"niah_multikey_1": 4, "niah_multikey_2": 4, "niah_multikey_3": 4}.get(task, 1)
  assert len(e.asks) == asked
  values = {"niah_multivalue": 4, "niah_multiquery": 4}.get(task, 1)
  assert all(len(q.expected) == values for q in e.asks)
  if task.startswith("niah_multikey_2") or task.startswith("niah_multikey_3"):
    assert e.haystack == "needles" and e.context.count("One of the special magic") > 20
  if task == "niah_single_1":
    assert e.haystack == "noise" and "The grass is green." in e.context


def test_uuid_values_are_uuids():
  e = _make("niah_multikey_3")
  for q in e.asks:
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                        q.expected[0])
    assert re.fullmatch(r"[0-9a-f-]{36}", q.key)


def test_vt_chain_in_order():
  """The value line first, each link after the one it copies; the answer names all five."""
  e = _make("vt")
  (q,) = e.asks
  names = q.expected
  assert len(names) == ruler.HOPS + 1
  first = e.context.index(f"VAR {names[0]} = {q.key}.")
  at = [e.context.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
  assert first < at[0] and at == sorted(at)
  assert f"assigned the value {q.key}" in q.tail


def test_cwe_counts():
  e = _make("cwe", 8000)
  words = collections.Counter(re.findall(r"^\d+\. (\w+)$", e.context, re.M))
  (q,) = e.asks
  assert all(words[w] == ruler.COMMON for w in q.expected) and len(q.expected) == 10
  assert {c for w, c in words.items() if w not in q.expected} == {ruler.RARE}


def test_fwe_expects_the_drawn_texts_top_words():
  e = _make("fwe", 8000)
  body = e.context.split("\n")[1].split()
  top = [w for w, _ in collections.Counter(body).most_common(3)]
  assert set(e.asks[0].expected) == set(top)


def test_chat_template_wraps_and_base_has_no_instructions():
  chat = _make("niah_single_2", template=haystack.CHATML)
  assert chat.context.startswith("<|im_start|>user\nSome special magic")
  assert "<|im_start|>assistant\nThe special magic number for" in chat.asks[0].tail
  base = _make("niah_single_2", template=haystack.BASE)
  assert "hidden inside" not in base.context


def test_score_is_the_share_found():
  assert ruler.score("a 123 and 456", ["123", "456"]) == 1.0
  assert ruler.score("ABC only", ["abc", "def", "ghi", "jkl"]) == 0.25
  assert ruler.score("nothing", ["1"]) == 0.0
  with pytest.raises(KvjaxError, match="at least one"):
    ruler.score("x", [])


def test_expand_families():
  assert ruler.expand("aggregation") == ["cwe", "fwe"]
  assert ruler.expand(["vt", "all"])[0] == "vt" and len(ruler.expand("all")) == 11
  assert ruler.expand(["niah"]) == [t for t in ruler.TASKS if t.startswith("niah")]


@pytest.mark.parametrize("call,match", [
    (lambda: _make("sudoku"), "unknown task 'sudoku'"),
    (lambda: _make("niah_single_1", 0), "must be positive"),
    (lambda: _make("cwe", 500), "ask for a longer context"),
    (lambda: ruler.make("niah_single_2", ENC, 4000), "named prose text"),
    (lambda: ruler.expand(["nope"]), "unknown task 'nope'"),
])
def test_bad_input_one_line(call, match):
  with pytest.raises(KvjaxError, match=match) as e:
    call()
  assert "\n" not in str(e.value)


def test_shares_interval():
  """0/1 scores: Wilson's interval exactly; shares: within [0, 1] around the mean."""
  for k, n in ((0, 5), (3, 10), (10, 10)):
    got = intervals.shares([1.0] * k + [0.0] * (n - k))
    assert got["score"] == k / n and got["n"] == n
    np.testing.assert_allclose(got["score_ci95"], intervals.wilson(k, n), atol=1e-9)
  frac = intervals.shares([0.25, 0.5, 0.75, 1.0])
  lo, hi = frac["score_ci95"]
  assert 0 <= lo < 0.625 < hi <= 1
  assert intervals.shares([])["score_ci95"] is None


# -- question-aware eviction on a tiny model -------------------------------------------------
def _gqa():
  return tiny_config(**{"model.vocab_size": 260, "model.max_seq_len": 512,
                        "model.n_kv_heads": 2})


@pytest.mark.parametrize("over", [
    {"cache.policy": "snapkv", "cache.ratio": 0.5, "cache.window": 4, "cache.codec": "int8"},
    {"cache.policy": "h2o", "cache.ratio": 0.25, "cache.window": 4},
    {"cache.policy": "tova", "cache.ratio": 0.5}], ids=["snapkv-int8", "h2o", "tova"])
def test_aware_is_the_policy_prefill_of_context_and_question(over):
  """The question fed through the context's fp32 cache with its queries kept, then
  compacted: the cache `evict.prefill` makes for context + question as one prompt, and the
  logits of that prompt's last token; the answer then reads the compacted cache."""
  from kvjax import decode
  from kvjax.decode import evict

  cfg32 = _gqa()
  params = tiny_params(cfg32)
  cfg = config_lib.apply_overrides(cfg32, over)
  rng = np.random.default_rng(7)
  prefix, tail = rng.integers(0, 256, 90).tolist(), rng.integers(0, 256, 7).tolist()
  width, tail_pad, room = 96, 16, 5
  ref = evaluate.reference_config(cfg)
  pre = tasks.prefill_queries(ref, params, prefix, width)
  last, got = tasks.aware(cfg, ref, params, pre, tail, tail_pad, room)
  tok, n = through_cache._pad(prefix + tail, width + tail_pad)
  first, want_last, want = evict.prefill(
      params, tok, n, cache_lib.init_cache(cfg, 1, width + tail_pad + room),
      jax.random.PRNGKey(0), static=step.Static.of(cfg), sampler=decode.Sampler())
  np.testing.assert_allclose(np.asarray(last), np.asarray(want_last), atol=2e-4)
  budget = int(np.ceil(over["cache.ratio"] * 97))
  assert int(got.held[0]) == int(want.held[0]) == budget and int(got.lengths[0]) == 97
  for a, b in zip(jax.tree.leaves((got.k, got.v)), jax.tree.leaves((want.k, want.v))):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-4)
  ans = tasks.continue_greedy(cfg, params, got, int(first[0]), 4)
  assert ans == tasks.continue_greedy(cfg, params, want, int(first[0]), 4)


def test_aware_differs_from_blind_where_the_question_matters():
  """snapkv's window is the question under the aware protocol and the end of the context
  under the blind one, so the tokens each keeps differ."""
  cfg32 = _gqa()
  params = tiny_params(cfg32)
  cfg = config_lib.apply_overrides(cfg32, {"cache.policy": "snapkv", "cache.ratio": 0.3,
                                           "cache.window": 4})
  rng = np.random.default_rng(8)
  prefix, tail = rng.integers(0, 256, 90).tolist(), rng.integers(0, 256, 7).tolist()
  ref = evaluate.reference_config(cfg)
  pre = tasks.prefill_queries(ref, params, prefix, 96)
  _, aware = tasks.aware(cfg, ref, params, pre, tail, 16, 5)
  blind = tasks.evict_prefix(cfg, pre, 16 + 5)
  held = int(np.ceil(0.3 * 90))  # the blind budget: a ratio of the context alone
  assert int(aware.held[0]) == int(np.ceil(0.3 * 97)) and int(blind.held[0]) == held
  assert not np.allclose(np.asarray(aware.k[0], np.float32)[..., :held, :],
                         np.asarray(blind.k[0], np.float32)[..., :held, :])


# -- the experiment, end to end ----------------------------------------------------------------
def _cfg(tmp_path, **params):
  model = tmp_path / "tiny.yaml"
  model.write_text("model: {vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 4, "
                   "n_kv_heads: 2, d_ff: 48, max_seq_len: 2048}\ntokenizer: bytes\n")
  p = {"models": [f"config:{model}"], "context": 1024, "task": "niah_multikey_1",
       "sample": 0, "text": "stdlib", "tail_pad": 192,
       "caches": {"fp32": {"cache.codec": "fp32"}, "int4": {"cache.codec": "int4"},
                  "snap_50": {"cache.policy": "snapkv", "cache.ratio": 0.5,
                              "cache.window": 8},
                  "knorm_50": {"cache.policy": "knorm", "cache.ratio": 0.5}}}
  p.update(params)
  return config_lib.apply_overrides(config_lib.Config(), {"experiment": "ruler", "params": p})


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  from kvjax.lab.experiments import ruler as exp

  cfg = _cfg(tmp_path_factory.mktemp("ruler"))
  exp.check(cfg)
  return exp.run_cell(cfg)


def test_run_cell_rows(rows):
  """Four questions (one per needle) x (two codecs, snapkv blind and aware, knorm blind)."""
  got = collections.Counter((r["variant"]["setting"], r["variant"]["protocol"]) for r in rows)
  assert got == {("fp32", "blind"): 4, ("int4", "blind"): 4, ("snap_50", "blind"): 4,
                 ("snap_50", "aware"): 4, ("knorm_50", "blind"): 4}
  for r in rows:
    w, m, v = r["workload"], r["metrics"], r["variant"]
    assert w["task"] == "niah_multikey_1" and w["family"] == "niah" and w["protocol"] == \
        v["protocol"]
    assert w["prompt_tokens"] + w["gen_len"] <= 1024
    assert m["score"] == ruler.score(m["output"], m["expected"])
    assert m["found"] == round(m["score"] * m["expected_n"])
    if v["setting"].startswith(("snap", "knorm")):
      n = w["prompt_tokens"] if v["protocol"] == "aware" else w["context_tokens"]
      assert m["selected_from"] == n and m["held_tokens"] == int(np.ceil(0.5 * n))
  fp32 = [r["metrics"]["bytes_per_token"] for r in rows if r["variant"]["setting"] == "fp32"]
  int4 = [r["metrics"]["bytes_per_token"] for r in rows if r["variant"]["setting"] == "int4"]
  assert fp32[0] == pytest.approx(2 * 2 * 2 * 8 * 4, rel=0.01) and int4[0] < fp32[0] / 3


def test_summary_marks_uncalibrated(rows):
  from kvjax.lab.experiments import ruler as exp

  table = exp.summary(rows)
  fam = {(t["cache"], t["protocol"]): t for t in table["by family"]}
  assert set(fam) == {("fp32", "blind"), ("int4", "blind"), ("snap_50", "blind"),
                      ("snap_50", "aware"), ("knorm_50", "blind")}
  fp32 = np.mean([r["metrics"]["score"] for r in rows if r["variant"]["setting"] == "fp32"])
  for t in fam.values():
    assert t["n"] == 4 and t["calibrated"] == (fp32 >= exp.CALIBRATED)
  flipped = [dict(r, metrics={**r["metrics"], "score": 1.0}) if r["variant"]["setting"] ==
             "fp32" else r for r in rows]
  assert all(t["calibrated"] for t in exp.summary(flipped)["by task"])


def test_family_scored_over_its_calibrated_tasks():
  """niah_single_1 is answered by fp32 (1.0), niah_multikey_3 is not (0.0): niah is read from
  single_1 alone, its one task; a family whose every task fp32 misses is beyond the model,
  read whole; no fp32 rows leave calibration unknown."""
  from kvjax.lab.experiments import ruler as exp

  rows = [ruler_row("niah_single_1", "fp32", 1.0), ruler_row("niah_single_1", "int4", 0.0),
          ruler_row("niah_multikey_3", "fp32", 0.0), ruler_row("niah_multikey_3", "int4", 1.0),
          ruler_row("cwe", "fp32", 0.5), ruler_row("cwe", "int4", 0.25)]
  assert calibration.calibration(rows) == {("m", 8192, "niah_single_1"): 1.0,
                                     ("m", 8192, "niah_multikey_3"): 0.0,
                                     ("m", 8192, "cwe"): 0.5}
  fam = {(t["family"], t["cache"]): t for t in exp.summary(rows)["by family"]}
  assert fam[("niah", "int4")]["score"] == 0.0 and fam[("niah", "int4")]["tasks"] == 1
  assert fam[("niah", "fp32")]["score"] == 1.0 and fam[("niah", "fp32")]["calibrated"]
  assert fam[("aggregation", "int4")]["score"] == 0.25
  assert fam[("aggregation", "int4")]["calibrated"] is False
  task = {(t["task"], t["cache"]): t["calibrated"] for t in exp.summary(rows)["by task"]}
  assert task[("niah_single_1", "int4")] and not task[("niah_multikey_3", "int4")]
  blind = [r for r in rows if r["variant"]["setting"] != "fp32"]
  assert calibration.family_rows(blind) == (blind, None)


@pytest.mark.parametrize("params,match", [
    ({"task": "sudoku"}, "unknown task 'sudoku'"),
    ({"context": 4096}, "exceed model.max_seq_len"),
    ({"protocols": ["psychic"]}, "unknown params.protocols"),
    ({"protocols": ["aware"]}, "knorm scores without queries"),
    ({"caches": {"x": {"model.d_model": 8}}}, "must map cache.. keys"),
    ({"caches": {"x": {"cache.policy": "snapkv", "cache.ratio": 1.5}}}, "ratio"),
    ({"caches": {"x": {"cache.policy": "psychic", "cache.ratio": 0.5}}}, "psychic"),
    ({"caches": None}, "params.caches"),
    ({"template": "alpaca"}, "unknown params.template"),
    ({"tail_pad": 64}, "raise params.tail_pad"),
    ({"task": "cwe"}, "ask for a longer context"),
])
def test_check_one_line(tmp_path, params, match):
  from kvjax.lab.experiments import ruler as exp

  with pytest.raises(KvjaxError, match=match) as e:
    exp.check(_cfg(tmp_path, **params))
  assert "\n" not in str(e.value)


def test_prefill_flops_counts_windowed_layers_by_their_window():
  from kvjax.lab.experiments import ruler as exp

  m = tiny_config().model
  full = exp.prefill_flops(m, 1024)
  win = exp.prefill_flops(config_lib.apply_overrides(
      tiny_config(), {"model.sliding_window": 64, "model.global_every": 2}).model, 1024)
  assert win < full and exp.prefill_flops(m, 2048) > 2 * full


def test_plot_from_rows(rows, tmp_path):
  import json

  from kvjax.lab import plots
  res = tmp_path / "res"
  res.mkdir()
  (res / "ruler.jsonl").write_text("".join(
      json.dumps({"experiment": "ruler", **r}) + "\n" for r in rows))
  written = plots.plot_all(res, tmp_path / "plots")
  assert sorted(p.name for p in written) == ["ruler_tiny.png", "ruler_tiny.svg"]
  assert all(p.stat().st_size > 1000 for p in written)


def test_a_prefill_the_memory_cannot_hold_is_refused_before_it_starts(tmp_path, monkeypatch):
  from kvjax.lab.experiments import ruler as exp

  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", "1MiB")
  with pytest.raises(KvjaxError, match="one-call prefill.*queries x2") as e:
    exp.check(_cfg(tmp_path))
  assert "\n" not in str(e.value)
