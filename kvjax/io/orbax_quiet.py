"""Silencing what a failed orbax restore leaves behind, so a damaged checkpoint is one line.

orbax restores a step by gathering one asyncio task per array in a fresh event loop
(`run_until_complete`, then `close`). When one array's read fails, the gather raises and
the loop is closed with the other reads still pending. They are finalized later, usually
at interpreter exit: each suspended read catches the GeneratorExit of its finalization as
a BaseException and raises a new Exception ("Encountered error while reading array
index ..." with the whole TensorStore spec), which Python prints as "Exception ignored in
<coroutine ...>"; a read that completes after the loop closed fails in its callback with
"Event loop is closed". Whether and how many depends on thread timing. A failure before
the gather leaves coroutines that were created but never awaited, which warn "coroutine
... was never awaited" when collected.

`watch()`, entered around a restore, installs an unraisable-exception hook that drops only
reports coming from those reads (orbax or tensorstore code, or "Event loop is closed"); every
other report still prints. It is in place before the restore starts, because a read can
fail on the closed loop before the failed restore's exception reaches its handler. A
restore that succeeds removes it again; `abandon_reads()`, called once a restore has
failed, keeps it for the rest of the process and closes the pending reads and unstarted
coroutines now (so nothing is left to finalize at exit, and nothing warns). A read
whose TensorStore future completes after the loop closed reports from TensorStore's own
thread, through `sys.stderr` and not the hook, any time up to the interpreter's exit (before
or after the error line): `sys.stderr` then gets a filter (`_QuietThreads`) that holds each
other thread's traceback until its last line and drops it when it is one of those (the
same test as the hook); the main thread's writes, and every other thread's other text, pass
at once. KVJAX_DEBUG=1 keeps everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import sys
import threading
import traceback
import types

_LIBRARIES = (f"{os.sep}orbax{os.sep}", f"{os.sep}tensorstore{os.sep}")
_installed = False       # a failed restore kept the filters for the rest of the process
_kept = False            # abandon_reads() was called inside the current watch()


def _from_abandoned_read(unraisable) -> bool:
  """Whether an unraisable report comes from a read of a failed restore."""
  exc = unraisable.exc_value
  if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
    return True
  code = getattr(unraisable.object, "cr_code", None)
  files = [code.co_filename] if code is not None else []
  files += [f.filename for f in traceback.extract_tb(unraisable.exc_traceback)]
  return any(lib in name for name in files for lib in _LIBRARIES)


class _QuietThreads:
  """`sys.stderr` for the rest of a process whose restore failed: a traceback written by a
  thread other than the main one is held until its exception line and dropped when it
  reports an abandoned read ("Event loop is closed", or orbax / TensorStore frames); that
  thread is then quiet for good (a chained traceback's "During handling ..." and blank
  lines follow its first one)."""

  def __init__(self, stream):
    self._stream, self._held, self._quiet = stream, {}, set()
    self._lock = threading.Lock()

  def __getattr__(self, name):  # encoding, fileno, isatty, ...: the wrapped stream's
    return getattr(self._stream, name)

  def write(self, text: str) -> int:
    if threading.current_thread() is threading.main_thread():
      return self._stream.write(text)
    with self._lock:
      me = threading.current_thread()  # not get_ident(): idents are reused
      if me in self._quiet:
        return len(text)
      held = self._held.get(me, "")
      if not held and not text.startswith("Traceback (most recent call last)"):
        return self._stream.write(text)
      held += text
      last = held.rstrip("\n").rsplit("\n", 1)[-1]
      if not held.endswith("\n") or not last or last[0].isspace() or last.startswith("Traceback"):
        self._held[me] = held  # the traceback goes on
        return len(text)
      self._held.pop(me, None)
      if "Event loop is closed" in last or any(lib in held for lib in _LIBRARIES):
        self._quiet.add(me)
        return len(text)
      self._stream.write(held)
      return len(text)

  def flush(self) -> None:
    self._stream.flush()


@contextlib.contextmanager
def watch():
  """Around one restore: the filters installed before it starts, and removed after it
  unless `abandon_reads()` was called inside (a failed restore keeps them to the end)."""
  global _installed, _kept
  if _installed or os.environ.get("KVJAX_DEBUG"):
    yield
    return
  previous_hook, previous_err = sys.unraisablehook, sys.stderr
  quiet_err = _QuietThreads(sys.stderr)
  sys.stderr = quiet_err

  def hook(unraisable):
    if not _from_abandoned_read(unraisable):
      previous_hook(unraisable)

  sys.unraisablehook = hook
  _kept = False
  try:
    yield
  finally:
    if _kept:
      # "Task was destroyed but it is pending!" for the same reads goes to asyncio's logger
      logging.getLogger("asyncio").setLevel(logging.CRITICAL)
      _installed = True
    else:
      if sys.unraisablehook is hook:
        sys.unraisablehook = previous_hook
      if sys.stderr is quiet_err:
        sys.stderr = previous_err


def _never_started(obj) -> bool:
  """An orbax coroutine created for the restore but never awaited (the gather that would
  have run it was not reached): collected, it warns "coroutine ... was never awaited"."""
  return (isinstance(obj, types.CoroutineType)
          and inspect.getcoroutinestate(obj) == inspect.CORO_CREATED
          and any(lib in obj.cr_code.co_filename for lib in _LIBRARIES))


def abandon_reads() -> None:
  """Close the reads a failed restore left pending on its closed event loop, and the
  coroutines it created but never started."""
  global _kept
  if os.environ.get("KVJAX_DEBUG"):
    return
  _kept = True
  for obj in gc.get_objects():
    if _never_started(obj):
      obj.close()
      continue
    if not isinstance(obj, asyncio.Task) or obj.done():
      continue
    try:
      closed = obj.get_loop().is_closed()
    except Exception:  # noqa: BLE001  a task without a loop: not one of these
      continue
    if closed:
      try:
        obj.get_coro().close()
      except Exception:  # noqa: BLE001  the read's own error on close: already reported
        pass
