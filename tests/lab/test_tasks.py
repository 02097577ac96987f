"""Long-context tasks: generators, scoring, answering through the cache, the experiment."""

import jax
import numpy as np
import pytest
from conftest import tiny_config, tiny_params

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.io.tokenizer import ByteTokenizer
from kvjax.lab import evaluate, tasks
from kvjax.lab.tasks import through_cache

ENC = ByteTokenizer().encode


def _words(text: str) -> list[str]:
  """A second, coarser 'tokenizer' (one id per word) to show generators are agnostic."""
  return text.split()


@pytest.mark.parametrize("task,depths", [("passkey", [0.3]), ("niah", [0.0, 0.5, 1.0]),
                                         ("vt", [0.2, 0.7])])
def test_generators_deterministic_per_seed(task, depths):
  a = tasks.generate(task, ENC, 1500, depths, seed=3)
  b = tasks.generate(task, ENC, 1500, depths, seed=3)
  c = tasks.generate(task, ENC, 1500, depths, seed=4)
  assert a == b
  assert [q.answer for q in a.queries] != [q.answer for q in c.queries]


@pytest.mark.parametrize("encode", [ENC, _words], ids=["bytes", "words"])
@pytest.mark.parametrize("task,depths", [("passkey", [0.0]), ("passkey", [0.5]),
                                         ("passkey", [1.0]), ("niah", [0.1, 0.4, 0.9]),
                                         ("vt", [0.1, 0.5])])
def test_answer_where_they_say(task, depths, encode):
  target = 2000 if encode is ENC else 400
  e = tasks.generate(task, encode, target, depths, seed=7)
  assert len(e.queries) == len(depths)
  answers = [q.answer for q in e.queries]
  assert len(set(answers)) == len(answers)  # distractors differ from the answer
  for q, d in zip(e.queries, depths):
    assert q.depth == d
    assert e.prefix.count(q.answer) == 1  # the fact appears exactly once...
    assert q.answer not in q.tail  # ...and never in the question
    line_end = e.prefix.index(".", q.fact_char + len("VAR ABCDE = ")) + 1
    assert q.answer in e.prefix[q.fact_char:line_end]  # ...at the offset the query names
    assert q.fact_token == len(encode(e.prefix[:q.fact_char]))
    # depth respected: the fact sits at that fraction of the haystack (between the
    # instructions and the end of the prefix), within a few filler sentences
    start = len(encode(e.prefix.split("\n", 1)[0])) + 1
    frac = (q.fact_token - start) / (e.prefix_tokens - start)
    assert abs(frac - d) < 0.06, (frac, d)
    if task == "niah":
      assert q.key in q.tail and e.prefix.count(f"number for {q.key} is") == 1
    if task == "vt":
      assert f"VAR {q.key} = VAR " in e.prefix and q.key in q.tail


def test_vt_chain_order_and_hops():
  e = tasks.generate("vt", ENC, 3000, [0.3], seed=1, hops=2)
  q = e.queries[0]
  names = []
  name = q.key
  for _ in range(2):  # follow the chain back from the asked variable
    i = e.prefix.index(f"VAR {name} = VAR ")
    src = e.prefix[i:].split("VAR ")[2].split(".")[0]
    assert e.prefix.index(f"VAR {src} = ") < i  # a hop comes after its source
    names.append(name)
    name = src
  assert e.prefix.index(f"VAR {name} = {q.answer}.") == q.fact_char
  with pytest.raises(KvjaxError, match="hops"):
    tasks.generate("vt", ENC, 3000, [0.3], hops=-1)


@pytest.mark.parametrize("task,depths", [("passkey", [0.5]), ("niah", [0.2, 0.8]),
                                         ("vt", [0.5])])
@pytest.mark.parametrize("target", [700, 3000])
def test_fitted_to_target(task, depths, target):
  e = tasks.generate(task, ENC, target, depths, seed=0, template=tasks.CHATML)
  longest = max(len(ENC(q.tail)) for q in e.queries)
  assert e.n_tokens == len(ENC(e.prefix)) + longest == e.prefix_tokens + longest
  sentence = max(len(ENC(s)) for s in tasks.FILLER.split(".")) + 2
  assert target - sentence <= e.n_tokens <= target
  assert e.prefix.startswith(tasks.CHATML.user)
  assert all(tasks.CHATML.assistant in q.tail for q in e.queries)


