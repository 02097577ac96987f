"""Token eviction policies (`cache.policy`): which tokens a cache keeps, at prefill and
while decoding. A policy is one module of this folder; everything it decides lives there.

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

The contract (`Policy`): at prefill, `select` (or `scores`, from which the default takes
the top tokens; `keep` adds the policy's own per-slot state) picks, for every layer,
sequence and KV head, which prompt tokens stay; `capacity` sizes the compacted cache. At
decode, `decode_write` places the new tokens: append after the held ones (this base), a
ring (`window.Window`), or score-and-replace per layer, sequence and KV head
(`replace.ScoreAndReplace`; h2o and tova score by attention, `attn.DecodeScored`). The
compacted layouts (`kvjax.cache.compact`, `kvjax.cache.paged_compact`) are generic storage:
they copy the kept tokens, then call `decode_write` with themselves as `Slots` (how to read
the held keys and put tokens into slots), so a policy never imports a layout. Keys are
stored already rotated at their own positions, so attention needs no per-slot position: the
new query is rotated at its true position (`cache.lengths` counts every token seen, not
the tokens held) and every held token is older than it.

Budget: `cache.budget` tokens per sequence (the same count in every layer and KV head;
which tokens may differ per head where the policy scores per head), or `cache.ratio`, the
fraction of each prompt kept (ceil(ratio * prompt length) tokens, per sequence). A prompt
no longer than its budget is kept whole (`budget`: the rules and host-side checks).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import KvjaxError

POLICIES: dict[str, "Policy"] = {}

KEEP = 1e30  # score of a token the policy always keeps (finite, so ties stay ordered)


def register(policy: "Policy") -> "Policy":
  POLICIES[policy.name] = policy
  return policy


FULL = "full"  # the policy that keeps every token


def evicts(cache_cfg) -> bool:
  """Whether `cache.policy` drops tokens: every policy but `full`. The one place that
  names `full`; the layouts, programs and experiments ask this instead."""
  return cache_cfg.policy != FULL


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


class Slots(Protocol):
  """The storage a compacted layout lends a policy's decode rule (`Policy.decode_write`).

  Its caches carry `lengths` (tokens seen), `held` (slots [0, held) hold a token) and
  `budget` [B] int32, `state` (the policy's own leaves [L, B, K, S], `Policy.init_state`)
  and `spec` (the CacheSpec: `capacity` S, the codecs `kc`, `vc`, `cache_cfg`). `put_*`
  encode the new K/V through the codecs and return the cache with `fields` replaced."""

  def keys(self, cache) -> Any:
    """The K codec storage of the S slots seen contiguously, leaves [L, B, K, S, ...]."""

  def put_tokens(self, cache, slot_BT, k_LBTKD, v_LBTKD, **fields) -> Any:
    """Token t of sequence b into slot slot_BT[b, t] of every layer and KV head
    (-1: not written)."""

  def put_heads(self, cache, slot_LBK, k_LBKD, v_LBKD, **fields) -> Any:
    """One token per (layer, sequence, KV head) into its own slot (S: not written)."""


class Policy:
  """Prefill selection and decode rule of one policy; this base keeps, at decode, every
  new token after the held ones (append)."""

  name = "base"
  needs_queries = False   # True: `select` reads the prompt's queries (Context.q_LBTHD)
  decode_queries = False  # True: `decode_write` reads each new token's rotated query
  decode_evicts = False   # True: the cache holds `budget` slots and keeps evicting in decode
  uniform_slots = True    # True: decode puts a token in the same slot of every layer and
  #                         KV head (`write_slots`, which the host can replay: serving)
  default_window = 0      # `cache.window` when it is 0

  def window(self, c) -> int:
    return c.window or self.default_window

  def sinks(self, c) -> int:
    return 0

  def window_budget(self, c) -> int:
    """The budget `cache.window` alone sets (window, sinks); 0: it sets none."""
    return 0

  def floor(self, c) -> tuple[str, int]:
    """(what, tokens) a budget must exceed: the window this policy always keeps."""
    return "window", self.window(c)

  def check(self, c) -> None:
    """Policy-specific host-side checks of the CacheConfig `c` (budget resolved)."""
    budget = effective_budget(c)
    if budget and self.window(c) and budget <= self.window(c):
      raise KvjaxError(f"cache.budget={budget} must exceed the {c.policy} window "
                       f"{self.window(c)}; raise the budget or lower cache.window")

  # -- prefill ---------------------------------------------------------------------------------
  def scores(self, ctx: Context) -> jax.Array:
    """[L, B, K, S] float32, higher = keep; `KEEP` for tokens always kept."""
    raise NotImplementedError

  def select(self, ctx: Context, Sk: int) -> jax.Array:
    """[L, B, K, Sk] int32: the prompt position each slot of the compacted cache takes.
    Slots [0, min(length, budget)) of a sequence are held; the rest are unused."""
    return top_positions(self.scores(ctx), ctx.lengths_B, ctx.budget_B, Sk)

  def keep(self, ctx: Context, Sk: int) -> tuple[jax.Array, dict]:
    """(`select`, the policy's state of each kept slot {name: [L, B, K, Sk]})."""
    return self.select(ctx, Sk), {}

  # -- decode ----------------------------------------------------------------------------------
  def init_state(self, shape_LBKS: tuple) -> dict:
    """The policy's own cache leaves, per slot and KV head, empty (none by default)."""
    return {}

  def state_bytes_per_token(self, n_kv_heads: int) -> int:
    """Bytes one held token costs per layer beside its K/V (`init_state`'s leaves)."""
    leaves = jax.tree.leaves(jax.eval_shape(lambda: self.init_state((1, 1, n_kv_heads, 1))))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)

  def capacity(self, c, T: int, room: int) -> int:
    """Slots of the compacted cache for prompts of width T and `room` decode tokens: the
    kept prompt plus the room (`heads.prompt_slots`: more under adaptive heads), or the
    budget alone for a policy that evicts in decode."""
    from kvjax.policies import heads
    budget = static_budget(c, T)
    return min(budget, T + room) if self.decode_evicts else \
        heads.prompt_slots(c, budget, T) + room

  def write_slots(self, c, positions_BT, lengths_B, held_B, budget_B):
    """Where decode writes new tokens (numpy or jax): (slot of each token [B, T], -1 when
    evicted at once or padding; lengths [B]; held [B]). Append after the held tokens."""
    xp, valid_BT, n1 = seen(positions_BT, lengths_B)
    slot_BT = positions_BT - lengths_B[:, None] + held_B[:, None]
    return xp.where(valid_BT, slot_BT, -1), n1, held_B + (n1 - lengths_B)

  def decode_write(self, spec, slots: Slots, cache, k_LBTKD, v_LBTKD, positions_BT,
                   q_LBTHD=None):
    """The new tokens [L, B, T, K, D] at `positions_BT` (-1: padding) into `cache`, through
    the storage `slots`: at `write_slots`, the same slot in every layer and KV head."""
    slot_BT, n1, held = self.write_slots(spec.cache_cfg, positions_BT, cache.lengths,
                                         cache.held, cache.budget)
    return slots.put_tokens(cache, slot_BT, k_LBTKD, v_LBTKD, lengths=n1, held=held)


def seen(positions_BT, lengths_B):
  """(numpy or jax.numpy as the positions are, valid [B, T], tokens seen after them [B])."""
  xp = jnp if isinstance(positions_BT, jax.Array) else np
  valid_BT = positions_BT >= 0
  return xp, valid_BT, lengths_B + xp.sum(valid_BT, axis=1).astype(xp.int32)


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
    return int(ratio_budgets(c.ratio, [T])[0])
  return effective_budget(c)


def ratio_budgets(ratio: float, lengths) -> np.ndarray:
  """ceil(ratio x length), at least 1, in float64 on the host: the one definition of a
  ratio's budget (float32 on the device would keep 28 of 90 tokens at ratio 0.3)."""
  return np.maximum(1, np.ceil(float(ratio) * np.asarray(lengths, np.float64))).astype(np.int32)


def effective_budget(c) -> int:
  """`cache.budget`, or the budget `cache.window` alone sets (window: the window; sinks:
  sinks + window)."""
  if c.budget or c.ratio:
    return c.budget
  return get(c.policy).window_budget(c)
