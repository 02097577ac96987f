"""Reading YAML strictly: config files and `--set` values, each problem one line.

PyYAML's SafeLoader merges a key written twice (two `model:` sections: the second wins
silently), builds self-referencing anchors (`a: &x [*x]`) into cyclic objects that every
later walk recurses on without bound, and expands nested aliases exponentially. The loader
here refuses all three while the document is built, and a file that is not UTF-8 is named
as such; every refusal is a `KvjaxError` that names the file (or `--set` item) and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvjax.config import jsonfile
from kvjax.errors import KvjaxError

# Values a document may expand to through its aliases (each alias counts its whole subtree).
MAX_VALUES = 100_000
_MERGE = "tag:yaml.org,2002:merge"


class SyntaxProblem(KvjaxError):
  """Text that is not YAML at all (where a `--set` value may be plain text instead)."""


class StrictLoader(yaml.SafeLoader):
  """SafeLoader that refuses duplicate mapping keys, alias cycles and alias bombs."""

  where = "the YAML"

  def compose_document(self):
    node = super().compose_document()
    _check_graph(node, self.where)
    return node

  def construct_mapping(self, node, deep=False):
    if isinstance(node, yaml.MappingNode):
      seen: dict = {}
      for key_node, _ in node.value:  # the node's own keys; `<<:` merges may be overridden
        if key_node.tag == _MERGE:
          continue
        key = self.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
          first = seen.get(key)
        except TypeError:
          raise KvjaxError(f"{self.where} line {line}: a mapping key must be a scalar, got "
                           f"{type(key).__name__}; quote it or fix the indentation") from None
        if first is not None:
          raise KvjaxError(f"{self.where} line {line}: duplicate key '{key}' (first at line "
                           f"{first}); keep one and merge their contents")
        seen[key] = line
    return super().construct_mapping(node, deep)


def _children(node) -> list:
  if isinstance(node, yaml.SequenceNode):
    return list(node.value)
  if isinstance(node, yaml.MappingNode):
    return [n for pair in node.value for n in pair]
  return []


def _check_graph(node, where: str) -> None:
  """Refuse an alias that refers to a node containing it (a cycle) and a document whose
  aliases expand to more than MAX_VALUES values; iterative, so depth costs no recursion."""
  if node is None:
    return
  size: dict[int, int] = {}
  on_path: set[int] = set()
  stack = [(node, False)]
  while stack:
    cur, done = stack.pop()
    key = id(cur)
    if done:
      on_path.discard(key)
      size[key] = 1 + sum(size[id(c)] for c in _children(cur))
      if size[key] > MAX_VALUES:
        raise KvjaxError(f"{where}: its anchors and aliases expand to more than "
                         f"{MAX_VALUES:,} values; write the values out or use fewer aliases")
      continue
    if key in size:
      continue
    if key in on_path:
      raise KvjaxError(f"{where} line {cur.start_mark.line + 1}: an anchor refers to itself "
                       "through an alias (a cycle); replace the alias with the values")
    on_path.add(key)
    stack.append((cur, True))
    for child in _children(cur):
      if id(child) in on_path:
        raise KvjaxError(f"{where} line {child.start_mark.line + 1}: an anchor refers to "
                         "itself through an alias (a cycle); replace the alias with the values")
      if id(child) not in size:
        stack.append((child, False))


def parse(text: str, where: str) -> Any:
  """The value of one YAML document, strictly (see the module doc); `where` names its
  origin in messages (`config file x.yaml`, `--set a=b`)."""
  loader = None
  try:
    loader = StrictLoader(text)  # its reader refuses control characters right here
    loader.where = where
    value = loader.get_single_data()
  except yaml.reader.ReaderError as e:
    raise SyntaxProblem(f"malformed YAML in {where}: {e.reason} (#x{e.character:04x} at "
                        f"character {e.position}); remove that character") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    line = f" line {mark.line + 1}" if mark else ""
    problem = getattr(e, "problem", None) or "invalid YAML"
    raise SyntaxProblem(f"malformed YAML in {where}{line}: {problem}; fix the syntax") from None
  except RecursionError:
    raise KvjaxError(f"{where} nests too deeply to read; flatten its structure") from None
  finally:
    if loader is not None:
      loader.dispose()
  if jsonfile.depth(value) > jsonfile.MAX_DEPTH:
    raise KvjaxError(f"{where} nests deeper than {jsonfile.MAX_DEPTH} levels; flatten its "
                     "structure")
  return value


def read(path: str | Path) -> Any:
  """The value of a YAML file, strictly; a missing, unreadable or non-UTF-8 file, and one
  that is not a regular file (a FIFO, a folder), is one line."""
  path = Path(path)
  raw = jsonfile.read_bytes(path, "config file", "pass a YAML file")
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise KvjaxError(f"config file {path} is not UTF-8 text (byte {e.start} is "
                     f"0x{raw[e.start]:02x}); save it as UTF-8") from None
  return parse(text, f"config file {path}")
