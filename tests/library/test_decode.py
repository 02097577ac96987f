"""The decode loop: greedy equals the reference, compiles once, samplers, eos, cache bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import decode
from kvjax import model as model_lib
from kvjax.decode import generate
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.model import Transformer

PROMPTS = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3]]


def _greedy_reference(cfg, params, prompt, n):
  """Greedy decoding by re-running the full forward pass (no cache) on the growing sequence,
  held in a fixed-size buffer with padding marked by position -1 (one compile)."""
  model = Transformer(cfg.model)
  S = len(prompt) + n
  full = jax.jit(lambda tok, pos: model.apply({"params": params}, tok, pos, None)[0])
  seq = list(prompt)
  for _ in range(n):
    tok = jnp.asarray([seq + [0] * (S - len(seq))], jnp.int32)
    pos = jnp.asarray([list(range(len(seq))) + [-1] * (S - len(seq))], jnp.int32)
    seq.append(int(jnp.argmax(full(tok, pos)[0, len(seq) - 1])))
  return seq[len(prompt):]


def test_greedy_contiguous_equals_none_equals_reference(variant_cfg):
  params = tiny_params(variant_cfg)
  got = {}
  for layout in ("contiguous", "none"):
    cfg = config_lib.replace(variant_cfg, **{"cache.layout": layout})
    got[layout] = generate.generate(cfg, params, PROMPTS, 10, timed=False)["tokens"]
  assert got["contiguous"] == got["none"]
  assert got["contiguous"][1] == _greedy_reference(variant_cfg, params, PROMPTS[1], 10)


def test_decode_compiles_once_for_many_steps_and_new_prompts():
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 1})
  params = tiny_params(cfg)
  generate.generate(cfg, params, PROMPTS, 12, timed=False)
  before = dict(decode.TRACES)
  other = [[t + 1 for t in p] for p in PROMPTS]  # same shapes, new values
  out = generate.generate(cfg, params, other, 12, timed=False)
  assert decode.TRACES == before
  assert all(len(t) == 12 for t in out["tokens"])


UNROLL_CASES = {
    "fp32": {},
    "int8": {"cache.codec": "int8"},
    "kivi-window": {"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 4,
                    "cache.residual": 4},
    "paged-int4": {"cache.layout": "paged", "cache.page_size": 4, "cache.codec": "int4"},
}


@pytest.mark.parametrize("case", sorted(UNROLL_CASES))
def test_unrolled_decode_equals_scanned(case):
  """`model.scan_unroll = n_layers` decodes with one weight tree per layer (sliced once per
  call, `model.split_layers`) in a Python layer loop: same tokens, same final cache."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, **UNROLL_CASES[case]})
  unrolled = config_lib.replace(cfg, **{"model.scan_unroll": cfg.model.n_layers})
  params = tiny_params(cfg)
  a, b = (generate.generate(c, params, PROMPTS, 9, timed=False, return_cache=True)
          for c in (cfg, unrolled))
  assert a["tokens"] == b["tokens"]
  for x, y in zip(jax.tree.leaves(a["cache"]), jax.tree.leaves(b["cache"]), strict=True):
    if jnp.issubdtype(x.dtype, jnp.floating):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    else:  # codes, bit patterns, lengths, block tables
      np.testing.assert_array_equal(x, y)


def _cache_copies(cfg, B=2, S=24):
  """Instructions of the compiled prefill and decode programs that copy a whole cache leaf."""
  params = tiny_params(cfg)
  cache, key, sampler = cache_lib.init_cache(cfg, B, S), jax.random.PRNGKey(0), decode.Sampler()
  tok_B = jnp.zeros((B,), jnp.int32)
  hlo = decode.decode.lower(params, cache, tok_B, key,
                            **generate.statics(cfg, sampler, steps=3)).compile().as_text() + \
      decode.prefill.lower(params, jnp.zeros((B, 5), jnp.int32), tok_B + 5, cache, key,
                           **generate.statics(cfg, sampler)).compile().as_text()
  shapes = {f"[{','.join(map(str, a.shape))}]" for a in jax.tree.leaves(cache) if a.ndim == 5}
  return [ln for ln in hlo.splitlines()
          if " copy(" in ln and any(sh in ln.split(" copy(")[0] for sh in shapes)]


@pytest.mark.parametrize("case", ["bf16", "paged-int4"])
def test_unrolled_decode_writes_the_cache_in_place(case):
  """Unrolled, the cache write must wait for the last layer's read of the old cache, or
  XLA copies the whole cache (twice per decode step, measured 2x slower); the scanned
  programs never copy it. Contiguous with one leaf per K/V (bf16), paged with codes and
  scales (int4; contiguous int8's codes + scales are written the same way, leaf by leaf).
  (Not checked with a residual window: its temporaries have the shape of a cache leaf, so
  this shape match cannot tell them from a copy.)"""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.codec": "bf16",
                       **UNROLL_CASES.get(case, {})})
  assert _cache_copies(cfg) == []
  assert _cache_copies(config_lib.replace(cfg, **{"model.scan_unroll": 2})) == []


