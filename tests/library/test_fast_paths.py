"""The fast paths equal the plain ones: blockwise online-softmax attention over the live
length == one softmax over every dequantized slot (MHA/GQA/MQA x codecs, live lengths on
and across block edges, ragged rows, prefill and decode), the model's logits at chosen
positions == the full logits sliced, and decoding many steps never retraces."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention, codecs, config, decode, model
from kvjax import cache as cache_lib
from kvjax.attention import xla
from kvjax.codecs import base as codecs_base
from kvjax.decode import generate, step
from kvjax.errors import KvjaxError

HEADS = [(4, 4), (4, 2), (4, 1)]  # (H, K): MHA, GQA, MQA
CODECS = ["fp32", "bf16", "int8", "int4", "fp8_e4m3"]


def segment(codec_name, k_BKSD, v_BKSD, lengths_B, cache_cfg=None):
  """One stored segment of raw K/V: slot s holds position s, the first `lengths_B` valid."""
  kc = codecs.for_role(codec_name, cache_cfg, "k")
  vc = codecs.for_role(codec_name, cache_cfg, "v")
  S = k_BKSD.shape[2]
  mask = jnp.arange(S)[None] < lengths_B[:, None]
  return cache_lib.Segment(kc.encode(k_BKSD), vc.encode(v_BKSD), mask, kc, vc,
                           live=jnp.max(lengths_B),
                           pos_BS=jnp.where(mask, jnp.arange(S)[None], -1))


def programs(codec_name, cache_cfg=None):
  """(blockwise, reference) attention over one segment of raw K/V, each one jitted program
  of (q, k_new, v_new, positions, k, v, lengths): the segment is built inside, so the live
  length is traced data (a dynamic trip count), and the reference is not run op by op."""
  return tuple(jax.jit(lambda q, kn, vn, pos, k, v, n, f=f: f(
      q, kn, vn, pos, [segment(codec_name, k, v, n, cache_cfg)]))
      for f in (attention.grouped, attention.reference))


# MHA/GQA/MQA on int8, every other codec on GQA. (MQA bf16 takes GQA bf16's one-einsum form
# at head_dim 8, and its G-matvec form is test_grouped_query_heads_split_or_not_equal_
# reference's; MHA int4 takes GQA int4's packed-plane einsum: neither adds a path.)
@pytest.mark.parametrize("H,K,codec", [(h, k, "int8") for h, k in HEADS] +
                         [(4, 2, c) for c in CODECS if c != "int8"])
def test_blockwise_attention_equals_reference(H, K, codec, monkeypatch):
  """Blocks of 8 over S = 21 slots (the last block overruns S and is pulled back); live
  lengths 0, 7, 8, 9, 16, 17 and 21 per row; one decode query and a ragged 3-token prefill."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  rng = np.random.default_rng(H * 10 + K)
  D, S = 8, 21
  fast, ref = programs(codec)
  for lengths in ([0, 7, 8], [9, 16, 17], [21, 3, 0]):
    B = len(lengths)
    lengths_B = jnp.asarray(lengths, jnp.int32)
    k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    for T in (1, 3):
      q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) * 3
      kn = jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32)
      vn = jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32)
      t = jnp.arange(T)[None]
      pos = jnp.where(t < jnp.array([T, 1, T])[:, None], lengths_B[:, None] + t, -1)
      got = fast(q, kn, vn, pos, k, v, lengths_B)
      want = ref(q, kn, vn, pos, k, v, lengths_B)
      valid = np.asarray(pos >= 0)[:, :, None, None]
      np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0),
                                 atol=2e-5, rtol=1e-5)
      assert np.all(np.isfinite(np.asarray(got)))  # padding queries read 0, never NaN


def prompt_case(seed: int, T: int, rows: list[int]):
  """A stored segment of 10 slots holding 0, 7 and 10 tokens (3 rows, GQA 4/2, head_dim 8)
  and a prompt of T new tokens per row, the first `rows[b]` valid (right padding):
  (lengths, k, v, q, k_new, v_new, positions)."""
  rng = np.random.default_rng(seed)
  B, H, K, D, S = 3, 4, 2, 8, 10
  lengths_B = jnp.asarray([0, 7, 10], jnp.int32)
  k, v = (jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) * 3
  kn, vn = (jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32) for _ in range(2))
  t = jnp.arange(T)[None]
  pos = jnp.where(t < jnp.array(rows)[:, None], lengths_B[:, None] + t, -1)
  return lengths_B, k, v, q, kn, vn, pos


