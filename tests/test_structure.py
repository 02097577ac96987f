"""The package's shape, held by tests: no import cycle between kvjax modules at any depth
(an import inside a function is an edge too: it runs on the first call, and a cycle it
closes is a layering that only works by the order modules happen to load), no module over
400 lines (a review signal that a module holds more than one concern, not a squeeze), and
no private name (`_x`) reached into from another module, and no import from the library
into the lab (LIBRARY, LAB below). Each test lists
every offender (file and line), so a failure says what to move."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvjax"
MAX_LINES = 400


def _modules(pkg: Path = PKG) -> dict[str, Path]:
  """Dotted module name -> file, for every .py under `pkg` (a package is its __init__)."""
  out = {}
  for path in sorted(pkg.rglob("*.py")):
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


MODULES = _modules()


def _package_of(name: str, path: Path) -> str:
  return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _absolute(node: ast.ImportFrom, name: str, path: Path) -> str:
  """The module a `from X import ...` names, relative imports resolved."""
  if not node.level:
    return node.module or ""
  base = _package_of(name, path).split(".")
  base = base[:len(base) - (node.level - 1)]
  return ".".join(base + ([node.module] if node.module else []))


def _kvjax_module(dotted: str, modules: dict[str, Path] = MODULES) -> str | None:
  """The longest module of `modules` that `dotted` names or lies inside, or None."""
  while dotted:
    if dotted in modules:
      return dotted
    dotted = dotted.rpartition(".")[0]
  return None


def _edges(name: str, path: Path, modules: dict[str, Path] = MODULES) -> dict[str, int]:
  """Modules `name` imports, anywhere in the file (module level, inside functions and
  branches), each with the line of its first import. Importing a submodule also imports
  its parent packages first; that implicit edge is left out, but a submodule that names its
  own package (`from kvjax.cache import Spec` inside kvjax/cache/paged.py) is an edge."""
  out: dict[str, int] = {}
  for node in ast.walk(ast.parse(path.read_text())):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = _absolute(node, name, path)
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        targets.append(sub if sub in modules else base)
    for target in targets:
      mod = _kvjax_module(target, modules)
      if mod and mod != name:
        out[mod] = min(out.get(mod, node.lineno), node.lineno)
  return out


def _graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
  return {name: _edges(name, path, modules) for name, path in modules.items()}


def _described(cycle: list[str], graph: dict[str, dict[str, int]],
               modules: dict[str, Path], root: Path) -> str:
  """`a (a.py:12) -> b (b.py:40) -> a`: each module with the line of its import of the next."""
  hops = [f"{a} ({modules[a].relative_to(root)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
  return " -> ".join(hops + [cycle[-1]])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle [a, b, ..., a] of `graph` found by depth-first search, or None."""
  state: dict[str, int] = {}  # 1: on the stack, 2: done
  stack: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Cycles of `graph`, each found after cutting the closing edge of the ones before it,
  so every cycle is listed at least once by one of its edges."""
  graph = {k: set(v) for k, v in graph.items()}
  out = []
  while (cycle := _find_cycle(graph)) is not None:
    out.append(cycle)
    graph[cycle[-2]].discard(cycle[-1])
  return out


def test_find_cycle_finds_one():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
  assert _cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}) == [["a", "b", "a"],
                                                                ["b", "c", "b"]]


def _cycle_report(pkg: Path) -> list[str]:
  """Every import cycle of the package at `pkg`, each described with files and lines."""
  modules = _modules(pkg)
  graph = _graph(modules)
  return [_described(c, graph, modules, pkg.parent)
          for c in _cycles({k: set(v) for k, v in graph.items()})]


def test_no_import_cycle():
  found = _cycle_report(PKG)
  assert not found, "import cycles between kvjax modules (imports inside functions count): " \
      + "; ".join(found)


def _package_cycle_report(pkg: Path) -> list[str]:
  """Cycles between packages: each module stands for the package that holds it, and an
  import of a module in an enclosing package (kvjax.lab.runner -> kvjax.lab.data) is left
  out (a package may use what its parents hold); each cycle with one import per hop."""
  modules = _modules(pkg)
  graph = _graph(modules)
  home = {n: _package_of(n, p) for n, p in modules.items()}
  edges: dict[str, dict[str, str]] = {}
  for a, out in graph.items():
    for b, line in out.items():
      pa, pb = home[a], home[b]
      if pa != pb and not pa.startswith(pb + "."):
        where = f"{a} ({modules[a].relative_to(pkg.parent)}:{line})"
        edges.setdefault(pa, {}).setdefault(pb, where)
  return [" -> ".join(edges[x][y] for x, y in zip(c, c[1:])) + f" -> {c[-1]}"
          for c in _cycles({k: set(v) for k, v in edges.items()})]


def test_no_import_cycle_between_packages(tmp_path):
  """A package-level cycle (two packages each importing a module of the other) is a
  layering the module test does not see; the check finds one that is planted."""
  assert not _package_cycle_report(PKG), "; ".join(_package_cycle_report(PKG))
  for name, text in {"a/__init__.py": "", "a/x.py": "from p.b import y\n",
                     "b/__init__.py": "", "b/y.py": "", "b/z.py": "from p.a import x\n",
                     "__init__.py": ""}.items():
    (tmp_path / "p" / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "p" / name).write_text(text)
  found = _package_cycle_report(tmp_path / "p")
  assert len(found) == 1 and "p.a.x" in found[0] and "p.b.z" in found[0], found


# The ground floor: what these import, at any depth, is each other and nothing else, so any
# module may import them (the registries add their checks to the config, `config.add_check`).
GROUND = ("kvjax.config", "kvjax.errors", "kvjax.plugins")


def test_config_is_the_ground_floor():
  graph = _graph(MODULES)
  ground = {n for n in MODULES if any(n == g or n.startswith(g + ".") for g in GROUND)}
  found = [f"{n} ({MODULES[n].relative_to(ROOT)}:{line}) imports {m}"
           for n in sorted(ground) for m, line in sorted(graph[n].items()) if m not in ground]
  assert not found, "the ground floor imports from above it: " + "; ".join(found)


# The library and the lab, in the layout itself. The lab measures the library: experiments
# and their runner, plots, tasks, metrics and intervals, results files and figures,
# evaluation, training, conversion, the size report and the serving bench, all under
# `kvjax/lab/`. The faces (the CLI and the Python facade) call both. Every other module is
# the library: model, caches, codecs, attention, policies, config, io, kernels, bytes and
# `kvjax/decode/` (the step, the token loop, the prefill and compaction programs, generate
# and placement). The library never imports the lab or a face, at any depth
# (function-level imports included), so it can be read, and reused, alone.
def _in(name: str, prefixes) -> bool:
  """Whether module `name` is one of `prefixes` or inside one of them."""
  return any(name == p or name.startswith(p + ".") for p in prefixes)


LAB = ("kvjax.lab",)
FACES = ("kvjax.cli", "kvjax.api", "kvjax.api_types", "kvjax.faces")
LIBRARY = tuple(n for n in MODULES if n != "kvjax" and not _in(n, LAB + FACES))


def _reached(graph: dict[str, dict[str, int]], roots) -> dict[str, list[str]]:
  """Every module `roots` import at any depth, each with one chain of imports from a root."""
  chains = {r: [r] for r in roots if r in graph}
  todo = list(chains)
  while todo:
    node = todo.pop(0)
    for nxt in sorted(graph.get(node, ())):
      if nxt not in chains:
        chains[nxt] = chains[node] + [nxt]
        todo.append(nxt)
  return chains


def test_reached_follows_imports_at_any_depth():
  graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {}, "d": {"a": 3}}
  assert _reached(graph, ["a"]) == {"a": ["a"], "b": ["a", "b"], "c": ["a", "b", "c"]}


def test_the_library_imports_nothing_from_the_lab():
  assert "kvjax.decode" in LIBRARY and "kvjax.decode.step" in LIBRARY and "kvjax.model" in LIBRARY
  assert any(_in(n, LAB) for n in MODULES) and all(any(_in(n, [f]) for n in MODULES)
                                                    for f in FACES), "a LAB or FACES name went stale"
  reached = _reached(_graph(MODULES), LIBRARY)
  found = [" -> ".join(chain) for name, chain in sorted(reached.items())
           if _in(name, LAB + FACES)]
  assert not found, "the library imports the lab or a face: " + "; ".join(found)


def test_the_lab_lives_under_kvjax_lab():
  """Each module the lab is made of sits under `kvjax/lab/`, so the tree shows the split:
  the library's top level holds no experiment, plot, task, metric or results module."""
  lab_words = ("experiment", "runner", "plot", "task", "metric", "interval", "figure",
               "rowfile", "evaluat", "train", "distill", "serve", "engine", "sizing")
  found = [n for n in LIBRARY if any(w in n.rpartition(".")[2] for w in lab_words)]
  assert not found, "lab modules outside kvjax/lab: " + ", ".join(found)


