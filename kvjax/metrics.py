"""Measurement helpers shared by the CLI and every experiment.

Protocol (docs/architecture.md): time compiled code only, warm up first, block until
ready, report the median of several repeats with their spread, and record the
environment next to every number.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import jax

from kvjax.cache import tree_bytes  # noqa: F401  (re-exported: bytes measured from a pytree)


@functools.lru_cache(maxsize=1)
def _git_commit() -> str:
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                         text=True, timeout=5)
    return out.stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def environment() -> dict:
  devices = jax.devices()
  return {
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "host": platform.node(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "git_commit": _git_commit(),
      "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def summarize(samples: list[float]) -> dict:
  """Median and spread (min, max, interquartile range) of timing samples in seconds."""
  s = sorted(samples)
  q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0], s[0], s[0]]
  return {"median": statistics.median(s), "min": s[0], "max": s[-1], "iqr": q[2] - q[0],
          "n": len(s)}


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict:
  """Time `fn()` (which must return JAX arrays) after `warmup` calls; blocks on outputs."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    samples.append(time.perf_counter() - t0)
  return summarize(samples)


def peak_bytes() -> int | None:
  """Peak device memory where the backend reports it (GPU/TPU), else None."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # backends without memory stats raise various errors
    return None
  return None if not stats else stats.get("peak_bytes_in_use")
