"""What every real model is held to against transformers (its GGUF load), shared by the
per-model test files (test_gemma3.py, test_qwen2.py; SmolLM2's are in test_gguf.py and
test_eval.py): the tokenizer's ids, teacher-forced perplexity through the cache, greedy
tokens through prefill and decode, and the exact MHA twin's logits."""

import jax.numpy as jnp
import numpy as np

from kvjax import config as config_lib
from kvjax.decode import generate
from kvjax.lab import convert
from kvjax.lab import data, evaluate
from kvjax.model import Transformer

TEXTS = ["", "Hello world", "def main():\n    return 42  # ok\n", "  two leading spaces\tand a tab",
         "x    =    1\n\n\n\n    y", "Ünïcödé — 日本語のテキスト 🎉 1234567 3.14159",
         "The quick brown fox jumps over the lazy dog.\r\nA second line."]
PROMPTS = ["The three primary colors are red, yellow and",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


def tokenizer_ids_equal(tok, ref_tok):
  for text in TEXTS + [data.eval_text("stdlib")[:4000]]:
    assert tok.encode(text) == ref_tok(text)["input_ids"], text[:40]
  assert tok.decode(tok.encode(TEXTS[5])).lstrip() == TEXTS[5]


def logits(cfg, params, ids_BT):
  pos = jnp.broadcast_to(jnp.arange(ids_BT.shape[1]), ids_BT.shape)
  return np.asarray(Transformer(cfg.model).apply({"params": params}, jnp.asarray(ids_BT), pos)[0])


def perplexity_through_the_cache(cfg, params, tok, ref_model, n=1024, seqs=2, chunk=64,
                                 segment=256):
  """kvjax's fp32 cache fed `chunk` tokens a step against transformers' teacher-forced loss,
  on `seqs` windows of `n` stdlib tokens: relative difference of the perplexities."""
  import torch

  windows = evaluate.text_windows(tok, data.eval_text("stdlib"), n, seqs)
  total = 0.0
  for start, lp in evaluate.stream_segments(cfg, params, windows, chunk, segment=segment):
    if start is None:
      continue
    nxt = windows[:, start + 1:start + 1 + lp.shape[1]]
    lp = lp[:, :nxt.shape[1]]
    total -= float(jnp.sum(jnp.take_along_axis(lp, jnp.asarray(nxt)[..., None], axis=-1)))
  ppl = np.exp(total / (seqs * (n - 1)))
  losses = []
  with torch.no_grad():
    for row in windows.tolist():  # one window at a time: [n, V] float32 logits each
      ids = torch.tensor([row])
      losses.append(ref_model(ids, labels=ids).loss.item())
  ref = np.exp(np.mean(losses))
  return abs(ppl / ref - 1), ppl, ref


def greedy_equal(cfg, params, ref_model, prompts_ids, n=32):
  import torch

  greedy = config_lib.apply_overrides(cfg, {"workload.temperature": 0.0, "workload.eos_id": -1})
  got = generate.generate(greedy, params, prompts_ids, n, timed=False)["tokens"]
  for ids, out in zip(prompts_ids, got):
    with torch.no_grad():
      want = ref_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n)[0, len(ids):].tolist()
    assert out == want, (len(ids), out, want)


def mha_twin_equal(cfg, params, ids):
  mha_cfg, mha = convert.expand(cfg, params, cfg.model.n_heads)
  assert mha_cfg.model.variant == "MHA"
  want = logits(cfg, params, np.asarray([ids]))
  np.testing.assert_allclose(logits(mha_cfg, mha, np.asarray([ids])), want,
                             atol=1e-5 * np.abs(want).max())