GEMMA_LIKE = {"model.n_kv_heads": 1, "model.global_every": 2, "model.sliding_window": 3,
              "model.rope_local_theta": 100.0}
CHUNK_CASES = {
    "fp32": {"model.n_kv_heads": 2},
    "paged": {"model.n_kv_heads": 2, "cache.layout": "paged", "cache.page_size": 4},
    "windowed": GEMMA_LIKE,
    "latent": "rank 8 (latent.factor)",
    "mla": "rank 8 beside 2 rotated pairs, read absorbed (latent.factor)",
    "none": {"cache.layout": "none"},
    "bf16": {"model.n_kv_heads": 2, "cache.codec": "bf16"},
    "int8": {"model.n_kv_heads": 2, "cache.codec": "int8"},
    "accelerator": {"model.n_kv_heads": 2, "model.program": "accelerator"},
}


@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("case", sorted(CHUNK_CASES))
def test_a_prompt_prefilled_in_chunks_decodes_as_in_one_call(case, chunk):
  """`workload.prefill_chunk` N: the prompts (ragged, 6, 2 and 5 tokens) go through the
  cache N tokens at a time, each chunk reading the earlier ones from the cache. With a
  float cache that is the one-call prefill: the same greedy tokens and the same stored K/V.
  A quantized cache's later chunks read the earlier ones through the codec, as decode
  does: the same tokens here, and the stored codes within one step of the codec."""
  if case in ("latent", "mla"):  # a model whose K/V are rank 8: its latents hold them exactly
    from kvjax.cache import latent
    cfg, params = latent.factor(tiny_config(), tiny_params(tiny_config()), 8,
                                rope_pairs=2 if case == "mla" else 0)
  else:
    cfg = tiny_config(**CHUNK_CASES[case])
    params = tiny_params(cfg)
  chunked = config_lib.replace(cfg, **{"workload.prefill_chunk": chunk})
  a, b = (generate.generate(c, params, PROMPTS, 6, timed=False, return_cache=True)
          for c in (cfg, chunked))
  assert a["tokens"] == b["tokens"]
  for x, y in zip(jax.tree.leaves(a["cache"]), jax.tree.leaves(b["cache"]), strict=True):
    if jnp.issubdtype(x.dtype, jnp.floating):
      np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)
    elif x.dtype == jnp.uint16:  # bfloat16 values or scales, stored as their bit patterns
      widen = lambda a: np.asarray(a).view(jnp.bfloat16).astype(np.float32)  # noqa: E731
      np.testing.assert_allclose(widen(y), widen(x), rtol=2e-2, atol=1e-3)
    elif case == "int8" and x.dtype == jnp.int8:
      assert np.max(np.abs(np.asarray(x, np.int32) - np.asarray(y, np.int32))) <= 1
    else:  # lengths, block tables
      np.testing.assert_array_equal(x, y)


def test_a_chunked_prefill_holds_the_temporaries_of_one_chunk():
  """The memory estimate of a long prompt prefilled in chunks counts one chunk's
  temporaries (and the carried logits), not the prompt's."""
  from kvjax import footprint
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  chunked = config_lib.replace(cfg, **{"workload.prefill_chunk": 64})
  whole = footprint.temp_bytes(cfg, 1, 4096, 4096)
  assert footprint.temp_bytes(chunked, 1, 4096, 4096) < whole / 4
  assert footprint.temp_bytes(chunked, 1, 64, 4096) == footprint.temp_bytes(cfg, 1, 64, 4096)
  V = cfg.model.vocab_size
  assert footprint.temp_bytes(chunked, 1, 4096, 4096) == \
      footprint.temp_bytes(cfg, 1, 64, 4096) + 4 * V


def test_a_chunked_prefill_with_an_eviction_policy_is_refused():
  cfg = tiny_config(**{"cache.policy": "window", "cache.budget": 8,
                       "workload.prefill_chunk": 2})
  with pytest.raises(KvjaxError, match="workload.prefill_chunk=2 .* cache.policy=window"):
    generate.generate(cfg, tiny_params(cfg), PROMPTS, 2, timed=False)
  with pytest.raises(KvjaxError, match="workload.prefill_chunk must be an integer >= 0"):
    tiny_config(**{"workload.prefill_chunk": -1})


def test_split_params_run_either_way():
  """Params already split per layer (`step.prepare_params`, whatever `model.scan_unroll`
  says) run the default switched scan to the same tokens, and splitting twice changes
  nothing."""
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  params = tiny_params(cfg)
  split = step.prepare_params(config_lib.replace(cfg, **{"model.scan_unroll": 2}), params)
  assert "layers" not in split and model_lib.split_layers(split) is split
  want = generate.generate(cfg, params, PROMPTS, 6, timed=False)["tokens"]
  assert generate.generate(cfg, split, PROMPTS, 6, timed=False)["tokens"] == want


