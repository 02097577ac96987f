"""A non-editable install works: a wheel built from this tree, installed into a folder of its
own, imports from there (not from the source tree or an editable install) and finds what it
ships as package data (kvjax/shapes/*.yaml, named with `--config NAME`) from any directory,
and runs an experiment and draws its plots there (`kvjax run`, `kvjax plot`).

One wheel per test session (module fixture); each check is one `python -m kvjax.cli` process
run from a scratch directory with only the installed folder on PYTHONPATH.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
  """`pip wheel` of a copy of the tree (so no build/ or egg-info lands in the checkout),
  then `pip install --no-deps --target`: the folder to put on PYTHONPATH."""
  tmp = tmp_path_factory.mktemp("install")
  src = tmp / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy2(ROOT / name, src / name)
  shutil.copytree(ROOT / "kvjax", src / "kvjax",
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
  env = {**os.environ, "PIP_NO_INDEX": "1"}  # nothing is downloaded: no deps, no isolation
  proc = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w",
                         str(tmp / "dist"), str(src)], capture_output=True, text=True,
                        env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (wheel,) = (tmp / "dist").glob("kvjax-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "kvjax/shapes/llama3-8b.yaml" in names and "kvjax/cli/__main__.py" in names
  assert {"kvjax/lab/plots/__init__.py", "kvjax/lab/plots/style.py", "kvjax/lab/plots/memory.py"} <= set(names)
  # the CPU kernels' sources, built on first use
  assert {"kvjax/kernels/read.cc", "kvjax/kernels/matvec.cc",
          "kvjax/kernels/parallel.h"} <= set(names)
  site = tmp / "site"
  proc = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return site


def _kvjax(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
  """`python -m kvjax.cli ARGV` from `cwd` (not the repo) with the installed copy first."""
  env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "kvjax.cli", *argv], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_the_installed_package_ships_and_loads_the_read_kernel(installed, tmp_path):
  """The wheel ships the kernels' sources whole: the installed package names the same build
  as this tree (the name hashes every source and header byte, the flags, jax and the CPU),
  and from a fresh cache folder holding only that build it registers the kernel. The build
  itself is `make kernels`' (the same `kernels.build()`, before the suite), not compiled a
  second time here; where g++ exists `test_native` fails unless that build is active."""
  from kvjax import kernels
  if not (shutil.which("g++") or os.environ.get("CXX")):
    pytest.skip("no C++ compiler: the kernel cannot be built here")
  built = kernels.build()
  cache = tmp_path / "cache" / "kernels"
  cache.mkdir(parents=True)
  shutil.copy2(built, cache / built.name)
  code = ("from kvjax import kernels; print(kernels.library_path().name); "
          "print(kernels.status()); print(kernels.SOURCE)")
  env = {**os.environ, "PYTHONPATH": str(installed), "KVJAX_CACHE": str(tmp_path / "cache"),
         "JAX_PLATFORMS": "cpu", "CXX": "/bin/false"}  # a missing build fails, never compiles
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  name, status, source = proc.stdout.split("\n")[:3]
  assert source.startswith(str(installed))
  assert name == built.name
  assert status == "active", proc.stderr[-2000:]
  assert sorted(p.name for p in cache.glob("*.so")) == [built.name]


def test_the_installed_package_is_the_one_imported(installed, tmp_path):
  env = {**os.environ, "PYTHONPATH": str(installed)}
  code = ("import kvjax, kvjax.cli, kvjax.config as c; "
          "print(kvjax.__file__); print(c.SHAPES_DIR); print(','.join(c.shape_names()))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  file, shapes_dir, names = proc.stdout.split("\n")[:3]
  assert Path(file).is_relative_to(installed), file  # the wheel's copy, not ROOT/kvjax
  assert Path(shapes_dir) == installed / "kvjax" / "shapes"
  assert {"llama3-8b", "smollm2-135m"} <= set(names.split(","))


def test_installed_size_finds_a_packaged_shape_by_name(installed, tmp_path):
  proc = _kvjax(installed, tmp_path, "size", "--config", "llama3-8b", "--seq-len", "1024",
                "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 cache by default, + int32 length
  assert out["bytes_per_token_asymptotic"] == 2 * 32 * 8 * 128 * 2
  assert out["total_bytes"] == out["bytes_per_token_asymptotic"] * 1024 + 4


def test_installed_generate_runs_a_packaged_shape_by_name(installed, tmp_path):
  """SmolLM2-135M's shape by name, random weights, cut to one layer and a 512-token
  vocabulary to keep it cheap (the full 49k embedding alone costs seconds to initialise):
  its 9 query heads, 3 KV heads of 64 (defaults: 4, 4, 16) still come from the packaged file."""
  proc = _kvjax(installed, tmp_path, "generate", "--config", "smollm2-135m",
                "--set", "model.n_layers=1", "--set", "model.vocab_size=512",
                "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert len(out["tokens"]) == 1 and len(out["tokens"][0]) == 2
  assert all(0 <= t < 512 for t in out["tokens"][0])
  assert out["variant"] == "GQA-3" and out["capacity"] == 5
  # fp32 cache: K and V x 1 layer x 3 KV heads x 64 x 4 bytes x 5 slots, + int32 length
  assert out["cache_bytes"] == 2 * 1 * 3 * 64 * 4 * 5 + 4


def test_installed_run_and_plot_from_another_directory(installed, tmp_path):
  """`kvjax run` a tiny config (the memory experiment: no compilation) and `kvjax plot` its
  results, from a scratch directory, with only the installed copy importable."""
  (tmp_path / "tiny.yaml").write_text(
      "name: tiny\nexperiment: memory\n"
      "model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 4}\n"
      "grid: {cache.codec: [fp32, int8]}\n"
      "params: {contexts: [8, 64], shapes: [llama3-8b], concurrency_contexts: [1024]}\n")
  proc = _kvjax(installed, tmp_path, "run", "tiny.yaml", "--out", "res")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert list((tmp_path / "res").glob("*.jsonl"))
  proc = _kvjax(installed, tmp_path, "plot", "res", "--out", "figs")
  assert proc.returncode == 0, proc.stderr[-3000:]
  pngs = {p.name for p in (tmp_path / "figs").glob("*.png")}
  assert {"memory_bytes_vs_context.png", "memory_bytes_per_token.png",
          "memory_max_concurrency.png"} <= pngs, (pngs, proc.stdout)
  assert all((tmp_path / "figs" / n).read_bytes()[:4] == b"\x89PNG" for n in pngs)
  proc = _kvjax(installed, tmp_path, "plot", "nowhere")
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
  assert "no results folder nowhere" in proc.stderr