@pytest.mark.parametrize("T", [11, 12])
def test_prompt_query_blocks_equal_reference(T, monkeypatch):
  """A prompt read in query blocks of 4 (the last one short when T = 11), each against the
  keys up to its own end, after a stored segment, ragged rows (right padding): the plain
  attention's output. And the whole model's prompt logits equal one block's."""
  monkeypatch.setattr(xla, "NEW_BLOCK", 4)
  lengths_B, k, v, q, kn, vn, pos = prompt_case(T, T, [T, 5, 1])
  # Each side is one jitted program, traced while NEW_BLOCK holds the value it tests.
  got, want = (f(q, kn, vn, pos, k, v, lengths_B) for f in programs("bf16"))
  valid = np.asarray(pos >= 0)[:, :, None, None]
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), atol=2e-5,
                             rtol=1e-5)
  cfg, params = tiny(2, "fp32")
  tokens = jnp.asarray(np.random.default_rng(T).integers(0, 260, (3, T)), jnp.int32)
  forward = lambda: jax.jit(lambda p, t, pos: model.Transformer(cfg.model).apply(  # noqa: E731
      {"params": p}, t, pos)[0])(params, tokens, pos)
  blocked = forward()
  monkeypatch.setattr(xla, "NEW_BLOCK", T)
  whole = forward()
  np.testing.assert_allclose(np.where(valid[..., 0], blocked, 0), np.where(valid[..., 0], whole, 0),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("band, windows", [(0, [0, 0, 0]), (8, [8, 3, 0]), (16, [16, 5, 9])])
def test_prompt_blocks_in_a_scan_equal_reference(band, windows, monkeypatch):
  """A prompt longer than its query block runs as one `lax.scan` over query blocks, each
  reading its own keys in key blocks (the last pulled back) from the first key any of its
  queries sees: with and without a window band (per-row windows below the band, 0 = full),
  after a stored segment, ragged rows. The plain attention's output."""
  monkeypatch.setattr(xla, "NEW_BLOCK", 4)
  monkeypatch.setattr(xla, "KEY_BLOCK", 8)
  lengths_B, k, v, q, kn, vn, pos = prompt_case(band, 37, [37, 30, 5])
  W_B1 = jnp.asarray(windows)[:, None]
  floor = None if not band else jnp.where(W_B1 > 0, pos - W_B1 + 1, 0).astype(jnp.int32)
  window = {} if floor is None else {"floor_BT": floor}
  got, want = (jax.jit(lambda q, kn, vn, pos, k, v, n, f=f: f(
      q, kn, vn, pos, [segment("fp32", k, v, n)], **window,
      **({"band": band} if f is attention.grouped else {})))(q, kn, vn, pos, k, v, lengths_B)
      for f in (attention.grouped, attention.reference))
  valid = np.asarray(pos >= 0)[:, :, None, None]
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), atol=2e-5,
                             rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(got)))


def test_a_windowed_layer_reads_its_band_and_a_full_layer_its_triangle():
  """The keys a 32k-token prompt's pass reads in one layer, counted by the function that
  sets the traced loop's trip counts (`xla.key_spans`): a 512-token window (Gemma 3's)
  reads at most 1.2x the keys its window needs; a full layer at most 1.2x the causal
  triangle; a window as wide as the prompt as much as a full layer."""
  T, W = 32768, 512
  need_window = sum(min(t + 1, W) for t in range(T))
  need_full = T * (T + 1) // 2
  assert xla.keys_read(T, window=W, band=W) <= 1.2 * need_window
  assert xla.keys_read(T, window=W, band=W) >= need_window
  assert need_full <= xla.keys_read(T, window=0, band=W) <= 1.2 * need_full
  assert need_full <= xla.keys_read(T) <= 1.2 * need_full
  assert xla.keys_read(T, window=T, band=W) == xla.keys_read(T, window=0, band=W)


def test_the_prompt_program_does_not_grow_with_the_prompt():
  """The model's prompt pass through a cache lowers to the same program at 4,096 and 16,384
  tokens (one scan of query blocks, no op per block): its HLO has as many instructions,
  so its compile time follows the layer body, not the prompt."""
  cfg, params = tiny(2, "fp32")
  cfg = config.replace(cfg, **{"model.sliding_window": 64, "model.global_every": 2})
  params = step.prepare_params(cfg, params)

  def ops(T):
    cache = cache_lib.init_cache(cfg, 1, T)
    tokens = jnp.zeros((1, T), jnp.int32)
    lowered = decode.prefill.lower(params, tokens, jnp.asarray([T], jnp.int32), cache,
                                   jax.random.PRNGKey(0), **step.statics(cfg, decode.Sampler()))
    return sum(1 for line in lowered.as_text().splitlines() if " = " in line)
  assert ops(4096) == ops(16384)


