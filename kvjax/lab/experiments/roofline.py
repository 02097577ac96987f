"""roofline: how close decode runs to the memory-bandwidth limit, per variant and codec.

Decode is memory-bound: a step cannot be faster than the bytes it must read (every
weight matrix once, plus what each sequence's cache holds at its live length: K/V with the
codec's scales, a residual window and lengths, `kvjax.footprint`) divided by
the memory bandwidth. This experiment times `workload.gen_len - 1` compiled decode steps
from a cache already holding `workload.prompt_len` tokens per sequence, `workload.repeats`
times, and right before each repeat measures the bandwidth (a large streaming reduction,
`params.bandwidth_mib` MiB, median of 3 passes; and a streaming copy of the same array,
`copy_Bps`, with `copy_fraction` = achieved / copy bandwidth). It reports

  roofline_fraction = median over repeats of (step_bytes / bandwidth_i) / tpot_i

with `tpot_s`, the byte counts and the achieved bandwidth. It also reports the second
roof, the step's arithmetic: `step_flops` (2 per multiply-add of every weight matrix per
sequence, the tied lm_head included, plus the attention's two products over the live
tokens) divided by the throughput of the dot that arithmetic runs on, measured in the same
process (`DotProbe`: a square float32, bf16 and int8 matmul; the weights' products use
`model.param_dtype`'s, the attention's float32 for the CPU read kernel, the compute dtype
for the accelerator program's XLA read, else its codec's dot type). `bound` says which roof is higher (`bytes` or `flops`), `roof_s` is that roof
and `roof_fraction` = roof_s / tpot. The cache is filled by setting
its lengths (contents are zeros: decode speed does not depend on values), so no prefill
is timed and a cell at 8k context costs seconds, not minutes. The embedding table is not
counted (a step gathers B rows of it) unless it is tied to the lm_head.

Paired variants (`params.interleave` and `params.reference`, as in `latency`): each repeat
probes bandwidth and dots once, then times every variant in turn (order rotated per
repeat); `tpot_vs_ref` is the median of per-repeat ratios to the reference, with
`tpot_vs_ref_ci95` (a bootstrap over repeats), one row per variant (`variant.setting`).
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import config as config_lib
from kvjax import footprint
from kvjax.decode import generate, step
from kvjax.errors import KvjaxError
from kvjax.lab import experiments as ex
from kvjax.lab import intervals, metrics

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"bandwidth_mib", "interleave", "reference"})


def capacity(cfg: config_lib.Config) -> int:
  w = cfg.workload
  return cfg.cache.capacity or w.prompt_len + max(w.gen_len, 2)


def check(cfg: config_lib.Config) -> None:
  ex.check_context(cfg, capacity(cfg))
  # No prompt runs (the cache is filled by length); each run allocates one fresh cache and
  # donates it to decode, and interleaved variants run one at a time: one cache alive.
  for name, c in (ex.interleaved(cfg) or {"": cfg}).items():
    if c.workload.prompt_len > cfg.workload.prompt_len:
      raise KvjaxError(f"params.interleave.{name} holds workload.prompt_len="
                       f"{c.workload.prompt_len} tokens, more than the cell's "
                       f"{cfg.workload.prompt_len}; a variant may hold fewer (what a policy "
                       "leaves), never more")
    ex.check_memory(c, cfg.workload.batch, capacity(cfg), 1, caches=1)
  check_bandwidth_mib(cfg)


def check_bandwidth_mib(cfg: config_lib.Config) -> None:
  mib = cfg.param("bandwidth_mib", 512)
  if not isinstance(mib, int) or isinstance(mib, bool) or mib < 1:
    raise KvjaxError(f"params.bandwidth_mib must be a whole number of MiB >= 1, got {mib!r}; "
                     "512 suits a CPU, 4096 a GPU")


class Bandwidth:
  """Bytes/s of a compiled sum over a `mib` MiB float32 array (read once per pass)."""

  def __init__(self, mib: int):
    n = mib * 2 ** 20 // 4
    self.nbytes = n * 4
    self._x = jax.block_until_ready(jnp.ones((n,), jnp.float32))
    self._sum = jax.jit(jnp.sum).lower(self._x).compile()
    self._copy = jax.jit(lambda x: x + 1.0).lower(self._x).compile()
    jax.block_until_ready((self._sum(self._x), self._copy(self._x)))  # warm-up

  def measure(self, passes: int = 3) -> float:
    """Median over `passes` timed passes."""
    return self.nbytes / metrics.time_call(lambda: self._sum(self._x), repeats=passes,
                                           warmup=0)["median"]

  def measure_copy(self, passes: int = 3) -> float:
    """Bytes/s of a streaming copy (read the array, write a new one: 2 x its bytes a pass),
    the device's copy bandwidth when `mib` is large enough not to be launch-bound."""
    return 2 * self.nbytes / metrics.time_call(lambda: self._copy(self._x), repeats=passes,
                                               warmup=0)["median"]


