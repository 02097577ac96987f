"""The host-side page allocator of the serving engine (the device layout is
kvjax/cache/paged.py).

`PageAllocator` keeps the free list, reference counts and the prefix cache (full pages
keyed by a chained digest of all tokens up to the page's end, `page_keys`, vLLM style),
with least-recently-used eviction of unreferenced cached pages. `kvjax.lab.serve.engine`
drives it; nothing here touches a device.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def page_keys(tokens: list[int], page: int, n_pages: int, start: bytes = b"") -> list[bytes]:
  """Chained digests of the first `n_pages` full pages: key i covers tokens [0, (i+1) * page),
  so equal keys mean equal prefixes (a 128-bit digest; vLLM chains Python hashes)."""
  keys, parent = [], start
  for i in range(n_pages):
    chunk = np.asarray(tokens[i * page:(i + 1) * page], np.int64).tobytes()
    parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
    keys.append(parent)
  return keys


class PageAllocator:
  """Free list, reference counts and a prefix cache of full pages, all on the host.

  Every page is in exactly one state: free (refs 0, no key), cached-idle (refs 0, keyed,
  in the LRU, still holding its tokens for a later hit) or in use (refs > 0, keyed or
  not). `allocate` takes a free page, else evicts the least recently used idle page.
  """

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
    self.refs = [0] * num_pages
    self.by_key: dict[bytes, int] = {}
    self.key_of: dict[int, bytes] = {}
    self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
    self.evictions = 0

  def available(self) -> int:
    return len(self.free) + len(self.idle)

  def allocate(self) -> int | None:
    if self.free:
      page = self.free.pop()
    elif self.idle:
      page, _ = self.idle.popitem(last=False)
      del self.by_key[self.key_of.pop(page)]
      self.evictions += 1
    else:
      return None
    self.refs[page] = 1
    return page

  def release(self, page: int) -> None:
    if self.refs[page] <= 0:
      raise AssertionError(f"page {page} released with refcount {self.refs[page]}")
    self.refs[page] -= 1
    if self.refs[page] == 0:
      if page in self.key_of:
        self.idle[page] = None
      else:
        self.free.append(page)

  def peek(self, key: bytes) -> int | None:
    return self.by_key.get(key)

  def share(self, key: bytes) -> int | None:
    """Take a reference to the cached page holding `key`'s tokens, if any."""
    page = self.by_key.get(key)
    if page is not None:
      if self.refs[page] == 0:
        del self.idle[page]
      self.refs[page] += 1
    return page

  def register(self, page: int, key: bytes) -> None:
    """Offer a full, in-use page to the prefix cache (a duplicate of a cached key stays private)."""
    if key not in self.by_key and page not in self.key_of:
      self.by_key[key] = page
      self.key_of[page] = key

  def writable(self, page: int) -> bool:
    """Only a page its one owner is still filling may be written: never a shared or cached one."""
    return self.refs[page] == 1 and page not in self.key_of

  def check(self) -> None:
    """Assert the invariants (tests call this after every operation)."""
    free, idle = set(self.free), set(self.idle)
    assert len(free) == len(self.free), "a page is on the free list twice"
    assert not free & idle, "a page is both free and cached"
    assert all(r >= 0 for r in self.refs), "negative refcount"
    for p in range(self.num_pages):
      in_use = self.refs[p] > 0
      states = in_use + (p in free) + (p in idle)
      assert states == 1, f"page {p} is in {states} states (in use / free / cached idle)"
      assert (p in idle) <= (p in self.key_of), f"idle page {p} has no key"
      assert (p in free) <= (p not in self.key_of), f"free page {p} still has a key"
    assert {self.by_key[k]: k for k in self.by_key} == self.key_of, "key maps disagree"
