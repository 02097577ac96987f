"""`cache.rotate` (kvjax/codecs/rotate.py, applied in kvjax/model/layers.py): the matrices are
orthogonal; an fp32 cache gives the unrotated cache's logits and tokens; bytes do not move;
a rotated quantized cache equals an unrotated one whose codec is x -> Q(x R) Rᵀ; the
policies keep the same tokens; bad values are one line."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from test_cache_codecs import (B, KIVI, LENS, TOKS, FakeQuant, confident_params, logits_for,
                               tiny)

from kvjax import cache as cache_lib
from kvjax import cli, codecs, config, footprint
from kvjax.codecs import rotate
from kvjax.decode import generate
from kvjax.errors import KvjaxError

KINDS = ("hadamard", "random")


@pytest.mark.parametrize("kind", KINDS)
def test_matrices_are_orthogonal_and_fixed(kind):
  for D in (8, 64):
    r = rotate.matrix(kind, D)
    np.testing.assert_allclose(r @ r.T, np.eye(D), atol=1e-6)
    assert np.abs(r - np.eye(D)).max() > 0.1  # not the identity
  if kind == "hadamard":  # every entry ±1/sqrt(D): one large channel spreads over all D
    np.testing.assert_allclose(np.abs(rotate.matrix(kind, 64)), 1 / 8)
  else:  # seeded: the same seed, the same matrix; another seed, another one
    np.testing.assert_array_equal(rotate.matrix(kind, 8, 3), rotate.matrix.__wrapped__(kind, 8, 3))
    assert np.abs(rotate.matrix(kind, 8, 0) - rotate.matrix(kind, 8, 1)).max() > 0.1
  assert rotate.matrix("none", 8) is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("over", [{}, {"cache.residual": 5}], ids=["plain", "window"])
def test_fp32_rotated_cache_is_exact(kind, over):
  """Logits within 1e-5 of the unrotated fp32 cache's (prefill + 20 teacher-forced steps),
  greedy tokens equal, and what is stored really is k R."""
  want = logits_for(over)
  got = logits_for({**over, "cache.rotate": kind})
  np.testing.assert_allclose(got, want, atol=1e-5)
  cfg, params = tiny()[0], confident_params()
  prompts = [TOKS[0, :14].tolist(), TOKS[1, :5].tolist()]
  runs = [generate.generate(config.apply_overrides(cfg, {**over, "cache.rotate": r}), params,
                           prompts, 12, timed=False, return_cache=True) for r in ("none", kind)]
  assert runs[0]["tokens"] == runs[1]["tokens"]
  assert all(len(set(seq)) > 3 for seq in runs[0]["tokens"])
  k0, k1 = (np.asarray(r["cache"].k) for r in runs)  # [L, B, K, S, D]
  r = rotate.matrix(kind, 8)
  np.testing.assert_allclose(k1[:, 0, :, :9], k0[:, 0, :, :9] @ r, atol=1e-5)
  assert np.abs(k1 - k0).max() > 1e-2


@pytest.mark.parametrize("over", [{"cache.codec": "int4"}, {"cache.codec": "int2", **KIVI},
                                  {"cache.codec": "nf4", "cache.group_size": 4}])
def test_bytes_do_not_change(over):
  cfg = config.apply_overrides(tiny()[0], over)
  rot = config.apply_overrides(cfg, {"cache.rotate": "hadamard"})
  for capacity in (8, 37):
    assert cache_lib.tree_bytes(cache_lib.init_cache(cfg, 2, capacity)) == \
        cache_lib.tree_bytes(cache_lib.init_cache(rot, 2, capacity))
    assert footprint.count(cfg, capacity).fields() == footprint.count(rot, capacity).fields()


class RotatedFake(FakeQuant):
  """Reference: an unrotated cache whose history reads back as Q(x R) Rᵀ (Q the codec's
  encode + decode), every token kept in fp32 and quantized from scratch at each read."""

  name = "rotatedfake"

  def read(self, spec, store, lengths_B, layer):
    r = rotate.matrix("hadamard", spec.head_dim)
    H = spec.history
    old = (jnp.arange(spec.capacity)[None] < spec.quantized_len(lengths_B)[:, None])[:, None, :,
                                                                                     None]

    def fake(codec, x):
      hist = rotate.apply(codec.decode(codec.encode(rotate.apply(x[..., :H, :], r))), r, back=True)
      return jnp.where(old, jnp.concatenate([hist, x[..., H:, :]], axis=-2), x)

    k, v = (a[layer] for a in store)
    fp32 = codecs.get("fp32")
    mask = jnp.arange(spec.capacity)[None] < lengths_B[:, None]
    return [cache_lib.Segment(fake(spec.kc, k), fake(spec.vc, v), mask, fp32, fp32)]


@pytest.mark.parametrize("over", [  # per-token whole-head: int2-window (and K2V4's int4 V)
    {"cache.codec": "int4", "cache.group_size": 4},
    {"cache.codec": "int4", **KIVI},
    {"cache.codec": "int2", "cache.residual": 5},
    {"cache.k_codec": "int2", "cache.v_codec": "int4", "cache.group_size": 4},
], ids=["int4-g4", "int4-channel", "int2-window", "K2V4-g4"])
def test_rotated_quantized_cache_equals_quantizing_rotated_vectors(over, monkeypatch):
  """The rotation reaches the codec (the quantized logits move) and is undone exactly: the
  same logits as the unrotated model over a cache that stores Q(x R) Rᵀ."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  monkeypatch.setitem(cache_lib.LAYOUTS, "rotatedfake", RotatedFake())
  got = logits_for({**over, "cache.rotate": "hadamard"})
  want = logits_for(over, lambda s: dataclasses.replace(s, layout="rotatedfake"))
  np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
  plain = logits_for(over)
  assert np.abs(plain - got).max() > 1e-4


