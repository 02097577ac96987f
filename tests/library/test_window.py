"""Sliding-window layers (`model.sliding_window`, `model.global_every`) and the other Gemma 3
knobs of the one model definition: a windowed layer attends to exactly its last W tokens,
in the full forward pass, in cached decode, and in multi-token calls that continue a cache,
on every layout that records token positions and through every read; what cannot hold a
window is refused on the host in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab import evaluate
from kvjax.model import Transformer

# Every Gemma 3 knob on the tiny model; layer 0 is local (window 3, RoPE base 100), layer 1
# global. query_scale != head_dim, so the query scale is exercised too.
GEMMA_LIKE = {"model.n_kv_heads": 1, "model.qk_norm": True, "model.sandwich_norm": True,
              "model.embed_scale": True, "model.mlp_act": "gelu_tanh", "model.query_scale": 6.0,
              "model.global_every": 2, "model.sliding_window": 3, "model.rope_local_theta": 100.0}
TOKENS = np.array([[3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 23, 8, 4],
                   [2, 7, 1, 8, 28, 18, 28, 4, 5, 9, 0, 45, 2, 35, 3, 6]], np.int32)


def _params(cfg):
  """Random weights with norms away from 1 (unit norms would hide a missing norm)."""
  params = tiny_params(cfg)
  key = iter(jax.random.split(jax.random.PRNGKey(7), 64))
  return jax.tree_util.tree_map_with_path(
      lambda p, a: a * (1 + 0.5 * jax.random.uniform(next(key), a.shape))
      if "norm" in jax.tree_util.keystr(p) else a, params)


def _full(cfg, params, tokens):
  """Log-probabilities of the full forward pass (no cache), [B, T, V]."""
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits, _ = Transformer(cfg.model).apply({"params": params}, jnp.asarray(tokens), pos)
  return jax.nn.log_softmax(logits, axis=-1)


def test_a_window_covers_exactly_the_last_w_tokens():
  """One windowed layer: position p's output equals the model run on tokens p-W+1 .. p alone
  (RoPE sees only position differences), and differs from the unwindowed model's."""
  cfg = tiny_config(**{**GEMMA_LIKE, "model.n_layers": 1, "model.global_every": 0})
  params = _params(cfg)
  W = cfg.model.sliding_window
  got = _full(cfg, params, TOKENS)
  nowin = config_lib.replace(cfg, **{"model.sliding_window": 0})
  full = _full(nowin, params, TOKENS)
  np.testing.assert_allclose(got[:, :W], full[:, :W], atol=1e-5)  # the window holds all of them
  for p in range(W, TOKENS.shape[1]):
    alone = _full(nowin, params, TOKENS[:, p - W + 1:p + 1])[:, -1]
    np.testing.assert_allclose(got[:, p], alone, atol=2e-4)
    assert np.abs(got[:, p] - full[:, p]).max() > 1e-3


def test_a_window_as_long_as_the_text_changes_nothing():
  cfg = tiny_config(**GEMMA_LIKE)
  params = _params(cfg)
  wide = config_lib.replace(cfg, **{"model.sliding_window": TOKENS.shape[1]})
  off = config_lib.replace(cfg, **{"model.sliding_window": 0})
  np.testing.assert_allclose(_full(wide, params, TOKENS), _full(off, params, TOKENS), atol=1e-6)


CASES = {
    "contiguous-native": {},
    "contiguous-grouped": {"model.attention": "grouped"},
    "contiguous-reference": {"model.attention": "reference"},
    "paged": {"cache.layout": "paged", "cache.page_size": 4},
    "paged-accelerator": {"cache.layout": "paged", "cache.page_size": 4,
                          "model.program": "accelerator"},
    # a residual window shorter than the sliding one: the window reaches into the history
    "first-tokens-and-residual": {"cache.keep_first": 1, "cache.residual": 1},
    "accelerator-program": {"model.program": "accelerator"},
}


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_through_the_cache_equals_the_full_forward(case, chunk):
  """Token by token (a decode step: the window folded into the slot mask the kernel reads)
  and three at a time (each query its own window over stored slots) through an fp32 cache."""
  cfg = tiny_config(**{**GEMMA_LIKE, **CASES[case]})
  params = _params(cfg)
  want = _full(cfg, params, TOKENS)
  lp, _ = evaluate.stream_logprobs(cfg, params, TOKENS[:, :15], chunk=chunk)
  np.testing.assert_allclose(lp, want[:, :15], atol=2e-5)


