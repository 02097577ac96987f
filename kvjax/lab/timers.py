"""The lab's decode timer: a compiled prefill + decode (`kvjax.decode.generate.Compiled`)
timed one repeat at a time, for the experiments that time kvjax's decode against itself
or a peer (`kvjax.lab.metrics.bench_interleaved`)."""

from __future__ import annotations

from kvjax import cache as cache_lib
from kvjax.decode.generate import Compiled, Shape


class DecodeTimer:
  """Compiled prefill + decode for one config and shape (a `Compiled`), timed
  one repeat at a time.

  Both programs donate the cache, so every repeat allocates a fresh cache *outside* the
  timed region. `once()` returns (ttft_s, decode_s); several timers can be called in
  turn (`bench_interleaved`) so that A-vs-B ratios share the same machine noise.
  """

  def __init__(self, cfg, params, tokens_BT, lengths_B, steps: int, capacity: int = 0):
    self.steps = max(int(steps), 1)
    B, T = tokens_BT.shape
    self.capacity = capacity or T + self.steps + 1
    shape = Shape(B, T, self.capacity, self.steps)
    self.compiled = Compiled(cfg, params, shape).compile(tokens_BT, lengths_B)
    self.compile_s = self.compiled.compile_s
    self.cache_bytes = None
    self.peak_bytes = self.compiled.peak_bytes

  def once(self) -> tuple[float, float]:
    run = self.compiled.run()
    self.cache_bytes = cache_lib.tree_bytes(run.cache)
    return run.prefill_s, run.decode_s / self.steps
