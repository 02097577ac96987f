"""Quality through the cache: the harness is exact with the fp32 cache, metrics behave."""

import jax
import numpy as np
import pytest

from kvjax import config as config_lib
from kvjax.io import checkpoint
from kvjax.lab import evaluate, runner
from kvjax.model import init_params

MODEL = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.max_seq_len": 256}


def _cfg(**over):
  return config_lib.apply_overrides(config_lib.Config(), {**MODEL, **over})


@pytest.fixture(scope="module")
def setup():
  cfg = _cfg()
  params = init_params(cfg.model, 3)
  # larger weights than the init so that cache rounding is visible in the logits
  params = jax.tree.map(lambda x: x * 4.0, params)
  tokens = np.random.default_rng(0).integers(0, 256, size=(3, 23)).astype(np.int32)
  return cfg, params, tokens


@pytest.mark.parametrize("layout,chunk", [("contiguous", 1), ("contiguous", 5), ("none", 4)])
def test_streaming_fp32_equals_full_forward(setup, layout, chunk):
  cfg, params, tokens = setup
  cfg = config_lib.apply_overrides(cfg, {"cache.layout": layout, "cache.codec": "fp32"})
  lp, nbytes = evaluate.stream_logprobs(cfg, params, tokens, chunk)
  full = evaluate.full_logprobs(params, tokens, model_cfg=cfg.model)
  np.testing.assert_allclose(lp, full, atol=2e-5, rtol=1e-5)
  ppl_stream = np.exp(evaluate.nll(lp, tokens))
  ppl_full = np.exp(evaluate.nll(full, tokens))
  assert ppl_stream == pytest.approx(ppl_full, rel=1e-5)
  from kvjax import cache as cache_lib  # the filled cache's bytes, exactly (23 tokens, B=3)
  spec = cache_lib.CacheSpec.from_config(cfg, 3, 23)
  assert nbytes == cache_lib.LAYOUTS[layout].closed_form_bytes(spec)


def test_compare_metrics(setup):
  cfg, params, tokens = setup
  ref, _ = evaluate.stream_logprobs(cfg, params, tokens)
  same = evaluate.compare(ref, ref, tokens)
  assert same["kl"] == pytest.approx(0.0, abs=1e-7) and same["agreement"] == 1.0
  assert same["ppl"] == same["ppl_ref"] and same["dppl_rel"] == 0.0
  for codec in ("bf16", "fp16"):
    lp, nbytes = evaluate.stream_logprobs(config_lib.apply_overrides(cfg, {"cache.codec": codec}),
                                          params, tokens)
    m = evaluate.compare(lp, ref, tokens)
    assert 0.0 < m["kl"] < 1e-2 and 0.5 <= m["agreement"] <= 1.0
    assert abs(m["dppl_rel"]) < 0.05 and np.isfinite(m["ppl"])
  # a uniform predictor is worse than the model and disagrees in KL by a known amount
  uniform = np.full_like(np.asarray(ref), -np.log(ref.shape[-1]))
  m = evaluate.compare(uniform, ref, tokens)
  expect = float(np.mean(np.sum(np.exp(ref) * (ref - uniform), -1)))
  assert m["kl"] == pytest.approx(expect, rel=1e-5) and m["ppl"] == pytest.approx(260, rel=1e-4)


def test_recall_set_is_fixed_and_accuracy_is_scored_on_answers(setup):
  cfg, params, _ = setup
  filler = np.arange(1000, dtype=np.int32) % 100 + 20
  a = evaluate.recall_set(0, 4, 40, 3, filler)
  b = evaluate.recall_set(0, 4, 40, 3, filler)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  acc = evaluate.recall_accuracy(cfg, params, *a)
  assert 0.0 <= acc <= 1.0


def test_recall_accuracy_scores_exactly_the_masked_answers(setup, monkeypatch):
  """recall_accuracy on crafted log-probabilities (its model call replaced): predictions
  are scored at the masked answer positions only, and nowhere else."""
  cfg, params, _ = setup
  filler = np.arange(1000, dtype=np.int32) % 100 + 20
  seqs, mask = evaluate.recall_set(0, 4, 40, 3, filler)
  B, N = seqs.shape
  answers = mask[:, 1:]
  assert 0 < answers.sum() < answers.size

  def crafted(right_at):  # predicts the next token where right_at is True, else token 0
    lp = np.full((B, N, 260), -50.0, np.float32)
    nxt = np.where(right_at, seqs[:, 1:], 0)
    lp[np.arange(B)[:, None], np.arange(N - 1)[None], nxt] = 0.0
    return lp

  def score(lp):
    monkeypatch.setattr(evaluate, "stream_logprobs", lambda *a, **k: (lp, 0))
    return evaluate.recall_accuracy(cfg, params, seqs, mask)

  assert score(crafted(np.ones_like(answers))) == 1.0
  assert score(crafted(~answers)) == 0.0  # right everywhere except at the answers
  half = answers & (np.cumsum(answers, 1) % 2 == 1)  # every other answer of each row
  assert score(crafted(half)) == pytest.approx(half.sum() / answers.sum())