@pytest.mark.parametrize("task", ["passkey", "niah"])
def test_a_base_model_prompt_names_the_fact_only_in_its_fact_line(task):
  """`base` (a model that continues text, not one that follows instructions): no
  instructions, so the answer's opening words ("The pass key is") meet one earlier match,
  the fact's line; `plain` opens with instructions that name the fact too."""
  base = tasks.generate(task, ENC, 700, [0.5], seed=0, template=tasks.BASE)
  plain = tasks.generate(task, ENC, 700, [0.5], seed=0, template=tasks.PLAIN)
  name = {"passkey": "pass key", "niah": "magic number"}[task]
  assert base.prefix.count(name) == 1 and plain.prefix.count(name) > 1
  assert base.prefix.startswith(tasks.FILLER.split(".")[0])
  q = base.queries[0]
  assert base.prefix.index(name) > q.fact_char - 1 and q.tail == plain.queries[0].tail
  assert "base" in tasks.TEMPLATES


def test_score_exact_digits():
  assert tasks.score(" 12345.", "12345") == 1.0
  assert tasks.score("The key is 12345 indeed", "12345") == 1.0
  assert tasks.score(" 123456", "12345") == 0.0
  assert tasks.score(" 1234", "12345") == 0.0
  assert tasks.score(" 54321 12345", "12345") == 0.0  # the first number counts
  assert tasks.score(" no digits", "12345") == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(task="passkey", target=30, depths=[0.5]), "ask for a longer context"),
    (dict(task="niah", target=1000, depths=[0.5, 1.2]), r"outside \[0, 1\]"),
    (dict(task="passkey", target=1000, depths=[-0.1]), r"outside \[0, 1\]"),
    (dict(task="sudoku", target=1000, depths=[0.5]), "unknown task 'sudoku'"),
    (dict(task="passkey", target=1000, depths=[0.2, 0.4]), "one depth"),
    (dict(task="niah", target=1000, depths=[]), "at least one depth"),
])
def test_bad_input_one_line(kwargs, match):
  with pytest.raises(KvjaxError, match=match) as e:
    tasks.generate(encode=ENC, **kwargs)
  assert "\n" not in str(e.value)


class _Scripted:
  """A stand-in model: reads the prompt as text and answers with the key it finds (or a
  wrong number), decoded through the same tokenizer and scored by `tasks.score`."""

  def __init__(self, copy: bool):
    self.copy = copy

  def answer(self, e: tasks.Example, q: tasks.Query) -> list[int]:
    prompt = e.prefix + q.tail
    if e.task == "passkey":
      key = prompt.split("The pass key is ")[1][:5]
    elif e.task == "niah":
      key = prompt.split(f"number for {q.key} is: ")[1].split(".")[0]
    else:
      name = q.key
      while f"VAR {name} = VAR " in prompt:
        name = prompt.split(f"VAR {name} = VAR ")[1].split(".")[0]
      key = prompt.split(f"VAR {name} = ")[1].split(".")[0]
    if not self.copy:
      key = str((int(key) + 1) % 10 ** len(key)).zfill(len(key))
    return ENC(f" {key}.\n")


@pytest.mark.parametrize("copy,expected", [(True, 1.0), (False, 0.0)])
def test_scripted_model_scores_through_scoring_path(copy, expected):
  model, scores = _Scripted(copy), []
  for task, depths in [("passkey", [0.1]), ("passkey", [0.9]), ("niah", [0.0, 0.5, 1.0]),
                       ("vt", [0.2, 0.6])]:
    e = tasks.generate(task, ENC, 1200, depths, seed=2)
    for q in e.queries:
      out = ByteTokenizer().decode(model.answer(e, q))
      scores.append(tasks.score(out, q.answer))
  assert len(scores) == 7 and np.mean(scores) == expected


# -- through the cache, on a tiny random model -----------------------------------------------
def _tiny(**over):
  base = {"model.vocab_size": 260, "model.max_seq_len": 512}
  return tiny_config(**{**base, **over})


INT2 = {"cache.codec": "int2"}
KIVI4 = {"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 8,
         "cache.residual": 16}