def test_a_long_prompts_mlp_in_row_blocks_equals_the_whole(monkeypatch):
  """The MLP of a prompt longer than `layers.MLP_ROWS` runs a block of rows at a time (the
  last padded): the model's logits equal those of one MLP over every row, ragged rows."""
  from kvjax.model import layers
  cfg, params = tiny(2, "fp32")
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 260, (2, 11)), jnp.int32)
  t = jnp.arange(11)[None]
  pos = jnp.where(t < jnp.array([11, 6])[:, None], t, -1)

  def forward():  # traced afresh while MLP_ROWS holds the value it tests
    return np.asarray(jax.jit(lambda p, t, q: model.Transformer(cfg.model).apply(
        {"params": p}, t, q)[0])(params, tokens, pos))
  monkeypatch.setattr(layers, "MLP_ROWS", 4)
  blocked = forward()
  monkeypatch.setattr(layers, "MLP_ROWS", 64)
  whole = forward()
  valid = np.asarray(pos >= 0)[..., None]
  np.testing.assert_allclose(np.where(valid, blocked, 0), np.where(valid, whole, 0), atol=1e-5,
                             rtol=1e-5)


@pytest.mark.parametrize("codec, planes", [("int4", 2), ("int2", 4), ("int4", 1)])
def test_plane_wise_packed_reads_equal_reference(codec, planes, monkeypatch):
  """Packed codes read one bit plane at a time (`PLANE_MIN` lowered so the tiny head_dim
  qualifies; planes=1: the unpacked fallback) == every slot dequantized, across blocks."""
  from kvjax.codecs import quant
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  D, S, B, H, K = 8, 21, 3, 4, 2
  monkeypatch.setattr(quant, "PLANE_MIN", 1 if planes > 1 else D)
  rng = np.random.default_rng(planes)
  lengths_B = jnp.asarray([5, 21, 13], jnp.int32)
  k, v = (jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.float32) * 3
  kn, vn = (jnp.asarray(rng.standard_normal((B, 1, K, D)), jnp.float32) for _ in range(2))
  kc = codecs.for_role(codec)
  assert len(kc._planes(kc.encode(k), jnp.float32)) == planes
  got, want = (f(q, kn, vn, lengths_B[:, None], k, v, lengths_B) for f in programs(codec))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_grouped_query_heads_split_or_not_equal_reference(codec, per_head, monkeypatch):
  """G = 4 query heads per KV head read as G matvecs (the CPU form of the logits, and of the
  values at head_dim >= 128) or as one GEMM: both equal the reference, for both reads."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  monkeypatch.setattr(codecs_base, "per_head", lambda G, D, read="qk": per_head)
  rng = np.random.default_rng(7)
  B, K, S, D, H = 2, 1, 21, 8, 4
  lengths_B = jnp.asarray([9, 21], jnp.int32)
  k, v = (jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.float32) * 3
  kn, vn = (jnp.asarray(rng.standard_normal((B, 1, K, D)), jnp.float32) for _ in range(2))
  args = (q, kn, vn, lengths_B[:, None], k, v, lengths_B)
  fast, ref = programs(codec)
  np.testing.assert_allclose(fast(*args), ref(*args), atol=2e-5, rtol=1e-5)
  # The form really changed: split, each read of a stored block is G = 4 dots (+ 2 for the
  # new tokens); not split, one or two (int8 keys fold their scales with a second einsum).
  dots = str(jax.make_jaxpr(fast)(*args)).count("dot_general")
  assert dots == 2 * H + 2 if per_head else dots <= 5


def test_per_head_split_rule_on_cpu():
  """The CPU rule: logits split for 2 <= G <= min(4, D / 8); values only from head_dim 128."""
  assert jax.default_backend() == "cpu"
  ph = codecs_base.per_head
  assert ph(3, 64, "qk") and not ph(3, 64, "pv")
  assert ph(2, 128, "qk") and ph(2, 128, "pv")
  assert not ph(1, 64, "qk") and not ph(8, 128, "qk") and not ph(4, 16, "qk")
  assert not ph(8, 128, "pv") and not ph(4, 32, "pv")


def test_blockwise_attention_channel_keys_equal_reference(monkeypatch):
  """KIVI per-channel key scales (token blocks of 4) read in blocks of 8."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  cfg = config.load(None, {"cache.k_axis": "channel", "cache.group_size": 4,
                           "cache.residual": 8, "cache.codec": "int4"})
  rng = np.random.default_rng(1)
  B, K, S, D, H = 2, 2, 20, 8, 4
  lengths_B = jnp.asarray([12, 17], jnp.int32)
  k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.float32)
  kn = jnp.asarray(rng.standard_normal((B, 1, K, D)), jnp.float32)
  got, want = (f(q, kn, kn, lengths_B[:, None], k, v, lengths_B)
               for f in programs("int4", cfg.cache))
  np.testing.assert_allclose(got, want, atol=2e-5)


