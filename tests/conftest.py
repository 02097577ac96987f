"""Shared fixtures: tiny configs and parameters, built once per session.

The tests live in rooms that mirror the package: `library/` (what a decode step needs:
model, cache, codecs, attention, policies, model files, kernels, config), `lab/` (the
experiments, conversions, intervals, runner, results and plots), `faces/` (the command
line, the Python API and what they share), and here the contracts across all three
(structure, docs, golden decode, the real models, one-module plugins). A test module may
import another's helpers by its name from any room (the rooms are on `sys.path`).
"""

import atexit
import copy
import gc
import functools
import os
import shutil
import subprocess
import sys
import tempfile

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[1:1] = [os.path.join(_TESTS, room) for room in ("library", "lab", "faces")
                 if os.path.join(_TESTS, room) not in sys.path]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A JAX persistent compilation cache private to this run (a fresh temp dir, removed at exit,
# so nothing carries over to the next run and a program that no longer compiles fails):
# identical programs compiled again through a new jit object (model.init_params on every
# call, the CLI and experiments loading a model per command, the same program in a child
# process or in another xdist worker, each of which inherits these variables from the
# process that made the dir) are read back instead of compiled again. Only that process
# removes it.
_JAX_CACHE = os.environ.get("KVJAX_TESTS_JAX_CACHE", "")
if not os.path.isdir(_JAX_CACHE):
  _JAX_CACHE = tempfile.mkdtemp(prefix="kvjax-tests-jax-cache-")
  os.environ["KVJAX_TESTS_JAX_CACHE"] = _JAX_CACHE
  atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
os.environ.update({"JAX_COMPILATION_CACHE_DIR": _JAX_CACHE,
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
# Cheaper XLA:CPU compiles for the whole run and every subprocess it starts (they inherit the
# environment): the suite is compile-bound (tiny shapes). Backend optimization level 0
# without the expensive LLVM passes cut its CPU time by about a third, the legacy elemental
# emitters instead of the MLIR fusion emitters by about 40 % more; the real-model tests
# (matmuls in library calls) run no slower, the golden tokens and the HLO checks hold. Both
# sides of every comparison run under the same flags. A flag already in XLA_FLAGS is left
# alone; one this jaxlib does not know (XLA aborts on an unknown flag) is probed once and
# dropped.
_FAST_XLA = {"--xla_backend_optimization_level": "0", "--xla_llvm_disable_expensive_passes": "true"}
_PROBED_XLA = {"--xla_cpu_use_fusion_emitters": "false"}


def _xla_flags() -> str:
  flags = os.environ.get("XLA_FLAGS", "")
  fast = [f"{k}={v}" for k, v in _FAST_XLA.items() if k not in flags]
  probed = [f"{k}={v}" for k, v in _PROBED_XLA.items() if k not in flags]
  if probed:
    env = {**os.environ, "XLA_FLAGS": " ".join([flags, *fast, *probed]), "JAX_PLATFORMS": "cpu"}
    ok = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, timeout=120).returncode == 0
    probed = probed if ok else []
  return " ".join([flags, *fast, *probed]).strip()


os.environ["XLA_FLAGS"] = _xla_flags()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvjax import config as config_lib  # noqa: E402
from kvjax import model  # noqa: E402

import jax  # noqa: E402

# The variables above are read when jax is first imported; set them again in case a plugin
# imported it before this file.
jax.config.update("jax_compilation_cache_dir", _JAX_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
  """Drop every compiled program after each test module. One process compiles thousands of
  small programs over the suite; each XLA:CPU executable maps its own code pages, and with
  all of them alive the whole run crashed inside a compile (SIGSEGV/SIGABRT while writing
  the compilation cache, 8 GB resident, at the same late test every time). Later modules
  reload what they share from the persistent cache above."""
  yield
  jax.clear_caches()
  gc.collect()


TINY = {"model.vocab_size": 64, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
        "model.n_kv_heads": 4, "model.d_ff": 48}
KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}


def tiny_config(**overrides) -> config_lib.Config:
  return config_lib.apply_overrides(config_lib.Config(), {**TINY, **overrides})


_PARAMS = {}


def tiny_params(cfg: config_lib.Config):
  """Parameters cached per model shape: tests share them instead of re-initialising."""
  key = (cfg.model, cfg.seed)
  if key not in _PARAMS:
    _PARAMS[key] = model.init_params(cfg.model, cfg.seed)
  return _PARAMS[key]


@pytest.fixture(params=sorted(KV_HEADS), ids=lambda v: v)
def variant_cfg(request):
  """The tiny model as MHA, GQA and MQA (fp32 cache)."""
  return tiny_config(**{"model.n_kv_heads": KV_HEADS[request.param]})


def model_path(name: str):
  """The installed GGUF of a named model (`make models`); CI must have it, a laptop may skip."""
  from kvjax.io import zoo
  path = zoo.path_of(name)
  if not path.is_file():
    if os.environ.get("CI"):
      pytest.fail(f"{name} is not installed; .ci/run must run `make models` first")
    pytest.skip(f"{name} not installed: run `make models`")
  return path


def smollm2_path():
  return model_path("smollm2-135m")


def kvjax_side(name: str):
  """(cfg, params, tokenizer) as kvjax reads a named model's GGUF file."""
  model_path(name)
  from kvjax.io import sources
  return sources.load(sources.parse(f"gguf:{name}"))


def _in_memory(reader_cls, file, *args, **kwargs):
  """gguf-py's GGUFReader over a read-only in-memory copy of the file instead of its
  np.memmap: the same bytes and the same parse, but each of the vocabulary's ~10^6 small
  reads slices a plain array, not a memmap (whose slicing and __array_finalize__ were most
  of the reader's time)."""
  from gguf import gguf_reader

  class _Numpy:  # numpy, whose memmap hands back the file's bytes in memory
    def __getattr__(self, name):
      return getattr(np, name)

    @staticmethod
    def memmap(path, mode="r", **_):
      data = np.fromfile(path, dtype=np.uint8)
      data.flags.writeable = mode != "r"
      return data

  real_np, gguf_reader.np = gguf_reader.np, _Numpy()
  try:
    return reader_cls(file, *args, **kwargs)
  finally:
    gguf_reader.np = real_np


def transformers_side(name: str):
  """(tokenizer, model) as transformers reads the same GGUF file (float32)."""
  path = model_path(name)
  import gguf
  from transformers import AutoModelForCausalLM, AutoTokenizer

  # transformers reads the file through gguf-py, whose slow parts are pure and read-only:
  # the GGUFReader's parse of the metadata (the vocabulary and merges; transformers
  # parses the file once for the tokenizer and once for the model) and the tensor name map
  # (transformers builds it afresh for each of ~400 modules). Here its two loads share one
  # parse and one map per architecture; how it converts what it reads stays its own.
  real_reader, real_map, readers = gguf.GGUFReader, gguf.get_tensor_name_map, {}

  def shared_reader(file, *args, **kwargs):
    key = (os.path.realpath(file), args, tuple(sorted(kwargs.items())))
    if key not in readers:
      readers[key] = _in_memory(real_reader, file, *args, **kwargs)
    return readers[key]

  # Its metadata-only reads (return_tensors=False: one for the tokenizer's config, one for
  # the model's) are one parse of the same fields; the second gets a copy of the first.
  from transformers import modeling_gguf_pytorch_utils as gguf_utils
  real_load, metadata = gguf_utils.load_gguf_checkpoint, {}

  def shared_load(file, return_tensors=False, **kwargs):
    if return_tensors or kwargs:
      return real_load(file, return_tensors=return_tensors, **kwargs)
    key = os.path.realpath(file)
    if key not in metadata:
      metadata[key] = real_load(file, return_tensors=False)
    return copy.deepcopy(metadata[key])

  gguf.GGUFReader = shared_reader
  gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)
  gguf_utils.load_gguf_checkpoint = shared_load
  try:
    kw = {"gguf_file": path.name}
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
    ref_model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype="float32", **kw)
  finally:
    gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
    gguf_utils.load_gguf_checkpoint = real_load
  assert len(readers) == 1  # both went through the shared parse
  return ref_tok, ref_model


