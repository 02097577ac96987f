"""Codecs through the cache and the model: measured bytes == closed form, logit error per
codec vs an fp32 cache, int8 greedy == fp32, the residual window / KIVI channel keys vs a
dequantize-everything reference, incremental window writes, and the compiled decode
step's temporary memory."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import cli, codecs, config, decode, model
from kvjax.cache import contiguous
from kvjax.decode import generate
from kvjax.decode import step

# The layouts' writes and windows are held to a from-scratch reference here through the XLA
# read (`grouped`), whose float32 arithmetic makes the comparison exact to 2e-5; the native
# read (the CPU default) is held to `grouped` on the same settings in test_native.py.
TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.head_dim": 8,
        "model.n_layers": 2, "model.attention": "grouped"}
B, P, N = 2, 14, 20                  # batch, padded prompt, teacher-forced decode steps
LENS = np.array([14, 5], np.int32)   # ragged prompts
TOKS = np.random.default_rng(0).integers(0, 260, (B, P + N + 1)).astype(np.int32)
KIVI = {"cache.k_axis": "channel", "cache.group_size": 4, "cache.residual": 8}


@functools.lru_cache(maxsize=None)
def tiny():
  cfg = config.load(None, TINY)
  return cfg, model.init_params(cfg.model, 0)


@jax.jit
def teacher_forced(params, cache):
  """Prefill the ragged prompts, then feed TOKS one at a time: logits [B, N, V] per step."""
  static = step.Static.of(tiny()[0])
  t = jnp.arange(P)[None]
  cache = step.run(static, params, TOKS[:, :P], jnp.where(t < LENS[:, None], t, -1), cache).cache

  def one(c, _):
    tok = jnp.take_along_axis(jnp.asarray(TOKS), c.lengths[:, None], axis=1)
    out = step.run(static, params, tok, c.lengths[:, None], c)
    return out.cache, out.logits[:, 0]

  _, logits = jax.lax.scan(one, cache, None, length=N)
  return jnp.swapaxes(logits, 0, 1)


def logits_for(over: dict, spec_edit=None):
  cfg, params = tiny()
  cache = cache_lib.init_cache(config.apply_overrides(cfg, over), B, P + N + 1)
  if spec_edit:
    spec = spec_edit(cache.spec)
    cache = cache_lib.LAYOUTS[spec.layout].init(spec)
  return np.asarray(teacher_forced(tiny()[1], cache))


SETTINGS = [({}, "plain")] + [({"cache.residual": 5}, "window")] + [(KIVI, "kivi")]


# KIVI settings (per-channel keys, groups) apply to the quantized codecs only.
@pytest.mark.parametrize("name, over, tag", [
    pytest.param(name, over, tag, id=f"{name}-{tag}") for over, tag in SETTINGS
    for name in codecs.CODECS if not (tag == "kivi" and name in ("fp32", "bf16", "fp16"))])
def test_cache_bytes_equal_closed_form(name, over, tag):
  cfg = config.apply_overrides(tiny()[0], {"cache.codec": name, **over})
  for capacity in (1, 8, 37):
    cache = cache_lib.init_cache(cfg, 3, capacity)
    assert cache_lib.tree_bytes(cache) == cache_lib.layout_of(cache).closed_form_bytes(cache.spec)


def test_packed_payload_is_a_quarter_and_an_eighth_of_bf16():
  cfg = tiny()[0]
  L, K, S = cfg.model.n_layers, cfg.model.n_kv_heads, 64
  caches = {n: cache_lib.init_cache(config.apply_overrides(cfg, {"cache.codec": n}), 1, S)
            for n in ("bf16", "int4", "int2")}
  payload = lambda c: c.k["codes"].nbytes + c.v["codes"].nbytes  # noqa: E731
  meta = lambda c: cache_lib.tree_bytes(c) - payload(c) - 4  # noqa: E731  (4: lengths)
  bf16 = cache_lib.tree_bytes(caches["bf16"]) - 4
  assert payload(caches["int4"]) * 4 == bf16 and payload(caches["int2"]) * 8 == bf16
  for n in ("int4", "int2"):  # scale + zero in bf16: 4 bytes per head vector, K and V
    assert meta(caches[n]) == 2 * L * K * S * 4


def test_cli_size_matches_measured_generate_bytes(capsys):
  k8v4 = ["--k-codec", "int8", "--v-codec", "int4", "--set", "cache.residual=5", "--json"]
  assert cli.main(["generate", "--prompt-ids", "1,2,3,4,5", "--prompt-ids", "6,7",
                   "--max-new-tokens", "11", *k8v4]) == 0
  gen = json.loads(capsys.readouterr().out)
  assert (gen["k_codec"], gen["v_codec"]) == ("int8", "int4")
  m = config.Config().model
  assert cli.main(["size", "--layers", str(m.n_layers), "--heads", str(m.n_heads), "--kv-heads",
                   str(m.n_kv_heads), "--head-dim", str(m.D), "--batch", "2",
                   "--seq-len", str(gen["capacity"]), *k8v4]) == 0
  assert json.loads(capsys.readouterr().out)["total_bytes"] == gen["cache_bytes"]


# Logit error relative to the logits' spread, at most 4 units of each codec's relative
# resolution: 2^-(mantissa+1) for floats, 1/(2 * 127) for int8, 1/(2^bits - 1) of the range.
RESOLUTION = {"fp32": 2 ** -24, "bf16": 2 ** -9, "fp16": 2 ** -11, "fp8_e4m3": 2 ** -4,
              "fp8_e5m2": 2 ** -3, "int8": 1 / 254, "int4": 1 / 15, "int2": 1 / 3}


@functools.lru_cache(maxsize=None)
def fp32_logits():
  return logits_for({})


@pytest.mark.parametrize("name", list(RESOLUTION))
def test_decode_logit_error_is_bounded_per_codec(name):
  ref = fp32_logits()
  err = np.abs(logits_for({"cache.codec": name}) - ref).max() / ref.std()
  assert err <= 4 * RESOLUTION[name] + 1e-5


def confident_params(alpha=4.0):
  """The tiny model with an lm_head that also reads the current token's embedding through a
  fixed permutation: next-token predictions are confident (large argmax margins) and still
  vary from token to token, while the attention (the cache) still shifts every logit."""
  cfg, params = tiny()
  emb = params["embed_tokens"]["embedding"]
  perm = np.random.default_rng(7).permutation(emb.shape[0])
  head = dict(params["lm_head"], kernel=params["lm_head"]["kernel"] + alpha * emb[perm].T)
  return {**params, "lm_head": head}


def test_int8_greedy_tokens_equal_fp32():
  params = confident_params()
  run = lambda codec: np.asarray(teacher_forced(params, cache_lib.init_cache(  # noqa: E731
      config.apply_overrides(tiny()[0], {"cache.codec": codec}), B, P + N + 1)))
  ref, int8 = run("fp32"), run("int8")
  top2 = np.sort(ref, -1)[..., -2:]
  err = np.abs(int8 - ref).max()
  assert err > 0  # the cache does move the logits
  # Every fp32 margin exceeds twice int8's worst logit error, so no argmax can flip along
  # the fp32 trajectory; free-running greedy generation must then agree token for token.
  assert (top2[..., 1] - top2[..., 0]).min() > 2 * err
  prompts = [TOKS[0, :14].tolist(), TOKS[1, :5].tolist()]
  outs = [generate.generate(config.apply_overrides(tiny()[0], {"cache.codec": c}), params, prompts,
                          16, timed=False)["tokens"] for c in ("fp32", "int8")]
  assert outs[0] == outs[1]
  assert all(len(set(seq)) > 4 for seq in outs[0])  # not a degenerate constant output


class FakeQuant(contiguous.Contiguous):
  """Reference: keep every token in fp32; on each read, encode+decode the whole history
  (positions < q(n)) from scratch and attend over plain fp32 arrays."""

  name = "fakequant"

  def init(self, spec):
    shape = (spec.n_layers, spec.batch, spec.n_kv_heads, spec.capacity, spec.head_dim)
    return cache_lib.KVCache(k=jnp.zeros(shape), v=jnp.zeros(shape),
                             lengths=jnp.zeros((spec.batch,), jnp.int32), spec=spec)

  def write(self, cache, k_LBTKD, v_LBTKD, positions_BT):
    slots = jnp.where(positions_BT >= 0, positions_BT, cache.spec.capacity)
    put = lambda s, new: cache_lib.scatter(slots)(s, jnp.swapaxes(new, 2, 3))  # noqa: E731
    return dataclasses.replace(cache, k=put(cache.k, k_LBTKD), v=put(cache.v, v_LBTKD),
                               lengths=cache.lengths + jnp.sum(positions_BT >= 0, 1))

  def store(self, cache):
    return (cache.k, cache.v)

  def read(self, spec, store, lengths_B, layer):
    H = spec.history
    old = (jnp.arange(spec.capacity)[None] < spec.quantized_len(lengths_B)[:, None])[:, None, :,
                                                                                     None]

    def fake(codec, x):
      hist = codec.decode(codec.encode(x[..., :H, :]))
      return jnp.where(old, jnp.concatenate([hist, x[..., H:, :]], axis=-2), x)

    k, v = (a[layer] for a in store)
    fp32 = codecs.get("fp32")
    mask = jnp.arange(spec.capacity)[None] < lengths_B[:, None]
    return [cache_lib.Segment(fake(spec.kc, k), fake(spec.vc, v), mask, fp32, fp32)]


@pytest.mark.parametrize("over", [
    {"cache.k_codec": "int4", "cache.v_codec": "int2", **KIVI},
    {"cache.codec": "int4", "cache.group_size": 4, "cache.residual": 5},
])
def test_windowed_decode_equals_dequantize_everything_reference(over, monkeypatch):
  """Prefill (ragged, flushing several groups at once) + 20 steps crossing group
  boundaries, chunked reads (READ_CHUNK=8): same logits as the from-scratch reference."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  monkeypatch.setitem(cache_lib.LAYOUTS, "fakequant", FakeQuant())
  got = logits_for(over)
  want = logits_for(over, lambda s: dataclasses.replace(s, layout="fakequant"))
  np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())