# The test modules that hold all three rooms to a contract, kept beside conftest.py.
CONTRACTS = {"test_structure.py", "test_docs.py", "test_golden.py", "test_qwen2.py",
             "test_gemma3.py", "test_registries.py"}


def test_the_tests_mirror_the_rooms():
  """Each test module sits in the room of what it tests (tests/library, tests/lab,
  tests/faces), or is one of the named contracts across them at tests/."""
  tests = ROOT / "tests"
  top = {p.name for p in tests.glob("test_*.py")}
  assert top == CONTRACTS, f"test modules outside a room: {sorted(top - CONTRACTS)}; " \
      f"contracts that are gone: {sorted(CONTRACTS - top)}"
  rooms = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
  assert rooms == {"library", "lab", "faces"}, rooms
  names = [p.name for p in tests.rglob("test_*.py")]
  assert len(names) == len(set(names)), "two test modules share a name across rooms"


def test_a_cycle_through_a_function_level_import_is_reported(tmp_path):
  """The check itself: a throwaway package whose two modules import each other, one of them
  only inside a function, is reported with both files and lines; without that import the
  package is clean."""
  pkg = tmp_path / "toy"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "low.py").write_text("X = 1\n\n\ndef late():\n  from toy import high\n  return high.Y\n")
  (pkg / "high.py").write_text("from toy import low\n\nY = low.X\n")
  found = _cycle_report(pkg)
  assert len(found) == 1 and "toy.low (toy/low.py:5)" in found[0] \
      and "toy.high (toy/high.py:1)" in found[0], found
  (pkg / "low.py").write_text("X = 1\n")
  assert _cycle_report(pkg) == []