def _last_logits(cfg, params, prefix, tail, capacity=160):
  """(one-shot: prefix + tail in one call, split: prefix prefilled then tail as its own
  call) logits of the last tail token."""
  fresh = cache_lib.init_cache(cfg, 1, capacity)
  fwd, pad = through_cache._forward, through_cache._pad
  static = through_cache._static(cfg)
  shot, _ = fwd(params, *pad(prefix + tail, capacity), fresh, static=static)
  pre = tasks.prefill(cfg, params, prefix, capacity, chunk=64)
  split, _ = fwd(params, *pad(tail, 16), pre, static=static)
  return np.asarray(shot), np.asarray(split)


def test_question_reads_the_encoded_cache():
  """One-shot prefill of prefix + question never reads the codec for the first answer
  token; the question as its own call does. fp32: both agree; int2: they differ."""
  cfg32 = _tiny()
  params = tiny_params(cfg32)
  rng = np.random.default_rng(0)
  prefix, tail = rng.integers(0, 256, 120).tolist(), rng.integers(0, 256, 9).tolist()
  shot32, split32 = _last_logits(cfg32, params, prefix, tail)
  shot2, split2 = _last_logits(config_lib.apply_overrides(cfg32, INT2), params, prefix, tail)
  np.testing.assert_allclose(shot32, split32, atol=2e-5)  # fp32: the split is exact
  np.testing.assert_allclose(shot2, shot32, atol=2e-5)    # one shot: the codec is unseen
  assert np.abs(split2 - split32).max() > 1e-3            # through the cache: it is seen


@pytest.mark.parametrize("over", [INT2, {"cache.k_codec": "int8", "cache.v_codec": "int4"},  # KIVI:
                                  {**KIVI4, "cache.rotate": "hadamard", "cache.keep_first": 4},
                                  {"cache.codec": "int8", "model.sliding_window": 24,
                                   "model.global_every": 2}],
                         ids=["int2", "k8v4", "kivi-rotated-first4", "int8-windowed"])
def test_encode_prefix_is_the_prefill_write(over):
  """Storing an fp32 prefill's K/V through a codec gives the cache a one-shot prefill with
  that codec writes, so the answer after it is the same (shared fp32 prefill is exact); a
  windowed model's rings too, though the fp32 cache kept only their last W tokens."""
  cfg32 = _tiny(**{k: v for k, v in over.items() if k.startswith("model.")})
  params = tiny_params(cfg32)
  cfg = config_lib.apply_overrides(cfg32, over)
  rng = np.random.default_rng(1)
  prefix, tail = rng.integers(0, 256, 100).tolist(), rng.integers(0, 256, 7).tolist()
  ref = tasks.prefill(evaluate.reference_config(cfg), params, prefix, 128, chunk=128)
  moved = tasks.encode_prefix(cfg, tasks.prefix_kv(ref), 128)
  direct = tasks.prefill(cfg, params, prefix, 128, chunk=128)
  assert int(moved.lengths[0]) == int(direct.lengths[0]) == 100
  leaves = lambda c: jax.tree.leaves((c.k, c.v, c.k_win, c.v_win, c.k_first, c.v_first,  # noqa: E731
                                       c.k_ring, c.v_ring))
  for a, b in zip(leaves(moved), leaves(direct)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=1e-5 if a.dtype.kind == "f" else 1)
  got = tasks.answer_through_cache(cfg, params, moved, tail, 6, tail_pad=16)
  want = tasks.answer_through_cache(cfg, params, direct, tail, 6, tail_pad=16)
  assert got == want and len(got) == 6
  ref_tokens = tasks.answer_through_cache(evaluate.reference_config(cfg), params, ref, tail,
                                          6, tail_pad=16)
  assert len(ref_tokens) == 6


def test_prefix_kv_refuses_a_lossy_cache():
  cfg = config_lib.apply_overrides(_tiny(), INT2)
  c = tasks.prefill(cfg, tiny_params(cfg), [1, 2, 3], 16)
  with pytest.raises(KvjaxError, match="fp32 contiguous"):
    tasks.prefix_kv(c)


