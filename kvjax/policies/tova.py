"""`tova`: prompt tokens ranked by the attention of the last prompt query, per layer and
KV head (averaged over the query heads sharing it).

Acts at prefill only (one ranking by the final prompt token); decode appends without
evicting (the original method re-ranks at every step; that is not built).
"""

from kvjax.policies.base import Policy, register
from kvjax.policies.attn import attention_mass


class TOVA(Policy):
  name = "tova"
  needs_queries = True

  def scores(self, ctx):
    return attention_mass(ctx.q_LBTHD, ctx.k_LBKSD, ctx.lengths_B, ctx.lengths_B[:, None] - 1)


register(TOVA())