def test_quality_run_cell_rows(tmp_path, setup):
  from kvjax.lab.experiments import quality

  text = tmp_path / "text.txt"
  text.write_text("for i in range(10):\n    print(i)\n" * 200)
  cfg, params, _ = setup
  mcfg = config_lib.apply_overrides(cfg, {"train.data": str(text), "train.recall_pairs": 3})
  checkpoint.save(tmp_path / "m", mcfg, params, step=0)
  settings = {"fp32": {"cache.codec": "fp32"}, "bf16": {"cache.codec": "bf16"}}
  items = {  # the runner applies the selected setting (runner.compose)
      "experiment": "quality", "workload.prompt_len": 8, "workload.gen_len": 4,
      "params": {"checkpoints": [str(tmp_path / "m")], "settings": settings, "setting": "bf16",
                 "eval_tokens": 32, "eval_seqs": 2, "recall_contexts": [24, 40],
                 "recall_seqs": 4, "gen_prompts": 2}}
  ecfg = runner.compose(items, {}, {})
  quality.check(ecfg)
  rows = quality.run_cell(ecfg)
  assert [r["workload"]["task"] for r in rows] == ["text", "recall", "recall"]
  text_row = rows[0]
  assert text_row["variant"]["k_codec"] == "bf16" and text_row["variant"]["kv_heads"] == 2
  for key in ("ppl", "ppl_ref", "kl", "agreement", "gen_agreement", "cache_bytes"):
    assert key in text_row["metrics"]
  for key in ("dppl_rel", "kl", "agreement"):  # each with its bootstrap interval around it
    lo, hi = text_row["metrics"][f"{key}_ci95"]
    assert lo <= text_row["metrics"][key] <= hi, key
  line = quality.summary(rows)[0]
  assert line["dppl_%_ci95"].startswith("[") and line["kl_ci95"].startswith("[")
  assert quality.summary([{**text_row, "metrics": {  # an older row, without intervals
      k: v for k, v in text_row["metrics"].items() if not k.endswith("_ci95")}}])[0][
          "kl_ci95"] == ""
  # bf16 stores half the fp32 payload; both carry the same int32 lengths (4 bytes x 2 seqs)
  assert text_row["metrics"]["cache_bytes"] - 8 == (text_row["metrics"]["cache_bytes_ref"] - 8) // 2
  m = text_row["metrics"]  # bytes per token: what the cache held over the 2 x 32 tokens
  assert m["bytes_per_token"] == m["cache_bytes"] / (2 * 32) > m["bytes_per_token_asymptotic"]
  assert m["bits_per_element"] == pytest.approx(  # bf16: 16 bits, plus the lengths
      16 * m["bytes_per_token"] / m["bytes_per_token_asymptotic"])
  assert [r["workload"]["context"] for r in rows[1:]] == [24, 40]
  # the fp32 setting reproduces its own reference exactly
  ref_rows = quality.run_cell(runner.compose(items, {"params.setting": "fp32"}, {}))
  m = ref_rows[0]["metrics"]
  assert m["kl"] == pytest.approx(0.0, abs=1e-6) and m["agreement"] == 1.0
  assert m["gen_agreement"] == 1.0
  assert ref_rows[1]["metrics"]["recall"] == ref_rows[1]["metrics"]["recall_ref"]


def test_a_converted_checkpoint_is_held_to_its_source_model(tmp_path, setup):
  """params.converted: the exact MHA twin of the run's model scores as the model itself,
  with its recipe in the row; a checkpoint of another vocabulary is refused."""
  from kvjax.lab import convert
  from kvjax.errors import KvjaxError
  from kvjax.lab.experiments import quality

  text = tmp_path / "text.txt"
  text.write_text("for i in range(10):\n    print(i)\n" * 200)
  cfg, params, _ = setup
  mcfg = config_lib.apply_overrides(cfg, {"train.data": str(text)})
  checkpoint.save(tmp_path / "m", mcfg, params, step=0)
  twin_cfg, twin = convert.expand(mcfg, params, 4)
  checkpoint.save(tmp_path / "twin", twin_cfg, twin, step=0,
                  meta={"method": "expand", "recipe": {"method": "expand", "kv_heads": 4,
                                                       "source": "x"}})
  items = {"experiment": "quality", "workload.gen_len": 0,
           "params": {"checkpoints": [str(tmp_path / "m")], "eval_tokens": 32, "eval_seqs": 2,
                      "gen_prompts": 0, "settings": {"twin": {"params.converted": str(tmp_path / "twin")}},
                      "setting": "twin"}}
  ecfg = runner.compose(items, {}, {})
  quality.check(ecfg)
  (row,) = quality.run_cell(ecfg)
  v, m = row["variant"], row["metrics"]
  assert v["kv_heads"] == 4 and v["conversion"] == "expand" and v["recipe"] == "kv_heads=4"
  assert m["kl"] == pytest.approx(0.0, abs=1e-6) and m["agreement"] == 1.0
  other = config_lib.apply_overrides(twin_cfg, {"model.vocab_size": 300})
  checkpoint.save(tmp_path / "other", other, init_params(other.model, 0), step=0)
  with pytest.raises(KvjaxError, match="another tokenizer"):
    quality.run_cell(runner.compose(items, {"params.settings": {
        "twin": {"params.converted": str(tmp_path / "other")}}}, {}))
  with pytest.raises(KvjaxError, match="make it first"):
    quality.check(runner.compose(items, {"params.settings": {
        "twin": {"params.converted": str(tmp_path / "absent")}}}, {}))