def test_answer_matches_generate_with_fp32():
  """The split path decodes what `generate.generate` decodes from the whole prompt (fp32)."""
  cfg = _tiny()
  params = tiny_params(cfg)
  rng = np.random.default_rng(2)
  prefix, tail = rng.integers(0, 256, 80).tolist(), rng.integers(0, 256, 5).tolist()
  c = tasks.prefill(cfg, params, prefix, 100, chunk=32)
  got = tasks.answer_through_cache(cfg, params, c, tail, 8, tail_pad=8)
  want = evaluate.greedy_tokens(cfg, params, [prefix + tail], 8)[0]
  assert got == list(want)


# -- through an eviction policy ------------------------------------------------------------------
SNAP8 = {"cache.policy": "snapkv", "cache.ratio": 0.5, "cache.window": 4, "cache.codec": "int8"}


def _gqa():
  return _tiny(**{"model.n_kv_heads": 2})


@pytest.mark.parametrize("over", [SNAP8, {"cache.policy": "knorm", "cache.budget": 20},
                                  {"cache.policy": "sinks", "cache.ratio": 0.25,
                                   "cache.sinks": 2}, {**SNAP8, "cache.rotate": "hadamard"}],
                         ids=["snapkv-int8", "knorm", "sinks", "snapkv-int8-rotated"])
def test_evict_prefix_is_the_policy_prefill(over):
  """One fp32 prefill with its queries, stored through the codec and compacted, is the cache
  `evict.prefill` makes for the prefix with that setting; the question reads `budget`
  tokens of the prefix (slots [0, held)), and a ring keeps holding its budget to the end."""
  from kvjax import decode
  from kvjax.decode import evict

  cfg32 = _gqa()
  params = tiny_params(cfg32)
  cfg = config_lib.apply_overrides(cfg32, over)
  rng = np.random.default_rng(4)
  prefix, tail = rng.integers(0, 256, 90).tolist(), rng.integers(0, 256, 6).tolist()
  width, room = 96, 16 + 5
  pre = tasks.prefill_queries(evaluate.reference_config(cfg), params, prefix, width)
  got = tasks.evict_prefix(cfg, pre, room)
  tok, n = through_cache._pad(prefix, width)
  _, _, want = evict.prefill(params, tok, n, cache_lib.init_cache(cfg, 1, width + room),
                             jax.random.PRNGKey(0), static=step.Static.of(cfg),
                             sampler=decode.Sampler())
  budget = over.get("cache.budget") or int(np.ceil(over["cache.ratio"] * 90))
  assert got.spec.layout == "compacted" and int(got.held[0]) == budget < 90
  assert int(got.lengths[0]) == 90 and int(got.budget[0]) == budget
  assert got.spec.capacity == want.spec.capacity
  for a, b in zip(jax.tree.leaves((got.k, got.v, got.held)), jax.tree.leaves((want.k, want.v,
                                                                              want.held))):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=1e-5 if a.dtype.kind == "f" else 1)
  ans = tasks.answer_through_cache(cfg, params, got, tail, 5, tail_pad=16)
  assert ans == tasks.answer_through_cache(cfg, params, want, tail, 5, tail_pad=16)
  if over["cache.policy"] == "sinks":  # the ring still holds exactly its budget afterwards
    _, after = through_cache._forward(params, *through_cache._pad(tail, 16), got,
                                      static=through_cache._static(cfg))
    assert int(after.held[0]) == budget and int(after.lengths[0]) == 96


def test_full_through_the_policy_path_answers_like_the_codec_path():
  """`full` (and a policy keeping every token) through the one-call prefill answers exactly
  like the chunked fp32 prefill stored through the codec (today's path)."""
  cfg = config_lib.apply_overrides(_gqa(), {"cache.codec": "int8"})
  params = tiny_params(cfg)
  rng = np.random.default_rng(5)
  prefix, tail = rng.integers(0, 256, 70).tolist(), rng.integers(0, 256, 6).tolist()
  ref = evaluate.reference_config(cfg)
  old = tasks.encode_prefix(cfg, tasks.prefix_kv(tasks.prefill(ref, params, prefix, 128, 32)),
                            128)
  want = tasks.answer_through_cache(cfg, params, old, tail, 6, tail_pad=16)
  pre = tasks.prefill_queries(ref, params, prefix, 80)
  full = tasks.evict_prefix(cfg, pre, 22)
  assert full.spec.layout == "contiguous" and full.spec.capacity == 102
  assert tasks.answer_through_cache(cfg, params, full, tail, 6, tail_pad=16) == want
  keep_all = config_lib.apply_overrides(cfg, {"cache.policy": "knorm", "cache.ratio": 1.0})
  c = tasks.evict_prefix(keep_all, pre, 22)
  assert int(c.held[0]) == 70
  assert tasks.answer_through_cache(keep_all, params, c, tail, 6, tail_pad=16) == want


