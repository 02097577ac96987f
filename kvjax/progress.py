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


def ticks(T: int, chunk: int, n_layers: int) -> tuple[int, str]:
  """(ticks, unit) of one prefill of T tokens a row: one a layer when its call is long
  (`wanted`); prefilled in chunks (`workload.prefill_chunk`), one a layer of each chunk
  when a chunk is long, else one a chunk when the prompt is; 0 ticks: no callback."""
  chunks = -(-T // chunk) if 0 < chunk < T else 1
  if wanted(min(T, chunk) if chunk else T):
    return chunks * n_layers, "layer"
  return (chunks if wanted(T) else 0), "chunk"


def tick(*_) -> None:
  if _BAR is not None:
    _BAR.update(1)


@contextlib.contextmanager
def layers(total: int, desc: str = "prefill", unit: str = "layer"):
  """A progress bar of `total` ticks (on stderr) for the calls inside the block."""
  global _BAR
  from tqdm import tqdm
  _BAR = tqdm(total=total, desc=desc, unit=unit, leave=False)
  try:
    yield _BAR
  finally:
    _BAR.close()
    _BAR = None
