"""Hugging Face import: kvjax must compute the same function as `transformers` on the same
weights (logits within 1e-4 in fp32, identical greedy tokens through the cache), load
sharded and half-precision checkpoints, and refuse bad folders with one line.

Models are tiny, random and built here (no download). Weights are drawn with a larger
scale than HF's init so logits are spread out: greedy parity needs clear argmax margins,
and random norm weights and biases make sure those tensors are really loaded.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy as stnp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvjax import cli, model
from kvjax.decode import generate
from kvjax.errors import KvjaxError  # noqa: E402
from kvjax.io import hf  # noqa: E402

V, E, L = 128, 64, 2
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# name -> (family, extra HF config); covers MHA/GQA/MQA, tied/untied, bias (qwen2) on/off,
# non-default head_dim and rope_theta, llama3 rope scaling, a Mistral sliding window.
CASES = {
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa-tied-llama3": ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=True,
                                            rope_parameters={"rope_theta": 5e5, **LLAMA3})),
    "qwen2-mqa-hd32": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2-gqa-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True)),
    "mistral-gqa-hd32-window": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=32, sliding_window=64,
                                                rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 1e6})),
    "mistral-mqa-tied": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1,
                                         tie_word_embeddings=True, sliding_window=None)),
}
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}


def build_hf(family: str, seed: int = 0, **extra):
  conf_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[family])
  conf = conf_cls(vocab_size=V, hidden_size=E, intermediate_size=96, num_hidden_layers=L,
                  max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, **extra)
  torch.manual_seed(seed)
  m = model_cls(conf).eval()
  with torch.no_grad():
    for name, p in m.named_parameters():
      if p.ndim == 1:  # norms around 1, biases around 0, both random so both are checked
        p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape))
      else:
        p.normal_(0.0, 0.2)
  m.generation_config.eos_token_id = None
  m.generation_config.pad_token_id = 0
  return m


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
  family, extra = CASES[request.param]
  m = build_hf(family, **extra)
  folder = tmp_path_factory.mktemp(request.param)
  m.save_pretrained(folder)
  cfg, params = hf.load(folder)
  return m, folder, cfg, params


def _forward(cfg):
  """The full forward pass (no cache), jitted: compiling beats op-by-op dispatch here."""
  return jax.jit(lambda p, ids, pos: model.Transformer(cfg.model).apply({"params": p}, ids, pos))


def _prompts(B: int, T: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, V, (B, T))


def test_config_fields(case):
  m, _, cfg, _ = case
  c, mc = m.config, cfg.model
  assert (mc.n_layers, mc.d_model, mc.n_heads, mc.n_kv_heads, mc.D, mc.F, mc.vocab_size) == (
      c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
      getattr(c, "head_dim", None) or E // c.num_attention_heads, c.intermediate_size, V)
  assert mc.tie_embeddings == c.tie_word_embeddings
  assert mc.qkv_bias == (c.model_type == "qwen2")
  assert mc.rope_theta == c.rope_parameters["rope_theta"]
  window = getattr(c, "sliding_window", None)
  assert mc.max_seq_len == min(c.max_position_embeddings, window or 10**9)


def test_rope_frequencies_match(case):
  m, _, cfg, _ = case
  ref = m.model.rotary_emb.inv_freq.numpy()
  np.testing.assert_allclose(np.asarray(model.rope_inv_freq(cfg.model)), ref, rtol=1e-6)


def test_logits_match_transformers(case):
  m, _, cfg, params = case
  ids = _prompts(3, 16, seed=1)
  with torch.no_grad():
    ref = m(torch.tensor(ids)).logits.numpy()
  pos = np.broadcast_to(np.arange(16, dtype=np.int32), ids.shape)
  got, _ = _forward(cfg)(params, jnp.asarray(ids), jnp.asarray(pos))
  assert np.abs(np.asarray(got) - ref).max() < 1e-4


def test_greedy_generation_matches_transformers(case):
  m, _, cfg, params = case
  ids = _prompts(2, 8, seed=2)
  with torch.no_grad():
    out = m.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                     max_new_tokens=32, do_sample=False, output_scores=True,
                     return_dict_in_generate=True)
  ref = out.sequences[:, 8:].tolist()
  top2 = torch.stack(out.scores).topk(2, dim=-1).values
  margin = float((top2[..., 0] - top2[..., 1]).min())
  got = generate.generate(cfg, params, ids.tolist(), 32, timed=False)["tokens"]
  assert got == ref, f"greedy tokens differ (smallest transformers argmax margin {margin:.2e})"


# -- file formats -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  m = build_hf("llama", num_attention_heads=4, num_key_value_heads=2)
  folder = tmp_path_factory.mktemp("llama")
  m.save_pretrained(folder)
  return m, folder


def _leaves(params):
  return jax.tree_util.tree_leaves_with_path(params)


def test_sharded_checkpoint_loads_like_one_file(llama, tmp_path):
  m, folder = llama
  m.save_pretrained(tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  assert len(list(tmp_path.glob("*.safetensors"))) > 2
  _, one = hf.load(folder)
  _, sharded = hf.load(tmp_path)
  for (path, a), (_, b) in zip(_leaves(one), _leaves(sharded), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load(tmp_path, dtype):
  half = build_hf("llama", num_attention_heads=4, num_key_value_heads=2).to(getattr(torch, dtype))
  half.save_pretrained(tmp_path)
  _, params = hf.load(tmp_path)
  ref = half.model.layers[1].self_attn.k_proj.weight.detach().float().numpy().T
  np.testing.assert_array_equal(np.asarray(params["layers"]["k_proj"]["kernel"][1]), ref)
  assert params["embed_tokens"]["embedding"].dtype == jnp.float32  # fp32 compute by default
  if dtype == "bfloat16":  # and bf16 compute on request, close to the fp32 reference
    cfg16, p16 = hf.load(tmp_path, {"model.dtype": "bfloat16", "model.param_dtype": "bfloat16"})
    assert p16["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    ids = _prompts(1, 8, seed=4)
    with torch.no_grad():
      ref = half.float()(torch.tensor(ids)).logits.numpy()
    got, _ = _forward(cfg16)(p16, jnp.asarray(ids), jnp.arange(8, dtype=jnp.int32)[None])
    assert np.abs(np.asarray(got) - ref).max() < 0.1 * np.abs(ref).max()


# -- errors -------------------------------------------------------------------------------
def _edit_config(folder, **changes):
  path = folder / "config.json"
  data = json.loads(path.read_text())
  data.update(changes)
  path.write_text(json.dumps(data))


def _edit_tensors(folder, fn):
  path = folder / "model.safetensors"
  tensors = stnp.load_file(str(path))
  fn(tensors)
  stnp.save_file(tensors, str(path), metadata={"format": "pt"})


def _rm(path):
  path.unlink()


BAD = {
    "no such folder": (lambda f: shutil.rmtree(f), "not found"),
    "missing config": (lambda f: _rm(f / "config.json"), "config.json"),
    "malformed config": (lambda f: (f / "config.json").write_text("{"), "malformed"),
    "no weights": (lambda f: _rm(f / "model.safetensors"), "safetensors"),
    "unknown type": (lambda f: _edit_config(f, model_type="gpt2"), "gpt2"),
    "rope yarn": (lambda f: _edit_config(f, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                  "yarn"),
    "o_proj bias": (lambda f: _edit_config(f, attention_bias=True), "o_proj"),
    "gelu": (lambda f: _edit_config(f, hidden_act="gelu"), "gelu"),
    "missing tensor": (lambda f: _edit_tensors(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       "model.layers.1.mlp.up_proj.weight"),
    "wrong shape": (lambda f: _edit_tensors(f, lambda t: t.update(
        {"model.norm.weight": np.ones(E + 2, np.float32)})), "model.norm.weight"),
    "extra tensor": (lambda f: _edit_tensors(f, lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.bias": np.ones(E, np.float32)})), "o_proj.bias"),
    "int tensor": (lambda f: _edit_tensors(f, lambda t: t.update(
        {"model.norm.weight": np.ones(E, np.int32)})), "dtype"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_folder_gives_one_line_error(llama, tmp_path, name):
  _, folder = llama
  bad = tmp_path / "ckpt"
  shutil.copytree(folder, bad)
  breaker, needle = BAD[name]
  breaker(bad)
  with pytest.raises(KvjaxError) as err:
    hf.load(bad)
  msg = str(err.value)
  assert "\n" not in msg and needle in msg


def test_sliding_window_is_enforced_not_ignored(tmp_path):
  m = build_hf("mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
  m.save_pretrained(tmp_path)
  cfg, params = hf.load(tmp_path)
  assert cfg.model.max_seq_len == 16
  with pytest.raises(KvjaxError, match="max_seq_len"):
    generate.generate(cfg, params, [[1, 2, 3, 4, 5, 6, 7, 8]], 12, timed=False)
  with pytest.raises(KvjaxError, match="sliding_window=16"):
    hf.load_config(tmp_path, {"model.max_seq_len": 64})


def test_old_style_config_fields():
  base = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
              intermediate_size=96, vocab_size=V, max_position_embeddings=128)
  over = hf.config_overrides({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **{
      k: v for k, v in LLAMA3.items() if k != "rope_type"}}})
  assert over["model.rope_theta"] == 5e5 and over["model.rope_scaling"]["rope_type"] == "llama3"
  assert over["model.n_kv_heads"] == 4 and over["model.head_dim"] == 16
  qwen = {**base, "model_type": "qwen2", "sliding_window": 32}
  assert hf.sliding_window({**qwen, "use_sliding_window": False}) is None
  assert hf.sliding_window({**qwen, "use_sliding_window": True, "max_window_layers": 1}) == 32
  assert hf.sliding_window({**qwen, "use_sliding_window": True, "max_window_layers": 2}) is None
  assert hf.sliding_window({**qwen, "layer_types": ["full_attention"] * 2}) is None


_GOOD_HF = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=96, vocab_size=V, max_position_embeddings=128)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("hidden_size", -64), ("hidden_size", "64"), ("num_attention_heads", 0),
    ("num_attention_heads", "four"), ("num_hidden_layers", -2), ("intermediate_size", 9.5),
    ("vocab_size", 0), ("max_position_embeddings", "128"), ("num_key_value_heads", -1),
    ("head_dim", "16"), ("rms_norm_eps", 0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", "tiny"),
    ("rope_theta", 0), ("rope_theta", "1e4"), ("sliding_window", "64"), ("sliding_window", -8),
    ("num_hidden_layers", True),
])
def test_cli_hf_config_with_bad_numbers_is_one_line(tmp_path, capsys, field, value):
  """Zero, negative or string numeric fields in config.json: exit 2 and one line naming the
  field (they raised ZeroDivisionError / TypeError inside the importer before)."""
  (tmp_path / "config.json").write_text(json.dumps({**_GOOD_HF, field: value}))
  assert cli.main(["size", "--hf", str(tmp_path), "--seq-len", "8"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"'{field}'" in err and repr(value) in err, err


def test_cli_hf_config_with_bad_llama3_factor_is_one_line(tmp_path, capsys):
  scaling = {**LLAMA3, "factor": "eight"}
  (tmp_path / "config.json").write_text(json.dumps({**_GOOD_HF, "rope_scaling": scaling}))
  assert cli.main(["size", "--hf", str(tmp_path), "--seq-len", "8"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "'factor'" in err


# -- CLI ----------------------------------------------------------------------------------
def test_cli_size_hf(case, capsys):
  _, folder, cfg, _ = case
  assert cli.main(["size", "--hf", str(folder), "--seq-len", "64", "--batch", "2", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  m = cfg.model
  assert out["bytes_per_token_asymptotic"] == 2 * m.n_layers * m.n_kv_heads * m.D * 2  # bf16
  assert out["kv_heads"] == m.n_kv_heads and out["head_dim"] == m.D
  assert out["total_bytes"] == 2 * 64 * out["bytes_per_token_asymptotic"] + 4 * 2  # + lengths


def test_cli_generate_hf_ragged_batch_json(llama, capsys):
  """`kvjax generate --hf` with a ragged batch (right-padded in one kvjax batch) gives
  the tokens transformers gives for each prompt alone."""
  m, folder = llama
  prompts = [list(map(int, _prompts(1, n, seed=3 + n)[0])) for n in (5, 9, 7)]
  ref = []
  for p in prompts:
    with torch.no_grad():
      ref.append(m.generate(torch.tensor([p]), attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                            max_new_tokens=12, do_sample=False)[0, len(p):].tolist())
  argv = ["generate", "--hf", str(folder), "--max-new-tokens", "12", "--greedy", "--json"]
  for p in prompts:
    argv += ["--prompt-ids", ",".join(map(str, p))]
  assert cli.main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  m = hf.load_config(folder).model  # fp32 cache of 9 + 12 slots for 3 sequences, + lengths
  assert out["tokens"] == ref and out["batch"] == 3 and out["capacity"] == 21
  assert out["cache_bytes"] == 2 * m.n_layers * m.n_kv_heads * m.D * 4 * 21 * 3 + 4 * 3


def test_cli_prompt_text_uses_tokenizer_json(llama, tmp_path, capsys):
  from tokenizers import Tokenizer, models, pre_tokenizers

  _, folder = llama
  shutil.copytree(folder, tmp_path / "ckpt")
  words = ["hello", "kv", "cache", "world"] + [f"w{i}" for i in range(V - 5)] + ["[UNK]"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
  assert cli.main(["generate", "--hf", str(tmp_path / "ckpt"), "--prompt", "hello kv cache",
                   "--max-new-tokens", "1", "--greedy", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert len(out["tokens"][0]) == 1 and isinstance(out["text"][0], str)


def test_cli_convert_hf_mean_pools_and_generates(llama, tmp_path, capsys):
  """`kvjax convert --hf` (GQA-2 -> MQA): the saved checkpoint holds the mean of the HF
  k/v heads, loads with its config, and generates through the cache."""
  from kvjax.io import checkpoint

  m, folder = llama
  out = tmp_path / "mqa"
  assert cli.main(["convert", "--hf", str(folder), "--kv-heads", "1", "--method", "pool", "--out", str(out)]) == 0
  assert "GQA-2 -> MQA" in capsys.readouterr().out
  cfg, params = checkpoint.load(out)
  assert cfg.model.n_kv_heads == 1 and cfg.model.n_heads == 4
  D = cfg.model.D
  for layer in range(L):
    for name in ("k_proj", "v_proj"):
      w = getattr(m.model.layers[layer].self_attn, name).weight.detach().numpy()  # [K*D, E]
      want = w.reshape(2, D, E).mean(0).T
      np.testing.assert_allclose(np.asarray(params["layers"][name]["kernel"][layer]), want,
                                 rtol=1e-6, atol=1e-6)
  q = m.model.layers[0].self_attn.q_proj.weight.detach().numpy().T
  np.testing.assert_array_equal(np.asarray(params["layers"]["q_proj"]["kernel"][0]), q)
  assert cli.main(["generate", "--checkpoint", str(out), "--prompt-ids", "1,2,3",
                   "--max-new-tokens", "4", "--json"]) == 0
  assert len(json.loads(capsys.readouterr().out)["tokens"][0]) == 4
  # a target that does not divide the KV heads: one line, nothing written
  assert cli.main(["convert", "--hf", str(folder), "--kv-heads", "3", "--out",
                   str(tmp_path / "bad")]) == 2
  assert "--kv-heads must divide 2" in capsys.readouterr().err
  assert not (tmp_path / "bad").exists()


def test_cli_bad_folder_exits_with_one_line(tmp_path, capsys):
  assert cli.main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1", "--json"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "config.json" in err


# -- the peer benchmark's plumbing (timings are never asserted) --------------------------
def test_peer_experiment_rows_and_plot(tmp_path):
  """The speed race runs the same function on both sides: transformers' dynamic and
  static caches give kvjax's greedy tokens, and rows feed the plot."""

  from kvjax.lab.experiments import peer
  from kvjax import config as config_lib

  cfg = config_lib.load(None, {"model.vocab_size": V, "model.d_model": E, "model.n_layers": 2,
                               "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64,
                               "cache.codec": "fp32", "workload.batch": 2, "workload.prompt_len": 4,
                               "workload.gen_len": 3, "workload.repeats": 1,
                               "params": {"peers": ["kvjax", "kvjax_nnscan", "kvjax_unrolled",
                                                    "kvjax_bf16w", "dynamic", "static"],
                                          "threads": 1}})
  peer.check(cfg)
  rows = peer.run_cell(cfg)
  names = [r["variant"]["peer"] for r in rows]
  assert names == ["kvjax", "kvjax_nnscan", "kvjax_unrolled", "kvjax_bf16w", "dynamic", "static"]
  by = dict(zip(names, (r["metrics"] for r in rows)))
  for r in rows:
    m = r["metrics"]
    assert m["tpot_s"] > 0 and m["ttft_s"] > 0 and m["bandwidth_Bps"] > 0
    assert set(m["dot_Fps"]) == {"f32", "bf16", "s8"}
    assert r["workload"]["threads"] == 1 == r["workload"]["torch_threads"]
    lo, hi = m["tpot_vs_kvjax_ci95"]
    assert lo <= m["tpot_vs_kvjax"] <= hi
  assert [by[p].get("agreement") for p in ("kvjax_nnscan", "kvjax_unrolled", "dynamic",
                                           "static")] == [1.0] * 4
  loops = {r["variant"]["peer"]: r["variant"].get("layers") for r in rows}
  assert [loops[p] for p in ("kvjax", "kvjax_nnscan", "kvjax_unrolled")] == \
      ["switched", "nn.scan", "unrolled"]
  # kvjax rows carry both roofs of their own step; bf16 weights are half the weight bytes
  for p in ("kvjax", "kvjax_unrolled", "kvjax_bf16w"):
    assert by[p]["bound"] in ("bytes", "flops")
    assert by[p]["roof_s"] == max(by[p]["ideal_s"], by[p]["flops_s"])
  assert by["kvjax_bf16w"]["weight_bytes"] * 2 == by["kvjax"]["weight_bytes"]
  assert by["kvjax_bf16w"]["kv_bytes"] == by["kvjax"]["kv_bytes"]
  assert "bound" not in by["dynamic"]
  from kvjax.lab.plots import peer as peer_plot
  for r in rows:
    r["config"] = cfg.to_dict()
  assert all(p.is_file() for p in peer_plot.plot(rows, tmp_path))


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_filled_transformers_cache_decodes_the_same_tokens_every_repeat(arch, kind):
  """The peer's filled-cache timer on a model with sliding-window layers (Gemma 3: its
  DynamicCache cannot be cropped back, so it is made anew) and on one whose config has no
  head_dim (Qwen2): every repeat starts from the same filled context, so it decodes the
  same tokens."""
  import torch
  import transformers

  from kvjax.lab.experiments import _hf_peers

  torch.manual_seed(0)
  if arch == "gemma3":
    c = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, sliding_window=4,
                                      layer_types=["sliding_attention", "full_attention"])
    model = transformers.Gemma3ForCausalLM(c)
  else:
    c = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)
    model = transformers.Qwen2ForCausalLM(c)
  model.eval()
  timer = _hf_peers.HFFilledTimer(model, batch=2, context=8, steps=3, kind=kind)
  first = timer.tokens.copy()
  assert first.shape == (2, 4)
  timer.once()
  np.testing.assert_array_equal(timer.tokens, first)