@functools.lru_cache(maxsize=None)
def tiny(kv_heads: int, codec: str, attn: str = "grouped"):
  cfg = config.load(None, {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": kv_heads,
                           "model.head_dim": 8, "model.n_layers": 2, "cache.codec": codec,
                           "model.attention": attn})
  return cfg, model.init_params(cfg.model, 0)


def teacher_forced(cfg, params, tokens_BN, lens_B, capacity):
  """Ragged prefill, then feed tokens one at a time; logits [B, steps, V] per step."""
  static = step.Static.of(cfg)
  cache = cache_lib.init_cache(cfg, tokens_BN.shape[0], capacity)
  P = int(lens_B.max())

  @jax.jit
  def run(params, cache):
    t = jnp.arange(P)[None]
    c = step.run(static, params, tokens_BN[:, :P], jnp.where(t < lens_B[:, None], t, -1),
                 cache).cache

    def one(c, _):
      tok = jnp.take_along_axis(tokens_BN, c.lengths[:, None], axis=1)
      out = step.run(static, params, tok, c.lengths[:, None], c)
      return out.cache, out.logits[:, 0]

    return jax.lax.scan(one, c, None, length=tokens_BN.shape[1] - P - 1)[1]

  return np.asarray(run(params, cache))


@pytest.mark.parametrize("over", [
    {"cache.codec": "fp32"}, {"cache.codec": "int4"}, {"cache.layout": "paged", "cache.codec": "bf16",
                                                       "cache.page_size": 8},
    {"cache.layout": "none"}, {"cache.codec": "int8", "model.sliding_window": 8,
                               "model.global_every": 2}])
def test_a_prompt_in_query_blocks_decodes_as_one_block(over, monkeypatch):
  """Prefill of a ragged 29-token prompt in query blocks of 4 (keys 8 at a time; a window's
  band under model.sliding_window), then teacher-forced decode: the logits of the same
  program with the prompt in one block, on each layout and codec, windowed and full layers."""
  cfg, params = tiny(2, "fp32")
  cfg = config.replace(cfg, **{"model.max_seq_len": 64, **over})
  toks = jnp.asarray(np.random.default_rng(5).integers(0, 260, (2, 40)), jnp.int32)
  lens = jnp.asarray([29, 17], jnp.int32)
  monkeypatch.setattr(xla, "NEW_BLOCK", 4)
  monkeypatch.setattr(xla, "KEY_BLOCK", 8)
  assert xla.prompt_blocks(29, cfg.model.sliding_window)[0] < 29
  blocked = teacher_forced(cfg, params, toks, lens, 48)
  monkeypatch.setattr(xla, "prompt_blocks", lambda T, band=0: (max(T, 64), max(T, 64)))
  whole = teacher_forced(cfg, params, toks, lens, 48)
  np.testing.assert_allclose(blocked, whole, atol=2e-5, rtol=1e-5)


# GQA on packed int4 and MQA on scaled int8: the cache-to-segment plumbing is the same for
# every codec and head count; the blockwise read of each codec (fp32, bf16 ...) and of MHA
# is test_blockwise_attention_equals_reference's, MHA's model decode test_decode's.
@pytest.mark.parametrize("kv,codec", [(1, "int8"), (2, "int4")])
def test_model_decode_equals_reference_attention_across_block_edges(kv, codec, monkeypatch):
  """A capacity of 64 slots read in blocks of 8, live lengths growing from 3 / 10 across
  several block edges: the same logits as the plain attention over every slot."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  toks = jnp.asarray(np.random.default_rng(2).integers(0, 260, (2, 30)), jnp.int32)
  lens = jnp.asarray([10, 3], jnp.int32)
  cfg, params = tiny(kv, codec)
  got = teacher_forced(cfg, params, toks, lens, 64)
  ref_cfg, _ = tiny(kv, codec, "reference")
  want = teacher_forced(ref_cfg, params, toks, lens, 64)
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_logits_at_and_last_equal_full_logits_sliced():
  cfg, params = tiny(2, "fp32")
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 260, (2, 7)), jnp.int32)
  t = jnp.arange(7)[None]
  pos = jnp.where(t < jnp.array([[7], [4]]), t, -1)
  at = jnp.array([[6, 0], [3, 2]])

  @jax.jit  # one program for the three forwards (eagerly, every op compiles on its own)
  def run(params, tokens, pos, at):
    apply = lambda m, **k: m.apply({"params": params}, tokens, pos, **k)[0]  # noqa: E731
    return (apply(model.Transformer(cfg.model)),
            apply(model.Transformer(cfg.model), logits_at=at),
            apply(model.Transformer(cfg.model, logits_last=True)))

  full, got, last = run(params, tokens, pos, at)
  np.testing.assert_allclose(got, jnp.take_along_axis(full, at[..., None], axis=1), atol=1e-5)
  np.testing.assert_allclose(last[:, 0], full[jnp.arange(2), jnp.array([6, 3])], atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "none", "paged"])
def test_generate_matches_no_cache_and_never_retraces(layout, monkeypatch):
  """Greedy tokens through each layout == the recompute baseline (logits_last prefill,
  blockwise decode), and a second request of other lengths reuses both programs."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  cfg, params = tiny(2, "fp32")
  cfg = config.apply_overrides(cfg, {"cache.layout": layout, "cache.capacity": 48,
                                     "cache.page_size": 8})
  base = config.apply_overrides(cfg, {"cache.layout": "none"})
  prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2]]
  got = generate.generate(cfg, params, prompts, 20, timed=False)["tokens"]
  assert got == generate.generate(base, params, prompts, 20, timed=False)["tokens"]
  generate.generate(cfg, params, [[3, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9]], 20, timed=False)
  before = dict(decode.TRACES)
  generate.generate(cfg, params, [[9, 9, 9], [1] * 9], 20, timed=False)  # same padded width
  assert decode.TRACES == before


