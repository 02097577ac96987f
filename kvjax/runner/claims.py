"""Advisory locks for runs that share a results folder (`fcntl.flock`: a lock is released
when its holder's process ends, so a crashed run never blocks another).

- `locked(out, name)`: one results file's lock, held while a run repairs the file, re-reads
  the results, or appends a cell's rows (a cell's rows are written together under it).
- `claimed(out, key, wait)`: a cell's claim, held while a run runs that cell. Another run
  passes over a cell it cannot claim; it comes back to it after the rest and waits for the
  claim, then runs the cell only if its holder ended without finishing it.

The lock files live in `OUT/.kvjax-locks/` and stay there: removing a lock file that another
process may be waiting on would let two processes hold "the same" lock. A lock holds between
processes of one machine; runs on several machines sharing a folder use `--shard`
(kvjax.runner.shard), which gives each its own results file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_DIR = ".kvjax-locks"


def _open(out: str | Path, name: str) -> int:
  folder = Path(out) / LOCK_DIR
  folder.mkdir(parents=True, exist_ok=True)
  return os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def locked(out: str | Path, name: str):
  """Hold the exclusive lock named `name` in folder `out` (waiting for it)."""
  fd = _open(out, name + ".lock")
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def claimed(out: str | Path, key: str, wait: bool):
  """Claim cell `key` in folder `out`; yields whether this process holds it (with `wait`,
  always True once the current holder, if any, has let go)."""
  fd = _open(out, key + ".claim")
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
      yield False
      return
    yield True
  finally:
    os.close(fd)