# -- the experiment, end to end ----------------------------------------------------------------
def _experiment_cfg(tmp_path, **params):
  model = tmp_path / "tiny.yaml"
  model.write_text("model: {vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 4, "
                   "n_kv_heads: 2, d_ff: 48, max_seq_len: 1024}\ntokenizer: bytes\n")
  p = {"models": [f"config:{model}"], "context": 700, "setting": "int4_kivi",
       "tasks": ["passkey", "niah", "vt"], "depths": [0.25, 0.75], "gen_len": 4,
       "tail_pad": 192, "chunk": 256,
       "settings": {"fp32": {"cache.codec": "fp32"},
                    "int4_kivi": {"cache.codec": "int4", "cache.k_axis": "channel",
                                  "cache.group_size": 8, "cache.residual": 16},
                    "snap_50_int8": {"cache.policy": "snapkv", "cache.ratio": 0.5,
                                     "cache.window": 8, "cache.codec": "int8"},
                    "sinks_25": {"cache.policy": "sinks", "cache.ratio": 0.25,
                                 "cache.sinks": 4},
                    "h2o_25": {"cache.policy": "h2o", "cache.ratio": 0.25,
                               "cache.window": 8}}}
  p.update(params)
  return config_lib.apply_overrides(config_lib.Config(), {
      "experiment": "long_context", "params": p})


@pytest.fixture(scope="module")
def cell_rows(tmp_path_factory):
  """Rows of two cells (int4 KIVI-style and fp32) of the experiment on the tiny model."""
  from kvjax.lab.experiments import long_context

  tmp = tmp_path_factory.mktemp("lc")
  kivi = _experiment_cfg(tmp)
  long_context.check(kivi)
  return long_context.run_cell(kivi), long_context.run_cell(_experiment_cfg(tmp, setting="fp32"))


def test_run_cell_end_to_end(cell_rows):
  from kvjax.lab import intervals
  from kvjax.lab.experiments import long_context

  rows, fp32 = cell_rows
  # passkey: one example per depth; niah and vt: one example, one query per depth
  assert [r["workload"]["task"] for r in rows] == ["passkey"] * 2 + ["niah"] * 2 + ["vt"] * 2
  for r in rows:
    w, m, v = r["workload"], r["metrics"], r["variant"]
    assert w["context"] == 700 and 700 - 40 <= w["prompt_tokens"] + w["gen_len"] <= 700
    assert m["accuracy"] in (0.0, 1.0) and m["accuracy"] == tasks.score(m["output"], m["answer"])
    assert v["setting"] == "int4_kivi" and v["k_axis"] == "channel" and v["residual"] == 16
    assert v["k_codec"] == "int4" and v["model"] == "tiny"
    assert m["bytes_per_token"] < 2 * 2 * 2 * 8 * 4  # well under fp32's L*2*K*D*4 bytes
    assert m["bytes_per_token"] > m["bytes_per_token_asymptotic"]  # the 16-token window
  assert sorted({r["workload"]["depth"] for r in rows}) == [0.25, 0.75]
  prefix = fp32[0]["workload"]["prefix_tokens"]  # held: the prefix's K/V and its length
  assert fp32[0]["metrics"]["bytes_per_token"] == pytest.approx(2 * 2 * 2 * 8 * 4 + 4 / prefix)
  assert [r["workload"]["prompt_tokens"] for r in fp32] == \
      [r["workload"]["prompt_tokens"] for r in rows]  # same prompts for every setting
  table = long_context.summary(rows + fp32)
  assert {(t["setting"], t["task"]) for t in table} == {
      (s, t) for s in ("fp32", "int4_kivi") for t in ("passkey", "niah", "vt")}
  for t in table:  # two queries a task: the count right, the number asked, Wilson's interval
    got = [r["metrics"]["accuracy"] for r in rows + fp32
           if (r["variant"]["setting"], r["workload"]["task"]) == (t["setting"], t["task"])]
    assert (t["correct"], t["n"]) == (sum(got), 2) and t["accuracy"] == sum(got) / 2
    lo, hi = intervals.wilson(t["correct"], 2)
    assert t["accuracy_ci95"] == f"[{lo:.2f}, {hi:.2f}]"
    assert 0 <= lo <= t["accuracy"] <= hi <= 1 and hi - lo > 0.5  # two queries say little


