"""The accelerator program on the CPU (`model.program: accelerator`): the same greedy tokens
as the CPU program with the same read, a read with only the unpack and a convert between
each cached code and its dot, results within the codecs' tolerances of the dequantized
reference, and decode reading a power-of-two bucket of slots chosen on the host."""

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_params

from kvjax import attention, decode
from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.decode import generate
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.lab import experiments

PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32], [2, 7, 18, 28, 18]]
CODECS = {  # name -> cache overrides: float, symmetric, packed with groups, fp8, KIVI keys
    "bf16": {"cache.codec": "bf16"},
    "int8": {"cache.codec": "int8"},
    "int4-g8": {"cache.codec": "int4", "cache.group_size": 8},
    "int2": {"cache.codec": "int2"},
    "fp8_e4m3": {"cache.codec": "fp8_e4m3"},
    "kivi4": {"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 4,
              "cache.residual": 8},
}


def _cfg(prog: str, **over):
  return tiny_config(**{"model.n_kv_heads": 2, "cache.capacity": 32,
                        "model.attention": "grouped", "model.program": prog, **over})


@pytest.mark.parametrize("over", [{}, CODECS["int8"], CODECS["int4-g8"],
                                  {"cache.layout": "paged", "cache.codec": "int4",
                                   "cache.page_size": 4}],
                         ids=["fp32", "int8", "int4-g8", "paged-int4"])
def test_accelerator_program_tokens_equal_cpu_program(over):
  """Stacked nn.scan, one masked block per segment and the folded read give the greedy
  tokens of the switched scan and the blockwise read, and the rows say which ran."""
  got = {}
  for prog in ("cpu", "accelerator"):
    cfg = _cfg(prog, **over)
    assert step.Static.of(cfg).model.program == prog
    assert experiments.variant(cfg)["program"] == prog
    got[prog] = generate.generate(cfg, tiny_params(cfg), PROMPTS, 6, timed=False)["tokens"]
  assert got["accelerator"] == got["cpu"]


def test_program_auto_resolves_per_backend_and_unknown_is_refused():
  here = "cpu" if jax.default_backend() == "cpu" else "accelerator"  # the GPU stage runs this too
  assert step.Static.of(_cfg("auto")).model.program == here
  assert attention.resolve("auto", "accelerator") == "grouped"
  assert attention.resolve("auto", "cpu") == "native"
  with pytest.raises(KvjaxError, match="model.program 'gpu'.*auto, cpu, accelerator"):
    config_lib.validate(_cfg("gpu"))


# -- the read: codes reach their dot only through unpack + convert ---------------------------
ALLOWED = {"convert_element_type", "bitcast_convert_type", "shift_right_logical", "and",
           "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice",
           "dynamic_slice", "gather", "concatenate", "copy", "copy_p", "get"}


def _walk(jaxpr, tainted: set, reached: list, bad: list):
  """Follow the cache's code leaves forward: every equation they feed before a dot must be
  an unpack, a convert or a layout op; a dot_general they feed is recorded in `reached`."""
  for eqn in jaxpr.eqns:
    hit = [v for v in eqn.invars if not isinstance(v, jcore.Literal) and v in tainted]
    if not hit:
      continue
    name = eqn.primitive.name
    if name == "dot_general":
      reached.append(eqn)
      continue
    if name == "while":  # a loop body reads the codes (refs) as its constants
      body, nc, nb = eqn.params["body_jaxpr"].jaxpr, eqn.params["cond_nconsts"], \
          eqn.params["body_nconsts"]
      _walk(body, {iv for iv, ov in zip(body.invars[:nb], eqn.invars[nc:nc + nb])
                   if ov in hit}, reached, bad)
      continue
    inner = eqn.params.get("jaxpr")
    if inner is not None:  # pjit / closed_call / pallas_call: follow into the sub-program
      inner = getattr(inner, "jaxpr", inner)
      sub = {iv for iv, ov in zip(inner.invars, eqn.invars)
             if not isinstance(ov, jcore.Literal) and ov in tainted}
      n_reached = len(reached)
      _walk(inner, sub, reached, bad)
      out_tainted = {ov for iv, ov in zip(inner.outvars, eqn.outvars)
                     if not isinstance(iv, jcore.Literal) and iv in sub}
      if len(reached) == n_reached or out_tainted:
        tainted.update(out_tainted)
      continue
    if name not in ALLOWED:
      bad.append(name)
      continue
    tainted.update(eqn.outvars)


