"""Budgets per sequence, the sizes they give, and the host-side checks of a policy's
settings (`config.validate`, and once the prompt lengths are known). Which layouts a policy
can compact is the layouts' own check (`kvjax.cache.check`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import KvjaxError
from kvjax.policies.base import POLICIES, effective_budget, get, ratio_budgets, static_budget  # noqa: F401


def budgets(c, lengths_B, T: int | None = None) -> Any:
  """Per-sequence budgets [B] (jax or numpy, like `lengths_B`). Traced lengths of at most
  T tokens read a host table of `ratio_budgets` (T is then required with a ratio)."""
  traced = isinstance(lengths_B, jax.Array)
  xp = jnp if traced else np
  if c.ratio:
    if not traced:
      return ratio_budgets(c.ratio, lengths_B)
    if T is None:
      raise ValueError("budgets of traced lengths under a ratio need the prompt width T")
    table = jnp.asarray(ratio_budgets(c.ratio, np.arange(T + 1)))
    return table[jnp.clip(lengths_B, 0, T)]
  return xp.full(lengths_B.shape, effective_budget(c), xp.int32)


def capacity(c, T: int, room: int) -> int:
  """Slots of the compacted cache for prompts of width T and `room` decode tokens."""
  return get(c.policy).capacity(c, T, room)


def held_tokens(c, seq_len: int) -> int:
  """Tokens one sequence of `seq_len` holds under the policy (what `kvjax size` sizes)."""
  if c.policy == "full":
    return seq_len
  return min(seq_len, static_budget(c, seq_len))


def check_config(c, m=None) -> None:
  """Host-side checks of the policy settings (hooked into `config.validate`)."""
  pol = get(c.policy)
  from kvjax.policies import heads
  heads.check(c, pol, m)
  if c.budget < 0 or c.sinks < 0 or c.window < 0:
    raise KvjaxError("cache.budget, cache.sinks and cache.window must be >= 0")
  if c.ratio and not 0 < c.ratio <= 1:
    raise KvjaxError(f"cache.ratio={c.ratio} is outside (0, 1]: it is the fraction of each "
                     "prompt kept (0 leaves it unset)")
  if c.budget and c.ratio:
    raise KvjaxError("set cache.budget or cache.ratio, not both")
  if pol.name == "full":
    if c.budget or c.ratio:
      raise KvjaxError("cache.policy=full keeps every token; drop cache.budget/cache.ratio or "
                       "choose an evicting policy (" + ", ".join(p for p in POLICIES if p != "full")
                       + ")")
    return
  if c.residual or c.k_axis == "channel":
    raise KvjaxError(f"cache.policy={c.policy} compacts single tokens; set cache.residual=0 and "
                     "cache.k_axis=token (KIVI token blocks cannot be split)")
  if c.keep_first:
    raise KvjaxError(f"cache.policy={c.policy} compacts one store; set cache.keep_first=0 (the "
                     "sinks policy keeps first tokens: cache.policy=sinks, cache.sinks=N)")
  if not (effective_budget(c) or c.ratio):
    raise KvjaxError(f"cache.policy={c.policy} needs cache.budget (tokens kept per sequence) "
                     "or cache.ratio (fraction kept)")
  pol.check(c)


def check_lengths(c, lengths) -> None:
  """Host-side checks that need the prompt lengths (per-sequence budgets from a ratio)."""
  pol = get(c.policy)
  lengths = np.asarray(lengths)
  b = budgets(c, lengths)
  # Sequences compressed at prefill; a policy that evicts during decode (the window/sinks
  # ring, h2o/tova by attention) also evicts from the others once they grow past the budget.
  short = np.ones(lengths.shape, bool) if pol.decode_evicts else lengths > b
  what, floor = pol.floor(c)
  if np.any(short & (b <= floor)):
    i = int(np.argmax(short & (b <= floor)))
    raise KvjaxError(f"cache.ratio={c.ratio} keeps {int(b[i])} of sequence {i}'s "
                     f"{int(lengths[i])} tokens, not more than the {c.policy} "
                     f"{what} ({floor}); raise the ratio")
