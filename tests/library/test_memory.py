"""Memory before allocation (kvjax.memory): the closed forms match what is allocated, and a
request that cannot fit is refused on the host in one line with the estimate and the limit;
allocation failures that still happen are one line at the CLI boundary."""

import types

import jax
import numpy as np
import pytest

from kvjax import cache, cli, config, footprint, memory, model
from kvjax.errors import KvjaxError

QUICK = ["--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.n_heads=4",
         "--set", "model.n_kv_heads=2"]


@pytest.mark.parametrize("over", [
    {}, {"model.tie_embeddings": True, "model.qkv_bias": True, "model.n_kv_heads": 2},
    {"model.head_dim": 32, "model.d_ff": 104, "model.n_kv_heads": 1},
])
def test_param_count_is_the_initialised_tree(over):
  cfg = config.load(None, over)
  tree = jax.eval_shape(lambda: model.init_params(cfg.model, 0))
  assert footprint.param_count(cfg.model) == sum(x.size for x in jax.tree.leaves(tree))
  assert footprint.param_bytes(cfg.model) == 4 * footprint.param_count(cfg.model)


@pytest.mark.parametrize("loop", ["switch", "unrolled", "scan"])
def test_the_per_layer_copy_is_what_prepare_params_makes(loop):
  """A layer loop over per-layer weights (switch, unrolled) runs on a second copy of the
  layers' weights, made once by `step.prepare_params` while the caller keeps the stacked
  params: the estimate counts exactly that copy, and nothing for nn.scan."""
  from kvjax.decode import step
  cfg = config.load(None, {"model.layer_loop": loop, "model.qkv_bias": True})
  params = model.init_params(cfg.model, 0)
  prepared = step.prepare_params(cfg, params)
  held = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}  # the same buffers
  copied = sum(x.nbytes for x in jax.tree.leaves(prepared)
               if x.unsafe_buffer_pointer() not in held)
  assert memory.split_bytes(cfg) == copied
  assert memory.estimate(cfg, 1, 8, 4)["per-layer weights"] == copied
  assert (copied == footprint.layer_param_bytes(cfg.model)) == (loop != "scan")


@pytest.mark.parametrize("over", [
    {"cache.codec": "fp32"}, {"cache.codec": "int8"}, {"cache.layout": "none"},
    {"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 8,
     "cache.residual": 16},
    {"cache.layout": "paged", "cache.page_size": 8},
])
def test_cache_bytes_is_what_init_cache_allocates(over):
  cfg = config.load(None, {"model.d_model": 32, "model.n_layers": 1, **over})
  c = jax.eval_shape(lambda: cache.init_cache(cfg, 3, 40))
  want = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(c))
  assert footprint.cache_bytes(cfg, 3, 40) == want


def test_check_refuses_over_the_limit_with_both_numbers(monkeypatch):
  cfg = config.load(None)
  need = memory.check(cfg, 2, 64, 32)  # fits the machine
  parts = memory.estimate(cfg, 2, 64, 32)
  assert need == sum(parts.values()) and parts["params"] == 0
  assert parts["cache x2"] == 2 * footprint.cache_bytes(cfg, 2, 64)
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(need - 1))
  with pytest.raises(KvjaxError) as err:
    memory.check(cfg, 2, 64, 32, what="this test")
  msg = str(err.value)
  assert "\n" not in msg and "this test" in msg and "KVJAX_MEMORY_LIMIT" in msg
  assert footprint.human(need) in msg and footprint.human(need - 1) in msg
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(need))
  assert memory.check(cfg, 2, 64, 32) == need


@pytest.mark.parametrize("text, want", [("2048", 2048), ("1.5KiB", 1536), ("2 GiB", 2 * 2**30),
                                        ("3M", 3 * 2**20)])
def test_memory_limit_env_sizes(monkeypatch, text, want):
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", text)
  assert memory.available_bytes()[0] == want


def test_memory_limit_env_that_is_not_a_size(monkeypatch):
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", "lots")
  with pytest.raises(KvjaxError, match="KVJAX_MEMORY_LIMIT='lots' is not a size"):
    memory.available_bytes()


def test_host_ram_is_read_on_cpu(monkeypatch):
  monkeypatch.delenv("KVJAX_MEMORY_LIMIT", raising=False)
  free, source = memory.available_bytes()
  assert source.startswith("host RAM") and 0 < free


def test_none_layout_temporaries_cover_the_recomputed_prefix():
  cfg = config.load(None)
  cached = footprint.temp_bytes(cfg, 1, 8, 1024)
  none = footprint.temp_bytes(config.load(None, {"cache.layout": "none"}), 1, 8, 1024)
  m = cfg.model
  # the prefix's activations and its blocked pass over 1,024 tokens, not the prompt's 8
  assert none > 15 * cached
  assert none >= 4 * 1024 * (2 * m.d_model + 3 * m.F + 4 * m.n_heads * m.D)


def test_cli_generate_refuses_a_cache_larger_than_memory(capsys):
  """The capacity used to reach XLA (RESOURCE_EXHAUSTED, 50 lines) or numpy (a traceback)."""
  rc = cli.main(["generate", "--prompt-ids", "1,2", *QUICK, "--set", "cache.capacity=2000000000",
                 "--set", "model.max_seq_len=2000000000"])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and err.count("\n") == 1
  assert "not enough memory for this generate" in err and "available" in err