def ex_params(cfg):
  from kvjax.lab import experiments
  return experiments.random_params(cfg.model, cfg.seed)


def test_roofline_experiment_rows_and_plot(tmp_path):
  """One tiny cell end to end: the bytes add up, the fraction is ideal / measured, and the
  plot writes PNG + SVG."""
  from kvjax.lab.experiments import roofline
  cfg = config.load(None, {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
                           "model.head_dim": 8, "model.n_layers": 2, "cache.codec": "int8",
                           "workload.prompt_len": 40, "workload.gen_len": 3,
                           "workload.repeats": 1, "params": {"bandwidth_mib": 4}})
  (row,) = roofline.run_cell(cfg)
  m = row["metrics"]
  assert m["step_bytes"] == m["weight_bytes"] + m["kv_bytes"] > m["kv_bytes"] > 0
  # B x (live tokens L (K+V) heads (int8 + fp16 scale) + int32 length), 41 and 42 live
  assert m["kv_bytes"] == pytest.approx(1 * (41.5 * 2 * 2 * 2 * (8 + 2) + 4))
  assert m["roofline_fraction"] == pytest.approx(m["ideal_s"] / m["tpot_s"])  # one repeat
  # The arithmetic roof: 2 FLOPs per multiply-add of each weight matrix (tied lm_head
  # included) and of the attention over the 41.5 live tokens on average, at the probe's rate.
  p = ex_params(cfg)
  mats = sum(a.size for a in jax.tree.leaves(p) if a.ndim >= 2)
  assert m["weight_flops"] == 2 * (mats - p["embed_tokens"]["embedding"].size)  # untied
  assert m["attention_flops"] == pytest.approx(2 * 2 * 2 * 4 * 8 * 41.5)
  rate = m["dot_Fps"]
  assert m["flops_s"] == pytest.approx(m["weight_flops"] / rate[m["weight_dot"]] +
                                       m["attention_flops"] / rate[m["attention_dot"]])
  assert m["roof_s"] == max(m["ideal_s"], m["flops_s"])
  assert m["bound"] == ("bytes" if m["ideal_s"] >= m["flops_s"] else "flops")
  assert m["roof_fraction"] == pytest.approx(m["roof_s"] / m["tpot_s"])
  from kvjax.lab.plots import roofline as plot_roofline
  row["env"] = {"backend": "cpu", "device_kind": "cpu"}
  paths = plot_roofline.plot([row], tmp_path)
  assert {p.suffix for p in paths} == {".png", ".svg"} and all(p.stat().st_size for p in paths)


@pytest.mark.parametrize("prog, attn, dtype, codec, dot", [
    ("accelerator", "auto", "bfloat16", "int8", "bf16"),   # folded: codes converted into bf16 dots
    ("accelerator", "grouped", "float32", "int4", "f32"),
    ("cpu", "grouped", "bfloat16", "int8", "f32"),         # the CPU program's XLA read widens
])
def test_roofline_attention_dot_is_the_type_the_read_multiplies_in(prog, attn, dtype, codec, dot):
  """The arithmetic roof prices the attention at the dot it runs on: the accelerator
  program's XLA read multiplies in the compute dtype, the CPU program's in float32 (a
  bf16-model GPU row priced at float32 dots read as flops-bound on the H200)."""
  from kvjax.lab.experiments import roofline
  cfg = config.load(None, {"model.program": prog, "model.attention": attn,
                           "model.dtype": dtype, "cache.codec": codec})
  assert roofline.attention_dot(cfg) == dot