@pytest.mark.parametrize("attention", ["native", "reference"])
def test_rotation_reads_the_same_through_every_attention(attention):
  over = {"cache.codec": "int4", "cache.rotate": "hadamard", "cache.residual": 5}
  want = logits_for({**over, "model.attention": "grouped"})
  got = logits_for({**over, "model.attention": attention})
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("policy, knobs", [
    ("knorm", {"cache.budget": 4}), ("snapkv", {"cache.budget": 6, "cache.window": 2}),
    ("h2o", {"cache.budget": 6, "cache.window": 2}), ("tova", {"cache.budget": 5}),
    ("sinks", {"cache.budget": 6, "cache.sinks": 2})])
def test_policies_keep_the_same_tokens(policy, knobs):
  """On an fp32 cache q·k and |k| are unchanged by an orthogonal R, so every policy keeps the
  same slots: the rotated compacted keys are the unrotated ones times R, slot for slot."""
  cfg = config.apply_overrides(tiny()[0], {"cache.policy": policy, **knobs})
  params = confident_params()
  prompts = [TOKS[0, :14].tolist(), TOKS[1, :LENS[1]].tolist()]
  runs = [generate.generate(config.apply_overrides(cfg, {"cache.rotate": r}), params, prompts, 6,
                           timed=False, return_cache=True) for r in ("none", "hadamard")]
  c0, c1 = (r["cache"] for r in runs)
  assert c0.k.shape == c1.k.shape and c0.k.shape[3] < 14 + 6  # really compacted
  np.testing.assert_array_equal(np.asarray(c0.held), np.asarray(c1.held))
  np.testing.assert_allclose(np.asarray(c1.k), np.asarray(c0.k) @ rotate.matrix("hadamard", 8),
                             atol=1e-5)
  if "pos" in c0.state:
    np.testing.assert_array_equal(np.asarray(c0.state["pos"]), np.asarray(c1.state["pos"]))
  assert runs[0]["tokens"] == runs[1]["tokens"]


@pytest.mark.parametrize("over, match", [
    ({"cache.rotate": "foo"}, "unknown cache.rotate 'foo'; use one of none, hadamard, random"),
    ({"cache.rotate": "hadamard", "model.head_dim": 6}, "power-of-two head_dim, got 6"),
    ({"cache.rotate": "hadamard", "model.latent_rank": 16, "cache.layout": "latent"},
     "cache.layout=latent stores rank-A latents"),
    ({"cache.rotate_seed": -1}, "cache.rotate_seed must be an integer >= 0"),
])
def test_bad_rotations_are_one_line(over, match):
  with pytest.raises(KvjaxError, match=match):
    config.apply_overrides(tiny()[0], over)
  ok = config.apply_overrides(tiny()[0], {"cache.rotate": "random", "model.head_dim": 6})
  assert ok.cache.rotate == "random"  # random rotations take any head_dim


def test_cli_refuses_an_unknown_rotation(capsys):
  rc = cli.main(["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                 "--seq-len", "64", "--set", "cache.rotate=foo"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "cache.rotate" in err[0]
