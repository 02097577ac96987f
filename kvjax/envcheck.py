"""The environment variables kvjax reads, each parsed here and checked before JAX starts
(`check`, first thing in `kvjax.cli.main` and `kvjax.load`), so a bad value is one line
naming the variable and the fix instead of a setting silently ignored (`KVJAX_KERNEL=false`
kept the kernel on), a traceback (`KVJAX_MEMORY_LIMIT=1.2.3GiB`) or an XLA abort with a
page of flags (`XLA_FLAGS=--xla_force_host_platform_device_count=two`).

    KVJAX_KERNEL         on | off (also 1/0, yes/no, true/false; unset: on)
    KVJAX_MEMORY_LIMIT   a size, e.g. 16GiB, 512M or 1000000 (bytes); unset: measured
    KVJAX_NUM_PROCESSES, KVJAX_PROCESS_ID   integers (kvjax.distributed)
    KVJAX_DISTRIBUTED_TIMEOUT   seconds, 1..86400 (kvjax.distributed)
    XLA_FLAGS            its --xla_force_host_platform_device_count, when given, an integer >= 1
"""

from __future__ import annotations

import os
import re

from kvjax.errors import KvjaxError

ON, OFF = ("", "on", "1", "yes", "true"), ("off", "0", "no", "false")
MEMORY_UNITS = {"": 1, "B": 1, "K": 2**10, "KIB": 2**10, "M": 2**20, "MIB": 2**20, "G": 2**30,
                "GIB": 2**30, "T": 2**40, "TIB": 2**40}
MOST_BYTES = 2**60  # an exbibyte: more than any machine; a larger "size" is a typo
_SIZE = re.compile(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([A-Za-z]*)\s*")
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def kernel_on() -> bool:
  """Whether KVJAX_KERNEL leaves the CPU kernels on."""
  raw = os.environ.get("KVJAX_KERNEL", "").strip().lower()
  if raw in ON:
    return True
  if raw in OFF:
    return False
  raise KvjaxError(f"KVJAX_KERNEL={os.environ['KVJAX_KERNEL']!r} is neither on nor off; set it "
                   "to off (or 0/no/false) to turn the CPU kernels off, on or unset to keep them")


def size(text: str, what: str) -> int:
  """Bytes of a size like 16GiB, 512M or 1000000; one line naming `what` otherwise."""
  got = _SIZE.fullmatch(str(text))
  unit = got.group(2).upper() if got else None
  if not got or unit not in MEMORY_UNITS:
    raise KvjaxError(f"{what}={str(text)[:40]!r} is not a size; use bytes or a number and a "
                     "unit, e.g. 16GiB or 512MiB (K, M, G, T: powers of 1024)")
  n = int(float(got.group(1)) * MEMORY_UNITS[unit])
  if not 0 < n <= MOST_BYTES:
    raise KvjaxError(f"{what}={str(text)[:40]!r} is {'zero' if n <= 0 else 'more than 1 EiB'}; "
                     "give the memory kvjax may use, e.g. 16GiB")
  return n


def memory_limit() -> int | None:
  """KVJAX_MEMORY_LIMIT in bytes, or None when unset."""
  raw = os.environ.get("KVJAX_MEMORY_LIMIT", "").strip()
  return size(raw, "KVJAX_MEMORY_LIMIT") if raw else None


def _xla_flags() -> None:
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, _, value = flag.partition("=")
    if name == _DEVICE_COUNT and not (value.isdigit() and 1 <= int(value) <= 65536):
      raise KvjaxError(f"XLA_FLAGS has {flag[:80]!r}; {_DEVICE_COUNT} takes a whole number "
                       f"of devices, e.g. {_DEVICE_COUNT}=2")


def _integers() -> None:
  for name in ("KVJAX_NUM_PROCESSES", "KVJAX_PROCESS_ID"):
    raw = os.environ.get(name, "").strip()
    if raw and not (raw.isdigit() and int(raw) < 2**31):
      raise KvjaxError(f"{name} must be a whole number, got {raw[:40]!r}; set it or unset it")
  raw = os.environ.get("KVJAX_DISTRIBUTED_TIMEOUT", "").strip()
  if raw and not (raw.isdigit() and 1 <= int(raw) <= 86400):
    raise KvjaxError(f"KVJAX_DISTRIBUTED_TIMEOUT must be whole seconds 1..86400, got "
                     f"{raw[:40]!r}; set it or unset it")


def check() -> None:
  """Every variable above, parsed once: the first bad one is a one-line KvjaxError."""
  kernel_on()
  memory_limit()
  _xla_flags()
  _integers()
