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
from pathlib import Path
from typing import Callable

import jax

from kvjax import kernels
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


def _load_avg() -> list[float] | None:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except (OSError, AttributeError):  # not every platform has one
    return None


def _cpu_isa() -> str:
  """The widest vector extension the CPU reports (machines of one kind differ here, and the
  read's compute roof with it)."""
  flags = set(kernels.cpu_flags().split())
  for isa in ("avx512_bf16", "avx512f", "avx2", "asimd", "neon"):
    if isa in flags:
      return isa
  return "other"


def _cpu_model() -> str:
  """Vendor, family/model and name of the CPU (/proc/cpuinfo's first processor): two hosts
  of one machine kind with the same `cpu_isa` (a Zen 4 and an Intel one, say) differ in
  what each instruction form costs, so a row says which it ran on."""
  try:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if not line.strip():
        break
      key, _, val = line.partition(":")
      info[key.strip()] = val.strip()
  except OSError:
    return platform.processor() or "unknown"
  if "vendor_id" not in info:  # not x86 (Arm lists its parts by implementer and part)
    return " ".join(info.get(k, "") for k in ("CPU implementer", "CPU part")).strip() or \
        platform.processor() or "unknown"
  return (f"{info['vendor_id']} family {info.get('cpu family', '?')} model "
          f"{info.get('model', '?')}: {info.get('model name', '?')}")


def _jaxlib_version() -> str:
  try:
    import jaxlib
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return "unknown"


def _platform_version(device) -> str:
  try:
    return str(device.client.platform_version).strip().replace("\n", " ")
  except AttributeError:
    return "unknown"


def environment() -> dict:
  """The machine and software every number was measured on; `load_avg` (1, 5 and 15
  minutes) says how busy a shared machine was when the row was written."""
  devices = jax.devices()
  return {
      "jax": jax.__version__,
      "jaxlib": _jaxlib_version(),
      "backend": jax.default_backend(),
      "platform_version": _platform_version(devices[0]),  # the CUDA / ROCm runtime on a GPU
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "host": platform.node(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "git_commit": _git_commit(),
      "load_avg": _load_avg(),
      "cpu_isa": _cpu_isa(),
      "cpu_model": _cpu_model(),
      "cpu_read_kernel": kernels.status() if jax.default_backend() == "cpu" else None,
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


def bench_interleaved(timers: dict, repeats: int = 5, warmup: int = 1,
                      before_repeat=None, samples: bool = False) -> dict:
  """Round-robin repeats over named timers (`kvjax.lab.timers.DecodeTimer`, or anything with its
  `once()`, `compile_s` and `cache_bytes`); per name: TTFT/TPOT medians and spreads; with
  `samples`, also the per-repeat TPOTs (`tpot_s_samples`, in repeat order, for paired
  ratios). `before_repeat()`, when given, runs before each timed repeat (a bandwidth probe)."""
  per = {name: ([], []) for name in timers}
  for i in range(warmup + repeats):
    if i >= warmup and before_repeat is not None:
      before_repeat()
    for name, timer in timers.items():
      ttft, tpot = timer.once()
      if i >= warmup:
        per[name][0].append(ttft)
        per[name][1].append(tpot)
  out = {}
  for name, (ttfts, tpots) in per.items():
    a, b = summarize(ttfts), summarize(tpots)
    out[name] = {"ttft_s": a["median"], "ttft_s_iqr": a["iqr"], "tpot_s": b["median"],
                 "tpot_s_iqr": b["iqr"], "tpot_s_min": b["min"], "repeats": b["n"],
                 "compile_s": timers[name].compile_s, "cache_bytes": timers[name].cache_bytes,
                 "peak_bytes": getattr(timers[name], "peak_bytes", None)}
    if samples:
      out[name]["tpot_s_samples"] = tpots
  return out
