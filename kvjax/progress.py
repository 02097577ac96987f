"""Progress of a long prompt's prefill, one tick a layer, from inside the compiled program.

A prompt of at least `TOKENS` tokens is compiled with a host callback after each layer
(`tick`, through `jax.debug.callback`); a driver that wants a bar opens one around the call
(`layers(...)`), and a tick with no bar open does nothing. A shorter prompt's program has no
callback at all.
"""

from __future__ import annotations

import contextlib

TOKENS = 4096  # prompts at least this long tick once a layer

_BAR = None


def wanted(T: int) -> bool:
  """Whether a call of T new tokens a row ticks (a shape: decided when it is traced)."""
  return T >= TOKENS


def tick(*_) -> None:
  if _BAR is not None:
    _BAR.update(1)


@contextlib.contextmanager
def layers(total: int, desc: str = "prefill"):
  """A progress bar of `total` layer ticks (on stderr) for the calls inside the block."""
  global _BAR
  from tqdm import tqdm
  _BAR = tqdm(total=total, desc=desc, unit="layer", leave=False)
  try:
    yield _BAR
  finally:
    _BAR.close()
    _BAR = None