def test_cli_generate_refuses_weights_larger_than_memory(capsys, monkeypatch):
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", "1KiB")
  rc = cli.main(["generate", "--prompt-ids", "1,2", *QUICK])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and "the model's weights" in err


def test_run_refuses_a_cell_before_any_runs(capsys, tmp_path):
  rc = cli.main(["run", "configs/quickstart.yaml", "--out", str(tmp_path),
                 "--set", "workload.batch=10000000"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and "not enough memory for this cell" in err
  assert not (tmp_path / "latency.jsonl").exists() or \
      (tmp_path / "latency.jsonl").read_text() == ""


@pytest.mark.parametrize("exc", [
    MemoryError("Unable to allocate 40.0 GiB for an array with shape (5, 2, 1073741824)"),
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               "42949672960 bytes.\n" + "detail line\n" * 50),
])
def test_allocation_failures_that_still_happen_are_one_line(capsys, monkeypatch, exc):
  from kvjax.decode import generate

  def boom(*a, **k):
    raise exc
  monkeypatch.setattr(generate, "generate", boom)
  rc = cli.main(["generate", "--prompt-ids", "1,2", *QUICK])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and err.startswith("kvjax: error: out of memory")


def test_other_exceptions_are_not_hidden(monkeypatch):
  from kvjax.decode import generate

  def boom(*a, **k):
    raise ZeroDivisionError("a bug")
  monkeypatch.setattr(generate, "generate", boom)
  with pytest.raises(ZeroDivisionError):
    cli.main(["generate", "--prompt-ids", "1,2", *QUICK])


def test_numpy_memory_error_is_a_memory_error():
  """What numpy raises for an impossible array is caught by the MemoryError branch."""
  with pytest.raises(MemoryError):
    np.empty((2**44,), np.float32)  # 64 TiB


def test_every_model_source_refuses_weights_before_reading_them(tmp_path, monkeypatch, capsys):
  """checkpoint:, hf: and gguf: sources check the weights' bytes against the limit before
  reading a tensor (a --config model before creating one: test above)."""
  pytest.importorskip("gguf")
  from test_gguf import _source, write_gguf

  from kvjax.io import checkpoint
  cfg, params = _source(False)
  checkpoint.save(tmp_path / "ckpt", cfg, params, step=0)
  write_gguf(tmp_path / "m.gguf", cfg, params)
  need = footprint.param_bytes(cfg.model)
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(need - 1))
  for flag, ref in (("--checkpoint", tmp_path / "ckpt"), ("--gguf", tmp_path / "m.gguf")):
    rc = cli.main(["generate", flag, str(ref), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"the weights of {ref}" in err, err
    assert footprint.human(need) in err
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(need))  # exactly the weights' bytes: loads
  assert cli.main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt-ids", "1,2",
                   "--max-new-tokens", "2", "--json"]) == 0


def _prog(arg, out, temp, alias):
  ma = types.SimpleNamespace(argument_size_in_bytes=arg, output_size_in_bytes=out,
                             temp_size_in_bytes=temp, alias_size_in_bytes=alias)
  return types.SimpleNamespace(memory_analysis=lambda: ma)


def test_program_bytes_is_the_largest_program_net_of_donation():
  assert footprint.program_bytes(_prog(100, 50, 30, 40), _prog(10, 10, 500, 0)) == 520
  assert footprint.program_bytes(_prog(100, 50, 30, 40)) == 140
  assert footprint.program_bytes() is None
  assert footprint.program_bytes(types.SimpleNamespace(memory_analysis=lambda: None)) is None

  def broken():
    raise NotImplementedError
  assert footprint.program_bytes(types.SimpleNamespace(memory_analysis=broken)) is None


@pytest.mark.parametrize("shape, T", [("gemma3-270m", 32768), ("qwen2.5-coder-0.5b", 16384)])
def test_long_prompt_temporaries_match_the_compiled_prefill(shape, T):
  """A long prompt's prefill at a real model's shape (compiled, never run: no weights are
  made): the closed form of its temporaries covers what XLA's buffer assignment allocates
  and exceeds it by at most a quarter, so the memory check neither lets a long prompt
  through that cannot fit nor refuses one that can by much."""
  import jax.numpy as jnp
  from kvjax import cache as cache_lib, decode, model
  from kvjax.decode import step
  from kvjax.lab.experiments import load_shape
  cfg = load_shape(shape)
  params = jax.eval_shape(lambda: step.prepare_params(cfg, model.init_params(cfg.model, 0)))
  cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 1, T + 1))
  lowered = decode.prefill.lower(params, jax.ShapeDtypeStruct((1, T), jnp.int32),
                                 jax.ShapeDtypeStruct((1,), jnp.int32), cache,
                                 jax.random.PRNGKey(0), **step.statics(cfg, decode.Sampler()))
  temp = lowered.compile().memory_analysis().temp_size_in_bytes
  est = footprint.temp_bytes(cfg, 1, T, T + 1)
  assert temp <= est <= 1.25 * temp
