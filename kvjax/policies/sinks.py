"""`sinks` (attention sinks + recent window): the first `cache.sinks` tokens and the last
`budget - sinks`.

Prefill keeps those of the prompt; decode keeps evicting with the ring of `window.Window`:
slots [0, sinks) hold the sinks, the other `budget - sinks` slots are a ring of recent
tokens, so a decode query at position p sees [0, sinks) and [p - (budget - sinks), p].
"""

from kvjax.policies.base import register
from kvjax.policies.window import Window


class Sinks(Window):
  name = "sinks"

  def sinks(self, c) -> int:
    return c.sinks


register(Sinks())