def test_window_writes_encode_each_block_once_and_exactly():
  """Drive `write` directly: after every call the history holds exactly encode(all tokens
  < q(n)) block by block, and the window holds the raw newest tokens at slot p mod R."""
  cfg = config.apply_overrides(tiny()[0], {"cache.k_codec": "int4", "cache.v_codec": "int8",
                                           **KIVI})
  L, K, D = 2, 2, 8
  cache = cache_lib.init_cache(cfg, B, 40)
  spec, layout = cache.spec, cache_lib.layout_of(cache)
  rng = np.random.default_rng(3)
  full_k = rng.standard_normal((L, B, 40, K, D)).astype(np.float32) * 2
  full_v = rng.standard_normal((L, B, 40, K, D)).astype(np.float32)
  write = jax.jit(layout.write)
  H = spec.history  # every block of the history, encoded in one go (blocks are independent)
  want = {role: jax.jit(c.encode)(jnp.moveaxis(full[:, :, :H], 3, 2))
          for role, c, full in (("k", spec.kc, full_k), ("v", spec.vc, full_v))}
  calls = [np.array([10, 3])] + [np.array([3, 1])] * 3 + [np.array([1, 1])] * 12
  for counts in calls:
    T = int(counts.max())
    n0 = np.asarray(cache.lengths)
    pos = np.where(np.arange(T)[None] < counts[:, None], n0[:, None] + np.arange(T)[None], -1)
    gather = lambda a: np.stack([a[:, b, np.clip(pos[b], 0, 39)] for b in range(B)], 1)  # noqa
    cache = write(cache, gather(full_k), gather(full_v), pos.astype(np.int32))
    n = np.asarray(cache.lengths)
    q = np.asarray(spec.quantized_len(cache.lengths))
    assert np.all(n - q <= spec.residual) and np.all(q % 4 == 0)
    for b in range(B):
      for role, store, win, full in (("k", cache.k, cache.k_win, full_k),
                                     ("v", cache.v, cache.v_win, full_v)):
        for key, leaf in store.items():
          rows = leaf.shape[-2] * q[b] // H
          np.testing.assert_array_equal(np.asarray(leaf[:, b, :, :rows]),
                                        np.asarray(want[role][key][:, b, :, :rows]))
        for p in range(q[b], n[b]):
          np.testing.assert_array_equal(np.asarray(win[:, b, :, p % spec.residual]),
                                        full[:, b, p])


