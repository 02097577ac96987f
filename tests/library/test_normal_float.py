"""The normal-float codecs nf4 / nf2 (kvjax/codecs/normal.py): the levels are the normal
quantiles they claim, codes and packing round-trip, the error bound holds, bytes are codes
plus one scale, and the grouped, reference and native reads agree through the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm
from test_cache_codecs import KIVI, logits_for

from kvjax import codecs, config
from kvjax.codecs import normal, packing
from kvjax.errors import KvjaxError


@pytest.mark.parametrize("bits", [4, 2])
def test_levels_are_normal_quantiles(bits):
  lv = np.array(normal.levels(bits))
  n = 2 ** bits
  assert len(lv) == n and np.all(np.diff(lv) > 0)
  assert lv[0] == -1 and lv[-1] == 1 and 0 in lv
  np.testing.assert_array_equal(lv, lv.astype(jnp.bfloat16).astype(np.float32))  # bf16 values
  offset = 1 - 0.5 * (1 / (2 * n) + 1 / (2 * (n - 1)))
  pos = norm.ppf(np.linspace(offset, 0.5, n // 2 + 1)[:-1]) / norm.ppf(offset)
  neg = -norm.ppf(np.linspace(offset, 0.5, n // 2)[:-1]) / norm.ppf(offset)
  np.testing.assert_allclose(lv, np.sort(np.concatenate([neg, [0], pos])), atol=4e-3)
  if bits == 4:  # NF4's published table, to its bf16 rounding
    np.testing.assert_allclose(lv[7:], [0, 0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626,
                                        0.7230, 1], atol=2e-3)


@pytest.mark.parametrize("name", ["nf4", "nf2"])
@pytest.mark.parametrize("group", [0, 4])
def test_codes_and_packing_round_trip(name, group):
  cfg = config.CacheConfig(k_codec=name, v_codec=name, group_size=group)
  c = codecs.for_role(name, cfg, "v")
  D, g = 16, group or 16
  rng = np.random.default_rng(0)
  lv = np.array(normal.levels(c.bits), np.float32)
  # vectors of levels times a scale per group (its first element the top level): the stored
  # codes are those levels' indices, packed into D * bits / 8 bytes
  codes = rng.integers(0, 2 ** c.bits, (3, 5, D))
  codes[..., ::g] = 2 ** c.bits - 1
  s = np.repeat(np.exp(rng.uniform(-3, 3, (3, 5, D // g))), g, -1).astype(np.float32)
  enc = c.encode(jnp.asarray(lv[codes] * s))
  assert enc["codes"].shape == (3, 5, D * c.bits // 8) and enc["codes"].dtype == jnp.uint8
  assert set(enc) == {"codes", "scale"}  # no zero point
  np.testing.assert_array_equal(np.asarray(packing.unpack(enc["codes"], c.bits)), codes)
  np.testing.assert_array_equal(np.asarray(packing.unpack(packing.pack(jnp.asarray(codes),
                                                                       c.bits), c.bits)), codes)
  # the stored scale is the group's absmax rounded up to bf16 (< 2^-6 above it)
  dec = np.asarray(c.decode(enc))
  np.testing.assert_allclose(dec, lv[codes] * s, rtol=2 ** -6)
  assert np.all(np.abs(dec) >= np.abs(lv[codes] * s))
  # any input: within half the widest level gap times the scale; re-encoding keeps the codes
  y = jnp.asarray(rng.standard_normal((3, 5, D)) * 3, jnp.float32)
  ey = c.encode(y)
  dec = c.decode(ey)
  gap = np.max(np.diff(lv))
  scale = np.repeat(np.abs(np.asarray(y)).reshape(3, 5, D // g, g).max(-1), g, -1)
  assert np.all(np.abs(np.asarray(dec - y)) <= gap / 2 * scale * (1 + 2 ** -6))
  np.testing.assert_array_equal(np.asarray(c.encode(dec)["codes"]), np.asarray(ey["codes"]))


def test_bytes_are_codes_plus_one_scale():
  for name, bits in (("nf4", 4), ("nf2", 2)):
    c = codecs.get(name)
    assert c.bytes_per_token(3, 64) == 3 * (64 * bits / 8 + 2)
    assert c.bytes_per_token(3, 64) == codecs.get(f"int{bits}").bytes_per_token(3, 64) - 3 * 2
    assert c.stored.kernel is None  # the read kernel has no level table: the dots read it


def test_nf4_against_int4_on_normal_vectors():
  """Denser levels near zero: a lower mean absolute error than int4's asymmetric grid on
  normal vectors, with 2 fewer bytes a vector (the mean squared error is not lower: the
  outer gaps are wider)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (4096, 64))
  err = {n: np.asarray(codecs.get(n).decode(codecs.get(n).encode(x)) - x) for n in ("nf4", "int4")}
  assert np.mean(np.abs(err["nf4"])) < 0.97 * np.mean(np.abs(err["int4"]))


@pytest.mark.parametrize("over", [{"cache.codec": "nf4"}, {"cache.codec": "nf2", "cache.group_size": 4},
                                  {"cache.k_codec": "nf4", "cache.v_codec": "nf2", **KIVI}],
                         ids=["nf4", "nf2-g4", "channel"])
@pytest.mark.parametrize("attention", ["native", "reference"])
def test_reads_agree(over, attention):
  want = logits_for({**over, "model.attention": "grouped"})
  got = logits_for({**over, "model.attention": attention})
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
  assert np.abs(logits_for({}) - want).max() > 1e-4  # the codec does quantize


def test_pallas_is_refused():
  with pytest.raises(KvjaxError, match="model.attention=pallas has no read for nf4's storage"):
    config.apply_overrides(config.Config(), {"cache.codec": "nf4", "model.attention": "pallas"})
