"""The `native` attention (the CPU default): the read kernel and the stored-type dots.

Held to the XLA read (`grouped`) and to `reference` on a covering set:
  - segment level, both routes (the kernel, and XLA's stored-type dots with the kernel
    off): every codec with GQA at T = 3, and MHA and MQA at T = 1, on a ragged mask with a
    live length below the segment's size, head_dim 64 with row groups of 1 to 4, head_dim
    groups and per-channel keys (KIVI's layout) at head_dim 16 and 64, and mixed K/V kinds
    through the kernel's fused and generic scans (int2 planes narrower than eight codes,
    > 16 query rows, an uncompiled head_dim): 63 cases; tolerance 2e-5 of the output's
    scale (fp32 and the kernel's float arithmetic), 1e-4 where integer keys meet the
    15-bit query, 5e-4 (2e-4 for groups and channels) for the two-digit int8 and bf16 dots;
  - model level: the golden decode (`test_golden`: every variant x codec x layout x policy,
    recorded through the XLA read) holds under the native default; here the settings it
    does not cover (a residual window with per-token int4, the sinks policy's ring, h2o on
    pages) give `grouped`'s greedy tokens and bytes; chunked evaluation (T > 1 against
    stored segments) equal to 1e-4 in log-probability;
  - the structure: the default CPU decode program, compiled with XLA's default flags in a
    child process, calls the kernel; where a C++ compiler exists the kernel is active;
  - fidelity on SmolLM2: each codec's Δppl through `native` equals `grouped`'s within the
    larger of 0.02 percentage points and 2 % of its value.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax import codecs, config as config_lib, kernels
from kvjax.attention import base as attn_base, native, xla
from kvjax.cache import base as cache_base
from kvjax.config import CacheConfig
from kvjax.decode import generate
from kvjax.lab import evaluate

f32 = jnp.float32
CODECS = ["fp32", "bf16", "fp16", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]
SHAPES = {"mha": (2, 1), "gqa": (2, 3), "mqa": (1, 4)}  # K, G


def _segment(name, K, S, D, cache_cfg=None, seed=0):
  kc, vc = codecs.for_role(name, cache_cfg, "k"), codecs.for_role(name, cache_cfg, "v")
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(ks[0], (2, K, S, D), f32) * 2
  live = S - 8
  mask = (jax.random.uniform(ks[1], (2, S)) < 0.8) & (jnp.arange(S) < live)[None]
  mask = mask.at[1, : S // 2].set(False)  # ragged: the second sequence starts later
  return cache_base.Segment(kc.encode(x), vc.encode(x * 0.7 + 0.3), mask, kc, vc,
                            live=jnp.int32(live))


def _read(fn, q, seg):
  B, K, G, T, D = q.shape
  st = (jnp.full((B, K, G, T), attn_base.MASKED, f32), jnp.zeros((B, K, G, T), f32),
        jnp.zeros((B, K, G, T, D), f32))
  _, s, acc = jax.jit(lambda q, k, v: fn(q, seg.__class__(k, v, seg.mask_BS, seg.k_codec,
                                                        seg.v_codec, live=seg.live), st))(
      q, seg.k, seg.v)
  return acc / jnp.where(s > 0, s, 1.0)[..., None]


@pytest.fixture(params=["kernel", "dots"])
def route(request, monkeypatch):
  if request.param == "kernel" and not kernels.available():
    pytest.skip(f"the read kernel is not available here ({kernels.status()})")
  if request.param == "dots":
    monkeypatch.setattr(kernels, "available", lambda: False)
  return request.param


SEGMENT_CASES = [(name, "gqa", 3) for name in CODECS] + [
    ("int8", "mha", 1), ("int4", "mha", 1), ("bf16", "mqa", 1), ("int2", "mqa", 1)]


@pytest.mark.parametrize("name,shape,T", SEGMENT_CASES)
def test_segment_read_equals_xla_read(route, name, shape, T):
  K, G = SHAPES[shape]
  S, D = 80, 16
  seg = _segment(name, K, S, D)
  q = jax.random.normal(jax.random.PRNGKey(7), (2, K, G, T, D), f32)
  want = _read(xla.attend_segment, q, seg)
  got = _read(native.read_segment, q, seg)
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=_tol(route, name) * scale,
                             rtol=0)


@pytest.mark.parametrize("name,G,T", [("int8", 3, 1), ("int4", 5, 1), ("int2", 3, 2),
                                       ("bf16", 1, 1), ("bf16", 3, 1), ("bf16", 3, 2)])
def test_segment_read_at_head_dim_64(route, name, G, T):
  """The fused kernel at a real head_dim, where int4 and int2 planes are wide enough for
  the integer route and bf16 codes are read 32 columns at a time, split by parity: row
  groups of 1 to 4 (M = G x T = 1, 3, 5, 6)."""
  seg = _segment(name, 2, 72, 64, seed=3)
  q = jax.random.normal(jax.random.PRNGKey(8), (2, 2, G, T, 64), f32) * 0.3
  want = _read(xla.attend_segment, q, seg)
  got = _read(native.read_segment, q, seg)
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=_tol(route, name) * scale,
                             rtol=0)


@pytest.mark.parametrize("name,K,G,D", [(c, 1, 4, 256) for c in ("int8", "int4", "bf16")] +
                         [(c, 2, 7, 64) for c in ("int8", "int4", "bf16")])
def test_segment_read_at_the_new_models_shapes(route, name, K, G, D):
  """Gemma 3's MQA (head_dim 256, 4 query heads on its one KV head) and Qwen2.5's GQA-2
  (head_dim 64, 7 query heads a KV head: an odd row group), one decode query a row, over a
  slot mask with holes (a window folded in, a ragged start)."""
  seg = _segment(name, K, 72, D, seed=5)
  q = jax.random.normal(jax.random.PRNGKey(11), (2, K, G, 1, D), f32) * 0.3
  want = _read(xla.attend_segment, q, seg)
  got = _read(native.read_segment, q, seg)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                             atol=_tol(route, name) * float(jnp.max(jnp.abs(want))), rtol=0)


@pytest.mark.parametrize("name,D", [("int8", 64), ("int4", 64), ("int4", 16)])
def test_integer_values_over_an_odd_tail_and_a_nan(name, D):
  """Integer values, which the AVX-512 kernel reads two tokens per integer multiply-add
  against each tile's probabilities rounded to 15 bits (int4 at head_dim 16: four tokens'
  codes split and laid out at once): 77 live tokens (a full tile and an odd tail of 13)
  equal the XLA read, and a NaN value (the codec stores its token's scale as NaN) reads as
  NaN in exactly the rows the XLA read's does."""
  if not kernels.available():
    pytest.skip(f"the read kernel is not available here ({kernels.status()})")
  seg = _segment(name, 2, 85, D, seed=4)
  q = jax.random.normal(jax.random.PRNGKey(9), (2, 2, 3, 1, D), f32) * 0.3
  want, got = _read(xla.attend_segment, q, seg), _read(native.read_segment, q, seg)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                             atol=_tol("kernel", name) * float(jnp.max(jnp.abs(want))), rtol=0)
  c = seg.v_codec
  x = jax.random.normal(jax.random.PRNGKey(10), (2, 2, 85, D), f32).at[0, 1, 70, 5].set(jnp.nan)
  bad = seg.__class__(seg.k, c.encode(x), seg.mask_BS, seg.k_codec, c, live=seg.live)
  want, got = _read(xla.attend_segment, q, bad), _read(native.read_segment, q, bad)
  assert bool(jnp.any(jnp.isnan(want)))  # the poisoned token is live in sequence 0
  np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))


