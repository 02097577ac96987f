"""A serving request's host state (`Request`) and where its next tokens go in its pages.

A request is (tokens known, tokens cached). With an evicting `cache.policy` (paged only)
it is also compacted once, when its prompt is cached: `held` >= 0 is then the slots that
hold a token (the kept prompt tokens, then what decode appends, or the window/sinks ring
of `budget` slots), and its pages cover slots, not positions: a compacted request of any
length owns ceil(slots / page_size) pages (`kvjax.cache.paged_compact`). Where its next
tokens go is the policy's own slot rule, replayed here (`Policy.write_slots`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax import policies


@dataclasses.dataclass(eq=False)
class Request:
  prompt: list[int]
  max_new_tokens: int
  arrival: int = 0                 # engine step at which the request arrives
  output: list[int] = dataclasses.field(default_factory=list)
  slot: int = -1
  pages: list[int] = dataclasses.field(default_factory=list)
  cached: int = 0                  # leading tokens of `seq` whose K/V are in the cache
  registered: int = 0              # leading pages already in (or taken from) the prefix cache
  keys: list[bytes] = dataclasses.field(default_factory=list)
  preemptions: int = 0
  first_token_step: int = -1
  finish_step: int = -1
  held: int = -1                   # slots holding a token once compacted; -1: not compacted
  budget: int = 0                  # tokens its policy keeps (ring size of window/sinks)

  @property
  def seq(self) -> list[int]:
    return self.prompt + self.output


def _written(cache_cfg, r: Request, n: int):
  """The policy's decode rule replayed on the host for r's next n tokens, as the device
  runs it on r's row (`Policy.write_slots`): (slots [n], -1 not written; held after)."""
  one = lambda x: np.array([x], np.int32)  # noqa: E731
  slot_1T, _, held_1 = policies.get(cache_cfg.policy).write_slots(
      cache_cfg, np.arange(r.cached, r.cached + n, dtype=np.int32)[None], one(r.cached),
      one(r.held), one(r.budget))
  return slot_1T[0], int(held_1[0])


def slots_after(cache_cfg, r: Request, n: int) -> int:
  """Slots r occupies once its next n tokens are written (= tokens, until compacted)."""
  if r.held < 0:
    return r.cached + n
  return _written(cache_cfg, r, n)[1]


def next_slots(cache_cfg, r: Request, n: int) -> list[int]:
  """The slots r's next n tokens are written to (positions, until compacted; once
  compacted, by the policy's rule: appended, or the window/sinks ring)."""
  if r.held < 0:
    return list(range(r.cached, r.cached + n))
  return [int(s) for s in _written(cache_cfg, r, n)[0] if s >= 0]


def compacted(cache_cfg, r: Request) -> tuple[int, int]:
  """(held, budget) of r once its `cached` tokens are compacted by the policy."""
  b = int(policies.budgets(cache_cfg, np.array([r.cached], np.int32))[0])
  return min(r.cached, b), b


def utilization(running: list[Request], page: int, max_len: int) -> float:
  """Tokens held by running requests / token slots reserved for them (shared pages once;
  `page` 0: the contiguous reservation of `max_len` slots each)."""
  if not running:
    return 0.0
  if not page:
    return sum(r.cached for r in running) / (len(running) * max_len)
  fill: dict[int, int] = {}
  for r in running:
    n = r.cached if r.held < 0 else r.held
    for i, p in enumerate(r.pages):
      fill[p] = max(fill.get(p, 0), min(page, max(n - i * page, 0)))
  return sum(fill.values()) / (len(fill) * page) if fill else 0.0