QUANTIZED = {"int8": {"cache.codec": "int8"},
             "kivi-first-tokens": {"cache.codec": "int4", "cache.k_axis": "channel",
                                   "cache.group_size": 2, "cache.residual": 2,
                                   "cache.keep_first": 1}}


@pytest.mark.parametrize("case", sorted(QUANTIZED))
def test_quantized_windowed_decode_reads_as_the_reference(case):
  """The kernel's read (window in the slot mask) against the plain dequantizing read."""
  cfg = tiny_config(**{**GEMMA_LIKE, **QUANTIZED[case]})
  params = _params(cfg)
  ref = config_lib.replace(cfg, **{"model.attention": "reference"})
  a, _ = evaluate.stream_logprobs(cfg, params, TOKENS[:, :12])
  b, _ = evaluate.stream_logprobs(ref, params, TOKENS[:, :12])
  np.testing.assert_allclose(a, b, atol=2e-4)


@pytest.mark.parametrize("over, needle", [
    ({"cache.layout": "latent", "model.latent_rank": 4}, "cache.layout=latent"),
    ({"cache.policy": "window", "cache.budget": 8, "cache.layout": "paged"}, "rings"),
    ({"cache.policy": "window", "cache.budget": 8, "model.global_every": 0},
     "every layer here is windowed"),
    ({"model.attention": "pallas"}, "sliding-window"),
    ({"model.sliding_window": 5000}, "model.max_seq_len"),
    ({"model.mlp_act": "relu"}, "model.mlp_act"),
    ({"model.rope_local_theta": 0.5}, "rope_local_theta"),
])
def test_what_cannot_hold_a_window_is_refused_in_one_line(over, needle):
  with pytest.raises(KvjaxError) as e:
    config_lib.validate(tiny_config(**{**GEMMA_LIKE, **over}))
  assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)


def test_windowed_layers_keep_rings_whose_bytes_stop_at_w():
  """Tree bytes = closed form = full layers x S + windowed layers x W slots; the layers held
  whole (a residual window in the cache) hold every slot."""
  from kvjax import cache as cache_lib
  cfg = tiny_config(**{**GEMMA_LIKE, "model.n_layers": 4, "model.n_kv_heads": 2})
  m = cfg.model
  S, B, W = 40, 2, m.sliding_window
  c = cache_lib.init_cache(cfg, B, S)
  full, local = [i for i in range(4) if not m.is_local(i)], [i for i in range(4) if m.is_local(i)]
  assert (full, local) == ([1, 3], [0, 2])
  per_slot = 2 * m.n_kv_heads * m.D * 4  # K and V, fp32
  want = B * per_slot * (len(full) * S + len(local) * W) + 4 * B
  assert cache_lib.tree_bytes(c) == want == cache_lib.LAYOUTS["contiguous"].closed_form_bytes(c.spec)
  whole = cache_lib.init_cache(config_lib.replace(cfg, **{"model.sliding_window": 0}), B, S)
  assert cache_lib.tree_bytes(whole) == B * per_slot * 4 * S + 4 * B
  # on pages: a pool of the full layers only (every row's pages up front), the same rings
  pc = cache_lib.init_cache(config_lib.replace(cfg, **{"cache.layout": "paged",
                                                       "cache.page_size": 4}), B, S)
  Q = S // 4
  assert jax.tree.leaves(pc.k)[0].shape[0] == len(full)
  assert jax.tree.leaves(pc.k_ring)[0].shape[:2] == (2, B)
  want = B * per_slot * (len(full) * S + len(local) * W) + 4 * B * Q + 4 * B
  assert cache_lib.tree_bytes(pc) == want == cache_lib.LAYOUTS["paged"].closed_form_bytes(pc.spec)


