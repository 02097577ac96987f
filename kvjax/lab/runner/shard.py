"""`kvjax run FILE --shard I/N`: the I-th (1-based) of N disjoint parts of a grid, for a
sweep split over processes or machines (a job array) into one `--out` folder.

Cells that share work stay in one part: an experiment may define `share_key(cfg)`, and the
cells with one key form a group (long_context: the settings of one context share its
prefill); without it every cell is its own group. Groups, in grid order, are dealt to the
parts in turn (group k to part k mod N + 1), so the N parts cover the grid with no cell in
two of them (the parts come from the grid: give every part the same config and `--set`).
Each part writes its own file, `<experiment>.shard-I-of-N.jsonl` (a lock does
not hold across machines on a shared filesystem); every reader merges the files of a folder
(`results_files`), the first complete row of a cell winning.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvjax.errors import KvjaxError

_SHARD_FILE = re.compile(r"\.shard-(\d+)-of-(\d+)\.jsonl$")


def parse(text: str | None) -> tuple[int, int] | None:
  """`I/N` -> (I, N), or None for no shard; a one-line error for anything else."""
  if text is None:
    return None
  m = re.fullmatch(r"\s*([0-9]{1,9})\s*/\s*([0-9]{1,9})\s*", str(text))
  if not m:
    raise KvjaxError(f"--shard {text!r} is not I/N; give the part to run and the number of "
                     "parts, 1-based: --shard 1/4 ... --shard 4/4")
  i, n = int(m.group(1)), int(m.group(2))
  if n < 1:
    raise KvjaxError(f"--shard {text}: N, the number of parts, must be at least 1")
  if not 1 <= i <= n:
    raise KvjaxError(f"--shard {text}: I must be between 1 and N={n} (1-based: --shard 1/{n} "
                     f"... --shard {n}/{n})")
  return i, n


def groups(cells: list, module) -> list[list]:
  """Cells grouped by the experiment's `share_key` (each cell alone without one), in grid
  order."""
  share = getattr(module, "share_key", None)
  out: dict = {}
  for cell in cells:
    out.setdefault(share(cell.cfg) if share else cell.hash, []).append(cell)
  return list(out.values())


def select(cells: list, module, shard: tuple[int, int] | None) -> list:
  """The cells of part `shard` = (I, N); every cell for None."""
  if shard is None:
    return cells
  i, n = shard
  return [c for k, group in enumerate(groups(cells, module)) if k % n == i - 1 for c in group]


def file_name(experiment: str, shard: tuple[int, int] | None) -> str:
  return f"{experiment}.jsonl" if shard is None else \
      f"{experiment}.shard-{shard[0]}-of-{shard[1]}.jsonl"


def results_files(folder: str | Path, experiment: str) -> list[Path]:
  """An experiment's results files in a folder: the plain one, then its shards by (N, I)."""
  folder = Path(folder)
  shards = []
  for path in folder.glob(f"{experiment}.shard-*-of-*.jsonl"):
    m = _SHARD_FILE.search(path.name)
    if m and path.name == file_name(experiment, (int(m.group(1)), int(m.group(2)))):
      shards.append(((int(m.group(2)), int(m.group(1))), path))
  return [folder / file_name(experiment, None)] + [p for _, p in sorted(shards)]