def test_roofline_pairs_bandwidth_with_each_repeat(monkeypatch):
  """The fraction is the median of per-repeat ratios, each repeat's step time against the
  bandwidth measured just before it: a slow phase that slows both keeps its ratio (repeat
  1 here), where the median bandwidth over the median time mixes repeats and doubles it."""
  from kvjax.lab.experiments import roofline
  bws, tps = iter([4e9, 1e9, 1e9]), iter([0.0, 1.0, 4.0, 2.0])  # decode: warm-up first
  monkeypatch.setattr(roofline.Bandwidth, "__init__", lambda self, mib: None)
  monkeypatch.setattr(roofline.Bandwidth, "measure", lambda self, passes=3: next(bws))
  monkeypatch.setattr(roofline.Bandwidth, "measure_copy", lambda self, passes=3: 8e9)
  monkeypatch.setattr(roofline.FilledDecode, "__init__", lambda self, *a: None)
  monkeypatch.setattr(roofline.FilledDecode, "once", lambda self: next(tps))
  cfg = config.load(None, {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
                           "model.n_layers": 1, "workload.prompt_len": 8,
                           "workload.gen_len": 2, "workload.repeats": 3})
  m = roofline.run_cell(cfg)[0]["metrics"]
  assert m["bandwidth_Bps"] == 1e9 and m["tpot_s"] == 2.0 and m["repeats"] == 3
  assert m["roofline_fraction"] == pytest.approx(m["step_bytes"] / 4e9)
  assert m["ideal_s"] / m["tpot_s"] == pytest.approx(m["step_bytes"] / 2e9)
  assert m["copy_Bps"] == 8e9 and m["copy_fraction"] == pytest.approx(m["step_bytes"] / 16e9)


def test_roofline_interleaves_variants_and_pairs_their_ratios(monkeypatch):
  """`params.interleave`: every variant's decode is timed within each repeat, in an order
  rotated from repeat to repeat; `tpot_vs_ref` is the median of the per-repeat ratios to
  the reference, so a machine that slows by 3x between repeats leaves the ratio exact
  where the ratio of the medians would not be."""
  from kvjax.lab.experiments import roofline
  calls, phase = [], iter([1.0] * 2 + [1.0, 1.0, 3.0, 3.0, 1.0, 1.0])  # warm-ups, then 3 repeats
  monkeypatch.setattr(roofline.Bandwidth, "__init__", lambda self, mib: None)
  monkeypatch.setattr(roofline.Bandwidth, "measure", lambda self, passes=3: 1e9)
  monkeypatch.setattr(roofline.DotProbe, "__init__", lambda self, n=512: None)
  monkeypatch.setattr(roofline.DotProbe, "measure",
                      lambda self, passes=3: {"f32": 1e10, "bf16": 1e10, "s8": 1e10})

  def init(self, cfg, *a):
    self.codec = cfg.cache.k_codec

  def once(self):
    calls.append(self.codec)
    return {"bf16": 2.0, "int8": 1.0}[self.codec] * next(phase)
  monkeypatch.setattr(roofline.FilledDecode, "__init__", init)
  monkeypatch.setattr(roofline.FilledDecode, "once", once)
  cfg = config.load(None, {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
                           "model.n_layers": 1, "workload.prompt_len": 8,
                           "workload.gen_len": 2, "workload.repeats": 3,
                           "params": {"interleave": {"int8": {"cache.codec": "int8"},
                                                     "bf16": {"cache.codec": "bf16"}},
                                      "reference": "bf16"}})
  rows = roofline.run_cell(cfg)
  assert calls[2:] == ["bf16", "int8", "int8", "bf16", "bf16", "int8"]  # rotated per repeat
  by = {r["variant"]["setting"]: r["metrics"] for r in rows}
  assert [r["variant"]["setting"] for r in rows] == ["bf16", "int8"]  # the reference first
  assert by["bf16"]["tpot_vs_ref"] == 1.0 and by["int8"]["tpot_vs_ref"] == 0.5
  assert by["int8"]["tpot_vs_ref_ci95"] == [0.5, 0.5]
  assert by["int8"]["tpot_s_samples"] == [1.0, 3.0, 1.0] and by["int8"]["tpot_s"] == 1.0
  assert by["int8"]["kv_bytes"] < by["bf16"]["kv_bytes"]
  assert by["int8"]["weight_bytes"] == by["bf16"]["weight_bytes"]
  assert "interleaved" in rows[0]["workload"]["timing"]
  line = roofline.summary([{**r, "config": {}} for r in rows])[1]
  assert line["setting"] == "int8" and line["tpot_vs_ref"] == 0.5


