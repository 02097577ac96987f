"""The CPU kernels (XLA FFI custom calls) and their build: the decode read (`read.cc`,
`read`) and the few-row product with weights stored in bfloat16 or float32 (`matvec.cc`,
`weight_dots`).

The kernels are C++ against the header-only XLA FFI API that jax ships
(`jax.ffi.include_dir()`), compiled with the machine's g++ the first time a process needs
it, for this machine's instruction set (`-march=native`), into
`$KVJAX_CACHE/kernels/` (default `~/.cache/kvjax/kernels`), named by a hash of the
source, the compiler flags, jax's version and the CPU's feature flags, so a rebuilt jax or
another CPU gets its own build, and a second process reuses the first one's. Building is
guarded by a file lock, so concurrent processes build once.

Where no compiler is found (or the build fails), `available()` is False, the `native`
attention reads through XLA's stored-type dots instead (`kvjax.codecs.dots`), and kvjax
says so once on stderr. `KVJAX_KERNEL=off` turns the kernel off (the XLA route), for
comparison (a value neither on nor off is refused: kvjax.envcheck); `make test` asserts it
is active where g++ exists. A build is loaded only once proven whole (`untrusted`: its
recorded sha256, or a test load in a child process); a damaged one is rebuilt, said once.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvjax import envcheck

SOURCE = Path(__file__).with_name("read.cc")
SOURCES = (SOURCE, SOURCE.with_name("matvec.cc"))  # one library; parallel.h is shared
HEADERS = (SOURCE.with_name("parallel.h"),)
TARGET = "kvjax_read"
MATVEC = "kvjax_matvec"
MATVEC_T = "kvjax_matvec_t"
MATVEC_ROWS = 16  # the most rows `weight_dots` hands to the kernel (a decode step's)
MAX_WIDTH = 256   # the widest head (or latent row) the read kernel takes (read.cc's buffers)
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17",
         "-shared", "-fPIC", "-w"]


def cache_dir() -> Path:
  root = os.environ.get("KVJAX_CACHE") or str(Path.home() / ".cache" / "kvjax")
  return Path(root) / "kernels"


def cpu_flags() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor()


def library_path() -> Path:
  h = hashlib.sha256()
  for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(FLAGS).encode(),
               jax.__version__.encode(), cpu_flags().encode(), platform.machine().encode()):
    h.update(part)
  return cache_dir() / f"read-{h.hexdigest()[:16]}.so"


SYMBOLS = ("KvjaxRead", "KvjaxMatvec", "KvjaxMatvecT")
_PROBE = ("import ctypes, sys\nlib = ctypes.CDLL(sys.argv[1])\n"
          f"for name in {SYMBOLS!r}:\n  getattr(lib, name)\n")


def _digest(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def untrusted(lib: Path) -> str | None:
  """Why the library at `lib` must not be loaded into this process, or None: its bytes
  match the hash recorded when it was built, or (no record: an older kvjax's build, or a
  copy) a child process loads it and finds every symbol, and the hash is recorded then. A
  truncated file would kill the process with SIGBUS, another library raise `undefined
  symbol`, garbage fail to load: each is found here, outside this process."""
  try:
    recorded = lib.with_suffix(".sha256").read_text().strip()
  except OSError:
    recorded = None
  if recorded is not None:
    return None if recorded == _digest(lib) else \
        "its bytes differ from the hash recorded when it was built"
  try:
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(lib)], capture_output=True,
                          text=True, timeout=120)
  except subprocess.TimeoutExpired:
    return "a test load of it did not finish"
  if proc.returncode != 0:
    last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return f"a test load of it failed ({last[-160:]})"
  _write_record(lib)
  return None


def _write_record(lib: Path) -> None:
  tmp = lib.with_suffix(f".sha256.{os.getpid()}.tmp")
  tmp.write_text(_digest(lib) + "\n")
  os.replace(tmp, lib.with_suffix(".sha256"))


def build() -> Path:
  """Compile the kernels unless this machine's build exists and is whole (`untrusted`); its
  path. A build found damaged is rebuilt once, said on stderr. Raises OSError or
  CalledProcessError when it cannot."""
  out = library_path()
  why = untrusted(out) if out.exists() else None
  if out.exists() and why is None:
    return out
  if why is not None:
    print(f"kvjax: the kernel library {out} cannot be used ({why}); rebuilding it",
          file=sys.stderr)
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not cxx:
    raise OSError("no C++ compiler (g++) on PATH")
  out.parent.mkdir(parents=True, exist_ok=True)
  with open(out.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not out.exists() or untrusted(out) is not None:  # (another process may have built it)
      tmp = out.with_suffix(f".{os.getpid()}.tmp")
      subprocess.run([cxx, *FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o",
                      str(tmp)],
                     check=True, capture_output=True, text=True)
      if not tmp.is_file():  # (`CXX=true` exits 0 and writes nothing)
        raise OSError(f"its build wrote no library ({cxx} exited 0 without writing {tmp.name}); "
                      "set CXX to a working C++ compiler, or KVJAX_KERNEL=off")
      out.with_suffix(".sha256").unlink(missing_ok=True)
      os.replace(tmp, out)
      _write_record(out)
  return out


def _build_failed(e: subprocess.CalledProcessError) -> str:
  """Why a build failed, naming the compiler (`CXX=/bin/false` prints nothing)."""
  cxx = e.cmd[0] if isinstance(e.cmd, (list, tuple)) and e.cmd else "the compiler"
  last = (e.stderr or "").strip().splitlines()[-1:]
  said = f": {last[0][:200]}" if last else " and printed nothing"
  return (f"its build failed ({cxx} exited with status {e.returncode}{said}); set CXX to a "
          "working C++ compiler, or KVJAX_KERNEL=off")


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
  """Build, load and register the kernel once per process: None, or why not."""
  if not envcheck.kernel_on():
    return "turned off by KVJAX_KERNEL"
  try:
    lib = ctypes.CDLL(str(build()))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.KvjaxRead), platform="cpu")
    jax.ffi.register_ffi_target(MATVEC, jax.ffi.pycapsule(lib.KvjaxMatvec), platform="cpu")
    jax.ffi.register_ffi_target(MATVEC_T, jax.ffi.pycapsule(lib.KvjaxMatvecT), platform="cpu")
  except subprocess.CalledProcessError as e:
    return _build_failed(e)
  except (OSError, AttributeError) as e:  # (a symbol missing from a rebuilt library)
    return str(e)
  return None


@functools.lru_cache(maxsize=1)
def available() -> bool:
  """True when the kernel is built and registered (the default CPU read uses it)."""
  why = _load()
  if why is not None:
    print(f"kvjax: the CPU read kernel is not available ({why}); reading through XLA's "
          "dots instead", file=sys.stderr)
  return why is None


def status() -> str:
  """'active', or why the kernel is not (for results rows and `make test`)."""
  return "active" if available() else (_load() or "inactive")


def weight_dots(x, ws, transposed: bool = False):
  """x [..., E] times each weight matrix of `ws` (each [E, N_i] and stored in bfloat16 or
  float32; `transposed`: one table [N, E], as a tied lm_head multiplies by its embedding)
  in float32: a tuple of [..., N_i]. Through the kernel where it applies: few rows (at most
  MATVEC_ROWS, a decode step's), float32 x, every weight bf16 or float32, the kernel built,
  no device mesh traced (a split weight is XLA's to multiply); the matrices of one call
  share one dispatch (q/k/v, gate/up). Elsewhere, and on any other platform
  (`lax.platform_dependent`), XLA multiplies them (bf16 weights widened first). Same values
  up to float32 summation order."""
  ws = tuple(ws)
  E = x.shape[-1]
  rows = x.size // E if E else 0
  Ns = [w.shape[0 if transposed else 1] for w in ws]

  def xla_dots(x, *ws):
    return tuple(x @ (w.T if transposed else w).astype(x.dtype) for w in ws)

  mesh = jax.sharding.get_abstract_mesh()
  if (not ws or any(w.dtype not in (jnp.bfloat16, jnp.float32) for w in ws)
      or x.dtype != jnp.float32 or not 0 < rows <= MATVEC_ROWS or (transposed and len(ws) > 1)
      or not (mesh.empty or mesh.size == 1) or not available()):
    return xla_dots(x, *ws)

  def kernel(x, *ws):
    outs = tuple(jax.ShapeDtypeStruct((rows, N), jnp.float32) for N in Ns)
    ys = jax.ffi.ffi_call(MATVEC_T if transposed else MATVEC, outs,
                          vmap_method="sequential")(x.reshape(rows, E), *ws)
    return tuple(y.reshape(*x.shape[:-1], N) for y, N in zip(ys, Ns))

  return jax.lax.platform_dependent(x, *ws, cpu=kernel, default=xla_dots)


def weight_dot(x, w, transposed: bool = False):
  """`weight_dots` of one matrix."""
  return weight_dots(x, (w,), transposed)[0]


def _leaves(enc):
  """(codes, scale, zero) of a codec's stored leaves, empty arrays where it has none."""
  none = jnp.zeros((0,), jnp.uint16)
  if isinstance(enc, dict):
    return enc["codes"], enc.get("scale", none), enc.get("zero", none)
  return enc, none, none


def read(q_BKGTD, seg):
  """The online-softmax partial state (m, s, acc) of `seg` for these queries through the
  kernel, or None where the kernel does not read this segment's storage (a codec without
  a `stored.kernel`, or a segment without a `kernel_view`).

  Traced under a device mesh (`kvjax.decode.sharding.visible`), the call runs per device inside
  `jax.shard_map`: each device reads its own batch rows and KV heads, as the XLA read's
  partitioned dots do, where a plain custom call would gather every input onto each device."""
  kk, vk = seg.k_codec.stored.kernel, seg.v_codec.stored.kernel
  view = seg.kernel_view()
  if kk is None or vk is None or view is None or not available() or seg.head_BKS is not None:
    return None  # (the kernel reads one slot mask per sequence, not one per KV head)
  if q_BKGTD.shape[-1] > MAX_WIDTH:
    return None  # (a wide latent row: the XLA read takes it)
  layer, n_layers, pages, page, pool_rows = view
  kc, ks, kz = _leaves(seg.k)
  vc, vs, vz = _leaves(seg.v)
  scales = (_scales(seg.k_codec, ks), _scales(seg.v_codec, vs))
  S = seg.mask_BS.shape[1]
  live = S if seg.live is None else seg.live
  args = (q_BKGTD, kc, ks, kz, vc, vs, vz, seg.mask_BS, jnp.asarray(pages, jnp.int32),
          jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(live, jnp.int32).reshape(()))
  call = functools.partial(_call, kinds=(kk, vk), scales=scales, n_layers=n_layers,
                           page=page, pool_rows=pool_rows)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return call(*args)
  return jax.shard_map(call, mesh=mesh, in_specs=_specs(args, page, kc.ndim),
                       out_specs=(P("data", "kv", "rep"),) * 3,
                       check_vma=False)(*args)


MODES = {"whole": 0, "grouped": 1, "channel": 2}  # read.cc's Mode


def _scales(codec, scale) -> tuple[int, int]:
  """(mode, param) of a leaf's scales for the kernel: param is the scales per token of
  head_dim groups ([..., S, n]) or the tokens U each per-channel row covers."""
  mode = codec.stored.scales
  if mode == "channel":
    return MODES[mode], int(codec.group)
  return MODES[mode], int(scale.shape[-1]) if scale.ndim > 1 else 1


def _specs(args, page: int, codes_ndim: int) -> tuple:
  """Per-device pieces of the kernel's inputs: queries [B, K, G, T, D] split batch over
  `data`, KV heads over `kv` and a head's queries over `rep` (`kvjax.decode.sharding`'s rule);
  stored leaves their batch and KV heads ([B, K, ...] rows, [L, B, K, ...] layer stacks,
  [L, P, K, ...] page pools whose pages every device shares); the mask and the block table
  their batch; layer and live length whole."""
  lead = ("data", "kv") if codes_ndim == 4 else (None, None if page else "data", "kv")

  def stored(a):
    return P(*lead) if a.ndim >= len(lead) else P()
  return (P("data", "kv", "rep"), *map(stored, args[1:7]), P("data"),
          P("data") if page else P(), P(), P())


def _call(q_BKGTD, kc, ks, kz, vc, vs, vz, mask_BS, pages, layer, live, *, kinds, scales,
          n_layers: int, page: int, pool_rows: int):
  """The custom call on (this device's) arrays: shapes read from the arrays themselves."""
  B, K, G, T, D = q_BKGTD.shape
  S = mask_BS.shape[1]
  f32 = jnp.float32
  out = (jax.ShapeDtypeStruct((B * K, G * T), f32), jax.ShapeDtypeStruct((B * K, G * T), f32),
         jax.ShapeDtypeStruct((B * K, G * T, D), f32))
  m, s, acc = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
      q_BKGTD.astype(f32).reshape(B * K, G * T, D), kc, ks, kz, vc, vs, vz, mask_BS, pages,
      layer, live, k_kind=kinds[0], v_kind=kinds[1], k_width=int(kc.shape[-1]),
      v_width=int(vc.shape[-1]), k_mode=scales[0][0], k_param=scales[0][1],
      v_mode=scales[1][0], v_param=scales[1][1], n_layers=n_layers, batch=B, heads=K, seq=S,
      page=page, pool_rows=pool_rows)
  return m.reshape(B, K, G, T), s.reshape(B, K, G, T), acc.reshape(B, K, G, T, D)
