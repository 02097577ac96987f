"""The quality experiment on a model with its own tokenizer (an HF folder here; the same
path serves GGUF files): settings, mean-pooled fewer KV heads, and transformers'
quantized-cache peer on the same tokens, whose fp32 baseline must equal kvjax's."""

import json

import numpy as np
import pytest
import torch
import transformers
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from kvjax.lab import runner

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp("hf")
  conf = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
  torch.manual_seed(0)
  m = transformers.LlamaForCausalLM(conf).eval()
  with torch.no_grad():
    for _, p in m.named_parameters():
      if p.ndim > 1:
        p.normal_(0.0, 0.25)  # spread logits so cache rounding shows
  m.save_pretrained(folder)
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  byte_map = {c: i for i, c in enumerate(sorted(alphabet))}
  tok = Tokenizer(models.BPE(vocab=byte_map, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "text.txt").write_text(TEXT)
  return folder


def test_settings_pooling_and_quanto_peer(hf_folder, tmp_path):
  cfg = {"name": "q", "experiment": "quality",
         "model": {"d_model": 64, "n_heads": 4, "n_kv_heads": 2},
         "workload": {"gen_len": 0},
         "grid": {"params.setting": ["fp32", "int4", "mqa", "quanto_int4"]},
         "params": {"models": [f"hf:{hf_folder}"], "text": str(hf_folder / "text.txt"),
                    "eval_tokens": 64, "eval_seqs": 2, "chunk": 8, "gen_prompts": 0,
                    "peer_residual": 16,
                    "settings": {"fp32": {"cache.codec": "fp32"}, "int4": {"cache.codec": "int4"},
                                 "mqa": {"params.kv_heads": 1, "cache.codec": "fp32"},
                                 "quanto_int4": {"params.peer": "quanto_int4"}}}}
  (tmp_path / "q.yaml").write_text(yaml.safe_dump(cfg))
  runner.run_file(tmp_path / "q.yaml", out_dir=tmp_path / "out")
  rows = {r["variant"]["setting"]: r for r in
          map(json.loads, (tmp_path / "out" / "quality.jsonl").read_text().splitlines())}
  assert set(rows) == {"fp32", "int4", "mqa", "quanto_int4"}
  m = {k: r["metrics"] for k, r in rows.items()}
  assert m["fp32"]["dppl_rel"] == 0.0 and m["fp32"]["kl"] == 0.0
  assert m["int4"]["kl"] > 1e-5 and m["int4"]["bytes_per_token"] < m["fp32"]["bytes_per_token"]
  assert rows["mqa"]["variant"]["variant"] == "MQA" and m["mqa"]["kl"] > m["int4"]["kl"]
  assert m["mqa"]["bytes_per_token_asymptotic"] == m["fp32"]["bytes_per_token_asymptotic"] / 2
  for k in ("fp32", "int4", "mqa", "quanto_int4"):  # what the cache held, per token evaluated
    assert m[k]["bytes_per_token"] == m[k]["cache_bytes"] / (2 * 64), k
  peer = rows["quanto_int4"]
  same = lambda w: {k: v for k, v in w.items() if k != "reference"}  # noqa: E731
  assert peer["variant"]["peer"] == "quanto" and same(peer["workload"]) == \
      same(rows["fp32"]["workload"])
  assert rows["fp32"]["workload"]["reference"] == "fp32 cache"
  assert peer["workload"]["reference"] == "transformers' unquantized cache"
  # the peer's reference (transformers, unquantized cache) is kvjax's fp32 run of the same
  # weights on the same tokens: the two implementations agree
  assert m["quanto_int4"]["ppl_ref"] == pytest.approx(m["fp32"]["ppl_ref"], rel=1e-4)
  assert m["quanto_int4"]["kl"] > 0 and 0 < m["quanto_int4"]["bytes_per_token"] < \
      m["fp32"]["bytes_per_token"]
  assert np.isfinite(m["quanto_int4"]["ppl"])