def test_prefill_longer_than_the_window_then_decode_equals_recomputing():
  """A 12-token prompt into rings of 3 (only each row's last 3 positions are stored), then
  greedy decode: the tokens of recomputing the full forward pass each step."""
  from kvjax.decode import generate
  cfg = tiny_config(**{**GEMMA_LIKE, "workload.temperature": 0.0})
  params = _params(cfg)
  prompts = [TOKENS[0, :12].tolist(), TOKENS[1, :7].tolist()]
  got = generate.generate(cfg, params, prompts, 5, timed=False)["tokens"]
  S = 12 + 5  # one buffer, padding at position -1: one compile for every length
  full = jax.jit(lambda tok, pos: Transformer(cfg.model).apply({"params": params}, tok, pos)[0])
  for prompt, out in zip(prompts, got):
    seq = list(prompt)
    for _ in range(5):
      tok = jnp.asarray([seq + [0] * (S - len(seq))], jnp.int32)
      pos = jnp.asarray([list(range(len(seq))) + [-1] * (S - len(seq))], jnp.int32)
      seq.append(int(jnp.argmax(full(tok, pos)[0, len(seq) - 1])))
    assert out == seq[len(prompt):]


@pytest.mark.parametrize("prog", ["cpu", "accelerator"])
def test_an_unrolled_layer_reads_only_its_own_segment_and_decodes_the_same(prog):
  """With the layer index known when tracing (`model.scan_unroll` >= n_layers), a windowed
  layer reads its ring and a full layer the full stack, nothing else: the accelerator
  program reads every segment it is given as one masked block, so a second, empty
  segment there costs a full layer's bytes. The tokens equal the traced-index program's,
  which gives every layer both segments."""
  from kvjax import cache as cache_lib
  from kvjax.decode import generate
  from kvjax.cache import ring
  cfg = tiny_config(**{**GEMMA_LIKE, "model.n_layers": 4, "workload.temperature": 0.0,
                       "model.program": prog})
  params = _params(cfg)
  c = cache_lib.init_cache(cfg, 2, 20)
  rg, store, lengths = ring.layers(c.spec), cache_lib.get("contiguous").store(c), c.lengths
  for layer in range(4):
    (seg,) = ring.read(c.spec, store, lengths, layer, rg)
    assert seg.k is (c.k_ring if cfg.model.is_local(layer) else c.k)
  assert len(ring.read(c.spec, store, lengths, jnp.int32(0), rg)) == 2
  prompts = [TOKENS[0, :9].tolist(), TOKENS[1, :5].tolist()]
  want = generate.generate(cfg, params, prompts, 6, timed=False)["tokens"]
  unrolled = config_lib.replace(cfg, **{"model.scan_unroll": 4})
  assert generate.generate(unrolled, params, prompts, 6, timed=False)["tokens"] == want
  # the paged layout: the same rule, its full layers' segment a page-table read
  paged_cfg = config_lib.replace(cfg, **{"cache.layout": "paged", "cache.page_size": 4})
  pc = cache_lib.init_cache(paged_cfg, 2, 20)
  layout = cache_lib.get("paged")
  for layer in range(4):
    (seg,) = layout.read(pc.spec, layout.store(pc), pc.lengths, layer)
    assert seg.k is (pc.k_ring if cfg.model.is_local(layer) else pc.k)
  assert len(layout.read(pc.spec, layout.store(pc), pc.lengths, jnp.int32(0))) == 2
  for c in (paged_cfg, config_lib.replace(paged_cfg, **{"model.scan_unroll": 4})):
    assert generate.generate(c, params, prompts, 6, timed=False)["tokens"] == want