class DotProbe:
  """Multiply-adds per second XLA gives a square `n` x `n` matmul, per operand type
  (float32, bfloat16 accumulated in float32, int8 accumulated in int32): what the step's
  arithmetic could run at when nothing else limits it."""

  TYPES = {"f32": (jnp.float32, jnp.float32), "bf16": (jnp.bfloat16, jnp.float32),
           "s8": (jnp.int8, jnp.int32)}

  def __init__(self, n: int | None = None):
    """`n` defaults to 512 on the CPU and 8192 elsewhere: an accelerator finishes a 512
    product in about its launch time, so a small probe measures the launch, not the dots."""
    n = n or (512 if jax.default_backend() == "cpu" else 8192)
    self.n, self._calls = n, {}
    for name, (dt, acc) in self.TYPES.items():
      a = jnp.ones((n, n), dt)
      f = jax.jit(lambda x, y, acc=acc: jax.lax.dot(x, y, preferred_element_type=acc))
      comp = f.lower(a, a).compile()
      jax.block_until_ready(comp(a, a))
      self._calls[name] = (comp, a)

  def measure(self, passes: int = 3) -> dict:
    """FLOP/s (2 per multiply-add) per operand type, median over `passes`."""
    return {name: 2 * self.n ** 3 / metrics.time_call(lambda c=comp, a=a: c(a, a), repeats=passes,
                                                      warmup=0)["median"]
            for name, (comp, a) in self._calls.items()}


def step_flops(cfg: config_lib.Config, params, batch: int, held_from: int, steps: int) -> dict:
  """FLOPs (2 per multiply-add) of one decode step, averaged over the `steps` timed steps:
  every weight matrix once per sequence (the lm_head too: the embedding table when tied),
  and the attention's logits and values over each sequence's live tokens (a windowed
  layer's last W)."""
  m = cfg.model
  not_multiplied = ("latent_up", "rope_keep")  # read by the cache (`latent_flops`), or a mask
  mats = sum(a.size for path, a in jax.tree_util.tree_flatten_with_path(params)[0]
             if a.ndim >= 2 and not any(getattr(k, "key", None) in not_multiplied for k in path))
  if not m.tie_embeddings:  # the table is gathered, not multiplied; the lm_head is its own
    mats -= params["embed_tokens"]["embedding"].size
  live = held_from + (steps + 1) / 2
  read = sum(min(live, m.window_of(i)) if m.window_of(i) else live for i in range(m.n_layers))
  attn = 2 * 2 * m.n_heads * m.D * read  # a sliding-window layer reads at most its window
  if cfg.cache.layout == "latent":
    attn = latent_flops(m, read)
  return {"weight_flops": 2 * batch * mats, "attention_flops": batch * attn}


