"""kvjax/progress.py: a long prompt's prefill ticks once a layer (or a chunk) inside a bar;
a short one's program has no tick; a tick with no bar open does nothing."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib, config, decode, model, progress
from kvjax.decode import step


def _prefill(cfg, params, T):
  cache = cache_lib.init_cache(cfg, 1, T + 1)
  tokens = jnp.asarray(np.arange(T)[None] % 200, jnp.int32)
  out = decode.prefill(params, tokens, jnp.asarray([T], jnp.int32), cache,
                       jax.random.PRNGKey(0), **step.statics(cfg, decode.Sampler()))
  jax.block_until_ready(out)


def test_a_long_prompt_ticks_once_a_layer_and_a_short_one_never(monkeypatch):
  monkeypatch.setattr(progress, "TOKENS", 16)
  cfg = config.load(None, {"model.n_layers": 3, "model.d_model": 32, "model.n_heads": 4,
                           "model.n_kv_heads": 2, "model.head_dim": 8,
                           "model.norm_eps": 1.2345e-6})  # its own programs: none cached
  params = step.prepare_params(cfg, model.init_params(cfg.model, 0))
  with progress.layers(100) as bar:
    _prefill(cfg, params, 20)
    jax.effects_barrier()
    assert bar.n == 3
    _prefill(cfg, params, 8)  # below TOKENS: no callback in its program
    jax.effects_barrier()
    assert bar.n == 3
  _prefill(cfg, params, 20)  # no bar open: the ticks go nowhere
  jax.effects_barrier()


def test_a_chunked_prompt_ticks_as_many_times_as_its_bar_expects(monkeypatch):
  """`workload.prefill_chunk`: chunks at least TOKENS long tick once a layer each, shorter
  chunks of a long prompt once a chunk; `progress.ticks` (the bar's total) counts the same."""
  monkeypatch.setattr(progress, "TOKENS", 16)
  base = {"model.n_layers": 3, "model.d_model": 32, "model.n_heads": 4,
          "model.n_kv_heads": 2, "model.head_dim": 8, "model.norm_eps": 2.3456e-6}
  for chunk, T, want in ((16, 40, (9, "layer")), (8, 40, (5, "chunk")), (8, 12, (0, "chunk"))):
    cfg = config.load(None, {**base, "workload.prefill_chunk": chunk})
    assert progress.ticks(T, chunk, 3) == want
    params = step.prepare_params(cfg, model.init_params(cfg.model, 0))
    with progress.layers(100) as bar:
      _prefill(cfg, params, T)
      jax.effects_barrier()
      assert bar.n == want[0], (chunk, T)