def test_plots_from_rows(cell_rows, tmp_path):
  import json

  from kvjax.lab import plots
  res = tmp_path / "res"
  res.mkdir()
  with open(res / "long_context.jsonl", "w") as f:
    for r in cell_rows[0] + cell_rows[1]:
      f.write(json.dumps({"experiment": "long_context", **r}) + "\n")
  written = plots.plot_all(res, tmp_path / "plots")
  names = sorted(p.name for p in written)
  assert names == ["long_context_accuracy_vs_bytes.png", "long_context_accuracy_vs_bytes.svg",
                   "long_context_heatmap.png", "long_context_heatmap.svg"]
  assert all(p.stat().st_size > 1000 for p in written)


def test_policy_cell_answers_through_the_compacted_cache(tmp_path, cell_rows):
  """A policy setting: every query is answered through a cache holding ceil(ratio x prefix)
  prefix tokens, and its bytes per token are what that cache holds per prefix token: the
  codec's (plus what the policy keeps per held token: h2o's score and position, 8 bytes per
  layer and KV head) for each kept token, and its int32 counters."""
  import math

  from kvjax.lab.experiments import long_context

  fp32 = cell_rows[1]
  for name, ratio, codec_bpt, state_bpt in (
      ("snap_50_int8", 0.5, 2 * 2 * 2 * (8 + 2), 0),  # + fp16 scale
      ("h2o_25", 0.25, 2 * 2 * 2 * 8 * 4, 8 * 2 * 2)):
    cfg = _experiment_cfg(tmp_path, setting=name)
    long_context.check(cfg)
    rows = long_context.run_cell(cfg)
    assert [r["workload"]["prompt_tokens"] for r in rows] == \
        [r["workload"]["prompt_tokens"] for r in fp32]  # the same prompts as every setting
    for r in rows:
      m, v = r["metrics"], r["variant"]
      prefix = r["workload"]["prefix_tokens"]
      assert prefix < r["workload"]["prompt_tokens"]
      assert m["held_tokens"] == math.ceil(ratio * prefix) and m["kept"] == m["held_tokens"] / prefix
      assert m["codec_bytes_per_token"] == codec_bpt
      # held: the kept tokens with their state, and lengths/held/budget (3 int32)
      assert m["bytes_per_token"] == pytest.approx(
          ((codec_bpt + state_bpt) * m["held_tokens"] + 12) / prefix)
      assert v["policy"] in ("snapkv", "h2o") and v["ratio"] == ratio and v["setting"] == name
      assert m["accuracy"] == tasks.score(m["output"], m["answer"])
  assert {"policy", "held_tokens"}.isdisjoint(fp32[0]["variant"] | fp32[0]["metrics"])


def test_mean_pooled_kv_heads_setting(tmp_path, cell_rows):
  """`params.kv_heads` in a setting: the model's K/V heads mean-pooled (GQA-2 -> MQA here),
  its own prefill, half the bytes per token; with a policy on top, both apply."""
  from kvjax.lab.experiments import long_context

  settings = {"mqa": {"params.kv_heads": 1},
              "mqa_win": {"params.kv_heads": 1, "cache.policy": "window", "cache.ratio": 0.5}}
  for name in settings:
    cfg = _experiment_cfg(tmp_path, setting=name, settings=settings, tasks=["passkey"],
                          depths=[0.5])
    long_context.check(cfg)
    (row,) = long_context.run_cell(cfg)
    assert row["variant"]["kv_heads"] == 1 and row["variant"]["variant"] == "MQA"
    kept = row["metrics"].get("kept", 1.0)
    assert row["metrics"]["bytes_per_token"] == pytest.approx(2 * 2 * 1 * 8 * 4 * kept, rel=1e-3)
    assert kept == 1.0 if name == "mqa" else kept < 0.51
  with pytest.raises(KvjaxError, match="2 KV heads into 3; --kv-heads must divide 2"):
    long_context.check(_experiment_cfg(tmp_path, setting="bad",
                                       settings={"bad": {"params.kv_heads": 3}}))


