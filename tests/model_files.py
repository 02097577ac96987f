"""Tiny model files of every kind kvjax reads, written without torch or a download: a GGUF
with a byte-level BPE tokenizer, a Hugging Face safetensors folder and an orbax checkpoint,
all of one small llama shape. The fuzz harness (test_fuzz_models.py) corrupts them.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from kvjax import config as config_lib
from kvjax import model

# Small enough that a whole file is a few kB: fuzzing bytes hits headers and data alike.
SHAPE = {"model.vocab_size": 16, "model.d_model": 8, "model.n_layers": 1, "model.n_heads": 2,
         "model.n_kv_heads": 1, "model.head_dim": 4, "model.d_ff": 8, "model.max_seq_len": 32,
         "model.rope_theta": 10000.0, "model.norm_eps": 1e-5}
# 12 single characters of the byte-level alphabet, then 4 merges of them: a valid BPE.
_CHARS = list("abcdefghijkl")
MERGES = ["a b", "c d", "ab cd", "e f"]
TOKENS = _CHARS + [m.replace(" ", "") for m in MERGES]


def tiny_model(seed: int = 3):
  cfg = config_lib.apply_overrides(config_lib.Config(), {**SHAPE, "model.tie_embeddings": True})
  return cfg, jax.tree.map(np.asarray, model.init_params(cfg.model, seed))


def write_gguf(path, cfg, params, *, tokenizer: bool = True, meta=None, merges=None) -> Path:
  """A llama GGUF of `params` (F32), with a gpt2 tokenizer unless `tokenizer=False`;
  `meta` adds or replaces metadata ({full key: bool, str, int or float})."""
  from gguf import GGUFWriter

  from kvjax.io import gguf

  m, L = cfg.model, params["layers"]
  w = GGUFWriter(str(path), "llama")  # writes general.architecture
  scalars = {"llama.block_count": m.n_layers, "llama.context_length": m.max_seq_len,
             "llama.embedding_length": m.d_model, "llama.feed_forward_length": m.F,
             "llama.attention.head_count": m.n_heads,
             "llama.attention.head_count_kv": m.n_kv_heads, "llama.vocab_size": m.vocab_size,
             "llama.rope.freq_base": float(m.rope_theta),
             "llama.attention.layer_norm_rms_epsilon": float(m.norm_eps)}
  if tokenizer:
    scalars["tokenizer.ggml.model"] = "gpt2"
  for key, val in {**scalars, **(meta or {})}.items():
    add = {bool: w.add_bool, str: w.add_string, int: w.add_uint32, float: w.add_float32}
    add[type(val)](key, val)
  if tokenizer:
    w.add_token_list(TOKENS)
    w.add_token_merges(MERGES if merges is None else merges)
    w.add_token_types([1] * len(TOKENS))
  names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
           "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
  for i in range(m.n_layers):
    for leaf, g in names.items():
      rows = L[leaf]["kernel"][i].T
      if g in ("attn_q", "attn_k"):
        rows = gguf.permute(rows, m.n_heads if g == "attn_q" else m.n_kv_heads)
      w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(rows, np.float32))
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.asarray(L["input_layernorm"]["weight"][i]))
    w.add_tensor(f"blk.{i}.ffn_norm.weight",
                 np.asarray(L["post_attention_layernorm"]["weight"][i]))
  w.add_tensor("token_embd.weight", np.asarray(params["embed_tokens"]["embedding"]))
  w.add_tensor("output_norm.weight", np.asarray(params["norm"]["weight"]))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return Path(path)


def hf_config(cfg) -> dict:
  m = cfg.model
  return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": m.vocab_size,
          "hidden_size": m.d_model, "intermediate_size": m.F, "num_hidden_layers": m.n_layers,
          "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
          "head_dim": m.D, "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
          "rope_theta": m.rope_theta, "tie_word_embeddings": True, "hidden_act": "silu",
          "torch_dtype": "float32"}


def tokenizer_json() -> str:
  """The BPE of TOKENS/MERGES as a tokenizer.json (what a Hugging Face folder ships)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)},
                             merges=[tuple(m.split(" ")) for m in MERGES]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return tok.to_str()


def write_hf(folder, cfg, params, **config_changes) -> Path:
  """A Hugging Face llama folder (config.json + model.safetensors + tokenizer.json) of
  `params`."""
  import safetensors.numpy as stnp

  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  L, tensors = params["layers"], {}
  names = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
  for i in range(cfg.model.n_layers):
    for leaf, group in names.items():
      tensors[f"model.layers.{i}.{group}.{leaf}.weight"] = L[leaf]["kernel"][i].T
    for norm in ("input_layernorm", "post_attention_layernorm"):
      tensors[f"model.layers.{i}.{norm}.weight"] = L[norm]["weight"][i]
  tensors["model.embed_tokens.weight"] = params["embed_tokens"]["embedding"]
  tensors["model.norm.weight"] = params["norm"]["weight"]
  tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
  stnp.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps({**hf_config(cfg), **config_changes}))
  (folder / "tokenizer.json").write_text(tokenizer_json())
  return folder


def write_checkpoint(folder, cfg, params) -> Path:
  """A kvjax orbax checkpoint (config.yaml + steps/1/) of `params`."""
  from kvjax.io import checkpoint
  return checkpoint.save(folder, cfg, params, step=1)
