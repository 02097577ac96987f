"""The kernel cache trusts nothing it finds: a library is loaded into the process only when
its bytes match the hash recorded at build time, or a child process loaded it and found
every symbol. A truncated build (once SIGBUS in `generate`), another library (once an
`undefined symbol` traceback) or garbage is rebuilt once, said on stderr; a failing
compiler is named (`CXX=/bin/false` once gave "its build failed: []"), and KVJAX_KERNEL is
on or off, nothing else (`false` once kept the kernel on)."""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
import sys

import pytest

from kvjax import cli, envcheck, kernels
from kvjax.errors import KvjaxError


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  """A whole build of this machine's library (the suite's `make kernels` build)."""
  if not shutil.which("g++"):
    pytest.skip("no C++ compiler: the kernel cannot be built here")
  built = kernels.build()
  keep = tmp_path_factory.mktemp("good") / "good.so"
  shutil.copy2(built, keep)
  return keep


@pytest.fixture
def cache(tmp_path, monkeypatch, good):
  """A fresh KVJAX_CACHE holding nothing; returns where this machine's build goes."""
  monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
  lib = kernels.library_path()
  lib.parent.mkdir(parents=True)
  return lib


def _fake_compiler(tmp_path, source) -> str:
  """A `CXX` that 'compiles' by copying `source` to its -o target (no real compile)."""
  cxx = tmp_path / "cxx.sh"
  cxx.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp {source} "$2"\n')
  cxx.chmod(0o755)
  return str(cxx)


def test_a_copied_whole_build_is_probed_once_then_trusted_by_its_hash(cache, good):
  shutil.copy2(good, cache)
  assert kernels.untrusted(cache) is None  # no record: a child process loaded it
  record = cache.with_suffix(".sha256")
  assert record.read_text().strip() == kernels._digest(good)
  record.write_text("0" * 64 + "\n")
  assert "differ from the hash recorded" in kernels.untrusted(cache)


@pytest.mark.parametrize("damage", ["truncated", "another library", "garbage"])
def test_a_damaged_build_is_found_outside_this_process(cache, good, damage):
  if damage == "truncated":
    cache.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 3])
  elif damage == "another library":
    libm = ctypes.util.find_library("m")
    found = [p for p in ("/lib/x86_64-linux-gnu/" + str(libm), "/usr/lib/" + str(libm))
             if libm and shutil.os.path.exists(p)]
    if not found:
      pytest.skip("no libm to stand in for another library")
    shutil.copy(found[0], cache)
  else:
    cache.write_bytes(b"\x7fELF" + b"garbage" * 100)
  why = kernels.untrusted(cache)
  assert why and why.startswith("a test load of it failed")
  if damage == "another library":
    assert "KvjaxRead" in why or "undefined symbol" in why


def test_a_damaged_build_is_rebuilt_once_and_said(cache, good, tmp_path, monkeypatch, capsys):
  cache.write_bytes(good.read_bytes()[:1000])
  cache.with_suffix(".sha256").write_text(kernels._digest(good) + "\n")  # a stale record
  monkeypatch.setenv("CXX", _fake_compiler(tmp_path, good))
  assert kernels.build() == cache
  assert cache.read_bytes() == good.read_bytes()
  assert kernels.untrusted(cache) is None
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "cannot be used" in err[0] and "rebuilding it" in err[0]
  assert kernels.build() == cache and capsys.readouterr().err == ""  # trusted: no rebuild


def test_a_compiler_that_fails_silently_is_named(cache, monkeypatch):
  monkeypatch.setenv("CXX", "/bin/false")
  with pytest.raises(subprocess.CalledProcessError) as e:
    kernels.build()
  why = kernels._build_failed(e.value)
  assert "/bin/false exited with status 1 and printed nothing" in why and "CXX" in why
  assert not cache.exists()


def test_a_compiler_that_exits_0_without_a_library_is_named(cache, monkeypatch):
  """`CXX=true` once ended in a bare 'No such file or directory' for the temporary file."""
  monkeypatch.setenv("CXX", "/bin/true")
  with pytest.raises(OSError, match=r"/bin/true exited 0 without writing .*set CXX"):
    kernels.build()
  assert not cache.exists()


@pytest.mark.parametrize("value, on", [("", True), ("on", True), ("1", True), ("TRUE", True),
                                       ("off", False), ("0", False), ("no", False),
                                       ("false", False), (" False ", False)])
def test_kvjax_kernel_is_on_or_off(monkeypatch, value, on):
  monkeypatch.setenv("KVJAX_KERNEL", value)
  assert envcheck.kernel_on() is on


def test_kvjax_kernel_neither_on_nor_off_is_one_line(monkeypatch, capsys):
  monkeypatch.setenv("KVJAX_KERNEL", "maybe")
  with pytest.raises(KvjaxError, match="KVJAX_KERNEL='maybe' is neither on nor off"):
    envcheck.kernel_on()
  assert cli.main(["size", "--layers", "1", "--heads", "1", "--kv-heads", "1", "--head-dim",
                   "8", "--seq-len", "8"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "KVJAX_KERNEL" in err[0]


def test_a_process_with_kvjax_kernel_false_reports_the_kernel_off(tmp_path):
  code = "from kvjax import kernels; print(kernels.status())"
  env = {**shutil.os.environ, "KVJAX_KERNEL": "false", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "turned off by KVJAX_KERNEL"