def _segment_inputs(cfg, S=16, seed=0):
  B, K, D = 2, cfg.model.n_kv_heads, cfg.model.D
  spec = cache_lib.CacheSpec.from_config(cfg, B, S)
  rng = np.random.default_rng(seed)
  k, v = (jnp.asarray(rng.normal(size=(B, K, S, D)) * 2, jnp.float32) for _ in range(2))
  return spec, spec.kc.encode(k), spec.vc.encode(v)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_accelerator_read_has_only_unpack_and_convert_before_each_dot(name):
  """No scale, zero point or offset touches a code between its load and its dot: they fold
  into the query, the logits, the probabilities or the output instead."""
  cfg = _cfg("accelerator", **CODECS[name])
  spec, k_enc, v_enc = _segment_inputs(cfg)
  B, K, D = 2, cfg.model.n_kv_heads, cfg.model.D
  code = "x" if not isinstance(k_enc, dict) else "codes"

  def read(q, kn, vn, pos, k_enc, v_enc):
    mask = jnp.ones((B, 16), bool)
    seg = cache_lib.Segment(k_enc, v_enc, mask, spec.kc, spec.vc, live=jnp.int32(16))
    return attention.ATTENTIONS["grouped"](q, kn, vn, pos, [seg], program="accelerator")

  args = (jnp.zeros((B, 1, cfg.model.n_heads, D)), jnp.zeros((B, 1, K, D)),
          jnp.zeros((B, 1, K, D)), jnp.full((B, 1), 16, jnp.int32), k_enc, v_enc)
  closed = jax.make_jaxpr(read)(*args)
  leaves = jax.tree_util.tree_leaves_with_path((k_enc, v_enc))
  invars = closed.jaxpr.invars[len(jax.tree.leaves(args[:4])):]
  codes = {var for (path, _), var in zip(leaves, invars)
           if code == "x" or jax.tree_util.keystr(path).endswith(f"['{code}']")}
  assert len(codes) == 2  # the K and the V codes
  reached, bad = [], []
  _walk(closed.jaxpr, set(codes), reached, bad)
  assert not bad, f"{name}: codes pass through {sorted(set(bad))} before their dot"
  assert len(reached) >= 2  # K codes into the logits' dot, V codes into the values' dot


