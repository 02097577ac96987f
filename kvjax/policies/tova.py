"""`tova`: tokens ranked by the attention of the current query, per layer and KV head
(averaged over the query heads sharing it).

Prefill: the last prompt query ranks the prompt; the best `budget` tokens are kept.
Decode (`attn.DecodeScored`, score-and-replace): each new query ranks the held tokens
and itself afresh (nothing accumulates, nothing beyond K/V is stored), and once the budget
is full the lowest-ranked of them is dropped (the new token itself when it ranks strictly
lowest), so the cache holds `budget` tokens throughout.
"""

from kvjax.policies.attn import DecodeScored, attention_mass
from kvjax.policies.base import Policy, register


class TOVA(DecodeScored, Policy):
  name = "tova"
  needs_queries = True

  def scores(self, ctx):
    return attention_mass(ctx.q_LBTHD, ctx.k_LBKSD, ctx.lengths_B, ctx.lengths_B[:, None] - 1)


register(TOVA())
