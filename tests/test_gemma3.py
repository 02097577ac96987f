"""Gemma 3 270M (gemma3: MQA 4/1, head_dim 256, 15 of 18 layers with a 512-token window)
against transformers' GGUF load: ids, perplexity through the hybrid cache past the window,
greedy tokens whose decode crosses the window, the exact MHA twin."""

import pytest

import real_models as rm
from conftest import kvjax_side, transformers_side
from kvjax import config as config_lib
from kvjax import data

NAME = "gemma3-270m"


@pytest.fixture(scope="module")
def gemma3():
  return (*kvjax_side(NAME), *transformers_side(NAME))


def test_config_is_the_hybrid_mqa_model(gemma3):
  m = gemma3[0].model
  assert config_lib.load(NAME).model == m  # the packaged shape (--config NAME) is the file's
  assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.D, m.F, m.vocab_size) == \
      (18, 640, 4, 1, 256, 2048, 262144)
  assert m.variant == "MQA" and m.tie_embeddings and m.sliding_window == 512
  assert [i for i in range(18) if not m.is_local(i)] == [5, 11, 17]
  assert (m.rope_theta, m.rope_local_theta) == (1e6, 1e4)


def test_tokenizer_ids_equal_transformers(gemma3):
  rm.tokenizer_ids_equal(gemma3[2], gemma3[3])


def test_perplexity_through_the_cache_past_the_window(gemma3):
  cfg, params, tok, _, ref_model = gemma3
  # one window past the 512-token window (the 2 x 1,024: scripts/real_parity.py)
  rel, ppl, ref = rm.perplexity_through_the_cache(cfg, params, tok, ref_model, n=640, seqs=1)
  assert rel < 1e-3, (ppl, ref)


def test_greedy_tokens_as_decode_crosses_the_window(gemma3):
  cfg, params, tok, _, ref_model = gemma3
  long = tok.encode(data.eval_text("stdlib")[:6000])[:504]  # the window fills mid-decode
  rm.greedy_equal(cfg, params, ref_model, [long], n=12)  # 3 x 32: scripts/real_parity.py


def test_mha_twin_has_the_same_logits(gemma3):
  cfg, params, tok, _, _ = gemma3
  rm.mha_twin_equal(cfg, params, tok.encode(rm.PROMPTS[0]))