def test_no_module_over_the_line_limit():
  long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
          if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines (split them): " + ", ".join(
      f"{p} ({n})" for p, n in sorted(long.items()))


def _private(attr: str) -> bool:
  return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _private_uses(name: str, path: Path) -> list[str]:
  """`alias._x` on an imported kvjax module, and `from kvjax.x import _x`, anywhere in the
  file (imports inside functions count too), as 'file:line: text'."""
  tree = ast.parse(path.read_text())
  rel = path.relative_to(ROOT)
  aliases, found = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if _kvjax_module(a.name):
          aliases.add(a.asname or a.name)
    elif isinstance(node, ast.ImportFrom):
      base = _absolute(node, name, path)
      if not _kvjax_module(base):
        continue
      for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in MODULES:
          aliases.add(a.asname or a.name)
        elif _private(a.name):
          found.append(f"{rel}:{node.lineno}: from {base} import {a.name}")
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _private(node.attr):
      base = node.value
      dotted = []
      while isinstance(base, ast.Attribute):
        dotted.append(base.attr)
        base = base.value
      if isinstance(base, ast.Name):
        dotted.append(base.id)
        text = ".".join(reversed(dotted))
        if text in aliases or text in MODULES:
          found.append(f"{rel}:{node.lineno}: {text}.{node.attr}")
  return found


def test_no_private_name_across_modules():
  found = sorted(hit for name, path in MODULES.items() for hit in _private_uses(name, path))
  assert not found, "private names used from another module (make them public where they " \
      "are defined, or move the code): " + "; ".join(found)


def _lines(pattern: str, owner, skip=lambda line: False) -> list[str]:
  """`path:line` of every line that matches `pattern` (and is not `skip`ped) in a kvjax
  module other than the decision's `owner(name)`: a second route of that decision."""
  import re
  test = re.compile(pattern)
  return [f"{path.relative_to(ROOT)}:{i}" for name, path in MODULES.items() if not owner(name)
          for i, line in enumerate(path.read_text().splitlines(), 1)
          if test.search(line) and not skip(line)]


# Each decision the compiled programs depend on is made in one function of the library (the
# resolver), and `tell` marks making it: a match anywhere else in the library (docstrings,
# comments and `def` lines aside) is a second resolver. Everything else reads the answer.
DECISIONS = {
    "program": ("kvjax.attention.base", "program", r"default_backend\(\)\s*[!=]=\s*[\"']cpu"),
    "layer loop": ("kvjax.decode.step", "layer_loop",
                   r"(?<![\w])unrolled\(|\.layer_loop\s*[!=]=\s*[\"']auto"),
    "read route": ("kvjax.attention.base", "resolve",
                   r"[\"']native[\"']\s+if\b|\belse\s+[\"']native[\"']"),
    "built layout": ("kvjax.cache", "built", r"(?<![\w.])compacted\(|\.compacted\("),
    "mesh": ("kvjax.decode.sharding", "_mesh", r"(?<![\w])Mesh\("),
}


def _code_lines(path: Path) -> tuple[list[str], set[int], list[tuple[int, int, str]]]:
  """The file's lines, its docstrings' line numbers, and (first, last, name) of every
  function (methods included), outermost first."""
  tree = ast.parse(path.read_text())
  doc: set[int] = set()
  funcs = []
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
        isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
      doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      funcs.append((node.lineno, node.end_lineno, node.name))
  return path.read_text().splitlines(), doc, sorted(funcs, key=lambda f: f[0] - f[1])


