"""`cache.keep_first` (kvjax/cache/contiguous.py): the first N tokens of each sequence are
stored bit for bit in full precision beside the quantized cache; decode equals a reference
that quantizes everything else from scratch; every read agrees; bytes are counted; the
layouts that cannot hold it refuse in one line."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from test_cache_codecs import B, KIVI, TOKS, FakeQuant, logits_for, tiny

from kvjax import cache as cache_lib
from kvjax import cli, codecs, config, footprint
from kvjax.decode import generate
from kvjax.errors import KvjaxError

NF = 3  # first tokens kept


def test_first_tokens_round_trip_bit_exact():
  """After a ragged prefill (14 and 2 tokens: one row shorter than N) and decode, the kept
  store holds exactly the K/V an fp32 cache holds at positions < N, and the int2 history
  holds the rest from position N on (slot p - N)."""
  cfg, params = tiny()
  prompts = [TOKS[0, :14].tolist(), TOKS[1, :2].tolist()]
  run = lambda over: generate.generate(config.apply_overrides(cfg, over), params, prompts, 4,  # noqa: E731
                                      timed=False, return_cache=True)["cache"]
  ref, got = run({}), run({"cache.codec": "int2", "cache.keep_first": NF})
  assert got.k_first.shape[3] == NF and got.k_first.dtype == jnp.float32
  for b, n in enumerate((14, 2)):
    kept = min(n, NF)
    for first, full in ((got.k_first, ref.k), (got.v_first, ref.v)):
      np.testing.assert_array_equal(np.asarray(first[:, b, :, :kept]),
                                    np.asarray(full[:, b, :, :kept]))
  # the history starts at position N: its first slot decodes close to the fp32 key at N
  hist = codecs.for_role("int2", got.spec.cache_cfg, "k").decode(got.k)
  np.testing.assert_allclose(np.asarray(hist[:, 0, :, 0]), np.asarray(ref.k[:, 0, :, NF]),
                             atol=0.5 * float(np.abs(ref.k).max()))


class FakeFirst(FakeQuant):
  """Reference: every token kept in fp32; on each read positions < N stay as they are and
  the history (positions [N, N + q(n - N))) is encoded and decoded from scratch."""

  name = "fakefirst"

  def read(self, spec, store, lengths_B, layer):
    N, H = spec.keep_first, spec.history
    s = jnp.arange(spec.capacity)[None]
    q_B = spec.quantized_len(jnp.maximum(lengths_B - N, 0))
    old = ((s >= N) & (s < N + q_B[:, None]))[:, None, :, None]

    def fake(codec, x):
      hist = codec.decode(codec.encode(x[..., N:N + H, :]))
      return jnp.where(old, jnp.concatenate([x[..., :N, :], hist, x[..., N + H:, :]], axis=-2), x)

    k, v = (a[layer] for a in store)
    fp32 = codecs.get("fp32")
    mask = s < lengths_B[:, None]
    return [cache_lib.Segment(fake(spec.kc, k), fake(spec.vc, v), mask, fp32, fp32)]


SETTINGS = [{"cache.codec": "int4"}, {"cache.codec": "int2", "cache.group_size": 4},
            {"cache.codec": "int4", "cache.residual": 5},
            {"cache.k_codec": "int4", "cache.v_codec": "int2", **KIVI},
            {"cache.codec": "nf4", "cache.residual": 5}]
IDS = ["int4", "int2-g4", "int4-window", "kivi", "nf4-window"]


# plain per-token int4 is covered by int4-window here and by test_every_read_agrees
@pytest.mark.parametrize("over", SETTINGS[1:], ids=IDS[1:])
def test_quantized_decode_equals_reference(over, monkeypatch):
  """Ragged prefill (14 and 5 tokens), then 20 steps through blocks of 8 (READ_CHUNK):
  the logits of the from-scratch reference, and the first tokens really change them."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  monkeypatch.setitem(cache_lib.LAYOUTS, "fakefirst", FakeFirst())
  kept = {**over, "cache.keep_first": NF}
  got = logits_for(kept)
  want = logits_for(kept, lambda s: dataclasses.replace(s, layout="fakefirst"))
  np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
  assert np.abs(logits_for(over) - got).max() > 1e-4