def test_step_bytes_count_the_weights_at_their_stored_dtype():
  """A variant with bf16 weights reads half the weight bytes of the same params in float32
  (the step casts them to `model.param_dtype`), whatever dtype they were handed in."""
  from kvjax.lab.experiments import roofline
  cfg = config.load(None, {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
                           "model.n_layers": 1, "model.vocab_size": 64})
  params = model.init_params(cfg.model, 0)
  f32 = roofline.step_bytes(cfg, params, 1, 8, 2)
  bf16 = roofline.step_bytes(config.replace(cfg, **{"model.param_dtype": "bfloat16"}), params,
                             1, 8, 2)
  table = params["embed_tokens"]["embedding"].nbytes  # untied: gathered, not read whole
  assert f32["weight_bytes"] == sum(a.nbytes for a in jax.tree.leaves(params)) - table > 0
  assert bf16["weight_bytes"] * 2 == f32["weight_bytes"]
  assert bf16["kv_bytes"] == f32["kv_bytes"]


@pytest.mark.parametrize("mib", [0, -4, 1.5, "512"])
def test_roofline_refuses_a_bad_bandwidth_size(mib):
  """A bandwidth pass over 0 MiB would divide by zero after the cell's decode ran; the
  host-side check refuses it first, in one line."""
  from kvjax.lab.experiments import roofline
  cfg = config.load(None, {"params": {"bandwidth_mib": mib}})
  with pytest.raises(KvjaxError, match="bandwidth_mib") as err:
    roofline.check(cfg)
  assert "\n" not in str(err.value)


# -- the default layer loop: no weight copied per step ------------------------------------------
NOCOPY = {"model.vocab_size": 96, "model.d_model": 48, "model.n_heads": 4, "model.head_dim": 12,
          "model.n_layers": 3, "model.d_ff": 80}


def _program(cfg, params, B=2, S=24):
  """Compiled decode (4 steps) for these params: its HLO text and temporary bytes."""
  cache = cache_lib.init_cache(cfg, B, S)
  comp = decode.decode.lower(params, cache, jnp.zeros((B,), jnp.int32), jax.random.PRNGKey(0),
                             **generate.statics(cfg, decode.Sampler(), steps=4)).compile()
  return comp.as_text(), comp.memory_analysis().temp_size_in_bytes


def _weight_copies(hlo: str, params) -> list[str]:
  """Instructions whose result has the shape of one layer's weight matrix: a dot reads its
  weight where the params lie, so any such buffer is a copy (a slice out of the stack)."""
  shapes = {"f32[" + ",".join(map(str, a.shape[1:])) + "]"
            for a in jax.tree.leaves(params["layers"]) if a.ndim == 3}
  return [ln for ln in hlo.splitlines()
          if "=" in ln and ln.split("=", 1)[1].split()[0].split("{")[0] in shapes
          and not any(op in ln for op in (" parameter(", " get-tuple-element(", " tuple("))]


@pytest.mark.parametrize("over", [{"model.n_kv_heads": 2},
                                  {"model.n_kv_heads": 1, "cache.codec": "int8"},
                                  {"model.n_kv_heads": 4, "cache.layout": "paged",
                                   "cache.page_size": 8, "cache.codec": "bf16"}],
                         ids=["gqa-fp32", "mqa-int8", "mha-paged-bf16"])
def test_default_decode_step_copies_no_weight(over):
  """The compiled default decode (params from `step.prepare_params`) holds no buffer of a
  weight matrix's shape and fewer temporary bytes than one layer's weights; the nn.scan
  program (`model.layer_loop=scan`) on stacked params copies every matrix each step (the
  check's positive control)."""
  cfg = config.load(None, {**NOCOPY, **over})
  params = model.init_params(cfg.model, 0)
  layer_bytes = sum(a[0].nbytes for a in jax.tree.leaves(params["layers"]) if a.ndim == 3)
  hlo, temp = _program(cfg, step.prepare_params(cfg, params))
  assert _weight_copies(hlo, params) == [] and temp < layer_bytes
  assert " conditional(" in hlo  # the switched layer loop
  old_hlo, old_temp = _program(config.replace(cfg, **{"model.layer_loop": "scan"}), params)
  assert len(_weight_copies(old_hlo, params)) >= 7 and old_temp > layer_bytes


# One case per kind of cache tree the layer loop carries: MHA/GQA/MQA, a plain-cast codec
# (bf16), scaled codes (int8; fp8_e4m3 has the same codes + scale leaves), packed codes with
# a different K and V codec (k8v4), the residual window's extra leaves (kivi), the paged pool
# and the none layout. Codec numerics per se are test_golden's and test_codecs'.
PROGRAM_CASES = {
    "mha-fp32": {"model.n_kv_heads": 4},
    "mqa-int8": {"model.n_kv_heads": 1, "cache.codec": "int8"},
    "gqa-k8v4": {"model.n_kv_heads": 2, "cache.k_codec": "int8", "cache.v_codec": "int4"},
    "gqa-kivi-window": {"model.n_kv_heads": 2, "cache.codec": "int4", "cache.k_axis": "channel",
                        "cache.group_size": 4, "cache.residual": 4},
    "mha-paged-bf16": {"model.n_kv_heads": 4, "cache.layout": "paged", "cache.page_size": 8,
                       "cache.codec": "bf16"},
    "gqa-none": {"model.n_kv_heads": 2, "cache.layout": "none"},
}


