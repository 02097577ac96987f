"""The docs stay true to the tree: every page under docs/ is reachable from the README,
every relative link resolves (to a heading that exists, where it names one), and every
repository path a page names in backticks (`kvjax/...`, `scripts/...`, `configs/...`,
`tests/...`, `results/...`, `docs/...`) exists, so a moved module or a renamed config fails
here instead of misleading a reader. docs/experiments.md stays a page of findings (at most
600 lines), and no page names a host's load average or a commit of this repository: those
belong to the `NOTES.md` beside the rows under results/."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:kvjax|scripts|configs|tests|results|docs)/[A-Za-z0-9_./\-]+)")
# Paths the pages name as where a command writes, not as files in the tree.
OUTPUTS = {"results/tmp-reproduce/", "results/tp16/p0"}


EXPERIMENTS_MAX_LINES = 600
# "load average 12", "load avg", "at load 14-17", "load ~15": how busy a host was
LOAD = re.compile(r"load[ -]average|load avg\b|loadavg|\bload\s+(?:about\s+|~)?\d", re.I)
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
# "commit 2f04a5b", "commits 6c9d2ac and b69c9e5": named as a commit, whatever git knows
NAMED_COMMIT = re.compile(r"\bcommits?\b\W{0,3}(?:\w+\W{1,3}){0,2}?`?([0-9a-f]{7,40})\b")


def _anchors(page: Path) -> set[str]:
  """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces as hyphens,
  a repeated heading numbered -1, -2, ..."""
  seen: dict[str, int] = {}
  out, fenced = set(), False
  for line in page.read_text().splitlines():
    if line.lstrip().startswith("```"):
      fenced = not fenced
    m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
      seen[slug] = seen.get(slug, -1) + 1
      out.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
  return out


def _stale_links(page: Path, root: Path = ROOT) -> list[str]:
  out = []
  for m in LINK.finditer(page.read_text()):
    target = m.group(1)
    if target.startswith(("http://", "https://", "mailto:")):
      continue
    path, _, anchor = target.partition("#")
    dest = page.parent / path if path else page
    if not dest.exists():
      out.append(f"{page.relative_to(root)}: link ({target})")
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
      out.append(f"{page.relative_to(root)}: link ({target}): no such heading")
  return out


def _load_averages(page: Path, root: Path = ROOT) -> list[str]:
  return [f"{page.relative_to(root)}:{i}: {m.group(0)!r}"
          for i, line in enumerate(page.read_text().splitlines(), 1)
          for m in LOAD.finditer(line)]


def _commits(page: Path, root: Path = ROOT, repo: Path = ROOT) -> list[str]:
  """Strings on the page that name a commit: written as one ("commit 2f04a5b"), or any word
  of 7-40 hex digits that git resolves to a commit of the repository at `repo` (none are
  looked up where git or the repository is missing)."""
  text = page.read_text()
  found = {m.group(1) for m in NAMED_COMMIT.finditer(text)
           if re.search(r"[a-f]", m.group(1)) and re.search(r"\d", m.group(1))}
  words = sorted(set(HEX.findall(text)) - found)
  if words and _has_git(repo):
    res = subprocess.run(["git", "-C", str(repo), "cat-file", "--batch-check"],
                         input="".join(f"{w}^{{commit}}\n" for w in words),
                         capture_output=True, text=True, check=True)
    found |= {w for w, line in zip(words, res.stdout.splitlines())
              if line.split()[1:2] == ["commit"]}  # "<sha> commit <size>", else "<w> missing"
  return [f"{page.relative_to(root)}: {w}" for w in sorted(found)]


def _has_git(repo: Path) -> bool:
  return bool(shutil.which("git")) and (repo / ".git").exists()


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


def test_experiments_page_is_findings_at_most_600_lines():
  n = len((ROOT / "docs" / "experiments.md").read_text().splitlines())
  assert n <= EXPERIMENTS_MAX_LINES, (
      f"docs/experiments.md has {n} lines (at most {EXPERIMENTS_MAX_LINES}): keep one "
      "paragraph of findings per experiment; a run's story goes to the NOTES.md beside its rows")


def test_no_page_names_a_load_average_or_a_commit():
  found = [line for page in PAGES for line in _load_averages(page) + _commits(page)]
  assert not found, ("a host's load average or a commit hash belongs in the NOTES.md beside "
                     "the rows (results/**/NOTES.md), not in the docs: " + "; ".join(found))


@pytest.mark.skipif(not _has_git(ROOT), reason="no git or no .git: commits cannot be looked up")
def test_the_commit_check_knows_this_repository(tmp_path):
  head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"],
                        capture_output=True, text=True, check=True).stdout.strip()
  page = tmp_path / "page.md"
  page.write_text(f"the rows came from {head}; 1234567 needles, config hash `18b204572da3` "
                  "and 0000000 name no commit\n")
  assert _commits(page, tmp_path, repo=ROOT) == [f"page.md: {head}"]


def test_the_checks_catch_a_stale_link_and_path(tmp_path):
  (tmp_path / "kvjax" / "decode").mkdir(parents=True)
  (tmp_path / "kvjax" / "decode" / "step.py").write_text("")
  page = tmp_path / "page.md"
  (tmp_path / "there.md").write_text("# Top\n\n## The cache's axis order — `[L, B]`\n")
  page.write_text("see [a](nowhere.md), [b](there.md#top), [c](https://x.org),\n"
                  "[d](there.md#the-caches-axis-order--l-b), [e](there.md#gone), [f](#see) and\n"
                  "`kvjax/no_such_module.py`, `kvjax/decode/step.py`, `configs/train_`, `kvjax/cache/NAME.py`\n"
                  "\n# See\n\nrun at load average 3.1, then commit 2f04a5b; config hash 18b204572da3;\n"
                  "load ~15 on two cores\n")
  assert _stale_links(page, tmp_path) == ["page.md: link (nowhere.md)",
                                          "page.md: link (there.md#gone): no such heading"]
  assert _stale_paths(page, tmp_path) == ["page.md: `kvjax/no_such_module.py`"]
  assert _load_averages(page, tmp_path) == ["page.md:7: 'load average'", "page.md:8: 'load ~1'"]
  assert _commits(page, tmp_path) == ["page.md: 2f04a5b"]  # named so; tmp_path has no git


# -- docs/architecture.md: short, and its walk names only what the tree has ---------------
# The page starts from the default path of one token; a page that grows past this, or a
# walk that names a function that moved, stops being the map a reader follows.
import ast  # noqa: E402

ARCH = ROOT / "docs" / "architecture.md"
ARCH_MAX_LINES = 420
WALK = "## One token, file by file"
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")
EXTERNAL = {"jax", "lax", "jnp", "np", "nn", "flax"}  # names of libraries, not of kvjax


def _walk(text: str) -> str:
  """The walk section of the page: from its heading to the next `## ` heading."""
  start = text.index(WALK)
  end = text.find("\n## ", start + len(WALK))
  return text[start:end if end >= 0 else len(text)]


def _defined(body) -> set:
  """Names a module's or a class's body defines: functions, classes, assigned names."""
  names = set()
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.add(node.target.id)
  return names


def _definitions(root: Path = ROOT) -> tuple[dict, dict]:
  """Module dotted name -> its top-level names (defs, classes, assignments, imports), and
  class name -> [(its attributes, its base classes' names)] for every class in kvjax."""
  modules, classes = {}, {}
  for path in sorted((root / "kvjax").rglob("*.py")):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    body = ast.parse(path.read_text()).body
    names = _defined(body) | {(a.asname or a.name).split(".")[0] for node in body
                              if isinstance(node, (ast.Import, ast.ImportFrom))
                              for a in node.names}
    for node in body:
      if isinstance(node, ast.ClassDef):
        attrs = _defined(node.body)
        bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
        classes.setdefault(node.name, []).append((attrs, bases))
    modules[".".join(parts)] = names
  return modules, classes


def _has_attrs(cls: str, rest: list[str], classes: dict, seen=()) -> bool:
  """`cls.rest[0]` is an attribute of a kvjax class `cls` (or of a kvjax base class)."""
  if not rest:
    return True
  if len(rest) > 1 or cls in seen:
    return False
  return any(rest[0] in attrs or any(_has_attrs(b, rest, classes, (*seen, cls))
                                     for b in bases if b in classes)
             for attrs, bases in classes.get(cls, ()))


def _names_exist(parts: list[str], modules: dict, classes: dict, keys: set) -> bool:
  """A dotted name as a page writes it: `step.run` (a module's name, the module named by
  its last component: `base.get` in any `base`), `attention.base.program` (submodules),
  `decode.Sampler.from_config` (a class's attribute), `Contiguous.read` (a class's own or
  inherited attribute), `cache.layout` (a config key), or a library's (`jax.lax.scan`)."""
  if parts[0] in EXTERNAL or ".".join(parts) in keys:
    return True
  heads = ["kvjax"] if parts[0] == "kvjax" else \
      [m for m in modules if m.rpartition(".")[2] == parts[0]]
  for mod in heads:
    i = 1
    while i < len(parts) and f"{mod}.{parts[i]}" in modules:
      mod, i = f"{mod}.{parts[i]}", i + 1
    if i == len(parts):
      return True
    if parts[i] in modules[mod] and (i + 1 == len(parts) or
                                     _has_attrs(parts[i], parts[i + 1:], classes)):
      return True
  return parts[0] in classes and _has_attrs(parts[0], parts[1:], classes)


def _unknown_in_walk(text: str, root: Path = ROOT) -> list[str]:
  """Every `kvjax/...` path and dotted name in backticks in the walk that the tree lacks."""
  from kvjax.config import known_keys
  walk = _walk(text)
  modules, classes = _definitions(root)
  keys = set(known_keys())
  out = [f"`{p}`" for p in dict.fromkeys(re.findall(r"`(kvjax/[\w./\-]+)`", walk))
         if not (root / p).exists()]
  out += [f"`{n}`" for n in dict.fromkeys(DOTTED.findall(walk))
          if not _names_exist(n.split("."), modules, classes, keys)]
  return out


def test_architecture_is_short_and_its_walk_names_what_exists():
  text = ARCH.read_text()
  lines = len(text.splitlines())
  assert lines <= ARCH_MAX_LINES, \
      f"docs/architecture.md has {lines} lines (at most {ARCH_MAX_LINES})"
  walk = _walk(text)
  assert re.search(r"^1\. \*\*`kvjax/", walk, re.M) and len(DOTTED.findall(walk)) > 50, \
      "the walk no longer names the files and functions of the path, step by step"
  found = _unknown_in_walk(text)
  assert not found, \
      "the walk in docs/architecture.md names what the tree lacks: " + ", ".join(found)


def test_the_walk_check_catches_a_stale_name():
  page = ("intro\n" + WALK + "\n1. **`kvjax/decode/step.py`**: `step.run`, `step.no_such`, "
          "`Contiguous.read`, `Contiguous.attach`, `Contiguous.nope`, "
          "`decode.Sampler.from_config`, `attention.base.program`, `gone.run`, `cache.layout`, "
          "`cache.nope`, `jax.lax.scan`, "
          "`kvjax/gone.py`\n## Next\n`step.also_gone` is outside the walk\n")
  assert _unknown_in_walk(page) == ["`kvjax/gone.py`", "`step.no_such`", "`Contiguous.nope`",
                                    "`gone.run`", "`cache.nope`"]


def _anchors(page: Path) -> set[str]:
  """GitHub's anchors of a page's headings: lowercased, punctuation but `-` and `_` dropped,
  spaces as `-`, a repeated heading numbered (`-1`, ...); fenced code is not a heading."""
  out, seen, fenced = set(), {}, False
  for line in page.read_text().splitlines():
    if line.startswith("```"):
      fenced = not fenced
    m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
    if m:
      slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
      out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
      seen[slug] = seen.get(slug, 0) + 1
  return out


def _stale_anchors(page: Path, root: Path = ROOT) -> list[str]:
  out = []
  for m in LINK.finditer(page.read_text()):
    target, _, anchor = m.group(1).partition("#")
    dest = page.parent / target if target else page
    if not anchor or target.startswith(("http://", "https://", "mailto:")) \
        or dest.suffix != ".md" or not dest.exists():
      continue
    if anchor not in _anchors(dest):
      out.append(f"{page.relative_to(root)}: link ({m.group(1)})")
  return out


def test_every_anchor_link_names_a_heading():
  found = [line for page in PAGES for line in _stale_anchors(page)]
  assert not found, "links to a heading that is not there: " + "; ".join(found)


def test_the_anchor_check_catches_a_renamed_heading(tmp_path):
  (tmp_path / "there.md").write_text(
      "# Top\n## One token, file by file\n```\n# not a heading\n```\n")
  page = tmp_path / "page.md"
  page.write_text("[a](there.md#one-token-file-by-file) [b](there.md#gone) "
                  "[c](there.md#not-a-heading) [d](#local) [e](https://x.org/y.md#z)\n"
                  "## Local\n")
  assert _stale_anchors(page, tmp_path) == ["page.md: link (there.md#gone)",
                                            "page.md: link (there.md#not-a-heading)"]


def test_the_shape_glossary_is_the_letters_names_use():
  """Every letter a shape-suffixed name in kvjax/ ends in (`q_BKGTD`) is in the glossary
  table of docs/architecture.md and in kvjax/config's one-line version, and neither lists a
  letter no name uses."""
  import re
  used = set()
  for path in (ROOT / "kvjax").rglob("*.py"):
    for m in re.finditer(r"\b[a-z][a-z0-9]*_([A-Z]{1,8})\b", path.read_text()):
      used |= set(m.group(1))
  doc = (ROOT / "docs" / "architecture.md").read_text()
  table = set(re.findall(r"^\| ([A-Z]) \|", doc, flags=re.M))
  face = (ROOT / "kvjax" / "config" / "__init__.py").read_text().split('"""')[1]
  line = face[face.index("Shape letters"):face.index("This package face")]
  listed = set(re.findall(r"(?:^|, |\n)([A-Z]) ", line))
  assert table == used, (sorted(table - used), sorted(used - table))
  assert listed == used, (sorted(listed - used), sorted(used - listed))
