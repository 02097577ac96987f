"""The Pallas read (interpret mode here) == the XLA blockwise read == one softmax over the
dequantized cache: every codec, MHA/GQA/MQA, contiguous (stacked by layer), paged through
a permuted block table, the residual window, live lengths across block and split edges,
prefill and decode; the whole model greedy-decodes the same tokens without retracing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params

from kvjax import attention, decode
from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.attention import pallas as pa
from kvjax.decode import generate
from kvjax.errors import KvjaxError

B, H, D = 3, 4, 8
# Two ragged prefill chunks, then a decode step, reading live lengths 0, (9, 2, 5) and
# (13, 3, 8): across 4-token blocks and the 12-token split edge (S = 21 slots).
CHUNKS = [[9, 2, 5], [4, 1, 3], [1, 1, 1]]
# |pallas - grouped| and |pallas - reference| bounds per codec: all compute in float32 from
# the same stored codes, so only the summation order (and where scales are applied)
# differs; the coarse codecs reconstruct larger values, so their rounding is larger.
TOL = {"fp32": 2e-6, "bf16": 2e-6, "int8": 4e-6, "int4": 1e-5, "int2": 1e-5, "fp8_e4m3": 4e-6}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  """Blocks of 4 tokens, 2 splits, 16-row tiles: tiny shapes still cross every edge."""
  monkeypatch.setattr(pa, "BLOCK", 4)
  monkeypatch.setattr(pa, "SPLITS", 2)
  monkeypatch.setattr(pa, "ROW_BLOCK", 16)


def _attend_all(cfg, S, K, table=None, seed=0):
  """Write CHUNKS through a cache; before each write, attend with layer 1's segments under
  `grouped` and `pallas` (and `reference` before the last write, to keep compiles short).
  Returns the lists of outputs (valid query rows only)."""
  rng = np.random.default_rng(seed)
  n = np.zeros(B, np.int64)
  writes = []
  for chunk in CHUNKS:
    T = max(chunk)
    t = np.arange(T)[None]
    pos = np.where(t < np.array(chunk)[:, None], n[:, None] + t, -1)
    n = n + np.array(chunk)
    kv = [jnp.asarray(rng.normal(size=(2, B, T, K, D)) * 2, jnp.float32) for _ in range(2)]
    q = jnp.asarray(rng.normal(size=(B, T, H, D)) * 2, jnp.float32)
    writes.append((*kv, q, jnp.asarray(pos, jnp.int32)))

  @jax.jit
  def run(writes, table, layer):
    c = cache_lib.init_cache(cfg, B, S)
    if table is not None:
      c = c.replace(block_table=table)
    out = {name: [] for name in ("grouped", "pallas", "reference")}
    for i, (k, v, q, pos) in enumerate(writes):
      segs = cache_lib.segments(c, layer)
      for name in out if i == len(writes) - 1 else ("grouped", "pallas"):
        got = attention.ATTENTIONS[name](q, k[1], v[1], pos, segs)
        out[name].append(jnp.where((pos >= 0)[:, :, None, None], got, 0.0))
      c = cache_lib.layout_of(c).write(c, k, v, pos)
    return out

  return run(writes, table, jnp.int32(1))


def _check(out, codec):
  for got, want in zip(out["pallas"], out["grouped"]):
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL[codec], rtol=0)
  np.testing.assert_allclose(np.asarray(out["pallas"][-1]), np.asarray(out["reference"][-1]),
                             atol=TOL[codec], rtol=0)


@pytest.mark.parametrize("codec, K, extra", [
    ("fp32", 4, {}), ("bf16", 2, {}), ("int8", 1, {}), ("int4", 2, {"cache.group_size": 4}),
    ("int2", 4, {}),
    ("int8", 2, {"cache.residual": 4}),  # window segment (ring of 4) + quantized history
    ("int4", 2, {"cache.k_axis": "channel", "cache.group_size": 4, "cache.residual": 8}),
], ids=lambda x: str(x))
def test_contiguous_equals_grouped_and_reference(codec, K, extra):
  """Stacked-by-layer storage, layer index traced; KIVI channel keys take the XLA read.
  (fp8_e4m3 is covered paged.)"""
  cfg = tiny_config(**{"model.n_kv_heads": K, "cache.codec": codec, "model.head_dim": D,
                       **extra})
  _check(_attend_all(cfg, 21, K), codec)


@pytest.mark.parametrize("codec, K, page", [("int4", 2, 4), ("bf16", 1, 8), ("fp8_e4m3", 4, 4)],
                         ids=lambda x: str(x))
def test_paged_permuted_table_equals_grouped_and_reference(codec, K, page):
  """Pages found through a random permutation; row 1 (6 tokens at most) has its pages
  from the third on unallocated (the sentinel P): never read, never a fault."""
  cfg = tiny_config(**{"model.n_kv_heads": K, "cache.codec": codec, "model.head_dim": D,
                       "cache.layout": "paged", "cache.page_size": page})
  N = -(-21 // page)
  table = np.random.default_rng(3).permutation(B * N).reshape(B, N)
  table[1, 2:] = B * N
  _check(_attend_all(cfg, 21, K, jnp.asarray(table, jnp.int32)), codec)


def test_dot_path_and_unstacked_segment(monkeypatch):
  """16 padded rows, 16-token blocks and head_dim 16: the kernel multiplies with `dot`.
  The segment holds one layer's storage (no `Segment.layer`)."""
  from test_fast_paths import segment
  monkeypatch.setattr(pa, "ROW_MIN", 16)
  monkeypatch.setattr(pa, "BLOCK", 16)
  rng = np.random.default_rng(5)
  Dd, S, K = 16, 45, 2
  lengths = jnp.asarray([45, 16, 33], jnp.int32)
  k, v = (jnp.asarray(rng.normal(size=(B, K, S, Dd)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.normal(size=(B, 1, H, Dd)) * 2, jnp.float32)
  kn, vn = (jnp.asarray(rng.normal(size=(B, 1, K, Dd)), jnp.float32) for _ in range(2))
  pos = lengths[:, None]
  run = jax.jit(lambda name, *a: attention.ATTENTIONS[name](*a[:4], [segment("int8", *a[4:])]),
                static_argnums=0)
  args = (q, kn, vn, pos, k, v, lengths)
  got, want = run("pallas", *args), run("grouped", *args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL["int8"], rtol=0)


def test_greedy_tokens_equal_grouped_without_retrace():
  """The whole model, paged int8 GQA cache: `pallas` decodes the tokens `grouped` does, and
  a second request of the same shapes neither retraces prefill nor decode."""
  prompts = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3]]
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.codec": "int8", "cache.layout": "paged",
                       "cache.page_size": 4})
  params = tiny_params(cfg)
  want = generate.generate(cfg, params, prompts, 8, timed=False)["tokens"]
  pcfg = config_lib.replace(cfg, **{"model.attention": "pallas"})
  before = dict(decode.TRACES)
  got = generate.generate(pcfg, params, prompts, 8, timed=False)["tokens"]
  assert got == want
  assert decode.TRACES == {k: v + 1 for k, v in before.items()}  # one trace each, 7 steps
  other = [[t + 1 for t in p] for p in prompts]
  generate.generate(pcfg, params, other, 8, timed=False)
  assert decode.TRACES == {k: v + 1 for k, v in before.items()}


