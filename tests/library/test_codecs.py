"""Cache codecs in isolation: round-trip bounds from each codec's math, packing, non-finite
input, the folded reads against a dequantize-everything reference, bytes, config checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvjax import codecs, config
from kvjax.codecs import packing, quant
from kvjax.errors import KvjaxError

QUANT = ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]
MODES = {"token": (0, "token"), "token_g4": (4, "token"), "channel_u4": (4, "channel")}
SHAPE = (2, 8, 8)  # [lead, T, D]
TINY = np.float32(np.finfo(np.float32).tiny)
FP8 = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}  # mantissa bits, smallest normal exponent


def make(name, mode):
  group, axis = MODES[mode]
  return codecs.for_role(name, config.CacheConfig(group_size=group, k_axis=axis), "k")


@functools.lru_cache(maxsize=None)
def roundtrip(name, mode):
  codec = make(name, mode)
  return jax.jit(lambda x: (codec.encode(x), codec.decode(codec.encode(x))))


def widen(codec, enc, key):
  """A stored scale / zero broadcast to every element it applies to (numpy, float64)."""
  a = np.asarray(packing.load_meta(enc[key]), np.float64)
  if codec.axis == "channel":
    return np.repeat(a, codec.group, axis=-2)
  return np.repeat(a, SHAPE[-1] // a.shape[-1], axis=-1)


def error_bound(codec, enc, x):
  """What each codec's math promises for |x - x̂| (plus float32 rounding of the decode)."""
  s = widen(codec, enc, "scale")
  ax = np.abs(x.astype(np.float64))
  slack = 2.0 ** -22 * ax + TINY  # decode's own float32 rounding; flushed subnormals
  if codec.kind == "int":
    return s / 2 + slack
  if codec.kind == "uint":
    # XLA:CPU flushes subnormal results to zero, each by at most TINY: an asymmetric
    # codec has four such steps where a symmetric one has one (the zero point's halves
    # max/2 + min/2, x - zero before the division, (code - h) * scale, zero + that)
    return s / 2 + slack + 3 * TINY + 2.0 ** -22 * np.abs(widen(codec, enc, "zero"))
  m, emin = FP8[codec.name]
  return np.maximum(2.0 ** -(m + 1) * ax, s * 2.0 ** (emin - m - 1)) + slack


@st.composite
def blocks(draw):
  """Finite float32 blocks: one decade range per block, optional spread inside groups,
  all-zero rows and constant groups along either axis."""
  mant = draw(hnp.arrays(np.float32, SHAPE, elements=st.floats(-1, 1, width=32)))
  top = draw(st.integers(-40, 38))
  spread = draw(st.integers(0, 8))
  dec = draw(hnp.arrays(np.int32, SHAPE, elements=st.integers(0, spread)))
  x = np.clip(mant.astype(np.float64) * 10.0 ** (top - dec), -3.4e38, 3.4e38).astype(np.float32)
  pattern = draw(st.sampled_from(["plain", "zero_rows", "constant_rows", "constant_cols"]))
  if pattern == "zero_rows":
    x[:, ::3] = 0
  elif pattern == "constant_rows":
    x[:] = x[..., :1]
  elif pattern == "constant_cols":
    x[:] = x[:, :1, :]
  return x


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", QUANT)
@settings(max_examples=15, deadline=None)
@given(x=blocks())
def test_roundtrip_within_the_codec_bound_and_finite(name, mode, x):
  codec = make(name, mode)
  enc, y = roundtrip(name, mode)(x)
  y = np.asarray(y, np.float64)
  assert np.all(np.isfinite(y)), "finite input must never decode to NaN/Inf"
  for leaf in jax.tree.leaves(enc):
    if leaf.dtype.kind == "f":
      assert np.all(np.isfinite(np.asarray(leaf, np.float32)))
  err = np.abs(x.astype(np.float64) - y)
  assert np.all(err <= error_bound(codec, enc, x))


@pytest.mark.parametrize("name", QUANT)
def test_scale_is_tight(name):
  """The stored scale is the group's max over the code range, rounded up by < 2^-7."""
  codec = make(name, "token")
  x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32) * 7
  enc, _ = roundtrip(name, "token")(x)
  s = widen(codec, enc, "scale")[..., 0]
  if codec.kind == "uint":
    need = (x.max(-1) - x.min(-1)) / (2 ** codec.bits - 1)
    assert np.all(s >= need * (1 - 2 ** -7)) and np.all(s <= need * (1 + 2 ** -5))
  else:
    top = 127 if codec.kind == "int" else float(jnp.finfo(codec.dtype).max)
    need = np.abs(x).max(-1) / top
    assert np.all(s >= need) and np.all(s <= need * (1 + 2 ** -6))