def _tokens_and_cache(cfg, params, prompts, n):
  """Prefill + decode through the compiled programs with these params as given."""
  tokens, lengths = generate.pad_prompts(prompts)
  sampler, key = decode.Sampler(), jax.random.PRNGKey(0)
  cache = cache_lib.init_cache(cfg, len(prompts), tokens.shape[1] + n)
  tok, _, cache = decode.prefill(params, tokens, lengths, cache, key,
                                 **generate.statics(cfg, sampler))
  rest, cache = decode.decode(params, cache, tok, key, **generate.statics(cfg, sampler, steps=n - 1))
  return np.concatenate([np.asarray(tok)[:, None], np.asarray(rest)], 1), cache


@pytest.mark.parametrize("case", sorted(PROGRAM_CASES))
def test_default_program_equals_previous_program(case):
  """The switched layer loop (split params, the default) gives the nn.scan program's
  (`model.layer_loop=scan`, stacked params) greedy tokens and final cache, for MHA/GQA/MQA
  x codecs x layouts; and the none layout's tokens (the full forward pass over the prefix
  at every step)."""
  cfg = config.load(None, {**NOCOPY, **PROGRAM_CASES[case]})
  params = model.init_params(cfg.model, 1)
  prompts = [[3, 14, 15, 9, 2, 6, 5, 3, 5], [5, 35]]
  new, c_new = _tokens_and_cache(cfg, step.prepare_params(cfg, params), prompts, 10)
  scan = config.replace(cfg, **{"model.layer_loop": "scan"})
  assert step.Static.of(cfg).model.layer_loop == "switch"
  old, c_old = _tokens_and_cache(scan, step.prepare_params(scan, params), prompts, 10)
  np.testing.assert_array_equal(new, old)
  for x, y in zip(jax.tree.leaves(c_new), jax.tree.leaves(c_old), strict=True):
    if jnp.issubdtype(x.dtype, jnp.floating):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    else:  # codes: the decode step's projections (the CPU kernel) and nn.scan's (XLA's dot)
      # sum in another order, so a value at a rounding boundary may land one code apart: at
      # most one in a thousand, or one code in a leaf smaller than that (where the order's
      # rounding flips one code depends on the host's kernel forms)
      d = np.abs(np.asarray(x).astype(np.int64) - np.asarray(y).astype(np.int64))
      assert d.max() <= 1 and np.sum(d > 0) <= max(1, 1e-3 * d.size)
  if cfg.cache.k_codec == cfg.cache.v_codec == "fp32":
    ref, _ = _tokens_and_cache(config.replace(cfg, **{"cache.layout": "none"}), params,
                               prompts, 10)
    np.testing.assert_array_equal(new, ref)


def test_bf16_weights_from_fp32_params_end_to_end():
  """`model.param_dtype: bfloat16` holds for params from any source: `prepare_params` casts
  fp32 ones (an imported checkpoint) once, the switched program reads bf16 weights, and its
  tokens equal the full forward pass over the same bf16 weights (layout none)."""
  cfg = config.load(None, {**NOCOPY, "model.n_kv_heads": 2, "model.param_dtype": "bfloat16"})
  fp32 = model.init_params(config.replace(cfg, **{"model.param_dtype": "float32"}).model, 2)
  prepared = step.prepare_params(cfg, fp32)
  assert {a.dtype for a in jax.tree.leaves(prepared)} == {jnp.dtype(jnp.bfloat16)}
  assert step.prepare_params(cfg, prepared) is prepared
  prompts = [[3, 14, 15, 9, 2, 6], [5, 35]]
  got = generate.generate(cfg, fp32, prompts, 8, timed=False)["tokens"]
  ref_cfg = config.replace(cfg, **{"cache.layout": "none"})
  assert got == generate.generate(ref_cfg, fp32, prompts, 8, timed=False)["tokens"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_bf16_embedding_is_never_widened_whole_in_decode(tied):
  """With bf16 weights the decode loop reads the embedding table (lookup and, tied, the
  lm_head) at its stored bytes: the compiled program holds no float32 copy of the table,
  which XLA would otherwise widen once per call outside the loop and read every step."""
  V = 4096
  cfg = config.load(None, {**NOCOPY, "model.vocab_size": V, "model.param_dtype": "bfloat16",
                           "model.tie_embeddings": tied})
  params = step.prepare_params(cfg, model.init_params(cfg.model, 0))
  hlo, temp = _program(cfg, params)
  table_f32 = V * cfg.model.d_model * 4
  assert temp < table_f32 // 2, (temp, table_f32)
