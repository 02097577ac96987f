"""The docs stay true to the tree: every page under docs/ is reachable from the README,
every relative link resolves, and every repository path a page names in backticks
(`kvjax/...`, `scripts/...`, `configs/...`, `tests/...`, `results/...`, `docs/...`) exists,
so a moved module or a renamed config fails here instead of misleading a reader."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:kvjax|scripts|configs|tests|results|docs)/[A-Za-z0-9_./\-]+)")
# Paths the pages name as where a command writes, not as files in the tree.
OUTPUTS = {"results/tmp-reproduce/", "results/tp16/p0"}


def _stale_links(page: Path, root: Path = ROOT) -> list[str]:
  out = []
  for m in LINK.finditer(page.read_text()):
    target = m.group(1)
    if target.startswith(("http://", "https://", "#", "mailto:")):
      continue
    if not (page.parent / target.split("#")[0]).exists():
      out.append(f"{page.relative_to(root)}: link ({target})")
  return out


def _stale_paths(page: Path, root: Path = ROOT) -> list[str]:
  out = []
  for m in PATH.finditer(page.read_text()):
    path = m.group(1).rstrip(".")
    if path.endswith("_") or "NAME" in path or path in OUTPUTS:  # a prefix or a pattern
      continue
    if not (root / path).exists():
      out.append(f"{page.relative_to(root)}: `{path}`")
  return out


def test_every_page_is_linked_from_the_readme():
  readme = (ROOT / "README.md").read_text()
  missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
  assert not missing, f"docs pages the README does not link: {missing}"


def test_every_relative_link_resolves():
  found = [line for page in PAGES for line in _stale_links(page)]
  assert not found, "links to nothing: " + "; ".join(found)


def test_every_named_repository_path_exists():
  found = [line for page in PAGES for line in _stale_paths(page)]
  assert not found, "paths the docs name that the tree does not have: " + "; ".join(found)


def test_the_checks_catch_a_stale_link_and_path(tmp_path):
  (tmp_path / "kvjax").mkdir()
  (tmp_path / "kvjax" / "step.py").write_text("")
  (tmp_path / "there.md").write_text("")
  page = tmp_path / "page.md"
  page.write_text("see [a](nowhere.md), [b](there.md#top), [c](https://x.org) and\n"
                  "`kvjax/no_such_module.py`, `kvjax/step.py`, `configs/train_`, `kvjax/cache/NAME.py`\n")
  assert _stale_links(page, tmp_path) == ["page.md: link (nowhere.md)"]
  assert _stale_paths(page, tmp_path) == ["page.md: `kvjax/no_such_module.py`"]