def both_sides(name: str):
  """kvjax_side + transformers_side of one model, their dequantization done once: both read
  the file's tensors through gguf-py's `dequantize` (a pure function of the bytes and the
  type), so the second reader of a tensor gets a copy of what the first computed."""
  import zlib

  import gguf
  from gguf import quants

  real, memo = quants.dequantize, {}

  def shared(data, qtype):
    key = (int(qtype), data.shape, zlib.crc32(np.ascontiguousarray(data).view(np.uint8)))
    if key not in memo:
      memo[key] = real(data, qtype)
    return memo[key].copy()

  quants.dequantize = gguf.dequantize = shared
  try:
    return (*kvjax_side(name), *transformers_side(name))
  finally:
    quants.dequantize = gguf.dequantize = real


@pytest.fixture(scope="session")
def smollm2_kvjax():
  """(cfg, params, tokenizer) for SmolLM2-135M as kvjax reads its GGUF file, once per test
  session (per xdist worker): for the modules that need no transformers side."""
  return kvjax_side("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2(smollm2_kvjax):
  """(cfg, params, tokenizer, transformers tokenizer, transformers model) for SmolLM2-135M,
  both sides loaded from the same GGUF file, once per test session (per xdist worker); a
  worker whose modules need only kvjax's side never loads transformers' model."""
  return (*smollm2_kvjax, *transformers_side("smollm2-135m"))


# The modules that take longest (setup included) run first: `make test` hands whole modules
# to its workers in collection order (xdist loadfile), so a long module collected last would
# run alone at the end while the other workers idle (longest-first keeps the tail short).
# Measure with `pytest --durations=0`; a module missing here only runs in its usual place.
LONGEST_FIRST = ("test_plot_layout.py", "test_qwen2.py", "test_gemma3.py", "test_sharding.py",
                 "test_python_doc.py", "test_plots.py", "test_faults.py", "test_golden.py",
                 "test_native.py", "test_gguf.py", "test_eval.py", "test_distributed.py",
                 "test_rotate.py", "test_keep_first.py", "test_accel.py", "test_fast_paths.py",
                 "test_pallas.py", "test_convert.py", "test_distill.py")


def pytest_collection_modifyitems(session, config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within kept


def ruler_row(task, setting, score, model="m", context=8192):
  """A `ruler` experiment row of one question (kvjax.lab.experiments.ruler's fields)."""
  from kvjax.lab.tasks import ruler

  return {"experiment": "ruler", "variant": {"model": model, "setting": setting,
                                             "protocol": "blind"},
          "workload": {"context": context, "task": task, "family": ruler.FAMILY[task],
                       "sample": 0, "key": "k"},
          "metrics": {"score": score, "bytes_per_token": 8.0 if setting == "fp32" else 4.0}}
