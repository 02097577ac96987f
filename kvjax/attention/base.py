"""The attention registry and the online softmax every variant shares.

A variant is a function `(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments) -> out_BTHD`:
the T new tokens' queries, keys and values, and the stored `Segment`s its cache layout
hands it (`kvjax.cache.base`). Each module of this folder registers its variants:
`xla` (grouped, reference), `native` (the CPU program's default) and `pallas`; `auto`, the
default name, resolves to `native` in the CPU program and `grouped` in the accelerator
program (`resolve`, `program`). A variant may also take the keywords `program` and `bucket`
(`get` binds them where it does), and under a sliding window `floor_BT` (each query's
lowest visible position) and `band` (the window's static bound, which sizes a prompt's
blocks: `xla.prompt_blocks`). Adding a variant = one module here that calls `register`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax.numpy as jnp

from kvjax.errors import KvjaxError

ATTENTIONS: dict[str, Callable] = {}
CHECKS: dict[str, Callable] = {}

MASKED = -1e30  # finite running-max floor: exp(MASKED - m) is 0 and never NaN


AUTO = "auto"  # not a variant: the name `resolve` turns into one per program


def names() -> list[str]:
  """What `model.attention` may name: `auto`, then the registered variants."""
  return [AUTO, *ATTENTIONS]


def register(name: str, fn: Callable, check: Callable | None = None) -> Callable:
  """Register a variant; `check(cache_cfg, model_cfg)` holds its host-side limits."""
  ATTENTIONS[name] = fn
  if check is not None:
    CHECKS[name] = check
  return fn


def program(name: str | None = "auto") -> str:
  """The compiled program `model.program` names: `cpu` (per-layer weights in the switched
  layer scan, stored segments read block by block up to their live length) or
  `accelerator` (stacked weights in nn.scan, each stored segment one masked block: no
  data-dependent loop, see `xla.block_size`); `auto` (or None) is `cpu` on the CPU
  backend and `accelerator` elsewhere. Either runs on any backend. Two callers resolve:
  `step.resolved` on the host (what `step.Static.of` puts in the jit key) and `get` (a
  model built straight from a config); everything after them takes the resolved name."""
  if name not in (None, "auto"):
    return name
  import jax  # noqa: PLC0415 (kept out of the registry's import for the config floor)
  return "cpu" if jax.default_backend() == "cpu" else "accelerator"


def resolve(name: str, prog: str = "cpu") -> str:
  """The variant `name` runs in the resolved program `prog`: `auto` (the default) is
  `native` in the CPU program, where the read kernel and the stored-type dots pay, and
  `grouped` (the XLA read) in the accelerator program."""
  if name != AUTO:
    return name
  return "native" if prog == "cpu" else "grouped"


def get(name: str, prog: str | None = "auto", bucket: int = 0) -> Callable:
  """The variant `name` of program `prog` as `fn(q, k, v, positions, segments)`; `bucket`
  > 0 (accelerator program) bounds the slots of each stored segment its one-block read
  covers (`xla.block_size`)."""
  prog = program(prog)
  try:
    fn = ATTENTIONS[resolve(name, prog)]
  except KeyError:
    raise KvjaxError(f"unknown attention '{name}'; known: {', '.join(names())}") from None
  if not _takes_program(fn):  # a variant of the plain five-argument form
    return fn
  return functools.partial(fn, program=prog, bucket=bucket)


@functools.lru_cache(maxsize=None)
def _takes_program(fn: Callable) -> bool:
  return "program" in inspect.signature(fn).parameters


def check(cache_cfg, model_cfg) -> None:
  """The registry's config checks (`kvjax.attention` adds them to `config.validate`): the
  chosen variant exists, and its own limits."""
  if model_cfg.attention not in names():
    raise KvjaxError(f"unknown attention '{model_cfg.attention}'; known: {', '.join(names())}")
  if model_cfg.attention in CHECKS:
    CHECKS[model_cfg.attention](cache_cfg, model_cfg)


def update(state, l_BKGTC, mask, pv):
  """Fold one block of logits into the online-softmax state (m, l, acc); masked keys
  contribute exactly 0. `pv(p)` returns the probability-weighted values [B, K, G, T, D]."""
  m, s, acc = state
  lm = jnp.where(mask, l_BKGTC, MASKED)
  m_new = jnp.maximum(m, jnp.max(lm, axis=-1))
  p = jnp.where(mask, jnp.exp(lm - m_new[..., None]), 0.0)
  corr = jnp.exp(m - m_new)
  return m_new, s * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv(p)