@pytest.mark.parametrize("setting,match", [
    ({"cache.policy": "snapkv", "cache.ratio": 0.5, "cache.codec": "int4",
      "cache.k_axis": "channel", "cache.group_size": 8, "cache.residual": 16},
     "compacts single tokens"),
    ({"cache.policy": "window", "cache.ratio": 0.5, "cache.layout": "none"},
     "needs cache.layout=contiguous or paged"),
    ({"cache.policy": "tova", "cache.ratio": 1.5}, r"finite number in \[0, 1\]"),
    ({"cache.policy": "snapkv", "cache.ratio": 0.01, "cache.window": 16}, "raise the ratio"),
    ({"cache.policy": "lru", "cache.ratio": 0.5}, "unknown cache.policy"),
])
def test_bad_policy_setting_is_one_line_before_any_cell(tmp_path, setting, match):
  """Refused by the experiment's check, and by `kvjax run` before any cell has run."""
  import yaml

  from kvjax.lab import runner
  from kvjax.lab.experiments import long_context

  cfg = _experiment_cfg(tmp_path, setting="bad", settings={"bad": setting})
  with pytest.raises(KvjaxError, match=match) as e:
    long_context.check(cfg)
  assert "\n" not in str(e.value)
  p = cfg.to_dict()["params"]
  p["settings"] = {"fp32": {"cache.codec": "fp32"}, "bad": setting}
  p.pop("setting")
  path = tmp_path / "lc.yaml"
  path.write_text(yaml.safe_dump({"experiment": "long_context", "params": p,
                                  "grid": {"params.setting": ["fp32", "bad"]}}))
  with pytest.raises(KvjaxError, match=match) as e:
    runner.run_file(path, out_dir=tmp_path / "out", progress=False)
  assert "\n" not in str(e.value)
  assert not list((tmp_path / "out").glob("*.jsonl")) or \
      not (tmp_path / "out" / "long_context.jsonl").read_text()


def test_eviction_rows_get_their_own_plots(cell_rows, tmp_path):
  """Rows with a policy draw accuracy vs bytes per method, vs context at a fixed budget and
  by depth, not the codec plots (whose names docs/img already holds)."""
  import copy
  import json

  from kvjax.lab import plots
  rows = []
  for ctx in (700, 1400):
    for r in cell_rows[1]:  # fp32, then each policy at two ratios
      base = copy.deepcopy(r)
      base["workload"]["context"] = ctx
      rows.append(base)
      for pol in ("window", "snapkv"):
        for ratio in (0.5, 0.25):
          e = copy.deepcopy(base)
          e["variant"].update(policy=pol, ratio=ratio, setting=f"{pol}_{ratio}")
          e["metrics"].update(held_tokens=int(ratio * ctx), kept=ratio,
                              bytes_per_token=ratio * e["metrics"]["bytes_per_token"])
          rows.append(e)
  res = tmp_path / "res"
  res.mkdir()
  (res / "long_context.jsonl").write_text("".join(
      json.dumps({"experiment": "long_context", **r}) + "\n" for r in rows))
  names = sorted(p.name for p in plots.plot_all(res, tmp_path / "plots") if p.suffix == ".png")
  assert names == ["long_context_evict_accuracy_vs_bytes.png",
                   "long_context_evict_accuracy_vs_context.png", "long_context_evict_depth.png"]


@pytest.mark.parametrize("params,match", [
    ({"context": 20}, "ask for a longer context"),
    ({"depths": [1.5]}, r"outside \[0, 1\]"),
    ({"tasks": ["sudoku"]}, "unknown task"),
    ({"setting": "int3"}, "unknown params.setting 'int3'"),
    ({"models": []}, "params.models"),
    ({"template": "alpaca"}, "unknown params.template"),
])
def test_experiment_check_one_line(tmp_path, params, match):
  from kvjax.lab.experiments import long_context

  with pytest.raises(KvjaxError, match=match) as e:
    long_context.check(_experiment_cfg(tmp_path, **params))
  assert "\n" not in str(e.value)