def _tol(route: str, name: str, v_name: str | None = None) -> float:
  """Per-codec tolerance, relative to the output's largest value (`v_name`: the value
  codec where it differs from the key codec `name`). The dots route rounds queries and
  probabilities to two digits (about 15 bits); the kernel reads integer keys against the
  query rounded to 15-bit integers (one rounding of each query element, a hundredth of an
  int8 code's own) and, on AVX-512, integer values against each tile's probabilities
  rounded to 15-bit integers (the dots route's rounding), and everything else in float32."""
  ints = ("int8", "int4", "int2")
  if route == "dots" and name not in ("fp32", "fp16"):
    return 5e-4
  if route == "kernel" and (v_name or name) in ints:
    return 5e-4
  return 1e-4 if route == "kernel" and name in ints else 2e-5


@pytest.mark.parametrize("k_codec,v_codec,T,D", [
    ("int2", "int4", 1, 16), ("bf16", "fp32", 6, 16), ("int4", "int4", 6, 16),
    ("int8", "int8", 1, 24),                                # the generic scan (see below)
    ("int8", "int4", 1, 64), ("bf16", "int8", 2, 64), ("int4", "fp16", 1, 32),
    ("fp8_e4m3", "int2", 1, 64)])                           # the fused scan, mixed kinds
def test_kernel_mixed_kinds_equal_xla_read(k_codec, v_codec, T, D):
  """K and V of different kinds: the fused scan (its K and V reads are chosen apart) and
  the generic scan (int2 planes narrower than eight codes, more than 16 query rows, a
  head_dim without a compiled form) against the XLA read."""
  if not kernels.available():
    pytest.skip(f"the read kernel is not available here ({kernels.status()})")
  kc, vc = codecs.get(k_codec), codecs.get(v_codec)
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 2, 48, D), f32)
  mask = (jnp.arange(48) < 40)[None] & (jnp.arange(2)[:, None] < 2)
  seg = cache_base.Segment(kc.encode(x), vc.encode(-x), mask, kc, vc, live=jnp.int32(40))
  q = jax.random.normal(jax.random.PRNGKey(6), (2, 2, 3, T, D), f32) * (4 / D) ** 0.5
  want, got = _read(xla.attend_segment, q, seg), _read(native.read_segment, q, seg)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                             atol=_tol("kernel", k_codec, v_codec) * float(jnp.max(jnp.abs(want))),
                             rtol=0)


