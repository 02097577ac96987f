"""results/MANIFEST.yaml: the command that made each committed results file, and facts
read back from the file (config hashes, git commits, machines, row count).

    python scripts/manifest.py check                  # the manifest matches results/ and configs/
    python scripts/manifest.py update                 # re-read the facts from the files
    python scripts/manifest.py commands [--out DIR] [--only FILE ...]
                                                      # the commands, writing under DIR
    python scripts/manifest.py compare DIR            # DIR's files have the committed structure

A `kvjax run` entry names its `config`, `set` overrides and `out` folder; its command is
built from them (an entry whose committed cells are several slices of a grid, filled over
several sessions, lists each slice's overrides under `slices`, a command each), and `check` holds every row's `config_hash` equal to a cell of that
config as committed now (so editing a config without regenerating its results fails the
test suite). Other entries (benchmark scripts, whose rows carry no config) list their
`commands` verbatim, `{results}` standing for the results folder; a `kvjax run` entry may
list `before` commands that make what its config reads (a converted checkpoint). An entry
with `needs: gpu` was made on a GPU (`scripts/device_check.sh`, docs/gpu.md): `commands` and `compare` leave
it out unless JAX's default backend is a GPU. `scripts/reproduce.sh` (`make reproduce`)
runs exactly these commands.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "results" / "MANIFEST.yaml"
MACHINE_KEYS = ("host", "backend", "device_kind", "device_count", "cpu_count", "python", "jax")
HEADER = """\
# Every committed file under results/ and the command that makes it (scripts/manifest.py).
# `make reproduce` runs these commands (scripts/reproduce.sh); tests/lab/test_manifest.py checks
# that each `kvjax run` file's config_hashes are cells of its config as committed, and that
# the facts below (rows, commits, machines) are those of the file. Edit `config`, `set`,
# `out` or `commands`; the rest is rewritten by `python scripts/manifest.py update`.
"""


def load(path: Path = MANIFEST) -> dict:
  return yaml.safe_load(path.read_text()) or {}


def rows(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _under(path: str, results_dir: str) -> str:
  """`results/x` -> `<results_dir>/x`: the same command, writing somewhere else."""
  rel = Path(path).relative_to("results")
  return str(Path(results_dir) / rel) if str(rel) != "." else results_dir


def slices(entry: dict) -> list[list[str]]:
  """The `--set` overrides of each `kvjax run` the entry's cells come from: its `slices`, or
  its one `set`."""
  return [list(s) for s in entry["slices"]] if "slices" in entry else [list(entry.get("set", []))]


def commands(entry: dict, results_dir: str = "results") -> list[str]:
  """The shell commands of one entry (`kvjax run` ones are built from config/set/out, one a
  slice); `{results}` in a verbatim command is the results folder."""
  if "config" in entry:
    before = [c.format(results=results_dir) for c in entry.get("before", [])]
    out = _under(entry["out"], results_dir)
    return before + [f"kvjax run {entry['config']} --out {out}"
                     + "".join(f" --set {shlex.quote(s)}" for s in sets)
                     for sets in slices(entry)]
  return [c.format(results=results_dir) for c in entry["commands"]]


def runnable(entry: dict) -> bool:
  """Whether this machine can regenerate the entry (`needs: gpu` entries need a GPU)."""
  if entry.get("needs") != "gpu":
    return True
  import jax
  return jax.default_backend() == "gpu"


def expected_hashes(entry: dict) -> set[str]:
  """Hashes of the cells the entry's config expands to (each slice's), as committed now."""
  sys.path.insert(0, str(ROOT))
  from kvjax.lab import runner
  return {c.hash for sets in slices(entry) for c in runner.expand(ROOT / entry["config"], sets)[1]}


def facts(path: Path) -> dict:
  """What the file itself says: rows, config hashes, commits and machines (from `env`)."""
  rs = rows(path)
  machines = []
  for r in rs:
    env = r.get("env") or {}
    m = {k: env.get(k) for k in MACHINE_KEYS if k in env}
    if m not in machines:
      machines.append(m)
  return {"rows": len(rs),
          "config_hashes": sorted({r["config_hash"] for r in rs if r.get("config_hash")}),
          "commits": sorted({(r.get("env") or {}).get("git_commit", "unknown") for r in rs}),
          "machines": machines}


def update(path: Path = MANIFEST) -> None:
  man = load(path)
  out = {}
  for name in sorted(man):
    entry = {k: v for k, v in man[name].items() if k in ("config", "set", "slices", "out",
                                                               "commands", "before", "needs")}
    entry.update(facts(ROOT / name))
    out[name] = entry
  path.write_text(HEADER + yaml.safe_dump(out, sort_keys=False, width=100))


def results_files() -> set[str]:
  """Committed results: every file under results/ except the manifest, scratch folders, a
  live run's own state (`.kvjax-locks`, `.kvjax-partial`: hidden, never committed) and the
  NOTES.md beside rows (what a run's story, host and commit were: prose, no command)."""
  base = ROOT / "results"
  return {str(p.relative_to(ROOT)) for p in base.rglob("*") if p.is_file()
          and p != MANIFEST and p.name != "NOTES.md"
          and not p.relative_to(base).parts[0].startswith("tmp")
          and not any(part.startswith(".") for part in p.relative_to(base).parts)}


def check(path: Path = MANIFEST) -> list[str]:
  """Problems, one line each (empty: the manifest and results/ agree)."""
  man, problems = load(path), []
  files = results_files()
  for name in sorted(files - set(man)):
    problems.append(f"{name}: not in {path.name}; add the command that made it")
  for name in sorted(set(man) - files):
    problems.append(f"{name}: listed in {path.name} but missing")
  for name in sorted(set(man) & files):
    entry, got = man[name], facts(ROOT / name)
    for key in ("rows", "config_hashes", "commits", "machines"):
      if entry.get(key) != got[key]:
        problems.append(f"{name}: {key} in {path.name} is not what the file holds; run "
                        "`python scripts/manifest.py update`")
    if "config" in entry:
      want = expected_hashes(entry)
      stray = sorted(set(got["config_hashes"]) - want)
      if stray:
        problems.append(f"{name}: {len(stray)} config hashes (e.g. {stray[0]}) are no cell of "
                        f"{entry['config']} as committed; regenerate the file with its command")
      if Path(entry["out"]) / f"{rows(ROOT / name)[0]['experiment']}.jsonl" != Path(name):
        problems.append(f"{name}: `kvjax run ... --out {entry['out']}` does not write this file")
      missing = sorted(want - set(got["config_hashes"]))
      if missing:
        problems.append(f"{name}: {len(missing)} cells of {entry['config']} have no rows")
    elif not entry.get("commands"):
      problems.append(f"{name}: no command recorded")
  return problems


def _shape(row: dict) -> dict:
  """A row's structure: its keys, and the keys of its nested sections."""
  return {k: sorted(v) if isinstance(v, dict) else type(v).__name__ for k, v in row.items()
          if k not in ("env",)}


def compare(other: Path, only: list[str] | None = None) -> list[str]:
  """Differences in structure between regenerated files under `other` and the committed
  ones: same rows count, same cells (config hashes), same keys in every section."""
  problems = []
  for name, entry in load().items():
    if (only and name not in only) or not runnable(entry):
      continue
    new = other / Path(name).relative_to("results")
    if not new.is_file():
      problems.append(f"{name}: not regenerated ({new} missing)")
      continue
    a, b = rows(ROOT / name), rows(new)
    if len(a) != len(b):
      problems.append(f"{name}: {len(b)} rows regenerated, {len(a)} committed")
    if facts(new)["config_hashes"] != entry.get("config_hashes", []):
      problems.append(f"{name}: regenerated cells differ from the committed ones")
    shapes_a = sorted({json.dumps(_shape(r), sort_keys=True) for r in a})
    shapes_b = sorted({json.dumps(_shape(r), sort_keys=True) for r in b})
    if shapes_a != shapes_b:
      problems.append(f"{name}: regenerated rows have other fields than the committed ones")
  return problems


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  sub.add_parser("check")
  sub.add_parser("update")
  c = sub.add_parser("commands")
  c.add_argument("--out", default="results", help="results folder the commands write under")
  c.add_argument("--only", nargs="*", help="only these files (results/...)")
  cmp = sub.add_parser("compare")
  cmp.add_argument("dir")
  cmp.add_argument("--only", nargs="*")
  args = ap.parse_args(argv)
  if args.cmd == "update":
    update()
    return 0
  if args.cmd == "commands":
    man = load()
    unknown = sorted(set(args.only or ()) - set(man))
    if unknown:
      print(f"manifest: error: {unknown[0]} is not in {MANIFEST.name}", file=sys.stderr)
      return 2
    for name, entry in man.items():
      if args.only and name not in args.only:
        continue
      if not runnable(entry):
        print(f"manifest: {name} needs a GPU; its command is left out", file=sys.stderr)
        continue
      for cmd in commands(entry, args.out.rstrip("/")):
        print(cmd)
    return 0
  problems = check() if args.cmd == "check" else compare(Path(args.dir), args.only)
  for p in problems:
    print(f"manifest: {p}", file=sys.stderr)
  if not problems:
    print(f"manifest: {args.cmd}: ok")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
