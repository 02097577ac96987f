"""One step through the cache: every program that calls the model against a cache traces
`kvjax.decode.step.run` (prefill, decode, recompute, streamed evaluation, a policy's prefill and
continuation, task prefixes and answers, the serving step, the latency timer), with the
arguments its reading needs, and the position rule is the one in `step.positions`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax import config
from kvjax.errors import KvjaxError
from kvjax.decode import evict, generate, step
from kvjax.lab import evaluate, tasks
from kvjax.lab.experiments import latency
from kvjax.lab.serve import engine


@pytest.fixture
def runs(monkeypatch):
  """The keyword arguments of every `step.run` traced from here on (caches cleared, so each
  program traces again)."""
  seen, real = [], step.run

  def spy(*args, **kw):
    seen.append({"layout": args[4].spec.layout, **kw})
    return real(*args, **kw)

  jax.clear_caches()
  monkeypatch.setattr(step, "run", spy)
  return seen


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


@pytest.mark.parametrize("layout", ["contiguous", "paged", "none"])
def test_generate_prefills_and_decodes_through_the_step(runs, layout):
  cfg = tiny_config(**{"cache.layout": layout})
  generate.generate(cfg, tiny_params(cfg), PROMPTS, 3, timed=False)
  assert [r.get("logits", "all") for r in runs] == ["last", "all"]  # prefill, then decode
  assert {r["layout"] for r in runs} == {layout}


def test_a_policy_prefill_asks_the_step_for_its_queries(runs):
  cfg = tiny_config(**{"cache.policy": "snapkv", "cache.budget": 4, "cache.window": 2})
  generate.generate(cfg, tiny_params(cfg), PROMPTS, 3, timed=False)
  assert runs[0]["queries"] is True and runs[0]["logits"] == "last"
  knorm = tiny_config(**{"cache.policy": "knorm", "cache.budget": 4})
  runs.clear()
  evict.continuation_logprobs(knorm, tiny_params(knorm), np.array([PROMPTS[0]]),
                              np.array([[9, 10, 11]]))
  assert runs[0]["queries"] is False and len(runs) == 2  # the prompt, then one scanned step


def test_evaluation_tasks_serving_and_timers_use_the_step(runs):
  cfg = tiny_config()
  params = tiny_params(cfg)
  evaluate.stream_logprobs(cfg, params, np.arange(1, 17, dtype=np.int32)[None], chunk=4)
  assert len(runs) == 1 and "logits" not in runs[0]  # every chunk's T logits
  runs.clear()
  c = tasks.prefill(cfg, params, [1, 2, 3, 4, 5, 6], capacity=16, chunk=4)
  tasks.answer_through_cache(cfg, params, c, [7, 8], steps=3)
  assert [r["logits"] for r in runs[:2]] == ["last", "last"] and len(runs) == 3
  runs.clear()
  e = engine.Engine(cfg, params, slots=2, max_len=16, chunk=4)
  e.run([engine.Request([1, 2, 3], 3)])
  assert runs and all(not isinstance(r["logits"], str) for r in runs)  # each row's last token
  runs.clear()
  toks, lens = np.array(PROMPTS[:1], np.int32), np.array([5], np.int32)
  latency.StepTimer(cfg, params, toks, lens, steps=2, capacity=12).once()
  assert [r.get("logits", "all") for r in runs] == ["last", "all"]


def test_positions_continue_the_cache_and_pad_with_minus_one():
  got = step.positions(jnp.array([0, 3]), jnp.array([2, 4]), 4)
  np.testing.assert_array_equal(np.asarray(got), [[0, 1, -1, -1], [3, 4, 5, 6]])


def test_the_step_returns_the_queries_the_layout_would_be_given():
  """`queries=True` returns the new tokens' rotated queries, [L, B, T, H, D], the same for
  every layer loop, and asking for them changes neither the logits nor the cache."""
  cfg = tiny_config(**{"cache.rotate": "hadamard"})
  from kvjax import cache as cache_lib
  params = tiny_params(cfg)
  toks = jnp.array([[1, 2, 3, 4]], jnp.int32)
  pos = step.positions(jnp.array([0]), jnp.array([4]), 4)
  static = step.Static.of(cfg)
  plain = step.run(static, params, toks, pos, cache_lib.init_cache(cfg, 1, 8))
  loops = [config.replace(cfg, **{"model.layer_loop": loop})
           for loop in ("scan", "switch", "unrolled")]
  outs = [step.run(step.Static.of(c), step.prepare_params(c, params), toks, pos,
                   cache_lib.init_cache(cfg, 1, 8), queries=True) for c in loops]
  m = cfg.model
  assert plain.queries is None and outs[0].queries.shape == (m.n_layers, 1, 4, m.n_heads, m.D)
  for out in outs[1:]:
    np.testing.assert_allclose(out.queries, outs[0].queries, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(outs[0].logits, plain.logits, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(outs[0].cache.lengths, plain.cache.lengths)


def test_the_layer_loop_is_decided_once_from_the_config():
  """`step.layer_loop` is the one decision: the switched scan in the CPU program, nn.scan in
  the accelerator program (the switched scan again for pallas), a Python loop when
  `model.scan_unroll` covers every layer, and `model.layer_loop` when set; `Static.of`
  carries the resolved loop, and params split for one loop are refused by nn.scan."""
  cfg = tiny_config()
  loop = lambda **o: step.layer_loop(config.replace(cfg, **o).model)  # noqa: E731
  assert loop(**{"model.program": "cpu"}) == "switch"
  assert loop(**{"model.program": "accelerator"}) == "scan"
  assert loop(**{"model.program": "accelerator", "model.attention": "pallas"}) == "switch"
  assert loop(**{"model.scan_unroll": cfg.model.n_layers}) == "unrolled"
  assert loop(**{"model.program": "accelerator", "model.layer_loop": "unrolled"}) == "unrolled"
  assert step.Static.of(cfg).model.layer_loop == "switch"
  scan = config.replace(cfg, **{"model.layer_loop": "scan"})
  split = step.prepare_params(cfg, tiny_params(cfg))
  toks = jnp.array([[1, 2]], jnp.int32)
  from kvjax import cache as cache_lib
  with pytest.raises(KvjaxError, match="split per layer .* model.layer_loop=scan"):
    step.run(step.Static.of(scan), split, toks, step.positions(jnp.array([0]), jnp.array([2]), 2),
             cache_lib.init_cache(cfg, 1, 4))
  with pytest.raises(KvjaxError, match="unknown model.layer_loop 'loop'; use one of auto, scan"):
    config.replace(cfg, **{"model.layer_loop": "loop"})