SCALE_CASES = [  # (codec, knobs, head_dim): groups of 4 take the generic scan, the rest fused
    ("int8", dict(group_size=4), 16), ("int4", dict(group_size=8), 16),
    ("int4", dict(group_size=32), 64), ("int2", dict(group_size=16), 64),
    ("fp8_e4m3", dict(group_size=16), 64),
    ("int4", dict(k_axis="channel", group_size=8, residual=16), 16),
    ("int2", dict(k_axis="channel", group_size=8, residual=16), 16),     # generic: int2 at 16
    ("int2", dict(k_axis="channel", group_size=32, residual=32), 64),    # KIVI's int2
    ("int8", dict(k_axis="channel", group_size=16), 64)]


@pytest.mark.parametrize("name,knobs,D", SCALE_CASES)
def test_grouped_and_channel_scales_equal_xla_read(route, name, knobs, D):
  """Head_dim groups and per-channel keys (KIVI's layout: one scale per channel per U
  tokens) through the kernel, and through the stored-type dots with the kernel off."""
  seg = _segment(name, 2, 64, D, CacheConfig(**knobs))
  read = kernels.read(jnp.zeros((2, 2, 3, 2, D)), seg)
  assert (read is not None) == (route == "kernel")
  q = jax.random.normal(jax.random.PRNGKey(3), (2, 2, 3, 2, D), f32) * 0.5
  want, got = _read(xla.attend_segment, q, seg), _read(native.read_segment, q, seg)
  tol = 2e-4 if route == "dots" else 2e-5
  np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                             atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)


PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32, 3, 8], [2, 7, 18, 28, 18]]
LAYOUTS = {
    "contiguous-int4-residual": {"cache.codec": "int4", "cache.residual": 8},
    "sinks-int4": {"cache.policy": "sinks", "cache.sinks": 2, "cache.window": 6,
                   "cache.codec": "int4"},
    "h2o-paged-int8": {"cache.layout": "paged", "cache.page_size": 4, "cache.policy": "h2o",
                       "cache.budget": 10, "cache.window": 4, "cache.codec": "int8"},
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_model_tokens_equal_the_xla_read(name):
  base = {"model.n_kv_heads": 2, "cache.capacity": 32, **LAYOUTS[name]}
  out = {}
  for attn in ("grouped", "native"):
    cfg = tiny_config(**base, **{"model.attention": attn})
    out[attn] = generate.generate(cfg, tiny_params(cfg), PROMPTS, 8, timed=False)
  assert out["native"]["tokens"] == out["grouped"]["tokens"]
  assert out["native"]["cache_bytes"] == out["grouped"]["cache_bytes"]


@pytest.mark.parametrize("codec", ["int4", "bf16"])
def test_chunked_eval_equals_the_xla_read(codec):
  """T > 1 queries against stored segments (chunked evaluation) through both reads."""
  tokens = np.random.default_rng(0).integers(0, 200, (2, 40)).astype(np.int32)
  lps = {}
  for attn in ("grouped", "native"):
    cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.codec": codec, "model.attention": attn})
    lps[attn], _ = evaluate.stream_logprobs(cfg, tiny_params(cfg), tokens, chunk=8)
  np.testing.assert_allclose(np.asarray(lps["native"]), np.asarray(lps["grouped"]), atol=1e-4)


def test_auto_is_native_on_the_cpu():
  assert attn_base.resolve("auto") == "native"
  assert attn_base.resolve("grouped") == "grouped"
  assert config_lib.Config().model.attention == "auto"


_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
from kvjax import cache as cache_lib, config, decode, kernels, model
from kvjax.decode import generate, step
cfg = config.load(None, {"model.n_kv_heads": 2, "cache.codec": sys.argv[1]})
params = step.prepare_params(cfg, model.init_params(cfg.model, 0))
cache = cache_lib.init_cache(cfg, 2, 24)
low = decode.decode.lower(params, cache, jnp.zeros((2,), jnp.int32), jax.random.PRNGKey(0),
                          **generate.statics(cfg, decode.Sampler(), steps=4))
text = low.compile().as_text()
print(json.dumps({"status": kernels.status(), "calls": text.count('custom_call_target="kvjax_read"')}))
"""


def test_default_cpu_decode_program_calls_the_kernel():
  """With XLA's default flags (the suite lowers the optimisation level, so a child process
  without them), the compiled default decode step calls the read kernel once per stored
  segment of the layer body; where g++ exists the kernel must be active, so CI cannot pass on the
  fallback."""
  if not shutil.which("g++") and not os.environ.get("CXX"):
    pytest.skip("no C++ compiler: kvjax reads through XLA's dots (said once on stderr)")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-c", _CHILD, "int8"], env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["status"] == "active"
  assert got["calls"] >= 1  # the layer loop's body reads its contiguous segment through it


@pytest.fixture(scope="module")
def smollm2_window(smollm2_kvjax):
  """128 tokens of held-out text and their log-probabilities through the fp32 cache, 64 a
  step: computed once for this module's SmolLM2 tests."""
  cfg, params, tok = smollm2_kvjax
  windows = evaluate.text_windows(tok, evaluate.data.eval_text("stdlib"), 128, 1)
  return windows, evaluate.stream_logprobs(cfg, params, windows, chunk=64)[0]