@pytest.mark.parametrize("name", QUANT)
def test_extreme_groups(name):
  """All-zero, constant, huge (near float32 max, both signs) and tiny groups stay finite,
  zeros stay exact zeros."""
  D = SHAPE[-1]
  rows = np.stack([np.zeros(D), np.full(D, 1001.0), np.full(D, -3.3e38),
                   np.linspace(-3.4e38, 3.4e38, D), np.full(D, 1e-38), np.linspace(-1e-37, 1e-37, D),
                   np.full(D, 1e-45), np.linspace(-5, 5, D)]).astype(np.float32)
  x = np.stack([rows, rows[::-1]])
  for mode in MODES:
    codec = make(name, mode)
    enc, y = roundtrip(name, mode)(x)
    y = np.asarray(y, np.float64)
    assert np.all(np.isfinite(y)), mode
    assert np.all(np.abs(x - y) <= error_bound(codec, enc, x)), mode
  _, y = roundtrip(name, "token")(x)
  assert np.all(np.asarray(y)[0, 0] == 0)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", QUANT)
def test_non_finite_marks_only_its_group(name, mode):
  """Documented behaviour: a group holding NaN/Inf decodes to all-NaN; others are untouched."""
  codec = make(name, mode)
  x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
  bad = x.copy()
  bad[0, 1, 2], bad[1, 5, 6] = np.nan, np.inf
  _, y_bad = roundtrip(name, mode)(bad)
  clean = bad.copy()
  clean[~np.isfinite(clean)] = 0.0
  _, y_clean = roundtrip(name, mode)(clean)
  y_bad, y_clean = np.asarray(y_bad), np.asarray(y_clean)
  hit = np.zeros(SHAPE, bool)
  for b, t, d in ((0, 1, 2), (1, 5, 6)):
    if codec.axis == "channel":
      hit[b, t // 4 * 4:t // 4 * 4 + 4, d] = True
    else:
      g = codec.group or SHAPE[-1]
      hit[b, t, d // g * g:d // g * g + g] = True
  assert np.all(np.isnan(y_bad[hit]))
  np.testing.assert_array_equal(y_bad[~hit], y_clean[~hit])


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_float_codecs_saturate_finite_and_propagate_non_finite(name):
  codec = codecs.get(name)
  x = jnp.array([[3.4e38, -3.4e38, 1e6, -1e6, np.nan, np.inf, -np.inf, 1.5]], jnp.float32)
  y = np.asarray(codec.decode(codec.encode(x)))
  assert np.all(np.isfinite(y[0, :4]))
  assert np.isnan(y[0, 4]) and y[0, 5] == np.inf and y[0, 6] == -np.inf and y[0, 7] == 1.5


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_exact_for_all_bit_patterns(bits):
  every_byte = jnp.arange(256, dtype=jnp.uint8).reshape(-1, 1)
  assert np.array_equal(quant.pack(quant.unpack(every_byte, bits), bits), every_byte)
  per = 8 // bits
  levels = 2 ** bits
  combos = np.stack(np.meshgrid(*[np.arange(levels)] * per, indexing="ij"), -1).reshape(-1, per)
  codes = jnp.asarray(combos, jnp.uint8)  # every combination of `per` codes: one byte each
  packed = quant.pack(codes, bits)
  assert packed.shape == (levels ** per, 1) and packed.dtype == jnp.uint8
  assert len(np.unique(np.asarray(packed))) == 256  # a bijection onto the byte values
  assert np.array_equal(quant.unpack(packed, bits), codes)
  wide = jnp.asarray(np.random.default_rng(0).integers(0, levels, (64, 8 * per)), jnp.uint8)
  assert np.array_equal(quant.unpack(quant.pack(wide, bits), bits), wide)


# Plain dtypes have no quantization axis: only the token mode applies to them.
CODEC_MODES = [pytest.param(name, mode, id=f"{mode}-{name}") for mode in MODES
               for name in QUANT + ["bf16", "fp16"]
               if not (name in ("bf16", "fp16") and mode != "token")]


@pytest.mark.parametrize("name, mode", CODEC_MODES)
def test_bytes_per_token_is_what_encode_stores(name, mode):
  codec = make(name, mode)
  K, T, D = 3, 16, 8
  enc = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((K, T, D), jnp.float32))
  stored = sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(enc))
  assert stored == T * codec.bytes_per_token(K, D)
  if name in ("int4", "int2"):  # packed: bits/8 of a byte per element
    assert np.prod(enc["codes"].shape) == K * T * D * codec.bits // 8


