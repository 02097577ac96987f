"""The `paged` layout: identical outputs to `contiguous`, exact bytes, one-line refusals."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params

from kvjax import attention, cli, codecs, decode
from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.cache import paged
from kvjax.decode import generate
from kvjax.decode import step
from kvjax.errors import KvjaxError

B, S, H, D = 3, 13, 4, 8  # capacity 13: no page size below 13 divides it except 1


def _writes(K, seed=0):
  """A ragged prefill chunk (lengths 5, 2, 4) then three one-token steps: K/V and positions."""
  rng = np.random.default_rng(seed)
  lengths = np.array([5, 2, 4])
  out = []
  pos = np.where(np.arange(5)[None] < lengths[:, None], np.arange(5)[None], -1)
  for positions in [pos] + [lengths[:, None] + i for i in range(3)]:
    T = positions.shape[1]
    kv = [jnp.asarray(rng.normal(size=(2, B, T, K, D)) * 3, jnp.float32) for _ in range(2)]
    out.append((*kv, jnp.asarray(positions, jnp.int32)))
  return out


def _attend(cache, q_BTHD, k_BTKD, v_BTKD, positions_BT, layer):
  segs = cache_lib.segments(cache, layer)
  return attention.grouped(q_BTHD, k_BTKD, v_BTKD, positions_BT, segs)


CASES = [("fp32", 1, 4), ("bf16", 5, 2), ("int8", 3, 1), ("int4", 7, 2), ("int2", 13, 4),
         ("fp8_e4m3", 64, 1)]


@pytest.mark.parametrize("codec, page, K", CASES, ids=lambda x: str(x))
def test_paged_attention_equals_contiguous(codec, page, K):
  """Write the same ragged tokens through both layouts; every read agrees to float32
  rounding (the paged read gathers pages where the contiguous one slices, so XLA may fuse
  the scale multiply differently) and the lengths exactly. The paged block table is a
  random permutation: physical page order must not matter."""
  cfg = tiny_config(**{"model.n_kv_heads": K, "cache.codec": codec, "model.head_dim": D,
                       "cache.page_size": page})
  rng = np.random.default_rng(1)
  writes = _writes(K)
  qs = [jnp.asarray(rng.normal(size=(B, pos.shape[1], H, D)), jnp.float32) for *_, pos in writes]
  N = -(-S // page)
  table_BN = jnp.asarray(rng.permutation(B * N).reshape(B, N), jnp.int32)

  @jax.jit
  def run(writes, qs):  # one program per case: eager ops would compile one by one
    out = {}
    for lay in ("contiguous", "paged"):
      c = cache_lib.init_cache(config_lib.replace(cfg, **{"cache.layout": lay}), B, S)
      if lay == "paged":
        c = c.replace(block_table=table_BN)
      out[lay] = []
      for (k_LBTKD, v_LBTKD, positions_BT), q in zip(writes, qs):
        out[lay].append(_attend(c, q, k_LBTKD[1], v_LBTKD[1], positions_BT, 1))
        c = cache_lib.layout_of(c).write(c, k_LBTKD, v_LBTKD, positions_BT)
      out[lay].append(c.lengths)
    return out

  out = run(writes, qs)
  for a, b in zip(out["contiguous"], out["paged"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnames="cfg")
def _model_logits(params, tokens_BT, lengths_B, *, cfg):
  """Prefill logits of every prompt position, then one decode step's logits."""
  static = step.Static.of(cfg)
  cache = cache_lib.init_cache(cfg, tokens_BT.shape[0], 16)
  t = jnp.arange(tokens_BT.shape[1])[None]
  positions = jnp.where(t < lengths_B[:, None], t, -1)
  pre = step.run(static, params, tokens_BT, positions, cache)
  pre_BTV, cache = pre.logits, pre.cache
  nxt_B1 = jnp.argmax(pre_BTV[jnp.arange(tokens_BT.shape[0]), lengths_B - 1], -1)[:, None]
  step_B1V = step.run(static, params, nxt_B1, lengths_B[:, None], cache).logits
  return jnp.where(positions[..., None] >= 0, pre_BTV, 0), step_B1V


@pytest.mark.parametrize("kv_heads, codec, page", [(2, "int8", 1), (1, "int4", 64)])
def test_model_logits_paged_equal_contiguous(kv_heads, codec, page):
  """The whole model on ragged prompts: prefill and decode logits agree to float32 rounding
  (the paged read gathers pages where the contiguous one slices, and XLA fuses the two
  programs differently, so bits may differ in the last place)."""
  cfg = tiny_config(**{"model.n_kv_heads": kv_heads, "cache.codec": codec,
                       "cache.page_size": page})
  tokens, lengths = generate.pad_prompts([[3, 14, 15, 9, 2, 6, 5], [5, 35], [8, 9, 7, 9]])
  got = [_model_logits(tiny_params(cfg), tokens, lengths,
                       cfg=config_lib.replace(cfg, **{"cache.layout": lay}))
         for lay in ("contiguous", "paged")]
  for a, b in zip(*got):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codec, K", [("fp32", 2), ("int8", 1), ("int4", 2), ("bf16", 4)])
