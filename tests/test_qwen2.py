"""Qwen2.5-Coder-0.5B-Instruct (qwen2: GQA 14/2, q/k/v biases, untied head) against
transformers' GGUF load: ids (Qwen's digit-by-digit split), perplexity through the cache,
greedy tokens, the exact MHA twin (14 KV heads)."""

import pytest

import real_models as rm
from conftest import both_sides
from kvjax import config as config_lib

NAME = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def qwen2():
  return both_sides(NAME)


def test_config_is_the_gqa7_model(qwen2):
  m = qwen2[0].model
  assert config_lib.load(NAME).model == m  # the packaged shape (--config NAME) is the file's
  assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.D, m.F, m.vocab_size) == \
      (24, 896, 14, 2, 64, 4864, 151936)
  assert m.variant == "GQA-2" and m.G == 7 and m.qkv_bias and not m.tie_embeddings
  assert not m.windowed and m.rope_theta == 1e6


def test_tokenizer_ids_equal_transformers(qwen2):
  rm.tokenizer_ids_equal(qwen2[2], qwen2[3])


def test_perplexity_through_the_cache(qwen2):
  cfg, params, tok, _, ref_model = qwen2
  rel, ppl, ref = rm.perplexity_through_the_cache(cfg, params, tok, ref_model, n=256, seqs=1)
  assert rel < 1e-3, (ppl, ref)


def test_greedy_tokens(qwen2):
  cfg, params, tok, _, ref_model = qwen2
  chat = "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n" \
         "<|im_start|>assistant\n"
  rm.greedy_equal(cfg, params, ref_model, [tok.encode(chat)], n=12)  # 3 x 32: real_parity.py


def test_mha_twin_has_the_same_logits(qwen2):
  cfg, params, tok, _, _ = qwen2
  rm.mha_twin_equal(cfg, params, tok.encode(rm.PROMPTS[0]))
