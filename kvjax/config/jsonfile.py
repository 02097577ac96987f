"""Reading files and JSON strictly: every file kvjax reads as text (configs, config.json,
results rows, a checkpoint's config.yaml) goes through `read_bytes`, and every JSON text
through `parse`, so each refusal is one `KvjaxError` line naming the file and the fix.

`read_bytes` refuses what is not a regular file before opening it: a FIFO would block the
read forever, a folder named `x.json` is not "missing", a device is not a file. `parse`
refuses what `json.loads` lets through or turns into a traceback: nesting deeper than
MAX_DEPTH (the C scanner's RecursionError, and the recursion of every later walk), integers
longer than MAX_DIGITS (Python's int limit is a ValueError of another kind, and a
4,000-digit count is not a count), and NaN, Infinity or a float that overflows to one (JSON
has no NaN; a measurement that is one is not a measurement).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from kvjax.errors import KvjaxError

MAX_DEPTH = 64
MAX_DIGITS = 40


class JsonProblem(KvjaxError):
  """A text that is not strict JSON; its message is the reason only (`parse` adds where)."""


def _int(text: str) -> int:
  if len(text.lstrip("-")) > MAX_DIGITS:
    raise JsonProblem(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_DIGITS})")
  return int(text)


def _float(text: str) -> float:
  if len(text) > 4 * MAX_DIGITS:
    raise JsonProblem(f"a number of {len(text)} characters (at most {4 * MAX_DIGITS})")
  value = float(text)
  if not math.isfinite(value):
    raise JsonProblem(f"{text} overflows to infinity")
  return value


def _constant(text: str):
  raise JsonProblem(f"{text} (JSON has no NaN or infinity)")


def depth(value: Any) -> int:
  """How deeply lists and objects nest in `value` (a scalar is 0); iterative."""
  most, stack = 0, [(value, 1)]
  while stack:
    cur, d = stack.pop()
    if isinstance(cur, (dict, list)):
      most = max(most, d)
      stack += [(v, d + 1) for v in (cur.values() if isinstance(cur, dict) else cur)]
  return most


def loads(text: str | bytes) -> Any:
  """The value of a strict JSON text; `JsonProblem` (the reason alone) otherwise."""
  try:
    value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
  except JsonProblem:
    raise
  except RecursionError:
    raise JsonProblem(f"nests deeper than {MAX_DEPTH} levels") from None
  except UnicodeDecodeError as e:
    raise JsonProblem(f"not UTF-8 text (byte {e.start})") from None
  except ValueError as e:  # JSONDecodeError, and any other value the scanner refuses
    raise JsonProblem((str(e).strip().splitlines() or ["invalid JSON"])[0][:160]) from None
  if depth(value) > MAX_DEPTH:
    raise JsonProblem(f"nests deeper than {MAX_DEPTH} levels")
  return value


def parse(text: str | bytes, where: str, fix: str = "fix or restore it") -> Any:
  """`loads`, its refusal one line: `malformed WHERE: why; FIX`."""
  try:
    return loads(text)
  except JsonProblem as e:
    raise KvjaxError(f"malformed {where}: {e}; {fix}") from None


def regular_problem(path: str | Path) -> str | None:
  """Why `path` cannot be read as a file (missing, a folder, a FIFO, a device), or None."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    return "does not exist"
  except OSError as e:
    return f"cannot be read ({e.strerror or e})"
  if stat.S_ISREG(mode):
    return None
  if stat.S_ISDIR(mode):
    return "is a folder, not a file"
  kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else \
      "a socket" if stat.S_ISSOCK(mode) else "a device"
  return f"is {kind}, not a regular file (reading it could block forever)"


def read_bytes(path: str | Path, what: str = "file", fix: str = "pass a regular file") -> bytes:
  """The bytes of a regular file; anything else (missing, a folder, a FIFO) one line."""
  why = regular_problem(path)
  if why is None:
    try:
      return Path(path).read_bytes()
    except OSError as e:
      why = f"cannot be read ({e.strerror or e})"
  raise KvjaxError(f"{what} {path} {why}; {fix}")


def read(path: str | Path, what: str = "JSON file", fix: str = "fix or restore it") -> Any:
  """The value of a strict JSON file (`read_bytes`, then `parse`)."""
  return parse(read_bytes(path, what), f"{what} {path}", fix)
