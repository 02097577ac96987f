"""Gemma 3 270M (gemma3: MQA 4/1, head_dim 256, 15 of 18 layers with a 512-token window)
against transformers' GGUF load: ids, perplexity through the hybrid cache past the window,
greedy tokens whose decode crosses the window, the exact MHA twin.

The window tests shrink the window to 128 tokens on both sides (the same weights, a
shorter window: the suite's time); scripts/real_parity.py holds the model at its own
512-token window on 2 x 1,024 tokens and 3 x 32 greedy tokens."""

import contextlib

import pytest

import real_models as rm
from conftest import both_sides
from kvjax import config as config_lib
from kvjax.lab import data

NAME = "gemma3-270m"
W = 128


@contextlib.contextmanager
def window(cfg, ref_model, w=W):
  """Both sides with window w on their sliding layers (transformers reads it from the
  config for masks and caches, and from each sliding layer's attention)."""
  layers = [lyr.self_attn for lyr in ref_model.model.layers if lyr.self_attn.sliding_window]
  assert len(layers) == 15
  old = ref_model.config.sliding_window
  ref_model.config.sliding_window = w
  for a in layers:
    a.sliding_window = w
  try:
    yield config_lib.apply_overrides(cfg, {"model.sliding_window": w})
  finally:
    ref_model.config.sliding_window = old
    for a in layers:
      a.sliding_window = old


@pytest.fixture(scope="module")
def gemma3():
  return both_sides(NAME)


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
  with window(cfg, ref_model) as short:  # past the window by half of it
    rel, ppl, ref = rm.perplexity_through_the_cache(short, params, tok, ref_model, n=W * 3 // 2,
                                                    seqs=1, segment=W // 2)
  assert rel < 1e-3, (ppl, ref)


def test_greedy_tokens_as_decode_crosses_the_window(gemma3):
  cfg, params, tok, _, ref_model = gemma3
  long = tok.encode(data.eval_text("stdlib")[:2000])[:W - 8]  # the window fills mid-decode
  with window(cfg, ref_model) as short:
    rm.greedy_equal(short, params, ref_model, [long], n=12)


def test_mha_twin_has_the_same_logits(gemma3):
  cfg, params, tok, _, _ = gemma3
  rm.mha_twin_equal(cfg, params, tok.encode(rm.PROMPTS[0]))