# A policy on a windowed model evicts on its full-attention layers; each windowed layer keeps
# its ring. W = 3 puts rings in the prefill cache already; W = 30 is at least the prefill
# cache's capacity, which then holds every layer whole, and compaction builds the rings.
@pytest.mark.parametrize("window", [3, 30])
@pytest.mark.parametrize("policy", ["window", "snapkv", "h2o"])
def test_a_policy_keeping_every_token_of_a_windowed_model_decodes_the_same(policy, window):
  """A budget above every sequence's length evicts nothing: the tokens of the same model
  without a policy. The compacted cache holds the 2 full layers at the policy's capacity and
  the 2 windowed layers' rings of W slots, its tree bytes equal to the closed form."""
  from kvjax import cache as cache_lib
  from kvjax.decode import generate
  cfg = tiny_config(**{**GEMMA_LIKE, "model.n_layers": 4, "model.sliding_window": window,
                       "workload.temperature": 0.0})
  params = _params(cfg)
  prompts = [TOKENS[0, :12].tolist(), TOKENS[1, :7].tolist()]
  want = generate.generate(cfg, params, prompts, 6, timed=False)["tokens"]
  pol = config_lib.replace(cfg, **{"cache.policy": policy, "cache.budget": 40})
  got = generate.generate(pol, params, prompts, 6, timed=False, return_cache=True)
  assert got["tokens"] == want
  c = got["cache"]
  assert c.spec.layout == "compacted" and c.k.shape[0] == 2 and c.k_ring.shape[:4] == (
      2, 2, 1, window)
  assert cache_lib.tree_bytes(c) == cache_lib.LAYOUTS["compacted"].closed_form_bytes(c.spec)


def test_a_policy_evicts_on_the_full_layers_and_leaves_the_rings_as_they_were():
  """After a 12-token prompt through a budget of 6 (recency): each full layer holds 6
  tokens, and the rings are exactly those of the same prompt without a policy; decoding
  on reads both (its tokens come out, and differ from no eviction only through what the
  full layers lost)."""
  from kvjax import cache as cache_lib
  from kvjax.decode import evict
  cfg = tiny_config(**{**GEMMA_LIKE, "model.n_layers": 4})
  params = _params(cfg)
  pol = config_lib.replace(cfg, **{"cache.policy": "window", "cache.budget": 6})
  tokens = jnp.asarray(TOKENS[:, :12])
  lengths = jnp.asarray([12, 12], jnp.int32)
  plain = cache_lib.init_cache(cfg, 2, 12)
  from kvjax.decode import step
  filled, q = evict.prefill_queries(step.prepare_params(cfg, params), tokens, lengths, plain,
                                    static=step.Static.of(cfg))
  c = cache_lib.init_cache(pol, 2, 12)
  kept, q2 = evict.prefill_queries(step.prepare_params(pol, params), tokens, lengths, c,
                                   static=step.Static.of(pol))
  small = evict.compress_filled(kept, lengths, q2, room=4, T=12)
  assert small.k.shape[0] == 2 and np.asarray(small.held).tolist() == [6, 6]
  np.testing.assert_array_equal(small.k_ring, filled.k_ring)
  np.testing.assert_array_equal(small.v_ring, filled.v_ring)
  # the kept full-layer slots are the last 6 positions of the full layers' store
  np.testing.assert_array_equal(small.k[:, :, :, :6], filled.k[:, :, :, 6:12])


@pytest.mark.parametrize("prog", ["cpu", "accelerator"])
def test_a_compacted_windowed_cache_reads_the_same_with_the_layer_index_known(prog):
  """The unrolled layer loop (each layer reads only its own store: the compacted full
  layers or its ring) decodes the tokens of the scanned loop (every layer gets both), after
  an eviction that changes what the full layers hold."""
  from kvjax.decode import generate
  cfg = tiny_config(**{**GEMMA_LIKE, "model.n_layers": 4, "workload.temperature": 0.0,
                       "model.program": prog, "cache.policy": "snapkv", "cache.budget": 17,
                       "cache.window": 4})
  params = _params(cfg)
  prompts = [TOKENS[0].tolist() + TOKENS[1, :8].tolist(), TOKENS[1, :10].tolist()]
  want = generate.generate(cfg, params, prompts, 6, timed=False)["tokens"]
  unrolled = config_lib.replace(cfg, **{"model.scan_unroll": 4})
  assert generate.generate(unrolled, params, prompts, 6, timed=False)["tokens"] == want