@pytest.mark.parametrize("overrides, words", [
    ({"model.head_dim": 12}, "power-of-two head_dim"),
    ({"cache.layout": "paged", "cache.page_size": 5}, "cache.page_size=16"),
])
def test_shapes_the_kernel_cannot_take_are_one_line_errors(overrides, words):
  with pytest.raises(KvjaxError, match=words) as err:
    tiny_config(**{"model.attention": "pallas", **overrides})
  assert "\n" not in str(err.value)
  tiny_config(**overrides)  # the same shapes are fine for `grouped`


@pytest.mark.parametrize("codec, layout, T", [("int4", "contiguous", 1), ("fp8_e4m3", "paged", 1),
                                              ("bf16", "contiguous", 8)], ids=str)
def test_kernel_lowers_to_triton_without_a_gpu(codec, layout, T, monkeypatch):
  """What a GPU would compile: exported for CUDA (no GPU needed), every op and shape of the
  kernel passes the Pallas Triton lowering, one Triton call per segment. T=8 (16 query
  rows, 16-token blocks, head_dim 16) takes the `dot` path."""
  monkeypatch.setattr(pa, "INTERPRET", False)
  monkeypatch.setattr(pa, "BLOCK", 16)
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.codec": codec, "model.head_dim": 16,
                       "cache.layout": layout, "cache.page_size": 16})

  def step(q, kv, pos):
    c = cache_lib.init_cache(cfg, B, 40)
    segs = cache_lib.segments(dataclasses.replace(c, lengths=c.lengths + 20), jnp.int32(1))
    return pa.pallas(q, kv, kv, pos, segs)

  shapes = [jax.ShapeDtypeStruct(s, d) for s, d in [((B, T, H, 16), jnp.bfloat16),
                                                    ((B, T, 2, 16), jnp.bfloat16),
                                                    ((B, T), jnp.int32)]]
  unchecked = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  try:
    exp = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=unchecked)(*shapes)
  except RuntimeError as e:  # JAX 0.11's Triton lowering asks for a real or abstract GPU
    if "AbstractDevice" not in str(e):
      raise
    pytest.skip("this JAX lowers Pallas to Triton only with a GPU device (seen with 0.11.2); "
                "on a GPU this file's other tests compile and run the kernel for real")
  assert exp.mlir_module().count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_bench_pallas_lays_our_cache_out_for_jax_paged_kernel(codec):
  """scripts/bench_pallas.py times JAX's own paged kernel (jax.experimental.pallas.ops.gpu.
  paged_attention) on our cache: its page layout of our storage must make that kernel
  (interpret mode here) compute our cache-only attention, which must in turn agree with
  JAX's reference implementation on the dequantized K/V."""
  import sys
  from pathlib import Path

  from jax.experimental.pallas.ops.gpu import paged_attention as jpa
  sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
  import bench_pallas as bp
  shape = dict(bp.SMOKE, heads=8, kv_heads=2)  # 4 query heads per kv head
  c, (q, _, _, _, k_enc, v_enc, _) = bp._cell(shape, codec, 2, 32, jax.random.PRNGKey(3))
  inputs = bp.jax_paged_inputs(c, q, k_enc, v_enc, page=8)
  want = bp.cache_only_reference(c, q, k_enc, v_enc)
  np.testing.assert_allclose(bp.jax_paged_step(4, interpret=True)(*inputs), want, atol=1e-5)
  kv = [jnp.swapaxes(c.decode(e, jnp.float32), 1, 2) for e in (k_enc, v_enc)]  # [B, S, K, D]
  np.testing.assert_allclose(jpa.paged_attention_reference(inputs[0], *kv, inputs[4]), want,
                             atol=1e-5)