def latent_flops(m, read: float) -> float:
  """A latent cache's attention FLOPs for one sequence over `read` held tokens (summed over
  layers). Without rope pairs every held token is up-projected to K and V (A·Y multiply-adds)
  before the dense read's two products; with them (`kvjax.cache.latent.AbsorbedSegment`)
  each query head's two products run over the W-wide rows, plus the queries' and outputs'
  own projections in and out of latent space, once per layer."""
  from kvjax.cache import latent
  A, H, D, r = m.latent_rank, m.n_heads, m.D, m.rope_pairs
  if not r:
    return 2 * A * latent.width(m) * read + 2 * 2 * H * D * read
  return 2 * 2 * H * latent.row_width(m) * read + m.n_layers * 2 * H * ((D - 2 * r) * A + A * D)


def attention_dot(cfg: config_lib.Config) -> str:
  """The operand type of the attention's arithmetic: float32 in the CPU read kernel (and the
  CPU program's XLA read, which widens codes first); the compute dtype in the accelerator
  program's XLA read (`attention/folded.py`: codes converted straight into the dots);
  bf16 or int8 in the stored-type dots."""
  from kvjax import attention, kernels
  from kvjax.decode import step  # noqa: PLC0415
  prog = step.resolved(cfg.model).program
  variant = attention.resolve(cfg.model.attention, prog)
  if variant == "grouped" and prog == "accelerator":
    return "bf16" if cfg.model.dtype == "bfloat16" else "f32"
  if variant != "native" or kernels.available():
    return "f32"
  return "s8" if cfg.cache.k_codec in ("int8", "int4", "int2") else \
      "bf16" if cfg.cache.k_codec in ("bf16", "fp8_e4m3", "fp8_e5m2") else "f32"


def step_bytes(cfg: config_lib.Config, params, batch: int, held_from: int, steps: int) -> dict:
  """Bytes one decode step must read, averaged over `steps` steps whose caches hold
  `held_from + 1` ... `held_from + steps` tokens: weights at `model.param_dtype` (embedding
  only if tied) + the live cache (`kvjax.footprint`: K/V codes, scales, a residual window,
  lengths), not the capacity."""
  size = jnp.dtype(cfg.model.param_dtype).itemsize
  weights = size * sum(a.size for a in jax.tree.leaves(params))
  if not cfg.model.tie_embeddings:
    weights -= size * params["embed_tokens"]["embedding"].size
  live = config_lib.replace(cfg, **{"cache.capacity": 0})
  kv = batch * sum(footprint.count(live, held_from + i).bytes for i in range(1, steps + 1)) / steps
  return {"weight_bytes": weights, "kv_bytes": kv, "step_bytes": weights + kv}


def roofs(cfg: config_lib.Config, params, batch: int, held_from: int, steps: int,
          tpot_s: float, bandwidth_Bps: float, dot_Fps: dict) -> dict:
  """Both roofs of a decode step that took `tpot_s` (`steps` steps from `held_from` held
  tokens), from the measured bandwidth and dot throughputs (`DotProbe.measure`): the
  step's bytes and FLOPs, `ideal_s` (bytes / bandwidth), `flops_s` (each product's FLOPs
  / its dot's throughput), `bound` (the higher roof: `bytes` or `flops`), `roof_s` and
  `roof_fraction` (roof_s / tpot_s)."""
  m = {**step_bytes(cfg, params, batch, held_from, steps),
       **step_flops(cfg, params, batch, held_from, steps)}
  # the weights' products run in the compute dtype (bf16 weights under float32 activations
  # are widened, by the CPU kernel in registers or by XLA into a copy)
  wdot = "bf16" if cfg.model.dtype == "bfloat16" else "f32"
  adot = attention_dot(cfg)
  ideal = m["step_bytes"] / bandwidth_Bps
  flops_s = m["weight_flops"] / dot_Fps[wdot] + m["attention_flops"] / dot_Fps[adot]
  roof = max(ideal, flops_s)
  return {**m, "bandwidth_Bps": bandwidth_Bps, "ideal_s": ideal, "dot_Fps": dot_Fps,
          "weight_dot": wdot, "attention_dot": adot, "flops_s": flops_s,
          "bound": "bytes" if ideal >= flops_s else "flops", "roof_s": roof,
          "roof_fraction": roof / tpot_s}


