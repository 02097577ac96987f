"""The checks the command line and the Python API share, so a value one refuses the other
refuses too, with the same one-line `KvjaxError`: counts and seeds held to the ranges of
their flags (`kvjax.config.check_number`, the check `--set` gives a config key), prompts
that are text or token ids, text that is UTF-8, the eval windows, where the eval text comes
from, and results holding NaN or infinity (never printed, never returned as a measurement).
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any

from kvjax.config import check_number, range_of
from kvjax.errors import ArgError, KvjaxError, as_arg

I32 = 2**31 - 1
POSITIVE = (0, False, I32, True)
CORPORA = ("stdlib", "shakespeare")  # kvjax.lab.data.NAMED


def count(name: str, value: Any, rng: tuple = POSITIVE) -> int:
  """`value` as a count inside `rng` (an int, not a bool, a float or text)."""
  check_number(name, value, rng, True)
  return value


def integer(name: str, value: Any) -> int:
  """`value` as an int (not a bool, a float or text), the argument `name` (an `ArgError`);
  its range is checked where it is used (`max_new_tokens must be >= 1` by
  generate.check_request, for both faces)."""
  if isinstance(value, bool) or not isinstance(value, int):
    as_arg(name, count, value)  # refused with check_number's line
  return value


def number(name: str, value: Any, key: str, integer: bool) -> Any:
  """The argument `name` (None, or a number in config key `key`'s range), refused as an
  `ArgError` that names the argument, not the key."""
  if value is not None:
    as_arg(name, check_number, value, range_of(key), integer)
  return value


def seed(value: Any) -> int | None:
  """A sampling seed: None, or an integer in the `seed` key's range (as `--seed`)."""
  if value is not None:
    as_arg("seed", count, value, range_of("seed"))
  return value


def text(what: str, value: Any) -> str:
  """`value` as text that encodes as UTF-8 (a command line's undecodable bytes arrive as
  lone surrogates, which no tokenizer can encode)."""
  if not isinstance(value, str):
    raise KvjaxError(f"{what} must be text (a str), got {type(value).__name__}")
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    bad = value[e.start]
    byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else \
        f"U+{ord(bad):04X}"
    raise KvjaxError(f"{what} is not UTF-8 text ({byte} at character {e.start}); pass UTF-8 "
                     "text") from None
  return value


def _ids(value: Any) -> list[int] | None:
  """A sequence of integer token ids as a list, or None when `value` is not one."""
  if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
    return None
  out = list(value)
  if all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in out):
    return [int(x) for x in out]
  return None


def prompts(prompt: Any) -> tuple[list, bool]:
  """(each prompt as text or a list of ids, whether `prompt` was a batch): a text, a
  sequence of token ids, or a list of either."""
  one = _one(prompt)
  if one is not None:
    return [one], False
  if isinstance(prompt, (list, tuple)) and prompt:
    items = [_one(p) for p in prompt]
    if all(p is not None for p in items):
      return items, True
  raise KvjaxError(f"prompt must be a text, a list of token ids or a list of either, got "
                   f"{type(prompt).__name__} {str(prompt)[:40]!r}")


def _one(p: Any):
  if isinstance(p, str):
    return text("prompt", p)
  ids = _ids(p)
  return ids if ids is not None and (ids or isinstance(p, list)) else None


def windows(tokens: Any, seqs: Any, chunk: Any) -> None:
  """The eval windows' arguments (`ArgError`s): integers, `tokens` >= 2 (a token and the
  next one), `seqs` >= 1 and `chunk` >= 1."""
  for name, v in (("chunk", chunk), ("tokens", tokens), ("seqs", seqs)):
    integer(name, v)
  if chunk <= 0:
    raise ArgError("chunk", f"{{arg}} must be positive, got {chunk}")
  if tokens < 2:
    raise ArgError("tokens", f"{{arg}} must be >= 2 (a token and the next one), got {tokens}")
  if seqs < 1:
    raise ArgError("seqs", f"{{arg}} must be >= 1, got {seqs}")


def eval_source(text_arg: Any, path: Any, corpus: Any) -> tuple[str, str]:
  """(kind, value) of where `Model.evaluate` reads: `text=` the text itself, `path=` a file
  or folder, `corpus=` a named corpus (stdlib, the default); exactly one, never guessed."""
  given = [k for k, v in (("text", text_arg), ("path", path), ("corpus", corpus))
           if v is not None]
  if len(given) > 1:
    raise KvjaxError(f"evaluate takes one of text=, path= or corpus=, got {' and '.join(given)}")
  if not given or given == ["corpus"]:
    name = "stdlib" if corpus is None else corpus
    if name not in CORPORA:
      raise KvjaxError(f"corpus= names a built-in corpus ({', '.join(CORPORA)}), got {name!r}; "
                       "give a file as path= or the text itself as text=")
    return "corpus", name
  if given == ["text"]:
    if not text("text", text_arg).strip():
      raise KvjaxError("text= is empty; pass the text to evaluate on")
    return "text", text_arg
  if not isinstance(path, (str, os.PathLike)):
    raise KvjaxError(f"path= must be a file or folder path, got {type(path).__name__}")
  if not Path(path).expanduser().exists():
    raise KvjaxError(f"path= {str(path)[:80]!r} does not exist; pass a text file or folder "
                     "(text= for the text itself)")
  return "path", str(path)


def non_finite(value: Any, path: str = ""):
  """(dotted path, value) of the first NaN or infinity in a result, or None."""
  if isinstance(value, float) and not math.isfinite(value):
    return path, value
  items = value.items() if isinstance(value, dict) else \
      enumerate(value) if isinstance(value, (list, tuple)) else ()
  for key, item in items:
    found = non_finite(item, f"{path}.{key}" if path else str(key))
    if found:
      return found
  return None


def refuse_non_finite(command: str, result: dict) -> None:
  """A result holding NaN or infinity is one line naming the field (JSON has no NaN, and
  `ppl nan` is not a measurement), for the CLI's printout and the API's return alike."""
  found = non_finite(result)
  if found:
    raise KvjaxError(f"{command} computed a non-finite '{found[0]}' ({found[1]}): the model or "
                     "its cache produced NaN or infinity, so there is no result to print; check "
                     "the weights, the codec and any --set values")
