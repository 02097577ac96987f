"""Host-side checks of a built config: the allowed range of every numeric field, the
cross-field rules (heads divide, dtypes and programs exist), each failure one line naming
the key, the value and the fix; then the checks the registries added (`add_check`).

The config is the ground floor: it imports no other kvjax module. Which attention variants,
layouts, codecs and policies exist, and what each allows, is known to the registries
(`kvjax.attention`, `kvjax.cache`, `kvjax.codecs`, `kvjax.policies`), and each registry adds
its own check here when it is imported; `kvjax.registries` imports them all, and every
entry point that builds a config from user input imports it first.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from kvjax.config.schema import DTYPES, SECTIONS, Config, field_type
from kvjax.errors import KvjaxError


# Allowed range of every numeric field: (low, low included, high, high included). Every
# bound is finite and every value must be representable where it is computed: integers
# become int32 shapes, ids and positions (seed: the 32 bits jax.random.PRNGKey keeps), and
# floats float32 numbers (none that rounds to 0 or inf there). Integer fields must hold
# ints, float fields finite numbers (no NaN / inf).
I32 = 2**31 - 1                      # int32's largest value
F32_MAX = (2 - 2.0**-23) * 2.0**127  # float32's largest finite value
F32_TINY = 2.0**-126                 # float32's smallest normal value (below: 0 on XLA)
_POS, _NONNEG = (0, False, I32, True), (0, True, I32, True)
_POS_F = (F32_TINY, True, F32_MAX, True)  # a positive float32 that is neither 0 nor inf
_UNIT, _UNIT_OPEN = (0, True, 1, True), (0, True, 1, False)
_RANGES = {
    "seed": (0, True, 2**32 - 1, True),
    "model.vocab_size": _POS, "model.d_model": _POS, "model.n_layers": _POS,
    "model.n_heads": _POS, "model.n_kv_heads": _POS, "model.head_dim": _NONNEG,
    "model.d_ff": _NONNEG,
    # theta > 1: the rotary frequencies theta^(-2i/D) decay with i (theta <= 1: they do not)
    "model.rope_theta": (1, False, F32_MAX, True),
    # added to a mean square of activations: at least float32's smallest normal, at most 1
    "model.norm_eps": (F32_TINY, True, 1, True),
    "model.scan_unroll": _POS, "model.max_seq_len": _POS, "model.latent_rank": _NONNEG,
    "model.rope_pairs": _NONNEG,
    "model.query_scale": (0, True, F32_MAX, True), "model.global_every": _NONNEG,
    "model.sliding_window": _NONNEG, "model.rope_local_theta": (0, True, F32_MAX, True),
    "cache.budget": _NONNEG, "cache.ratio": _UNIT, "cache.sinks": _NONNEG,
    "cache.window": _NONNEG, "cache.rotate_seed": _NONNEG, "cache.keep_first": _NONNEG,
    "cache.capacity": _NONNEG, "cache.group_size": _NONNEG, "cache.residual": _NONNEG,
    "cache.page_size": _POS, "cache.num_pages": _NONNEG,
    "workload.batch": _POS, "workload.prompt_len": _POS, "workload.gen_len": _NONNEG,
    # any finite temperature: below float32's smallest normal it samples greedily
    # (kvjax.decode.Sampler), as 0 does
    "workload.temperature": (0, True, F32_MAX, True), "workload.top_k": _NONNEG,
    "workload.top_p": (F32_TINY, True, 1, True), "workload.eos_id": (-1, True, I32, True),
    "workload.repeats": _POS, "workload.prefill_chunk": _NONNEG,
    "mesh.data": _POS, "mesh.model": _POS,
    "train.steps": _POS, "train.batch": _POS, "train.seq_len": _POS,
    "train.lr": (F32_TINY, True, 1, True),  # AdamW moves a weight by about lr per step
    "train.min_lr_ratio": _UNIT, "train.warmup": _NONNEG,
    "train.weight_decay": _UNIT,  # decoupled: lr * weight_decay <= 1 never flips a sign
    "train.b1": _UNIT_OPEN, "train.b2": _UNIT_OPEN, "train.grad_clip": _POS_F,
    "train.eval_every": _POS, "train.eval_batches": _POS, "train.checkpoint_every": _POS,
    "train.log_every": _POS, "train.recall_mix": _UNIT, "train.recall_pairs": _POS,
}
# What a zero or negative value of a field usually meant, for the message.
_DEFAULT_HINT = {"model.head_dim": " (0 picks d_model // n_heads)",
                 "model.d_ff": " (0 picks the Llama rule)",
                 "cache.capacity": " (0 means prompt + new tokens)",
                 "cache.ratio": " (the fraction of each prompt a policy keeps; 0 means "
                                "cache.budget sizes the cache)",
                 "cache.budget": " (0 means cache.ratio or no eviction)",
                 "model.latent_rank": " (0 means no latent cache)",
                 "model.rope_pairs": " (0 means every frequency pair rotates)",
                 "model.sliding_window": " (0 means every layer attends to all tokens)",
                 "workload.temperature": " (0 means greedy)",
                 "workload.top_k": " (0 means no top-k cut)",
                 "workload.eos_id": " (-1 means no stop token)",
                 "workload.prefill_chunk": " (0 means the whole prompt in one call)"}


def _num(x) -> str:
  return f"{x:.8g}" if isinstance(x, float) else str(x)


def _interval(rng: tuple, value: Any = None) -> str:
  """`> 0` where the high end is only the dtype's limit and the value is not above it,
  else the whole interval."""
  lo, lo_in, hi, hi_in = rng
  within = isinstance(value, (int, float)) and math.isfinite(value) and value <= hi
  if hi is None or (hi in (I32, F32_MAX) and within):
    return f"{'>=' if lo_in else '>'} {_num(lo)}"
  return f"in {'[' if lo_in else '('}{_num(lo)}, {_num(hi)}{']' if hi_in else ')'}"


def range_of(key: str) -> tuple:
  """The allowed (low, low included, high, high included) of a numeric config key."""
  return _RANGES[key]


def check_number(key: str, value: Any, rng: tuple, integer: bool) -> None:
  """Raise a one-line KvjaxError unless `value` is a finite int/float inside `rng`."""
  kind = "an integer" if integer else "a finite number"
  ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
  if isinstance(value, bool) or not ok_type or not math.isfinite(value):
    raise KvjaxError(f"{key} must be {kind} {_interval(rng)}, got {value!r}; "
                     f"set {key} to such a value")
  lo, lo_in, hi, hi_in = rng
  if (lo is not None and (value < lo or (value == lo and not lo_in))) or \
      (hi is not None and (value > hi or (value == hi and not hi_in))):
    hint = _DEFAULT_HINT.get(key, "")
    raise KvjaxError(f"{key} must be {kind} {_interval(rng, value)}{hint}, got {value!r}; "
                     f"set {key} to such a value")


# What kvjax.attention.rope implements: no scaling, or Llama-3's with exactly these numbers.
ROPE_TYPES = ("default", "llama3")
# The compiled programs (`kvjax.attention.base.program`): auto resolves per backend.
PROGRAMS = ("auto", "cpu", "accelerator")
# The layer loops (`kvjax.decode.step.layer_loop`): auto resolves per program.
LAYER_LOOPS = ("auto", "scan", "switch", "unrolled")
MLP_ACTS = ("silu", "gelu_tanh")  # the gate activations kvjax.model.layers implements
_LLAMA3 = {"factor": _POS_F, "low_freq_factor": _POS_F, "high_freq_factor": _POS_F,
           "original_max_position_embeddings": (1, True, I32, True)}


def _check_rope_scaling(scaling: dict) -> None:
  """Refuse a rope scaling kvjax does not implement (it would run as if unset)."""
  if not scaling:
    return
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind is None:
    raise KvjaxError(f"model.rope_scaling names no rope_type; kvjax implements "
                     f"{', '.join(ROPE_TYPES)} (set model.rope_scaling={{}} for none)")
  if kind not in ROPE_TYPES:
    raise KvjaxError(f"model.rope_scaling rope_type {kind!r} is not implemented; kvjax "
                     f"implements {', '.join(ROPE_TYPES)} (set model.rope_scaling={{}} for none)")
  allowed = {"rope_type", "type"} | (set(_LLAMA3) if kind == "llama3" else set())
  extra = sorted(set(scaling) - allowed)
  if extra:
    raise KvjaxError(f"model.rope_scaling.{extra[0]} is not used by rope_type {kind}; it "
                     f"takes {', '.join(sorted(allowed - {'type', 'rope_type'})) or 'no numbers'}")
  if kind == "default":
    return
  missing = [k for k in _LLAMA3 if scaling.get(k) is None]
  if missing:
    raise KvjaxError("model.rope_scaling of type llama3 needs factor, low_freq_factor, "
                     "high_freq_factor and original_max_position_embeddings; missing "
                     + ", ".join(missing))
  for key, rng in _LLAMA3.items():
    check_number(f"model.rope_scaling.{key}", scaling[key], rng, False)
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  if high <= low:
    raise KvjaxError(f"model.rope_scaling.high_freq_factor={high} must exceed "
                     f"low_freq_factor={low}; fix the rope scaling")


def _check_numbers(cfg: Config) -> None:
  for key, rng in _RANGES.items():
    if "." in key:
      sec, name = key.split(".")
      value, cls = getattr(getattr(cfg, sec), name), SECTIONS[sec]
    else:
      name, value, cls = key, getattr(cfg, key), Config
    check_number(key, value, rng, field_type(cls, name) is int)
  m, c, w = cfg.model, cfg.cache, cfg.workload
  _check_rope_scaling(dict(m.rope_scaling))
  if w.eos_id >= m.vocab_size:
    raise KvjaxError(f"workload.eos_id={w.eos_id} is outside the vocabulary [0, "
                     f"{m.vocab_size}); use a token id below model.vocab_size or -1 for none")
  if w.top_k > m.vocab_size:
    raise KvjaxError(f"workload.top_k={w.top_k} exceeds model.vocab_size={m.vocab_size}; "
                     "use at most the vocabulary size (0 means no cut)")
  if c.capacity and c.residual > c.capacity:
    raise KvjaxError(f"cache.residual={c.residual} exceeds cache.capacity={c.capacity}; "
                     f"use a window of at most {c.capacity} tokens or raise the capacity")
  if c.capacity and c.keep_first >= c.capacity:
    raise KvjaxError(f"cache.keep_first={c.keep_first} must be below cache.capacity={c.capacity}; "
                     f"keep fewer first tokens or raise the capacity")


# The registries' checks, `check(cache_cfg, model_cfg)` each, in the order they were added.
REGISTRY_CHECKS: list[Callable[[Any, Any], None]] = []


def add_check(check: Callable[[Any, Any], None]) -> None:
  """Run `check(cache_cfg, model_cfg)` in every `validate` from now on (a registry's own
  names and limits; added once however often its package is reloaded)."""
  key = (check.__module__, check.__qualname__)
  REGISTRY_CHECKS[:] = [c for c in REGISTRY_CHECKS if (c.__module__, c.__qualname__) != key]
  REGISTRY_CHECKS.append(check)


def validate(cfg: Config) -> Config:
  """Host-side checks with one-line messages that name the key, the value and the fix.

  Every numeric field is checked against `_RANGES` (type, finiteness, range) whatever
  built the config: YAML, `--set`, a checkpoint's config.yaml or an imported checkpoint's
  metadata, since all of them come through `apply_overrides`. Then every registry check
  added so far (`add_check`): the names of the attention, layout, codecs and policy, and
  each one's own limits."""
  m, c = cfg.model, cfg.cache
  _check_numbers(cfg)
  if m.n_heads % m.n_kv_heads:
    raise KvjaxError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads="
                     f"{m.n_kv_heads}; choose n_kv_heads among the divisors of n_heads")
  if not m.head_dim and m.d_model % m.n_heads:
    raise KvjaxError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
                     "set model.head_dim explicitly")
  if m.D % 2:
    raise KvjaxError(f"head_dim={m.D} is odd; rotary embeddings need an even head_dim")
  for name in ("dtype", "param_dtype"):
    if getattr(m, name) not in DTYPES:
      raise KvjaxError(f"unknown model.{name} '{getattr(m, name)}'; use one of {', '.join(DTYPES)}")
  if m.mlp_act not in MLP_ACTS:
    raise KvjaxError(f"unknown model.mlp_act '{m.mlp_act}'; use one of {', '.join(MLP_ACTS)}")
  if 0 < m.rope_local_theta <= 1:
    raise KvjaxError(f"model.rope_local_theta={m.rope_local_theta} must be > 1 (or 0 for "
                     "model.rope_theta); set it to the local layers' RoPE base")
  if m.sliding_window > m.max_seq_len:
    raise KvjaxError(f"model.sliding_window={m.sliding_window} exceeds the model's context "
                     f"model.max_seq_len={m.max_seq_len}; use a window of at most "
                     f"{m.max_seq_len} tokens (0: no window)")
  if m.rope_pairs > m.D // 2:
    raise KvjaxError(f"model.rope_pairs={m.rope_pairs} exceeds the {m.D // 2} frequency pairs "
                     f"of a head of {m.D}; use at most {m.D // 2} (0: every pair rotates)")
  if m.rope_pairs and (m.rope_local_theta or m.windowed):
    raise KvjaxError("model.rope_pairs (partial RoPE) takes one RoPE base and no window; this "
                     "model has local layers: set model.rope_pairs=0")
  if m.program not in PROGRAMS:
    raise KvjaxError(f"unknown model.program '{m.program}'; use one of {', '.join(PROGRAMS)}")
  if m.layer_loop not in LAYER_LOOPS:
    raise KvjaxError(f"unknown model.layer_loop '{m.layer_loop}'; use one of "
                     f"{', '.join(LAYER_LOOPS)}")
  if c.k_axis not in ("token", "channel"):
    raise KvjaxError(f"unknown cache.k_axis '{c.k_axis}'; use token or channel")
  for check in REGISTRY_CHECKS:
    check(c, m)
  return cfg