@pytest.mark.parametrize("attention", ["native", "reference"])
@pytest.mark.parametrize("over", [SETTINGS[0], SETTINGS[2], SETTINGS[3]], ids=IDS[:1] + IDS[2:4])
def test_every_read_agrees(attention, over):
  """The kept tokens are one more segment: the native read (its kernel for whole-head codecs,
  the stored-type dots for channel keys) and the reference read equal grouped's."""
  kept = {**over, "cache.keep_first": NF, "cache.rotate": "hadamard"}
  want = logits_for({**kept, "model.attention": "grouped"})
  got = logits_for({**kept, "model.attention": attention})
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_fp32_cache_with_first_tokens_is_the_plain_cache():
  np.testing.assert_allclose(logits_for({"cache.keep_first": NF, "cache.residual": 5}),
                             logits_for({}), atol=1e-5)


@pytest.mark.parametrize("over", [{"cache.codec": "int2"}, {"cache.codec": "int4", **KIVI}])
def test_bytes_are_counted(over):
  cfg = config.apply_overrides(tiny()[0], over)
  kept = config.apply_overrides(cfg, {"cache.keep_first": NF})
  m = cfg.model
  full = m.n_layers * 2 * m.n_kv_heads * m.D * 4  # one fp32 token, K and V, all layers
  for capacity in (8, 37):
    cache = cache_lib.init_cache(kept, 2, capacity)
    assert cache_lib.tree_bytes(cache) == cache_lib.layout_of(cache).closed_form_bytes(cache.spec)
  plain, first = footprint.count(cfg, 64).bytes, footprint.count(kept, 64).bytes
  if not cfg.cache.residual:  # per-token codec: N tokens move from the history to fp32
    assert first - plain == NF * (full - footprint.asymptotic(cfg))
  assert first > plain


def test_size_shows_the_first_tokens(capsys):
  argv = ["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
          "--seq-len", "64", "--codec", "int4"]
  sizes = []
  for extra in ([], ["--set", "cache.keep_first=4"]):
    assert cli.main(argv + extra + ["--json"]) == 0
    sizes.append(json.loads(capsys.readouterr().out))
  assert sizes[1]["keep_first"] == 4
  # 4 tokens in fp32 (2 layers x K, V x 2 heads x 16 x 4 bytes) instead of int4 (8 bytes of
  # codes + a bf16 scale and zero per head vector)
  assert sizes[1]["total_bytes"] - sizes[0]["total_bytes"] == 4 * (2 * 2 * 2 * (16 * 4 - 12))
  assert cli.main(argv + ["--set", "cache.keep_first=4"]) == 0
  assert "first 4 kept" in capsys.readouterr().out


@pytest.mark.parametrize("over, match", [
    ({"cache.keep_first": 8, "cache.capacity": 8}, "cache.keep_first=8 must be below cache.capacity=8"),
    ({"cache.keep_first": -1}, "cache.keep_first must be an integer >= 0"),
    ({"cache.keep_first": 2, "cache.layout": "paged"}, "cache.layout=paged does not support"),
    ({"cache.keep_first": 2, "cache.policy": "knorm", "cache.budget": 4}, "set cache.keep_first=0"),
    ({"cache.keep_first": 2, "model.latent_rank": 16, "cache.layout": "latent"},
     "cache.layout=latent stores rank-A latents"),
])
def test_bad_settings_are_one_line(over, match):
  with pytest.raises(KvjaxError, match=match):
    config.apply_overrides(tiny()[0], over)


def test_first_tokens_filling_the_capacity_are_refused_at_build():
  cfg = config.apply_overrides(tiny()[0], {"cache.keep_first": 6})
  with pytest.raises(KvjaxError, match="cache.keep_first=6 must be below the cache capacity 6"):
    cache_lib.init_cache(cfg, B, 6)
  with pytest.raises(KvjaxError, match="below the cache capacity"):
    generate.generate(cfg, tiny()[1], [[1, 2, 3]], 3, timed=False)