def _decision_sites(pattern: str, names) -> list[tuple[str, int, str]]:
  """(module, line, outermost function or "") of each code line matching `pattern`."""
  import re
  test, out = re.compile(pattern), []
  for name in names:
    lines, doc, funcs = _code_lines(MODULES[name])
    for i, line in enumerate(lines, 1):
      code = line.split("#")[0]
      if i in doc or code.lstrip().startswith("def ") or not test.search(code):
        continue
      out.append((name, i, next((f for a, b, f in funcs if a <= i <= b), "")))
  return out


def test_each_decision_is_made_in_one_function():
  """Program, layer loop, read route, built layout and mesh: each resolved by one function
  of the library, which holds the decision's tell; no other library line holds it."""
  found = []
  for what, (module, func, pattern) in DECISIONS.items():
    sites = _decision_sites(pattern, LIBRARY)
    assert any((m, f) == (module, func) for m, _, f in sites), f"{module}.{func} decides {what}"
    found += [f"{what}: {MODULES[m].relative_to(ROOT)}:{i} ({f or 'module level'})"
              for m, i, f in sites if (m, f) != (module, func)]
  assert not found, "a decision made outside its one resolver: " + "; ".join(found)


def test_only_the_policy_registry_names_the_full_policy():
  """Whether a cache evicts is the registry's question (`policies.evicts`): a layout, a
  program or an experiment that tests `cache.policy` against "full" itself is wiring the
  registry should own. (Results rows, plain dicts in the plots, are data, not config.)"""
  found = _lines(r"\.policy\s*[!=]=\s*[\"']full[\"']", lambda n: n.startswith("kvjax.policies"))
  assert not found, "cache.policy tested against 'full' outside kvjax.policies: " + ", ".join(found)


def test_the_cache_sits_below_the_model():
  """The model reads and writes caches; no cache module imports the model (RoPE, which the
  latent layout applies at read time, lives with attention, below both)."""
  graph = _graph(MODULES)
  found = [f"{n} ({MODULES[n].relative_to(ROOT)}:{line}) imports {m}"
           for n in sorted(graph) if _in(n, ["kvjax.cache"])
           for m, line in sorted(graph[n].items()) if _in(m, ["kvjax.model"])]
  assert not found, "the cache imports the model: " + "; ".join(found)


def test_one_module_counts_a_setting_s_bytes():
  """A cache setting's bytes are counted in one place, `kvjax.footprint` (from the layouts'
  `closed_form_bytes`), and weights at their dtype likewise: a module that calls the closed
  form itself, or counts the model's weights itself, is a second count that can drift
  from the one every report prints (the memory experiment measures trees against it)."""
  found = _lines(r"\.closed_form_bytes\(|(?<![\w.])param_count\(",
                 lambda n: n == "kvjax.footprint" or n.startswith("kvjax.cache"),
                 lambda line: line.lstrip().startswith(("def ", "#")))
  assert not found, "bytes counted outside kvjax.footprint: " + ", ".join(found)


def test_the_byte_count_names_no_layout():
  """`kvjax.footprint` asks each layout what it holds (`closed_form_bytes`, `asymptotic`,
  `rings`) and never branches on a layout's name: a new layout is counted by its own
  module, not by an edit here."""
  from kvjax import cache
  names = set(cache.LAYOUTS)
  found = [f"kvjax/footprint.py:{node.lineno} {node.value!r}"
           for node in ast.walk(ast.parse((PKG / "footprint.py").read_text()))
           if isinstance(node, ast.Constant) and node.value in names]
  assert not found, "layout names in the byte count: " + ", ".join(found)


def test_a_codec_is_read_through_one_interface():
  """Every read takes a codec through `qk` / `pv` (a block's logits and values, `native`
  for the stored-type dots) and `stored` (what the folded, Pallas and CPU-kernel reads
  load directly). Outside kvjax.codecs nothing reads a codec's class-level `storage` flag
  or a private read, which would be a second route that a new codec does not know of."""
  found = _lines(r"codec\w*\.(storage\b|_\w+)", lambda n: n.startswith("kvjax.codecs"))
  assert not found, "a codec read outside its interface (qk, pv, stored): " + ", ".join(found)


def test_one_token_loop():
  """A model call on one token per row (`step.run(static, params, token_B[:, None], ...)`)
  in a loop is `decode.decode`'s: generation, timers, task answers and teacher-forced
  continuations run it, so a change to the decode step changes all of them at once."""
  # the tokens' argument, the third, is one token per row
  found = _lines(r"step\.run\(\s*\w+,\s*\w+,\s*[\w.]+\[:, None\]", lambda n: n == "kvjax.decode")
  assert not found, "a token loop outside decode.decode: " + ", ".join(found)