@pytest.mark.parametrize("name, mode", CODEC_MODES)
def test_folded_reads_equal_dequantize_then_einsum(name, mode):
  """qk/pv fold scales (and zeros) instead of dequantizing; they equal the
  reference einsum over `decode` (the attention's blockwise loop is held to the reference
  in test_cache_codecs and test_pallas)."""
  codec = make(name, mode)
  B, K, G, T, S, D = 2, 2, 3, 2, 28, 8

  rng = np.random.default_rng(2)
  x = (rng.standard_normal((B, K, S, D)) * 3 + 1).astype(np.float32)
  q = rng.standard_normal((B, K, G, T, D)).astype(np.float32)
  p = np.asarray(jax.nn.softmax(rng.standard_normal((B, K, G, T, S)).astype(np.float32), -1))

  @jax.jit
  def both(x, q, p):
    enc = codec.encode(x)
    deq = codec.decode(enc)
    want = (jnp.einsum("bkgtd,bksd->bkgts", q, deq), jnp.einsum("bkgts,bksd->bkgtd", p, deq))
    return (codec.qk(q, enc), codec.pv(p, enc)), want

  got, want = both(x, q, p)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _cfg(**cache):
  over = {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 1}  # head_dim 16
  return config.load(None, {**over, **{f"cache.{k}": v for k, v in cache.items()}})


@pytest.mark.parametrize("cache, needle", [
    ({"codec": "int8", "group_size": 5}, "group_size"),
    ({"k_codec": "fp32", "v_codec": "int4", "group_size": 3}, "cache.v_codec"),
    ({"codec": "int4", "k_axis": "channel", "group_size": 4}, "cache.residual"),
    ({"codec": "int4", "k_axis": "channel", "residual": 8}, "cache.group_size"),
    ({"codec": "int4", "k_axis": "channel", "group_size": 4, "residual": 6}, "multiple"),
    ({"k_codec": "bf16", "v_codec": "int8", "k_axis": "channel", "group_size": 4,
      "residual": 8}, "quantized cache.k_codec"),
    ({"codec": "int3"}, "unknown codec"),
])
def test_config_errors_are_one_line_and_name_the_fix(cache, needle):
  with pytest.raises(KvjaxError) as err:
    _cfg(**cache)
  msg = str(err.value)
  assert needle in msg and "\n" not in msg


def test_int2_needs_head_dim_multiple_of_four():
  with pytest.raises(KvjaxError, match="int2"):
    config.load(None, {"model.d_model": 12, "model.n_heads": 2, "model.n_kv_heads": 1,
                         "cache.codec": "int2"})


@pytest.mark.parametrize("cache", [
    {"codec": "int8", "group_size": 8},
    {"codec": "int2", "k_axis": "channel", "group_size": 4, "residual": 8},
    {"k_codec": "int4", "v_codec": "fp8_e5m2", "k_axis": "channel", "group_size": 16,
     "residual": 32},
    {"codec": "bf16", "residual": 3},
    {"k_codec": "int8", "v_codec": "fp16", "residual": 5},
])
def test_valid_codec_configs_pass(cache):
  cfg = _cfg(**cache)
  assert cfg.cache.k_codec in codecs.CODECS and cfg.cache.v_codec in codecs.CODECS


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_init_allocates_the_stored_type_once_and_decodes_to_zeros(name):
  """A fresh cache is allocated once, in the type `encode` stores (bf16 and float8 as
  their bits): an eager float-zeros-then-bitcast held a 16 x 32k cache twice on the GPU.
  Its pytree, dtypes and shapes are what `encode` writes, and it decodes to +0.0."""
  codec = make(name, "token") if name in QUANT else codecs.get(name)
  shape = (2, 16, 8)
  jaxpr = jax.make_jaxpr(lambda: codec.init(shape))()
  assert "bitcast_convert_type" not in str(jaxpr) and "convert_element_type" not in str(jaxpr)
  init = codec.init(shape)
  enc = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct(shape, jnp.float32))
  assert jax.tree.structure(init) == jax.tree.structure(enc)
  assert [(a.shape, a.dtype) for a in jax.tree.leaves(init)] == \
      [(a.shape, a.dtype) for a in jax.tree.leaves(enc)]
  y = np.asarray(codec.decode(init), np.float32)
  assert np.all(y == 0) and not np.any(np.signbit(y))