def test_fidelity_on_smollm2(smollm2_kvjax, smollm2_window):
  """Δppl through the native read equals the XLA read's, codec by codec, on a short
  window of held-out text (the full windows are the `real_quality` experiment's): within
  the larger of 0.02 percentage points, 2 % of its value, and the XLA read's own distance
  from `reference` (every slot dequantized in float32). On windows this short a last-bit
  difference in a key or value before it is quantized can flip its int4 code, so two exact
  reads of one cache already differ by that much."""
  cfg, params, tok = smollm2_kvjax
  windows, ref = smollm2_window
  for over in ({"cache.codec": "int4"},
               {"cache.k_codec": "int4", "cache.v_codec": "int4", "cache.k_axis": "channel",
                "cache.group_size": 32, "cache.residual": 32}):
    d = {}
    for attn in ("reference", "grouped", "native"):
      c = config_lib.apply_overrides(cfg, {**over, "model.attention": attn})
      lp, _ = evaluate.stream_logprobs(c, params, windows, chunk=64)
      d[attn] = evaluate.compare(lp, ref, windows)["dppl_rel"]
    tol = max(2e-4, 0.02 * abs(d["grouped"]), abs(d["grouped"] - d["reference"]))
    assert abs(d["native"] - d["grouped"]) <= tol, (over, d)


def test_mse_clipping_cuts_int2_loss_on_smollm2(smollm2_kvjax, smollm2_window):
  """`cache.clip=mse` (kvjax/codecs/clip.py; its own tests in test_clip.py), on the real
  model through the default read: per-token int2 in a Hadamard basis loses far
  less against the fp32 cache with the range searched (a short window; the committed
  figures are `real_quality`'s)."""
  cfg, params, tok = smollm2_kvjax
  windows, ref = smollm2_window
  kl = {}
  for clip in ("none", "mse"):
    c = config_lib.apply_overrides(cfg, {"cache.codec": "int2", "cache.rotate": "hadamard",
                                     "cache.clip": clip})
    lp, _ = evaluate.stream_logprobs(c, params, windows, chunk=64)
    kl[clip] = evaluate.compare(lp, ref, windows)["kl"]
  assert kl["mse"] < 0.6 * kl["none"], kl


def test_paged_slots_without_a_page_are_never_read_outside_the_pool():
  """A block table whose unbacked entries point outside the pool (masked slots, as the
  serving engine leaves them) reads as the XLA read's clipped gather does: finite, equal."""
  if not kernels.available():
    pytest.skip(f"the read kernel is not available here ({kernels.status()})")
  c = codecs.get("bf16")  # float codes: the comparison is exact up to float32 rounding
  P, K, ps, D = 6, 2, 4, 16
  pool = c.encode(jax.random.normal(jax.random.PRNGKey(1), (1, P, K, ps, D), f32))
  pages = jnp.array([[2, 0, 10 ** 6, -7], [5, 10 ** 6, 10 ** 6, 10 ** 6]], jnp.int32)
  mask = jnp.arange(16)[None] < jnp.array([[8], [3]])
  seg = cache_base.PagedSegment(pool, pool, mask, c, c, live=jnp.int32(16), layer=0,
                                pages=pages, page_size=ps)
  q = jax.random.normal(jax.random.PRNGKey(2), (2, K, 2, 1, D), f32)
  st = (jnp.full((2, K, 2, 1), attn_base.MASKED, f32), jnp.zeros((2, K, 2, 1), f32),
        jnp.zeros((2, K, 2, 1, D), f32))
  want = xla.attend_segment(q, seg, st)
  got = jax.jit(lambda q: native.read_segment(q, seg, st))(q)
  for w, g in zip(want, got):
    assert bool(jnp.all(jnp.isfinite(g)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-5)