def test_no_retrace_across_ragged_lengths_with_window():
  cfg = config.apply_overrides(tiny()[0], {"cache.codec": "int2", **KIVI})
  params = tiny()[1]
  generate.generate(cfg, params, [[1, 2, 3, 4, 5, 6], [7, 8]], 10, timed=False)
  before = dict(decode.TRACES)
  generate.generate(cfg, params, [[9, 8], [1, 2, 3, 4, 5, 6]], 10, timed=False)
  assert decode.TRACES == before


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_decode_step_never_materializes_a_dequantized_cache(name):
  """Compiled decode step at S=4096: temporaries stay below ONE layer's K+V in float32 and
  far below the whole dequantized cache (codes are widened READ_CHUNK tokens at a time)."""
  cfg = config.load(None, {"model.d_model": 128, "model.n_heads": 2, "model.n_kv_heads": 1,
                           "model.n_layers": 4, "cache.codec": name})
  m, S = cfg.model, 4096
  params = jax.eval_shape(lambda: step.prepare_params(cfg, model.init_params(m, 0)))
  cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 1, S))
  static = step.Static.of(cfg)

  def one(params, tok, c):
    out = step.run(static, params, tok, c.lengths[:, None], c)
    return out.logits, out.cache

  compiled = jax.jit(one, donate_argnums=2).lower(
      params, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  layer_f32 = 2 * m.n_kv_heads * S * m.D * 4
  assert temp < layer_f32
  assert temp < m.n_layers * layer_f32 / 4


@pytest.mark.parametrize("k_axis", ["token", "channel"])
def test_windowed_write_updates_the_store_in_place(k_axis):
  """A decode step with a residual window writes the block leaving it into the history
  without copying the history: no instruction of the compiled step outputs a buffer of the
  whole store's shape except the in-place update itself (one per stored K/V leaf). Writing
  whole blocks through a reshaped view of the store made XLA:CPU change its layout and copy
  every code of every layer back, each step (a per-token cost the read never saw)."""
  import re
  from kvjax.lab import experiments as ex
  cfg = config.load(None, {"model.vocab_size": 64, "model.d_model": 32, "model.n_layers": 2,
                           "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 48,
                           "cache.codec": "int4", "cache.group_size": 4, "cache.residual": 16,
                           "cache.k_axis": k_axis})
  params = ex.random_params(cfg.model, 0)
  prog = generate.Compiled(cfg, params, generate.Shape(1, 0, 512 + 8, 4, context=512)).compile()
  cache = prog.fresh()
  stores = {tuple(a.shape) for a in jax.tree.leaves((cache.k, cache.v)) if a.size >= 512}
  assert stores
  hits = []
  for line in prog.dec.as_text().split("\n"):
    m = re.search(r"= \w+\[([\d,]*)\]\{[^}]*\} (\w[\w\-]*)\(", line)
    if m and m.group(1) and tuple(int(x) for x in m.group(1).split(",")) in stores:
      hits.append(m.group(2))
  assert "copy" not in hits, hits
  assert {"fusion", "scatter", "dynamic-update-slice"} & set(hits)  # the write itself