@pytest.mark.parametrize("codec, itemsize", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_cache_bytes_equal_closed_form(codec, itemsize):
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.codec": codec})
  B, S = 3, 20
  cache = cache_lib.init_cache(cfg, B, S)
  m = cfg.model
  expected = 2 * m.n_layers * m.n_kv_heads * m.D * S * B * itemsize + 4 * B
  assert cache_lib.tree_bytes(cache) == expected
  spec = cache_lib.CacheSpec.from_config(cfg, B, S)
  assert cache_lib.LAYOUTS["contiguous"].closed_form_bytes(spec) == expected
  out = generate.generate(cfg, tiny_params(cfg), PROMPTS, 4, timed=False)
  S_run = max(map(len, PROMPTS)) + 4
  per_slot = (expected - 4 * B) // S  # generate sizes the cache to prompt + new tokens
  assert out["cache_bytes"] == per_slot * S_run + 4 * B


def test_reduced_precision_caches_stay_close_to_fp32():
  cfg32 = tiny_config()
  params = tiny_params(cfg32)
  tokens = jnp.asarray([PROMPTS[0] + [1, 2, 3, 4]], jnp.int32)
  T = tokens.shape[1]
  ref = None
  for codec, tol in (("fp32", 0.0), ("bf16", 2e-2), ("fp16", 2e-3)):
    cfg = config_lib.replace(cfg32, **{"cache.codec": codec})
    model = Transformer(cfg.model)

    @jax.jit  # prefill then read back through the cache: one program, not a compile per op
    def run(params, tokens, cache):
      _, cache = model.apply({"params": params}, tokens[:, :6],
                             jnp.arange(6, dtype=jnp.int32)[None], cache)
      return model.apply({"params": params}, tokens[:, 6:],
                         jnp.arange(6, T, dtype=jnp.int32)[None], cache)[0]

    logits = run(params, tokens, cache_lib.init_cache(cfg, 1, T))
    if ref is None:
      ref = logits
    err = float(jnp.max(jnp.abs(logits - ref)) / jnp.max(jnp.abs(ref)))
    assert err <= tol + 1e-6, (codec, err)


def test_samplers():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 50)) * 3, jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), 64)
  greedy = np.asarray(decode.Sampler()(logits, keys[0]))
  assert (greedy == np.argmax(logits, -1)).all()
  assert (np.asarray(decode.Sampler(1.0, top_k=1)(logits, keys[1])) == greedy).all()
  assert (np.asarray(decode.Sampler(1.0, top_p=1e-6)(logits, keys[2])) == greedy).all()
  top5 = np.argsort(-np.asarray(logits), -1)[:, :5]
  draws = np.stack([np.asarray(decode.Sampler(1.0, top_k=5)(logits, k)) for k in keys])
  assert all(set(draws[:, b]) <= set(top5[b]) for b in range(4))
  assert len(set(draws[:, 0])) > 1  # it does sample, not argmax
  # top_p keeps the smallest prefix reaching p: every draw is inside that nucleus
  probs = np.asarray(jax.nn.softmax(logits, -1))
  order = np.argsort(-probs, -1)
  draws_p = np.stack([np.asarray(decode.Sampler(1.0, top_p=0.5)(logits, k)) for k in keys])
  for b in range(4):
    cum = np.cumsum(probs[b, order[b]])
    nucleus = set(order[b, :int(np.searchsorted(cum, 0.5) + 1)])
    assert set(draws_p[:, b]) <= nucleus


def test_sampling_is_reproducible_per_seed():
  cfg = tiny_config(**{"workload.temperature": 1.0, "workload.top_k": 20})
  params = tiny_params(cfg)
  a = generate.generate(cfg, params, PROMPTS, 8, seed=1, timed=False)["tokens"]
  b = generate.generate(cfg, params, PROMPTS, 8, seed=1, timed=False)["tokens"]
  c = generate.generate(cfg, params, PROMPTS, 8, seed=2, timed=False)["tokens"]
  assert a == b and a != c


def test_eos_stops_each_sequence():
  cfg = tiny_config()
  params = tiny_params(cfg)
  free = generate.generate(cfg, params, PROMPTS, 8, timed=False)["tokens"]
  eos = free[0][2]
  cfg_eos = config_lib.replace(cfg, **{"workload.eos_id": eos})
  out = generate.generate(cfg_eos, params, PROMPTS, 8, timed=False)["tokens"]
  for row_free, row in zip(free, out):
    if eos in row_free:
      cut = row_free.index(eos) + 1
      assert row == row_free[:cut]
    else:
      assert row == row_free


def test_request_limits_are_checked_on_the_host():
  cfg = tiny_config(**{"cache.capacity": 8})
  params = tiny_params(cfg)
  with pytest.raises(KvjaxError, match="exceeds the cache capacity 8"):
    generate.generate(cfg, params, [[1, 2, 3, 4, 5]], 4)
  with pytest.raises(KvjaxError, match="outside the vocabulary"):
    generate.generate(cfg, params, [[1, 99]], 2)
  with pytest.raises(KvjaxError, match="at least one token"):
    generate.generate(cfg, params, [[]], 2)
