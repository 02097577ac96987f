"""Token eviction policies (`cache.policy`): which prompt tokens a cache keeps.

A policy picks, for every layer, sequence and KV head, which of the prompt's tokens stay
in the cache; `kvjax.cache.compact` then copies those tokens into a cache whose capacity is the
budget (plus room for the decode tokens where the policy appends), so the memory is really
freed. Keys are stored already rotated at their own positions, so attention needs no
per-slot position: the new query is rotated at its true position (`cache.lengths` counts
every token seen, not the tokens held) and every held token is older than it.

| policy   | at prefill (prompt -> budget)                              | during decode          |
|----------|------------------------------------------------------------|------------------------|
| `full`   | keeps every token (today's cache; no budget)               | appends                |
| `window` | the last `budget` tokens                                   | ring: last `budget`    |
| `sinks`  | the first `sinks` + the last `budget - sinks` tokens       | ring: same rule        |
| `knorm`  | lowest key L2 norm, per layer and KV head                  | appends (no eviction)  |
| `snapkv` | attention of the last `window` prompt queries, max-pooled, | appends (no eviction)  |
|          | per layer and KV head; the window itself is kept           |                        |
| `h2o`    | attention accumulated over every prompt query, per layer   | evicts: lowest         |
|          | and KV head, plus the last `window` tokens                 | attention summed over  |
|          |                                                            | every query so far;    |
|          |                                                            | last `window` kept     |
| `tova`   | attention of the last prompt query, per layer and KV head  | evicts: lowest         |
|          |                                                            | attention of the       |
|          |                                                            | current query          |

knorm and snapkv compress the prompt (SnapKV's selection is defined by the prompt's
observation window) and decode appends after the kept tokens. h2o and tova keep evicting,
as their methods define (`policies.attn.DecodeScored`): the cache holds `budget` tokens
throughout, and each new token takes the slot of the lowest-scored one, per layer,
sequence and KV head, on the contiguous and the paged layout alike (the paged write picks
the slot with the same scoring, `compact.choose_slots`, and scatters into its page).

Budget: `cache.budget` tokens per sequence (the same count in every layer and KV head;
which tokens may differ per head where the policy scores per head), or `cache.ratio`, the
fraction of each prompt kept (ceil(ratio * prompt length) tokens, per sequence). A prompt
no longer than its budget is kept whole. For `window` and `sinks` a `cache.window` alone
sets the budget (window, or sinks + window).

A policy is one module of this folder that calls `register` (the package imports them all); it implements `select` (or `scores`,
from which the default `select` takes the top tokens) and optional host-side `check`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import KvjaxError

POLICIES: dict[str, "Policy"] = {}

KEEP = 1e30  # score of a token the policy always keeps (finite, so ties stay ordered)


def register(policy: "Policy") -> "Policy":
  POLICIES[policy.name] = policy
  return policy


def get(name: str) -> "Policy":
  try:
    return POLICIES[name]
  except KeyError:
    raise KvjaxError(f"unknown cache.policy '{name}'; known: {', '.join(POLICIES)}") from None


class Context:
  """What a policy may look at when it selects, all for the prompt just prefilled.

  k_LBKSD: stored keys read back in float32 (rotated at their positions), S = the prompt
  width T (right padding beyond `lengths_B`); q_LBTHD: the prompt's rotated queries (only
  for policies with `needs_queries`, else None); lengths_B: prompt tokens per sequence;
  budget_B: tokens to keep per sequence; cache_cfg: the CacheConfig.
  """

  def __init__(self, k_LBKSD, lengths_B, budget_B, cache_cfg, q_LBTHD=None):
    self.k_LBKSD, self.lengths_B, self.budget_B = k_LBKSD, lengths_B, budget_B
    self.cache_cfg, self.q_LBTHD = cache_cfg, q_LBTHD


class Policy:
  name = "base"
  decode_evicts = False  # True: the cache is a ring of `budget` slots that keeps evicting
  decode_scored = False  # True: evicts by the new query's attention (`attn.DecodeScored`)
  needs_queries = False  # True: `select` reads the prompt's queries (Context.q_LBTHD)
  default_window = 0     # `cache.window` when it is 0

  def window(self, c) -> int:
    return c.window or self.default_window

  def sinks(self, c) -> int:
    return 0

  def state_bytes_per_token(self, n_kv_heads: int) -> int:
    """Bytes one held token costs per layer beside its K/V (what the policy stores)."""
    return 0

  def check(self, c) -> None:
    """Policy-specific host-side checks of the CacheConfig `c` (budget resolved)."""

  def scores(self, ctx: Context) -> jax.Array:
    """[L, B, K, S] float32, higher = keep; `KEEP` for tokens always kept."""
    raise NotImplementedError

  def select(self, ctx: Context, Sk: int) -> jax.Array:
    """[L, B, K, Sk] int32: the prompt position each slot of the compacted cache takes.
    Slots [0, min(length, budget)) of a sequence are held; the rest are unused."""
    return top_positions(self.scores(ctx), ctx.lengths_B, ctx.budget_B, Sk)


def held(lengths_B: jax.Array, budget_B: jax.Array) -> jax.Array:
  """Tokens a sequence holds after compaction: all of a prompt within its budget."""
  return jnp.minimum(lengths_B, budget_B)


def top_positions(scores_LBKS, lengths_B, budget_B, Sk: int) -> jax.Array:
  """The `min(length, budget)` best-scored valid positions of each (layer, sequence, head),
  in ascending position order in slots [0, held); equal scores favour the earlier token."""
  S = scores_LBKS.shape[-1]
  valid_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
  s = jnp.where(valid_BS[None, :, None, :], scores_LBKS.astype(jnp.float32), -jnp.inf)
  _, idx = jax.lax.top_k(s, Sk)  # descending score, lower index first on ties
  keep = jnp.arange(Sk)[None, None, None, :] < held(lengths_B, budget_B)[None, :, None, None]
  pos = jnp.sort(jnp.where(keep, idx, S), axis=-1)
  return jnp.where(pos < S, pos, 0).astype(jnp.int32)


def static_budget(c, T: int) -> int:
  """The largest per-sequence budget for prompts of at most T tokens (a shape)."""
  if c.ratio:
    return max(1, math.ceil(c.ratio * T))
  return effective_budget(c)


def effective_budget(c) -> int:
  """`cache.budget`, or for window/sinks the window (+ sinks) when only that is given."""
  if c.budget or c.ratio:
    return c.budget
  pol = get(c.policy)
  if pol.decode_evicts and c.window:
    return pol.sinks(c) + c.window
  return 0


def budgets(c, lengths_B) -> Any:
  """Per-sequence budgets [B] (jax or numpy, like `lengths_B`)."""
  xp = jnp if isinstance(lengths_B, jax.Array) else np
  if c.ratio:
    return xp.maximum(1, xp.ceil(c.ratio * lengths_B)).astype(xp.int32)
  return xp.full(lengths_B.shape, effective_budget(c), xp.int32)


def check_config(c, m=None) -> None:
  """Host-side checks of the policy settings (hooked into `config.validate`)."""
  pol = get(c.policy)
  if c.layout in ("compacted", "paged_compacted"):
    raise KvjaxError(f"cache.layout={c.layout} is what a policy builds; set cache.policy "
                     "(window, sinks, knorm, snapkv, h2o, tova) with cache.layout=contiguous "
                     "or paged")
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
  if c.layout not in ("contiguous", "paged"):
    raise KvjaxError(f"cache.policy={c.policy} needs cache.layout=contiguous or paged (the "
                     f"{c.layout} layout cannot evict tokens)")
  if c.residual or c.k_axis == "channel":
    raise KvjaxError(f"cache.policy={c.policy} compacts single tokens; set cache.residual=0 and "
                     "cache.k_axis=token (KIVI token blocks cannot be split)")
  if c.keep_first:
    raise KvjaxError(f"cache.policy={c.policy} compacts one store; set cache.keep_first=0 (the "
                     "sinks policy keeps first tokens: cache.policy=sinks, cache.sinks=N)")
  if not (effective_budget(c) or c.ratio):
    raise KvjaxError(f"cache.policy={c.policy} needs cache.budget (tokens kept per sequence) "
                     "or cache.ratio (fraction kept)")
  budget = effective_budget(c)
  if pol.decode_evicts and c.window and c.ratio:
    raise KvjaxError(f"cache.policy={c.policy} with cache.ratio sizes its window from the ratio; "
                     "drop cache.window")
  if budget and c.window and pol.decode_evicts and c.budget and \
      c.budget != pol.sinks(c) + c.window:
    raise KvjaxError(f"cache.budget={c.budget} disagrees with cache.sinks + cache.window = "
                     f"{pol.sinks(c) + c.window}; set only one of them")
  if budget and budget <= pol.sinks(c):
    raise KvjaxError(f"cache.budget={budget} must exceed cache.sinks={pol.sinks(c)}; raise the "
                     "budget or lower cache.sinks")
  if budget and not pol.decode_evicts and pol.window(c) and budget <= pol.window(c):
    raise KvjaxError(f"cache.budget={budget} must exceed the {c.policy} window "
                     f"{pol.window(c)}; raise the budget or lower cache.window")
  pol.check(c)


def check_lengths(c, lengths) -> None:
  """Host-side checks that need the prompt lengths (per-sequence budgets from a ratio)."""
  pol = get(c.policy)
  lengths = np.asarray(lengths)
  b = budgets(c, lengths)
  # Sequences compressed at prefill; a policy that evicts during decode (the window/sinks
  # ring, h2o/tova by attention) also evicts from the others once they grow past the budget.
  ring = pol.decode_evicts
  evicts = ring or pol.decode_scored
  short = np.ones(lengths.shape, bool) if evicts else lengths > b
  floor = pol.sinks(c) if ring else pol.window(c)
  if np.any(short & (b <= floor)):
    i = int(np.argmax(short & (b <= floor)))
    raise KvjaxError(f"cache.ratio={c.ratio} keeps {int(b[i])} of sequence {i}'s "
                     f"{int(lengths[i])} tokens, not more than the {c.policy} "
                     f"{'sinks' if ring else 'window'} ({floor}); raise the ratio")
