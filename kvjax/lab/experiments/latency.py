"""latency: time to first token (prefill) and time per output token (decode) per variant.

One cell = one attention variant x codec x layout x batch x prompt length. The prompt
(`workload.prompt_len` random tokens per sequence) is prefilled, then `gen_len - 1`
tokens are decoded in one compiled `lax.scan`; TTFT and TPOT are the medians of
`workload.repeats` timed repeats after a warm-up, each with a fresh cache allocated
outside the timed region (kvjax.lab.timers.DecodeTimer). The cache holds
`prompt_len + gen_len` tokens (`context` in the rows), so TPOT is the decode cost at
that context. Weights are random: speed does not depend on their values.

Paired variants in one cell (`params.interleave`, a mapping name -> config overrides such
as `{cache.policy: window, cache.ratio: 0.5}` or `{cache.codec: int8}`): every variant
is compiled and prefilled once (its `ttft_s` is that one prefill, with the compaction of
`cache.policy`), then the variants' decode steps are timed in turn, round-robin, each
repeat from a copy of its prefilled cache made outside the clock (`StepTimer`), so their
ratios share one run's machine noise. Rows: one per variant, `variant.setting` = its name,
`tpot_vs_ref` = the median over repeats of its TPOT over the reference variant's in the same
repeat (`params.reference`, else the one without overrides), with `tpot_vs_ref_ci95` (a
bootstrap over repeats) and the per-repeat TPOTs (`tpot_s_samples`). A policy's cache holds its budget
plus the decode steps (`cache_bytes`). `bytes_per_token` is what the cache holds per token
of its `context` (`kvjax.footprint`, = cache_bytes / (batch x context); for paired variants the
measured cache over batch x context), `bytes_per_token_asymptotic` the long-context cost.

Every row also carries the decode step's two roofs (`roofline.roofs`: `ideal_s` = its bytes
over the bandwidth, `flops_s` = its FLOPs over the dots' throughput, `bound`, `roof_s`,
`roof_fraction` = roof_s / tpot_s), from one bandwidth and dot probe per cell measured after
its timing (`roofline.machine_rates`, `params.bandwidth_mib` MiB as in `roofline`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import footprint
from kvjax.decode import generate
from kvjax.errors import KvjaxError
from kvjax.lab import experiments as ex
from kvjax.lab import intervals
from kvjax.lab import metrics, timers
from kvjax.lab.experiments import roofline

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"interleave", "reference", "bandwidth_mib"})


capacity = roofline.capacity  # one rule for the cache a timed cell allocates


def check(cfg: config_lib.Config) -> None:
  ex.check_context(cfg, capacity(cfg))
  roofline.check_bandwidth_mib(cfg)
  for c in (ex.interleaved(cfg) or {"": cfg}).values():
    ex.check_memory(c, cfg.workload.batch, capacity(cfg), cfg.workload.prompt_len)


class StepTimer:
  """Decode steps of one config from one prefilled cache. The prompt is prefilled once
  (through `cache.policy`'s compaction; `ttft_s` is that one run), then each `once()`
  decodes `steps` tokens from a copy of that cache, copied before the clock starts (decode
  donates its cache). Same interface as `timers.DecodeTimer` for `bench_interleaved`."""

  def __init__(self, cfg, params, tokens_BT, lengths_B, steps: int, capacity: int):
    self.steps = max(int(steps), 1)
    B, T = tokens_BT.shape
    prog = generate.Compiled(cfg, params, generate.Shape(B, T, capacity, self.steps))
    prog.compile(tokens_BT, lengths_B)  # prefill, and decode lowered on what it returns
    t0 = time.perf_counter()
    tok, _, cache = prog.pre(prog.params, *prog.prompts, prog.fresh(), prog.keys[0])
    jax.block_until_ready((tok, cache))
    self.ttft = time.perf_counter() - t0
    self.dec, self.compile_s = prog.dec, prog.compile_s
    self.prog, self.cache, self.tok = prog, cache, tok
    self.cache_bytes = cache_lib.tree_bytes(cache)
    self.peak_bytes = prog.peak_bytes

  def once(self) -> tuple[float, float]:
    c = jax.block_until_ready(jax.tree.map(jnp.copy, self.cache))
    t0 = time.perf_counter()
    rest, c = self.dec(self.prog.params, c, self.tok, self.prog.keys[1])
    jax.block_until_ready((rest, c))
    return self.ttft, (time.perf_counter() - t0) / self.steps


def _interleaved_cell(cfg: config_lib.Config, cfgs: dict) -> list[dict]:
  w = cfg.workload
  params = ex.random_params(cfg.model, cfg.seed)
  tokens, lengths = ex.prompts(cfg, w.batch, w.prompt_len)
  S = capacity(cfg)
  clocks = {name: StepTimer(c, params, tokens, lengths, steps=max(w.gen_len - 1, 1), capacity=S)
            for name, c in cfgs.items()}
  res = metrics.bench_interleaved(clocks, repeats=w.repeats, samples=True)
  rates = roofline.machine_rates(cfg.param("bandwidth_mib", 512))
  ref = next(iter(res.values()))["tpot_s_samples"]  # `ex.interleaved` puts the reference first
  rows = []
  for name, m in res.items():
    c = cfgs[name].cache
    ratio, ci = intervals.paired_ratio(m["tpot_s_samples"], ref)
    # what the prefilled cache held (a policy's budget plus the decode room), per slot
    m.update({"tokens_per_s": w.batch / m["tpot_s"], "tpot_vs_ref": ratio,
              "tpot_vs_ref_ci95": ci,
              "bytes_per_token": m["cache_bytes"] / (w.batch * S),
              "bytes_per_token_asymptotic": footprint.asymptotic(cfgs[name]),
              **roofline.roofs(cfgs[name], params, w.batch, w.prompt_len, clocks[name].steps,
                               m["tpot_s"], *rates)})
    rows.append({
        "variant": ex.variant(cfgs[name], setting=name, policy=c.policy, budget=c.budget,
                              ratio=c.ratio, window=c.window, sinks=c.sinks),
        "workload": {"batch": w.batch, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                     "context": S, "decode_steps": clocks[name].steps,
                     "timing": "interleaved, decode from one prefilled cache"},
        "metrics": m,
    })
  return rows


def run_cell(cfg: config_lib.Config) -> list[dict]:
  cfgs = ex.interleaved(cfg)
  if cfgs:
    return _interleaved_cell(cfg, cfgs)
  w = cfg.workload
  params = ex.random_params(cfg.model, cfg.seed)
  tokens, lengths = ex.prompts(cfg, w.batch, w.prompt_len)
  S = capacity(cfg)
  timer = timers.DecodeTimer(cfg, params, tokens, lengths, steps=max(w.gen_len - 1, 1),
                              capacity=S)
  m = metrics.bench_interleaved({"cell": timer}, repeats=w.repeats)["cell"]
  m.update({
      "tokens_per_s": w.batch / m["tpot_s"],
      "prefill_tokens_per_s": w.batch * w.prompt_len / m["ttft_s"],
      "closed_form_bytes": footprint.cache_bytes(cfg, w.batch, S),
      **footprint.count(cfg, S, batch=w.batch).fields(),  # held at the context, window in
      **roofline.roofs(cfg, params, w.batch, w.prompt_len, timer.steps, m["tpot_s"],
                       *roofline.machine_rates(cfg.param("bandwidth_mib", 512))),
  })
  return [{
      "variant": ex.variant(cfg),
      "workload": {"batch": w.batch, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                   "context": S, "decode_steps": timer.steps},
      "metrics": m,
  }]


def summary(rows: list[dict]) -> list[dict]:
  """One line per row, with TPOT against a reference at the same batch and context
  (kvjax.lab.figures): interleaved rows' paired `tpot_vs_ref` with its interval, else
  `tpot_over_ref`, a ratio of medians to MHA-bf16 (else the first row) timed apart; `vs_ref`
  says faster, slower or not told apart (interval holding 1, or overlapping IQRs), and
  `regime` whether the step's time is its bytes' or its overhead (roof fraction below 0.1:
  per-step overhead decides, not the cache's bytes)."""
  from kvjax.lab import figures

  def key(r):
    return (r["workload"]["batch"], r["workload"]["context"], r["variant"]["layout"])

  ref = {}
  for r in rows:
    v = r["variant"]
    if v["variant"] == "MHA" and v["codec"] == "bf16":
      ref.setdefault(key(r), r["metrics"])
  for r in rows:
    ref.setdefault(key(r), r["metrics"])
  out = []
  for r in rows:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    out.append({"variant": v["variant"], "codec": ex.cache_name(v), "layout": v["layout"],
                "batch": w["batch"], "context": w["context"],
                "bytes_per_token": m["bytes_per_token"], "cache_bytes": m["cache_bytes"],
                "ttft_s": m["ttft_s"], "tpot_s": m["tpot_s"], "tpot_iqr_s": m["tpot_s_iqr"],
                **figures.ratio_fields(m, None if "tpot_vs_ref" in m else ref[key(r)]),
                "tokens_per_s": m["tokens_per_s"],
                "bound": m.get("bound", ""), **figures.roof_fields(m),
                "regime": regime(m)})
  return out


def regime(m: dict) -> str:
  """What a decode step's time measures: `bytes` when it runs near its roof, `overhead`
  when far below it (a toy shape: launch and per-step costs, not the cache's bytes)."""
  from kvjax.lab import figures
  f = figures.roof_fraction(m)
  if f is None or f > 1.0:
    return "unknown"
  return "overhead" if f < 0.1 else m.get("bound", "bytes") or "bytes"
