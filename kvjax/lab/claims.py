"""Advisory locks for runs that share a results folder (`fcntl.flock`: a lock is released
when its holder's process ends, so a crashed run never blocks another).

- `locked(out, name)`: one results file's lock, held while a run repairs the file, re-reads
  the results, or appends a cell's rows (a cell's rows are written together under it).
- `claimed(out, key, wait)`: a cell's claim, held while a run runs that cell. Another run
  passes over a cell it cannot claim; it comes back to it after the rest and waits for the
  claim, then runs the cell only if its holder ended without finishing it.
- `sole_writer(out, command)`: the whole folder, held by `kvjax train` and `kvjax convert`
  while they write a checkpoint there; a second writer is refused in one line.

The lock files live in `OUT/.kvjax-locks/` only while held: a holder removes its file
before it lets go, and a process that locked a file it finds removed (or replaced) drops it
and tries again, so two processes never hold "the same" lock through two files. `tidy`
removes the folder once it is empty; a crashed holder's file stays until the next holder of
that lock removes it. A lock holds between processes of one machine; runs on several
machines sharing a folder use `--shard` (kvjax.lab.runner.shard), each with its own file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from kvjax.errors import KvjaxError

LOCK_DIR = ".kvjax-locks"


def _acquire(out: str | Path, name: str, wait: bool) -> tuple[int, Path] | None:
  """(descriptor, path) of lock file `name` with its flock held, or None (`wait` False and
  another process holds it)."""
  path = Path(out) / LOCK_DIR / name
  while True:
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (FileNotFoundError, FileExistsError, NotADirectoryError):
      # the nearest thing that exists on the way: a file there never becomes a folder (no spin)
      there = next((p for p in (path.parent, *path.parent.parents) if os.path.lexists(p)), None)
      if there is not None and not there.is_dir():
        where = "kvjax keeps its lock files" if there == path.parent else "--out needs a folder"
        raise KvjaxError(f"{there} is a file where {where}; remove it, or choose another "
                         "--out") from None
      continue  # the folder was tidied away in between (mkdir's FileExistsError after EEXIST)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
      os.close(fd)
      return None
    try:
      if os.stat(path).st_ino == os.fstat(fd).st_ino:
        return fd, path
    except FileNotFoundError:
      pass
    os.close(fd)  # its holder removed the file before letting go: lock the new one


def _release(fd: int, path: Path) -> None:
  try:
    os.unlink(path)  # while still held, so nobody else holds a lock on this file
  except FileNotFoundError:
    pass
  os.close(fd)


@contextlib.contextmanager
def locked(out: str | Path, name: str):
  """Hold the exclusive lock named `name` in folder `out` (waiting for it)."""
  fd, path = _acquire(out, name + ".lock", wait=True)
  try:
    yield
  finally:
    _release(fd, path)


@contextlib.contextmanager
def claimed(out: str | Path, key: str, wait: bool):
  """Claim cell `key` in folder `out`; yields whether this process holds it (with `wait`,
  always True once the current holder, if any, has let go)."""
  got = _acquire(out, key + ".claim", wait)
  try:
    yield got is not None
  finally:
    if got is not None:
      _release(*got)


@contextlib.contextmanager
def sole_writer(out: str | Path, command: str):
  """Hold folder `out` for one writer (`kvjax train`, `kvjax convert`) for as long as it
  writes: a second writer into the same folder is a one-line KvjaxError, not a race with
  the first inside the checkpoint library."""
  created = not os.path.lexists(out)
  try:
    with claimed(out, "writer", wait=False) as mine:
      if not mine:
        raise KvjaxError(f"another kvjax process is writing {out} (a train or convert into the "
                         f"same folder); wait for it to end, or give this {command} another --out")
      yield
  finally:
    tidy(out)
    if created:  # made only to hold the lock: a writer that failed leaves no empty folder
      with contextlib.suppress(OSError):
        os.rmdir(out)


def tidy(out: str | Path) -> None:
  """Remove `OUT/.kvjax-locks` if no lock file is left in it."""
  try:
    os.rmdir(Path(out) / LOCK_DIR)
  except OSError:  # not empty (another run holds a lock) or already gone
    pass