def machine_rates(mib: int = 512) -> tuple[float, dict]:
  """One bandwidth (B/s) and one dot-throughput (FLOP/s per operand type) measurement,
  for rows that time no pairs of them (`latency`)."""
  return Bandwidth(mib).measure(), DotProbe().measure()


class FilledDecode:
  """Compiled decode of `steps` tokens from a cache that already holds `context` tokens
  (a `kvjax.decode.generate.Compiled` of prompt width 0)."""

  def __init__(self, cfg, params, batch: int, context: int, steps: int, cap: int):
    self.steps = steps
    shape = generate.Shape(batch, 0, cap, steps, context=context)
    self.compiled = generate.Compiled(cfg, params, shape).compile()

  def once(self) -> float:
    return self.compiled.run().decode_s / self.steps


def _workload(cfg: config_lib.Config, steps: int, **extra) -> dict:
  return {"batch": cfg.workload.batch, "prompt_len": cfg.workload.prompt_len, "gen_len":
          cfg.workload.gen_len, "context": cfg.workload.prompt_len, "capacity": capacity(cfg),
          "decode_steps": steps, **extra}


def _interleaved_cell(cfg: config_lib.Config, cfgs: dict) -> list[dict]:
  """`params.interleave`'s variants timed in turn in each repeat (module docstring)."""
  w = cfg.workload
  steps = max(w.gen_len - 1, 1)
  # Variants of one model shape share one prepared copy of its weights (each program would
  # otherwise split and keep its own); a variant that changes the shape (fewer KV heads, a
  # latent rank) gets random weights of its own. One that sets workload.prompt_len is timed
  # from that many held tokens (what a policy leaves of the context) within the capacity.
  shared, params = {}, {}
  for n, c in cfgs.items():
    if repr(c.model) not in shared:
      shared[repr(c.model)] = step.prepare_params(c, ex.random_params(c.model, cfg.seed))
    params[n] = shared[repr(c.model)]
  held = {n: c.workload.prompt_len for n, c in cfgs.items()}
  timers = {n: FilledDecode(c, params[n], w.batch, held[n], steps, capacity(cfg))
            for n, c in cfgs.items()}
  meter, probe = Bandwidth(cfg.param("bandwidth_mib", 512)), DotProbe()
  names, bws, dots, ts = list(timers), [], [], {n: [] for n in timers}
  for t in timers.values():
    t.once()  # warm-up
  for i in range(w.repeats):
    bws.append(meter.measure())
    dots.append(probe.measure())
    for n in names[i % len(names):] + names[:i % len(names)]:
      ts[n].append(timers[n].once())
  bw = statistics.median(bws)
  rate = {k: statistics.median(d[k] for d in dots) for k in DotProbe.TYPES}
  ref = names[0]  # `ex.interleaved` puts the reference first
  rows = []
  for n in names:
    t = metrics.summarize(ts[n])
    ratio, ci = intervals.paired_ratio(ts[n], ts[ref])
    m = {"tpot_s": t["median"], "tpot_s_iqr": t["iqr"], "tpot_s_min": t["min"],
         "repeats": t["n"], "tpot_vs_ref": ratio,
         "tpot_vs_ref_ci95": ci, "tpot_s_samples": ts[n],
         "tokens_per_s": w.batch / t["median"], **footprint.count(cfgs[n], held[n]).fields()}
    m.update(roofs(cfgs[n], params[n], w.batch, held[n], steps, t["median"], bw, rate))
    m.update({"roofline_fraction": m["ideal_s"] / t["median"], "kv_fraction": m["kv_bytes"]
              / m["step_bytes"], "achieved_Bps": m["step_bytes"] / t["median"]})
    rows.append({"variant": ex.variant(cfgs[n], setting=n),
                 "workload": _workload(cfg, steps, timing=f"interleaved with {', '.join(names)}",
                                       **({"held": held[n]} if held[n] != w.prompt_len else {})),
                 "metrics": m})
  return rows


