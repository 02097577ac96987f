"""GGUF import: synthetic files written with gguf.GGUFWriter load to the source params and
logits; bad files fail in one line; the installed SmolLM2 matches transformers' GGUF loader."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from kvjax import config as config_lib
from kvjax import model
from kvjax.decode import generate
from kvjax.errors import KvjaxError
from kvjax.io import gguf
from kvjax.io import zoo

SHAPE = {"model.vocab_size": 96, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
         "model.n_kv_heads": 2, "model.head_dim": 16, "model.d_ff": 128,
         "model.rope_theta": 50000.0, "model.norm_eps": 1e-5, "model.max_seq_len": 128}
NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _source(tie: bool):
  cfg = config_lib.apply_overrides(config_lib.Config(), {**SHAPE, "model.tie_embeddings": tie})
  params = jax.tree.map(np.asarray, model.init_params(cfg.model, 7))
  return cfg, params


def write_gguf(path, cfg, params, qtype=Q.F32, arch="llama", drop=(), extra_meta=None):
  """A llama GGUF of `params` as the converter writes it: [out, in] rows, Q/K permuted."""
  m = cfg.model
  w = GGUFWriter(str(path), arch)
  meta = {"block_count": m.n_layers, "context_length": m.max_seq_len,
          "embedding_length": m.d_model, "feed_forward_length": m.F,
          "head_count": m.n_heads, "head_count_kv": m.n_kv_heads}
  for key, val in meta.items():
    if key not in drop:
      getattr(w, f"add_{key}")(val)
  w.add_rope_freq_base(m.rope_theta)
  w.add_layer_norm_rms_eps(m.norm_eps)
  w.add_rope_dimension_count(m.D)
  w.add_vocab_size(m.vocab_size)
  for key, val in (extra_meta or {}).items():
    w.add_string(key, val)

  def put(name, arr):
    arr = np.ascontiguousarray(arr, np.float32)
    if qtype == Q.F32 or arr.ndim == 1:
      w.add_tensor(name, arr)
    elif qtype == Q.F16:
      w.add_tensor(name, arr.astype(np.float16))
    else:
      w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)

  L = params["layers"]
  for i in range(m.n_layers):
    for leaf, g in NAMES.items():
      rows = L[leaf]["kernel"][i].T
      if g in ("attn_q", "attn_k"):
        rows = gguf.permute(rows, m.n_heads if g == "attn_q" else m.n_kv_heads)
      put(f"blk.{i}.{g}.weight", rows)
    put(f"blk.{i}.attn_norm.weight", L["input_layernorm"]["weight"][i])
    put(f"blk.{i}.ffn_norm.weight", L["post_attention_layernorm"]["weight"][i])
  put("token_embd.weight", params["embed_tokens"]["embedding"])
  put("output_norm.weight", params["norm"]["weight"])
  if "lm_head" in params:
    put("output.weight", params["lm_head"]["kernel"].T)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  gguf.reader.cache_clear()
  return path


def _logits(cfg, params, tokens):
  pos = jnp.arange(tokens.shape[1])[None]
  return np.asarray(model.Transformer(cfg.model).apply({"params": params}, tokens, pos, None)[0])


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_f32_file_loads_source_params_and_logits(tmp_path, tie):
  cfg, params = _source(tie)
  path = write_gguf(tmp_path / "m.gguf", cfg, params)
  got_cfg, got = gguf.load(path)
  assert got_cfg.model == cfg.model
  flat_want = jax.tree_util.tree_leaves_with_path(params)
  flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
  for key, want in flat_want:
    np.testing.assert_array_equal(np.asarray(flat_got[key]), want, err_msg=str(key))
  tokens = jnp.array([[3, 17, 5, 60, 2, 9, 33]])
  np.testing.assert_allclose(_logits(got_cfg, got, tokens), _logits(cfg, params, tokens),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_files_dequantize_to_the_stored_values(tmp_path, qtype):
  cfg, params = _source(False)
  path = write_gguf(tmp_path / "m.gguf", cfg, params, qtype=qtype)
  _, got = gguf.load(path)
  src = params["layers"]["k_proj"]["kernel"][1].T                  # [out, in], unpermuted
  stored = gguf.permute(src, cfg.model.n_kv_heads)
  if qtype == Q.F16:
    expect = stored.astype(np.float16).astype(np.float32)
  else:
    expect = quants.dequantize(quants.quantize(stored, qtype), qtype)
  np.testing.assert_array_equal(np.asarray(got["layers"]["k_proj"]["kernel"][1]),
                                gguf.unpermute(expect, cfg.model.n_kv_heads).T)
  # and the model computes nearly the same function (quantization error only)
  tokens = jnp.array([[3, 17, 5, 60, 2, 9, 33]])
  err = np.abs(_logits(cfg, got, tokens) - _logits(cfg, params, tokens)).max()
  assert err < {Q.F16: 1e-3, Q.Q8_0: 2e-2, Q.Q4_0: 0.3, Q.Q4_1: 0.3}[qtype]


def test_permutation_round_trip_and_not_identity():
  x = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
  p = gguf.permute(x, 4)
  assert not np.array_equal(p, x)
  np.testing.assert_array_equal(gguf.unpermute(p, 4), x)
  # within a head, the converter interleaves the two rotate-half halves
  np.testing.assert_array_equal(p[:4, 0], x[[0, 8, 1, 9], 0])


def test_param_dtype_override(tmp_path):
  cfg, params = _source(True)
  path = write_gguf(tmp_path / "m.gguf", cfg, params)
  got_cfg, got = gguf.load(path, {"model.param_dtype": "bfloat16"})
  assert got_cfg.model.param_dtype == "bfloat16"
  assert got["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16


def _one_line_error(fn, *match):
  with pytest.raises(KvjaxError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg
  for m in match:
    assert m in msg, msg


def test_bad_files_fail_in_one_line(tmp_path):
  cfg, params = _source(True)
  good = write_gguf(tmp_path / "good.gguf", cfg, params)
  data = good.read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
  _one_line_error(lambda: gguf.load(tmp_path / "cut.gguf"), "cut.gguf")
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
  _one_line_error(lambda: gguf.load_config(tmp_path / "junk.gguf"), "junk.gguf")
  _one_line_error(lambda: gguf.load_config(tmp_path / "absent.gguf"), "not found")
  gpt2 = write_gguf(tmp_path / "gpt2.gguf", cfg, params, arch="gpt2")
  _one_line_error(lambda: gguf.load_config(gpt2), "'gpt2'", "llama")
  nokey = write_gguf(tmp_path / "nokey.gguf", cfg, params, drop=("head_count",))
  _one_line_error(lambda: gguf.load_config(nokey), "llama.attention.head_count")
  scaled = write_gguf(tmp_path / "yarn.gguf", cfg, params,
                      extra_meta={"llama.rope.scaling.type": "yarn"})
  _one_line_error(lambda: gguf.load_config(scaled), "yarn")


def test_missing_tensor_fails_in_one_line(tmp_path):
  cfg, params = _source(True)
  short = dict(params)
  short["layers"] = dict(params["layers"])
  # the metadata says 2 layers; write a file whose tensors describe 1
  one = config_lib.apply_overrides(cfg, {"model.n_layers": 1})
  short["layers"] = jax.tree.map(lambda x: x[:1], params["layers"])
  path = write_gguf(tmp_path / "short.gguf", one, short)
  _one_line_error(lambda: gguf.load(path, {"model.n_layers": 2}), "blk.1.")


def test_cli_bad_gguf_exits_2(tmp_path, capsys):
  from kvjax import cli
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + b"\0" * 40)
  assert cli.main(["size", "--gguf", str(bad), "--seq-len", "64"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1 and "bad.gguf" in err
  assert cli.main(["generate", "--gguf", "no-such-model", "--prompt-ids", "1"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and "unknown model 'no-such-model'" in err


def test_zoo_resolution(tmp_path, monkeypatch):
  monkeypatch.setenv("KVJAX_MODELS", str(tmp_path))
  _one_line_error(lambda: zoo.resolve_gguf("smollm2-135m"), "kvjax models fetch smollm2-135m")
  (tmp_path / "smollm2-135m.gguf").write_bytes(b"x")  # present, but not the known file
  _one_line_error(lambda: zoo.resolve_gguf("smollm2-135m"), "corrupt",
                  "kvjax models fetch smollm2-135m")
  _one_line_error(lambda: zoo.resolve_gguf("nope"), "unknown model 'nope'")


# -- the real model (fixture `smollm2` in conftest.py) ---------------------------------
def test_smollm2_config(smollm2):
  m = smollm2[0].model
  assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.D, m.F, m.vocab_size) == \
      (30, 576, 9, 3, 64, 1536, 49152)
  assert m.tie_embeddings and m.rope_theta == 100000.0 and m.max_seq_len == 8192


def test_smollm2_tokenizer_ids_equal_transformers(smollm2):
  _, _, tok, ref_tok, _ = smollm2
  texts = ["Hello world", "def main():\n    return 42  # ok\n", "  two leading spaces\tand a tab",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "Ünïcödé — 日本語 🎉 1234567"]
  for text in texts:
    assert tok.encode(text) == ref_tok(text)["input_ids"], text
    ids = tok.encode(text)
    assert tok.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)
  assert tok.decode(tok.encode(texts[4])) == texts[4]


def test_smollm2_logits_and_greedy_tokens_match_transformers(smollm2):
  import torch

  cfg, params, tok, _, ref_model = smollm2
  ids = tok.encode("The three primary colors are red, yellow and")
  with torch.no_grad():
    ref = ref_model(torch.tensor([ids])).logits[0].numpy()
  got = _logits(cfg, params, jnp.array([ids]))[0]
  assert np.abs(got - ref).max() < 2e-3 * np.abs(ref).max()
  greedy = config_lib.apply_overrides(cfg, {"workload.temperature": 0.0, "workload.eos_id": -1})
  n = 16  # greedy steps through the cache: a few short windows are enough on a real model
  out = generate.generate(greedy, params, [ids], n, timed=False)["tokens"][0]
  with torch.no_grad():
    want = ref_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                              min_new_tokens=n)[0, len(ids):].tolist()
  assert out == want


def test_convert_gguf_to_mqa_checkpoint(tmp_path):
  from kvjax import cli
  from kvjax.io import checkpoint
  from kvjax.lab import convert
  cfg, params = _source(True)
  path = write_gguf(tmp_path / "m.gguf", cfg, params)
  out = tmp_path / "mqa"
  assert cli.main(["convert", "--gguf", str(path), "--kv-heads", "1", "--out", str(out)]) == 0
  got_cfg, got = checkpoint.load(out)
  assert got_cfg.model.n_kv_heads == 1 and got_cfg.tokenizer == "none"  # the file has none
  _, want = convert.mean_pool(*gguf.load(path), 1)
  np.testing.assert_allclose(np.asarray(got["layers"]["k_proj"]["kernel"]),
                             np.asarray(want["layers"]["k_proj"]["kernel"]), rtol=1e-6)


def test_a_source_label_keeps_a_named_models_whole_name():
  """Rows once labelled Qwen2.5-Coder-0.5B `qwen2.5-coder-0` (the name's last dot taken for
  a file suffix)."""
  from kvjax.io import sources
  assert sources.parse("gguf:qwen2.5-coder-0.5b").name == "qwen2.5-coder-0.5b"
  assert sources.parse("gguf:/models/m.Q4_K.gguf").name == "m.Q4_K"
  assert sources.parse("config:configs/a.yaml").name == "a"