@pytest.mark.parametrize("name", ["bf16", "int8", "int4-g16", "fp8_e4m3"])
def test_pallas_kernel_has_only_unpack_and_convert_before_each_dot(monkeypatch, name):
  """The same rule inside the Pallas kernel (its `dot` path: 16 rows, 16-token blocks,
  16-column chunks): each loaded chunk of codes meets the query or the probabilities
  through the unpack and a convert only."""
  from kvjax.attention import pallas as pa
  monkeypatch.setattr(pa, "BLOCK", 16)
  over = {"cache.codec": "int4", "cache.group_size": 16} if name == "int4-g16" else \
      CODECS[name]
  cfg = _cfg("accelerator", **{"model.head_dim": 32, **over})
  spec, k_enc, v_enc = _segment_inputs(cfg, S=32)
  B, K, H = 2, cfg.model.n_kv_heads, cfg.model.n_heads
  code = "x" if not isinstance(k_enc, dict) else "codes"

  def read(q, k_enc, v_enc):
    seg = cache_lib.Segment(k_enc, v_enc, jnp.ones((B, 32), bool), spec.kc, spec.vc,
                            live=jnp.int32(32))
    return pa.segment_state(q, seg)

  q = jnp.zeros((B, K, H // K, 1, 32))
  closed = jax.make_jaxpr(read)(q, k_enc, v_enc)
  leaves = jax.tree_util.tree_leaves_with_path((k_enc, v_enc))
  codes = {var for (path, _), var in zip(leaves, closed.jaxpr.invars[1:])
           if code == "x" or jax.tree_util.keystr(path).endswith(f"['{code}']")}
  reached, bad = [], []
  _walk(closed.jaxpr, set(codes), reached, bad)
  assert not bad, f"{name}: codes pass through {sorted(set(bad))} before their dot"
  assert len(reached) >= 2


@jax.jit
def _both(q, k, v, pos, c):
  """The accelerator program's read and the reference over layer 1's segments of `c`."""
  segs = cache_lib.segments(c, 1)
  return (attention.ATTENTIONS["grouped"](q, k, v, pos, segs, program="accelerator"),
          attention.ATTENTIONS["reference"](q, k, v, pos, segs))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_accelerator_read_equals_reference(name):
  """One decode step and a prompt chunk over a partly filled cache (ragged live lengths),
  within the per-codec bounds the Pallas tests use against the same reference."""
  from test_pallas import TOL
  cfg = _cfg("accelerator", **{"model.head_dim": 8, **CODECS[name]})
  B, S, K, H, D = 2, 16, 2, 4, 8
  rng = np.random.default_rng(1)
  c = cache_lib.init_cache(cfg, B, S)
  for T, lens in ((8, [8, 5]), (4, [4, 1]), (1, [1, 1])):
    pos = np.where(np.arange(T)[None] < np.array(lens)[:, None],
                   np.asarray(c.lengths)[:, None] + np.arange(T)[None], -1)
    k, v = (jnp.asarray(rng.normal(size=(2, B, T, K, D)) * 2, jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, T, H, D)) * 2, jnp.float32)
    pos = jnp.asarray(pos, jnp.int32)
    got, want = _both(q, k[1], v[1], pos, c)
    ok = np.asarray(pos >= 0)[:, :, None, None]
    tol = TOL[name.split("-")[0].replace("kivi4", "int4")]
    np.testing.assert_allclose(np.where(ok, got, 0), np.where(ok, want, 0), atol=tol, rtol=0)
    c = cache_lib.layout_of(c).write(c, k, v, pos)


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_accelerator_prompt_read_by_query_blocks_equals_reference(name):
  """A prompt chunk of more than 128 tokens into a filled cache reads the stored segment
  128 queries at a time (ragged rows, one row's chunk shorter than a block)."""
  from test_pallas import TOL
  cfg = _cfg("accelerator", **{"model.head_dim": 8, **CODECS[name]})
  B, S, K, H, D = 2, 320, 2, 4, 8
  rng = np.random.default_rng(2)
  c = cache_lib.init_cache(cfg, B, S)
  for T, lens in ((100, [100, 60]), (150, [150, 90])):
    pos = np.where(np.arange(T)[None] < np.array(lens)[:, None],
                   np.asarray(c.lengths)[:, None] + np.arange(T)[None], -1)
    k, v = (jnp.asarray(rng.normal(size=(2, B, T, K, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    pos = jnp.asarray(pos, jnp.int32)
    got, want = _both(q, k[1], v[1], pos, c)
    ok = np.asarray(pos >= 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(ok, got, 0), np.where(ok, want, 0), atol=TOL[name],
                               rtol=0)
    c = cache_lib.layout_of(c).write(c, k, v, pos)


# -- bucketed capacity ---------------------------------------------------------------------------
def test_bucket_is_the_smallest_power_of_two_the_call_stays_within():
  acc, cpu = step.Static.of(_cfg("accelerator")), step.Static.of(_cfg("cpu"))
  assert [decode.bucket_for(acc, live, steps, 1024) for live, steps in
          ((5, 3), (5, 4), (1, 1), (100, 28), (100, 29))] == [8, 16, 2, 128, 256]
  assert decode.bucket_for(acc, 500, 100, 512) == 0  # would cover the whole capacity
  assert decode.bucket_for(cpu, 5, 3, 1024) == 0     # the CPU program's loop stops at live


@pytest.mark.parametrize("over", [CODECS["int8"], {"cache.layout": "paged",
                                                   "cache.page_size": 4}], ids=["int8", "paged"])
def test_bucketed_decode_equals_full_read_and_compiles_once_per_bucket(over):
  """Decode in calls of 3 steps, each reading the bucket the host picks, gives the tokens
  of one unbucketed call; a call per bucket compiles, the calls of a seen bucket do not."""
  cfg = _cfg("accelerator", **{"cache.capacity": 64, **over})
  params = step.prepare_params(cfg, tiny_params(cfg))
  tokens, lengths = generate.pad_prompts(PROMPTS)
  kw = generate.statics(cfg, decode.Sampler())
  static, n, steps = kw["static"], 8, 3

  def first():
    cache = cache_lib.init_cache(cfg, len(PROMPTS), 64)
    tok, _, cache = decode.prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), cache,
                                   jax.random.PRNGKey(0), **kw)
    return tok, cache

  tok, cache = first()
  want, _ = decode.decode(params, cache, tok, jax.random.PRNGKey(1), **kw, steps=n * steps)
  tok, cache = first()
  before, got, buckets = decode.TRACES["decode"], [], set()
  for i in range(n):
    live = tokens.shape[1] + i * steps
    b = decode.bucket_for(static, live, steps, 64)
    buckets.add(b)
    out, cache = decode.decode(params, cache, tok, jax.random.PRNGKey(1), **kw, steps=steps,
                               bucket=b)
    got.append(np.asarray(out))
    tok = out[:, -1]
  assert buckets == {16, 32, 0}  # 12 + 3i held: 16 for the first call, 32, then all 64 slots
  assert decode.TRACES["decode"] - before == len(buckets)
  np.testing.assert_array_equal(np.concatenate(got, axis=1), np.asarray(want))
  tok, cache = first()  # a bucket the call outgrows drops the tokens past it: reads are cut
  short, _ = decode.decode(params, cache, tok, jax.random.PRNGKey(1), **kw, steps=n * steps,
                           bucket=8)
  assert not np.array_equal(np.asarray(short), np.asarray(want))


# -- the memory estimate -------------------------------------------------------------------------
def test_prompt_temporaries_formula_and_the_compiled_prefill_fits_it():
  """A prompt's pass reads in blocks of 128 queries (against 512 of its own keys, and in
  the accelerator program against a stored segment's S slots at once): its prefill of 512
  tokens into 1024 slots allocates no more than the estimate (tiles of [128, S] logits,
  not [512, S]; unfused, as XLA:CPU at the suite's optimization level leaves them), and
  the estimate is the documented closed form."""
  from kvjax import footprint
  cfg = _cfg("accelerator", **{"cache.capacity": 1024, "model.max_seq_len": 1024})
  m, B, T, S = cfg.model, 2, 512, 1024
  H, K, D = m.n_heads, m.n_kv_heads, m.D
  acts = B * T * (2 * m.d_model + 4 * H * D + 4 * K * D + 4 * D) + B * T * 3 * m.F
  new_kv = 2 * m.n_layers * B * T * K * D * 4
  tiles = B * H * 128 * 512 + B * H * 128 * S
  widened = 2 * B * K * S * D * 4
  want = 4 * (B * m.vocab_size + acts + 4 * tiles) + widened + new_kv
  assert footprint.temp_bytes(cfg, B, T, S) == want
  cpu = _cfg("cpu", **{"cache.capacity": 1024})
  assert footprint.temp_bytes(cpu, B, T, S) == 4 * (B * m.vocab_size + acts + 4 * (
      B * H * 128 * 512 + B * H * 128 * 512)) + 2 * B * K * 512 * D * 4 + new_kv
  params = step.prepare_params(cfg, tiny_params(cfg))
  tokens = jnp.ones((B, T), jnp.int32)
  lowered = decode.prefill.lower(params, tokens, jnp.full((B,), T, jnp.int32),
                                 cache_lib.init_cache(cfg, B, S), jax.random.PRNGKey(0),
                                 **generate.statics(cfg, decode.Sampler()))
  temp = lowered.compile().memory_analysis().temp_size_in_bytes
  assert 0 < temp <= want
  assert temp < 4 * 2 * B * m.n_heads * T * S  # below two unblocked [T, S] tiles


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4", "fp8_e4m3"])
def test_llama3_8b_roofline_cells_pass_the_host_check_on_an_h200(monkeypatch, codec):
  """configs/accel/roofline_llama3_8b.yaml at batch 16 x 32k (the bf16 cache 64 GiB) and
  8 x 8k fit what an H200 leaves JAX (0.92 of 139 GiB): weights, one donated cache, a
  decode step's temporaries. Counted as a prompt pass with two caches they would not."""
  from kvjax import memory
  from kvjax.lab.experiments import roofline
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", f"{int(0.92 * 139 * 2**30)}")
  for batch, prompt in ((16, 32760), (8, 8184)):
    cfg = config_lib.load("configs/accel/roofline_llama3_8b.yaml", {
        "cache.codec": codec, "workload.batch": batch, "workload.prompt_len": prompt,
        "model.program": "accelerator"})
    roofline.check(cfg)
  if codec == "bf16":
    with pytest.raises(KvjaxError, match="not enough memory"):
      memory.check(cfg, 16, 32768, 32760, params=True)


def test_device_plan_dry_run_checks_every_stage_on_the_host(monkeypatch, capsys):
  """scripts/device_check.sh --dry-run: every stage's config loads, expands and passes its
  host checks at an H200's memory; a cell that cannot fit is refused in its stage's line."""
  from pathlib import Path
  scripts = str(Path(__file__).resolve().parents[2] / "scripts")
  monkeypatch.syspath_prepend(scripts)
  import device_plan
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", str(device_plan.H200_LIMIT))
  plan = device_plan.stages()
  names = [s["name"] for s in plan]
  assert names[:4] == ["roofline-8b", "model-smollm2", "model-qwen", "model-gemma3"]
  assert len(set(names)) == len(names) and sum(s["seconds"] for s in plan) <= 900
  assert device_plan.dry_run(plan) == 0
  out = capsys.readouterr().out
  assert out.count(" ok") == len(plan) and "REFUSED" not in out
  long = plan[names.index("roofline-8b-long")]
  too_big = [{**long, "set": {**long["set"], "grid.workload.batch": [64]}}]
  assert device_plan.dry_run(too_big) == 2
  assert "REFUSED" in capsys.readouterr().out