def run_cell(cfg: config_lib.Config) -> list[dict]:
  cfgs = ex.interleaved(cfg)
  if cfgs:
    return _interleaved_cell(cfg, cfgs)
  w, params = cfg.workload, ex.random_params(cfg.model, cfg.seed)
  steps = max(w.gen_len - 1, 1)
  timer = FilledDecode(cfg, params, w.batch, w.prompt_len, steps, capacity(cfg))
  meter, probe = Bandwidth(cfg.param("bandwidth_mib", 512)), DotProbe()
  timer.once()  # warm-up
  # Each repeat measures the bandwidth right before its decode and pairs the two: a slow
  # phase of a shared machine (seconds long) slows both, and their ratio stands.
  bws, ts, dots, copies = [], [], [], []
  for _ in range(w.repeats):
    bws.append(meter.measure())
    copies.append(meter.measure_copy())
    dots.append(probe.measure())
    ts.append(timer.once())
  del meter, probe
  t = metrics.summarize(ts)
  m = step_bytes(cfg, params, w.batch, w.prompt_len, steps)
  bw = statistics.median(bws)
  fractions = metrics.summarize([m["step_bytes"] / b / s for b, s in zip(bws, ts)])
  m.update({"tpot_s": t["median"], "tpot_s_iqr": t["iqr"], "tpot_s_min": t["min"],
            "repeats": t["n"], "bandwidth_Bps": bw, "ideal_s": m["step_bytes"] / bw,
            "copy_Bps": statistics.median(copies),
            "copy_fraction": m["step_bytes"] / t["median"] / statistics.median(copies),
            "roofline_fraction": fractions["median"],
            "roofline_fraction_iqr": fractions["iqr"],
            "achieved_Bps": m["step_bytes"] / t["median"],
            "tokens_per_s": w.batch / t["median"],
            **footprint.count(cfg, w.prompt_len).fields(),
            "kv_fraction": m["kv_bytes"] / m["step_bytes"]})
  rate = {k: statistics.median(d[k] for d in dots) for k in DotProbe.TYPES}
  m.update(roofs(cfg, params, w.batch, w.prompt_len, steps, t["median"], bw, rate))
  return [{"variant": ex.variant(cfg), "workload": _workload(cfg, steps), "metrics": m}]


def summary(rows: list[dict]) -> list[dict]:
  """One line per row: TPOT, the one roof fraction (kvjax.lab.figures: above 1 flagged, not
  shown), and speed against the reference: interleaved rows' paired `tpot_vs_ref` with its
  interval, else `tpot_over_ref` (a ratio of medians) against the same variant's bf16 cache
  read by the same attention with the same weights' dtype; `vs_ref` says whether the two
  can be told apart."""
  from kvjax.lab import figures
  key = lambda r: (r["variant"]["variant"], r["variant"].get("attention"),  # noqa: E731
                   r.get("config", {}).get("model", {}).get("param_dtype"),
                   r["workload"]["batch"], r["workload"]["context"])
  ref = {key(r): r["metrics"] for r in rows if r["variant"]["codec"] == "bf16"
         and not r["variant"].get("setting", "").startswith("xla_")}
  out = []
  for r in rows:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    rec = {"variant": v["variant"], "attention": v.get("attention", ""),
           "codec": ex.cache_name(v), "batch": w["batch"], "context": w["context"],
           "tpot_ms": m["tpot_s"] * 1e3, "tpot_iqr_ms": m.get("tpot_s_iqr", 0.0) * 1e3,
           "bound": m.get("bound", "bytes"), **figures.roof_fields(m),
           "achieved_GBps": m["achieved_Bps"] / 1e9,
           "bandwidth_GBps": m["bandwidth_Bps"] / 1e9}
    if "tpot_vs_ref" in m:  # timed in turn with its own reference: the paired ratio alone
      rec["setting"] = v.get("setting", "")
    rec.update(figures.ratio_fields(m, None if "tpot_vs_ref" in m else ref.get(key(r))))
    out.append(rec)
  return out
