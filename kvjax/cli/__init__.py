"""The `kvjax` command line: size, generate, eval, run, results, plot, train, convert,
models (README).

User errors exit with status 2 and one line on stderr that names the problem and the fix. A
result holding NaN or infinity is such an error too: it is never printed (JSON has no NaN).

`kvjax.cli:main` is the console script: it parses (kvjax.cli.parser), runs the command
(kvjax.cli.commands), prints its result (kvjax.cli.show) and turns every failure a user can
fix into that one line; this module holds `main` and that error handling.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path

from kvjax.cli.commands import DEFAULT_CODEC, codec_names, layout_names
from kvjax.cli.parser import NUMBER_FLAGS, build_parser
from kvjax.cli.show import print_human
from kvjax import envcheck, inputs
from kvjax.errors import ArgError, KvjaxError

__all__ = ["DEFAULT_CODEC", "build_parser", "codec_names", "layout_names", "main",
           "parse_args"]


def _silence_stdout() -> None:
  """Point stdout at /dev/null so Python's exit-time flush does not fail a second time."""
  import os
  try:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  except (OSError, ValueError):
    pass


def _is_lead_process() -> bool:
  """Only process 0 prints on a multi-host run (every process computes the same result)."""
  if "jax" not in sys.modules:
    return True
  import jax
  return jax.process_index() == 0


def _quiet_libraries() -> None:
  """Library logs (absl/orbax at ERROR for a damaged but readable checkpoint, XLA's C++
  logging, jax's backend fallback warning) would print around the one line a user error
  gets; KVJAX_DEBUG=1 keeps them."""
  if os.environ.get("KVJAX_DEBUG"):
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # XLA C++ logs (read when jax loads)
  for name in ("absl", "orbax", "jax._src.xla_bridge"):
    logging.getLogger(name).setLevel(logging.CRITICAL)


def _close_bars() -> None:
  """Close any live tqdm bar (innermost first) so the error line that follows starts a line
  of its own instead of being glued onto the bar."""
  tqdm_mod = sys.modules.get("tqdm")
  bars = list(getattr(getattr(tqdm_mod, "tqdm", None), "_instances", ()) or ())
  for bar in sorted(bars, key=lambda b: -abs(getattr(b, "pos", 0))):
    bar.close()


def _attach_values(argv: list[str]) -> list[str]:
  """`--prompt-ids -1,2` -> `--prompt-ids=-1,2`, `--seed -1e+16` -> `--seed=-1e+16`,
  `--shard -1/2` -> `--shard=-1/2`:
  argparse reads a value that starts with '-' (other than a plain negative number) as a
  flag, so the bad value would never reach the check that names it."""
  takes = NUMBER_FLAGS | {"--prompt-ids", "--shard"}
  out, i = [], 0
  while i < len(argv):
    if argv[i] in takes and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
      out.append(f"{argv[i]}={argv[i + 1]}")
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


def parse_args(argv: list[str]):
  """The parsed command line, as `main` reads it (a bad value is a one-line KvjaxError)."""
  parser = build_parser()  # (fills NUMBER_FLAGS)
  return parser.parse_args(_attach_values(list(argv)))


def _out_of_memory(e: BaseException) -> bool:
  """numpy's MemoryError or XLA's RESOURCE_EXHAUSTED (host or device allocation)."""
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)[:2000]


def _inside(path: str, folder: str) -> bool:
  try:
    Path(path).resolve().relative_to(Path(folder).resolve())
    return True
  except (ValueError, OSError):
    return False


def _os_message(e: OSError, args) -> str:
  """An OS error as advice about the path it concerns: what the command writes (its --out,
  or `kvjax run`'s default results/ folder) or what it reads (a --config, --text, ...)."""
  path = e.filename
  what = f"{e.strerror or e}" + (f": {path}" if path else "")
  out = getattr(args, "out", None) or ("results" if getattr(args, "command", "") == "run"
                                       else None)
  if e.errno in (errno.ENOSPC, errno.EDQUOT):
    return f"{what}; free space or choose another --out (rows already written are kept)"
  if path and out and _inside(str(path), str(out)):
    return f"{what}; choose another --out or fix its permissions (rows already written are kept)"
  if path:
    return f"{what}; check that this path exists and is readable by you"
  return f"{what}; check the paths given on the command line"


def _fail(message: str) -> int:
  _close_bars()
  print(f"kvjax: error: {message}", file=sys.stderr)
  return 2


def _utf8_arguments(args) -> None:
  """Every text argument (paths among them) must be UTF-8: undecodable bytes arrive as lone
  surrogates, which rows, JSON and the checkpoint writer cannot hold (one line here, not a
  traceback from deep inside them)."""
  for name, value in vars(args).items():
    for v in value if isinstance(value, list) else [value]:
      if isinstance(v, str):
        inputs.text("the file argument" if name == "file" else f"--{name.replace('_', '-')}", v)


def main(argv: list[str] | None = None) -> int:
  _quiet_libraries()
  args = None
  try:
    envcheck.check()  # KVJAX_*, XLA_FLAGS: before JAX starts (an XLA abort is no message)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    _utf8_arguments(args)
    if hasattr(args, "distributed"):
      from kvjax import distributed
      how = (args.coordinator, args.num_processes, args.process_id, args.distributed,
             args.distributed_timeout)
      run = None if distributed.supervised() else distributed.settings(*how)
      if run:  # multi-process: run as a supervised child, one line if the run is lost
        return distributed.supervise(argv, run)
      distributed.initialize_distributed(*how)
    result = args.func(args)
    if args.command in ("size", "eval"):
      for w in result.get("warnings", ()):
        print(f"kvjax: warning: {w}", file=sys.stderr)
    if args.command in ("size", "generate", "eval") and _is_lead_process():
      inputs.refuse_non_finite(args.command, result)
      if args.json:
        print(json.dumps(result, allow_nan=False))  # JSON has no NaN: never print one
      else:
        print_human(args.command, result)
    return 0
  except ArgError as e:  # a library call's argument, named as this face names it
    return _fail(e.on_command_line())
  except KvjaxError as e:
    return _fail(str(e))
  except BrokenPipeError:  # `kvjax size ... | head -1`: the reader left; nothing to report
    _silence_stdout()
    return 0
  except OSError as e:  # an unreadable input, an --out that is a file, a full disk...
    return _fail(_os_message(e, args))
  except KeyboardInterrupt:
    _close_bars()
    print("kvjax: interrupted; rows already written are kept", file=sys.stderr)
    return 130
  except Exception as e:  # noqa: BLE001  (allocation failures only; anything else is a bug)
    if not _out_of_memory(e):
      raise
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return _fail(f"out of memory ({first}); lower the batch, cache.capacity or "
                 "--max-new-tokens, or use a smaller codec")