def test_paged_blockwise_read_equals_reference_across_page_and_block_edges(codec, K, monkeypatch):
  """Pages of 3 tokens read in blocks of 6 (READ_CHUNK 8 rounded down to whole pages), from
  stacked pools through a permuted block table: live lengths on and across page and block
  edges, including a row with nothing cached, equal one softmax over every dequantized slot."""
  monkeypatch.setattr(codecs, "READ_CHUNK", 8)
  rng = np.random.default_rng(K)
  L, layer, ps, N = 2, 1, 3, 6  # 18 slots per sequence
  kc = vc = codecs.for_role(codec)
  P = B * N + 2  # two spare pages that no sequence uses
  table_BN = jnp.asarray(rng.permutation(P)[:B * N].reshape(B, N), jnp.int32)
  kv_LBKSD = [jnp.asarray(rng.normal(size=(L, B, K, N * ps, D)), jnp.float32) for _ in range(2)]

  def pool(codec_, x_LBKSD):  # logical token s of row b -> page table[b, s // ps], slot s % ps
    enc = codec_.encode(x_LBKSD.reshape(L, B, K, N, ps, D).transpose(0, 1, 3, 2, 4, 5))
    empty = codec_.init((L, P, K, ps, D))
    return jax.tree.map(lambda e, a: e.at[:, table_BN.reshape(-1)].set(
        a.reshape(L, B * N, *a.shape[3:])), empty, enc)

  k_pool, v_pool = pool(kc, kv_LBKSD[0]), pool(vc, kv_LBKSD[1])

  def paged_seg(n):
    return cache_lib.PagedSegment(k_pool, v_pool, jnp.arange(N * ps)[None] < n[:, None], kc,
                                  vc, live=jnp.max(n), layer=layer, pages=table_BN, page_size=ps)

  # Three jitted programs (the references too: eagerly, every op would compile on its own):
  # the blockwise paged read, the reference over the same pages, and the reference over the
  # unpaged tokens.
  got_fn = jax.jit(lambda q, kn, vn, n: attention.grouped(q, kn, vn, n[:, None], [paged_seg(n)]))
  want_fn = jax.jit(lambda q, kn, vn, n: attention.reference(q, kn, vn, n[:, None],
                                                             [paged_seg(n)]))
  plain_fn = jax.jit(lambda q, kn, vn, n: attention.reference(q, kn, vn, n[:, None], [
      cache_lib.Segment(kc.encode(kv_LBKSD[0][layer]), vc.encode(kv_LBKSD[1][layer]),
                        jnp.arange(N * ps)[None] < n[:, None], kc, vc)]))
  for lengths in ([0, 5, 6], [7, 12, 18], [13, 1, 17]):
    lengths_B = jnp.asarray(lengths, jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, 1, H, D)), jnp.float32) * 3
    kn, vn = (jnp.asarray(rng.normal(size=(B, 1, K, D)), jnp.float32) for _ in range(2))
    got, want = got_fn(q, kn, vn, lengths_B), want_fn(q, kn, vn, lengths_B)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # The reference reads the same pages, so also check against the unpaged tokens.
    np.testing.assert_allclose(want, plain_fn(q, kn, vn, lengths_B), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_cache_bytes_equal_closed_form(codec):
  cfg = tiny_config(**{"cache.layout": "paged", "cache.page_size": 5, "cache.codec": codec,
                       "cache.num_pages": 11, "model.n_kv_heads": 2})
  spec = cache_lib.CacheSpec.from_config(cfg, 2, 13)
  pool = paged.init_pool(spec)
  assert cache_lib.tree_bytes(pool) == cache_lib.LAYOUTS["paged"].closed_form_bytes(spec)
  L, K, Dm = cfg.model.n_layers, 2, cfg.model.D
  if codec == "fp32":  # 2 (K, V) x layers x pages x page x heads x dim x 4 bytes + tables
    assert cache_lib.tree_bytes(pool) == 2 * L * 11 * 5 * K * Dm * 4 + 4 * 2 * 3 + 4 * 2


@pytest.mark.parametrize("overrides, words", [
    ({"cache.residual": 8}, "cache.residual"),
    ({"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 4,
      "cache.residual": 8}, "cache.residual"),
    ({"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 4}, "k_axis"),
])
def test_unsupported_paged_options_are_one_line_errors(overrides, words):
  with pytest.raises(KvjaxError, match=words) as err:
    tiny_config(**{"cache.layout": "paged", **overrides})
  assert "\n" not in str(err.value)


def test_pool_too_small_for_up_front_allocation_is_an_error():
  cfg = tiny_config(**{"cache.layout": "paged", "cache.page_size": 4, "cache.num_pages": 5})
  with pytest.raises(KvjaxError, match="num_pages=5 is smaller than the 8 pages"):
    cache_lib.init_cache(cfg, 2, 16)


def test_cli_generate_paged_gives_the_contiguous_tokens(capsys):
  """`kvjax generate --set cache.layout=paged` (page size 3, ragged prompts) == contiguous."""
  prompts = [[1, 2, 3, 4, 5, 9, 9], [7, 8]]
  args = ["generate", "--max-new-tokens", "6", "--json", "--set", "cache.layout=paged",
          "--set", "cache.page_size=3"]
  args += [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
  args += [a for k, v in {"model.vocab_size": 64, "model.d_model": 32, "model.d_ff": 48}.items()
           for a in ("--set", f"{k}={v}")]
  assert cli.main(args) == 0
  out = json.loads(capsys.readouterr().out)
  cfg = tiny_config()  # the same model the CLI built: defaults + the three overrides
  ref = generate.generate(cfg, tiny_params(cfg), prompts, 6, timed=False)["tokens"]
  assert out["layout"] == "paged" and out["tokens"] == ref
