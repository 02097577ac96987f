"""`full`: keep every token (today's cache). Acts nowhere: prefill and decode store all."""

from kvjax.policies.base import Policy, register


class Full(Policy):
  name = "full"


register(Full())
