"""The attention registry and the online softmax every variant shares.

A variant is a function `(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments) -> out_BTHD`:
the T new tokens' queries, keys and values, and the stored `Segment`s its cache layout
hands it (`kvjax.cache.base`). Each module of this folder registers its variants:
`xla` (grouped, reference), `native` (the CPU default) and `pallas`; `auto`, the default
name, resolves to `native` on the CPU and `grouped` elsewhere (`resolve`). Adding a variant
= one module here that calls `register`.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from kvjax.errors import KvjaxError

ATTENTIONS: dict[str, Callable] = {}
CHECKS: dict[str, Callable] = {}

MASKED = -1e30  # finite running-max floor: exp(MASKED - m) is 0 and never NaN


def register(name: str, fn: Callable, check: Callable | None = None) -> Callable:
  """Register a variant; `check(cache_cfg, model_cfg)` holds its host-side limits."""
  ATTENTIONS[name] = fn
  if check is not None:
    CHECKS[name] = check
  return fn


def resolve(name: str) -> str:
  """The variant `name` runs: `auto` (the default) is `native` on the CPU, where the read
  kernel and the stored-type dots pay, and `grouped` (the XLA read) on accelerators."""
  if name != "auto":
    return name
  import jax  # noqa: PLC0415 (kept out of the registry's import for the config floor)
  return "native" if jax.default_backend() == "cpu" else "grouped"


def get(name: str) -> Callable:
  try:
    return ATTENTIONS[resolve(name)]
  except KeyError:
    raise KvjaxError(f"unknown attention '{name}'; known: {', '.join(ATTENTIONS)}") from None


def check(cache_cfg, model_cfg) -> None:
  """The registry's config checks: the chosen variant's own limits."""
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
