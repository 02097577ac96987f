"""Scale out with `jax.sharding`: one device mesh for parameters and cache (docs/scaling.md).

`mesh.data` x `mesh.model` devices form a `jax.sharding.Mesh`; everything else is XLA's
SPMD partitioner, fed by the shardings of the inputs (parameters, cache, prompts) and by
`constrain_cache` inside the jitted prefill/decode, so the cache keeps its layout through
the decode loop. Nothing here is a home-made collective.

The `model` axis (size m) is laid out as two mesh axes, `kv` x `rep`:
  m_kv = m when K % m == 0, else K when m % K == 0 (anything else is an error);
  rep  = m / m_kv: how many devices hold a copy of each KV head.
Megatron-style tensor parallelism uses both (`TP = ("kv", "rep")`): q/gate/up kernels
split their output axis, o/down their input axis, so each layer needs one all-reduce
after attention and one after the MLP. K/V projections and the cache split the KV-head
axis over `kv` only; when K < m (MQA, small GQA) each KV head is replicated on the `rep`
devices whose query heads read it (what vLLM and Megatron do). Sharding the cache along
the sequence instead would save that replication but needs a distributed softmax every
step; `kvjax size` reports the replication's cost (`bytes_per_device` vs `ideal`).

Embedding and lm_head split the vocabulary over TP (a vocab-parallel embedding is a
masked gather plus an all-reduce; the logits stay vocab-split until the sampler's
argmax). Norms are replicated (E floats per layer). The batch splits over `data`.

The cache is laid out by the logical axes each cache class names for its fields (`AXES`,
kvjax.cache.base) through one table, `RULES`: batch over `data`, KV heads over `kv`,
everything else whole. So the `paged` layout's pool [L, P, K, page, ...] splits KV heads
only (pages are shared by the batch, so they are replicated over `data`), its block table
and every per-sequence counter split the batch, and a field with no named axes is refused.

Divisibility: heads that do not divide -> one-line KvjaxError (a head is never split);
a batch that `data` does not divide -> KvjaxError; d_ff or vocab that `TP` does not
divide -> that weight is replicated (pinned by tests/library/test_sharding.py).

Starting the processes of a multi-host run (`jax.distributed`) is kvjax.distributed's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.config import Config
from kvjax.distributed import ENV, initialize_distributed  # noqa: F401  (their old home)
from kvjax.errors import KvjaxError

AXES = ("data", "kv", "rep")
TP = ("kv", "rep")          # the whole `model` axis
COLUMN = ("q_proj", "gate_proj", "up_proj")   # split the output axis over TP
KV_PROJ = ("k_proj", "v_proj")                # split the output axis over `kv`
ROW = ("o_proj", "down_proj")                 # split the input axis over TP
# The cache's logical axes (`kvjax.cache.base`: each cache class's `AXES`) on the mesh: a
# sequence's leaves split the batch over `data` and KV heads over `kv`; layers, tokens and
# a shared pool's pages stay whole.
RULES = {"batch": "data", "kv_heads": "kv", "layers": None, "tokens": None, "pages": None,
         None: None}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Mesh axis sizes for one config: data x kv x rep devices."""

  data: int
  kv: int
  rep: int

  @property
  def model(self) -> int:
    return self.kv * self.rep

  @property
  def n_devices(self) -> int:
    return self.data * self.model

  @property
  def sizes(self) -> dict:
    return {"data": self.data, "kv": self.kv, "rep": self.rep}

  def shards(self, spec: P) -> int:
    """How many pieces an array with this PartitionSpec is cut into."""
    n = 1
    for entry in spec:
      for name in (entry if isinstance(entry, tuple) else (entry,)):
        n *= self.sizes.get(name, 1) if name else 1
    return n


def plan(cfg: Config) -> Plan:
  """Check that the mesh fits the model's heads; return the axis sizes."""
  m, H, K = cfg.mesh.model, cfg.model.n_heads, cfg.model.n_kv_heads
  if H % m:
    raise KvjaxError(f"mesh.model={m} does not divide model.n_heads={H}; choose mesh.model "
                     "among the divisors of n_heads")
  if K % m == 0:
    return Plan(cfg.mesh.data, m, 1)
  if m % K == 0:
    return Plan(cfg.mesh.data, K, m // K)
  raise KvjaxError(f"mesh.model={m} and model.n_kv_heads={K}: one must divide the other "
                   "(KV heads are split, or replicated m/K times, never cut)")


def is_sharded(cfg: Config) -> bool:
  return cfg.mesh.data * cfg.mesh.model > 1


def check_batch(cfg: Config, batch: int) -> None:
  if batch % cfg.mesh.data:
    raise KvjaxError(f"batch {batch} is not divisible by mesh.data={cfg.mesh.data}; "
                     "pad the batch or choose mesh.data among its divisors")


@functools.lru_cache(maxsize=8)
def _mesh(p: Plan, device_ids: tuple) -> Mesh:
  by_id = {d.id: d for d in jax.devices()}
  devs = np.array([by_id[i] for i in device_ids]).reshape(p.data, p.kv, p.rep)
  return Mesh(devs, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def make_mesh(cfg: Config) -> Mesh:
  """The (data, kv, rep) mesh over the first data * model devices (all hosts' devices)."""
  p = plan(cfg)
  devices = jax.devices()
  if p.n_devices > len(devices):
    raise KvjaxError(f"mesh {cfg.mesh.data}x{cfg.mesh.model} needs {p.n_devices} devices, "
                     f"{len(devices)} visible; lower mesh.data/mesh.model (on CPU: XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={p.n_devices})")
  return _mesh(p, tuple(d.id for d in devices[:p.n_devices]))


# -- specs ------------------------------------------------------------------------------------
def _names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def param_spec(path: list[str], shape: tuple, p: Plan) -> P:
  """PartitionSpec of one parameter, named by its path in the Flax params dict."""
  def split(axis: int, over) -> P:
    n = math.prod(p.sizes[a] for a in (over if isinstance(over, tuple) else (over,)))
    if shape[axis] % n:
      return P()  # d_ff or vocab not divisible: replicate this weight (documented fallback)
    spec = [None] * len(shape)
    spec[axis] = over
    return P(*spec)

  module, leaf = (path[-2] if len(path) > 1 else ""), path[-1]
  if module in COLUMN:
    return split(len(shape) - 1, TP)   # kernel [L, E, out] or bias [L, out]
  if module in KV_PROJ:
    return split(len(shape) - 1, "kv")
  if module in ROW and leaf == "kernel":
    return split(len(shape) - 2, TP)   # kernel [L, in, E]
  if module == "embed_tokens":
    return split(0, TP)                # [V, E]
  if module == "lm_head" and leaf == "kernel":
    return split(1, TP)                # [E, V]
  return P()                           # norms, o/down biases (none in Llama)


def param_specs(params: Any, cfg: Config) -> Any:
  p = plan(cfg)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: param_spec(_names(path), tuple(x.shape), p), params)


def cache_leaf_spec(path: list[str], ndim: int, axes: dict, layout: str = "") -> P:
  """The PartitionSpec of one cache leaf: its field's logical axes (`axes`, the cache
  class's `AXES`) through `RULES`, its trailing (codec) dimensions whole. A field the class
  names no axes for is refused: a leaf must never be replicated by omission."""
  field = path[0] if path else ""
  if field not in axes:
    raise KvjaxError(f"cache leaf {'.'.join(path) or '(root)'} of layout {layout or '?'} has "
                     "no logical axes: name them in its cache class's AXES (kvjax.cache.base)")
  names = tuple(axes[field])[:ndim]
  return P(*(RULES[n] for n in names), *([None] * (ndim - len(names))))


def cache_specs(cache: Any) -> Any:
  """The PartitionSpec of every leaf of a cache (any layout: its class names the axes)."""
  axes = type(cache).AXES
  return jax.tree_util.tree_map_with_path(
      lambda path, x: cache_leaf_spec(_names(path), x.ndim, axes, cache.spec.layout), cache)


def shardings(specs: Any, mesh: Mesh) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, P))


# -- placement --------------------------------------------------------------------------------
def _put(x, sharding: NamedSharding):
  """Host data -> a global array; works on one host and on many (each holds the full x)."""
  if isinstance(x, jax.Array):
    same = x.sharding.is_equivalent_to(sharding, x.ndim) if hasattr(x, "sharding") else False
    return x if same else jax.device_put(x, sharding)
  arr = np.asarray(x)
  return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def shard_params(params: Any, cfg: Config, mesh: Mesh) -> Any:
  sh = shardings(param_specs(params, cfg), mesh)
  return jax.tree.map(_put, params, sh)


def init_params(cfg: Config, mesh: Mesh) -> Any:
  """Random parameters created already split (never whole on one device)."""
  from kvjax import model

  shapes = jax.eval_shape(lambda: model.init_params(cfg.model, cfg.seed))
  sh = shardings(param_specs(shapes, cfg), mesh)
  return jax.jit(lambda: model.init_params(cfg.model, cfg.seed), out_shardings=sh)()


def init_cache(cfg: Config, batch: int, capacity: int, mesh: Mesh) -> Any:
  """A fresh cache allocated directly in its sharded layout."""
  from kvjax import cache as cache_lib

  check_batch(cfg, batch)
  make = lambda: cache_lib.init_cache(cfg, batch, capacity)  # noqa: E731
  sh = shardings(cache_specs(jax.eval_shape(make)), mesh)
  return jax.jit(make, out_shardings=sh)()


def put_batch(x, mesh: Mesh):
  """Prompt tokens [B, T] / lengths [B]: batch over `data`, replicated over the model axis."""
  return _put(x, NamedSharding(mesh, P("data", *([None] * (np.ndim(x) - 1)))))


class Placement:
  """Where a program's arrays live: one device, or the mesh `mesh.*` asks for. Every
  method is the identity's placement on one device (`mesh` None)."""

  def __init__(self, cfg: Config, batch: int | None = None):
    self.cfg = cfg
    self.mesh = make_mesh(cfg) if is_sharded(cfg) else None
    if self.mesh is not None and batch is not None:
      check_batch(cfg, batch)

  def params(self, params):
    """Params split over the mesh (as given on one device); `step.prepare_params` next."""
    return params if self.mesh is None else shard_params(params, self.cfg, self.mesh)

  def batch(self, x):
    """Prompt tokens [B, T] or a per-sequence vector [B]: the batch over `data`."""
    return x if self.mesh is None else put_batch(x, self.mesh)

  def full(self, batch: int, value: int):
    """A [B] int32 vector of `value`, placed as `batch` places one."""
    if self.mesh is None:
      return jax.numpy.full((batch,), value, jax.numpy.int32)
    return self.batch(np.full((batch,), value, np.int32))

  def cache(self, batch: int, capacity: int, context: int = 0):
    """A fresh cache (in its sharded layout on a mesh); `context` tokens held by length."""
    from kvjax import cache as cache_lib

    if self.mesh is None:
      c = cache_lib.init_cache(self.cfg, batch, capacity)
    else:
      c = init_cache(self.cfg, batch, capacity, self.mesh)
    if context:
      c = dataclasses.replace(c, lengths=self.full(batch, context))
    return jax.block_until_ready(c)


def visible(cfg: Config):
  """Inside jit: the mesh made visible (abstract) to what is traced under this context (the
  CPU kernels read it, `kvjax.kernels`); nothing on one device."""
  if not is_sharded(cfg):
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(make_mesh(cfg).abstract_mesh)


def constrain_cache(cache: Any, cfg: Config) -> Any:
  """Inside jit: pin the cache to its layout (a no-op on one device)."""
  if not is_sharded(cfg):
    return cache
  sh = shardings(cache_specs(cache), make_mesh(cfg))
  return jax.lax.with_sharding_constraint(cache, sh)


def to_host(x) -> np.ndarray:
  """A (possibly multi-host) global array as a full numpy array on every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


# -- bytes ------------------------------------------------------------------------------------
def bytes_per_device(tree: Any, specs: Any, p: Plan) -> int:
  """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) under `specs`."""
  leaves = jax.tree.leaves(tree)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize // p.shards(s)
                 for x, s in zip(leaves, spec_leaves)))


def measured_device_bytes(tree: Any) -> int:
  """Bytes actually resident on the fullest device, from the arrays' shards."""
  per: dict = {}
  for x in jax.tree.leaves(tree):
    for s in x.addressable_shards:
      per[s.device] = per.get(s.device, 0) + s.data.size * s.data.dtype.itemsize
  return max(per.values()) if per else 0


def size_report(cfg: Config, batch: int, capacity: int, with_params: bool) -> dict:
  """Bytes per device of the cache (and parameters) under cfg.mesh, computed abstractly:
  no device is needed, so a laptop can size a 64-chip slice."""
  from kvjax import cache as cache_lib, footprint, model, policies

  p = plan(cfg)
  check_batch(cfg, batch)
  sized_as = cache_lib.get(cfg.cache.layout).sized_as  # `none`: the K/V it recomputes
  if sized_as:
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, layout=sized_as))
  if policies.evicts(cfg.cache):  # what the policy builds (`footprint.layout_name`): `capacity`
    # held slots plus its own leaves (held, budget; h2o's acc and pos per slot and KV head)
    spec = dataclasses.replace(cache_lib.CacheSpec.from_config(cfg, batch, capacity),
                               layout=footprint.layout_name(cfg))
    c = jax.eval_shape(lambda: cache_lib.get(spec.layout).init(spec))
  else:
    c = jax.eval_shape(lambda: cache_lib.init_cache(cfg, batch, capacity))
  total = bytes_per_device(c, cache_specs(c), Plan(1, 1, 1))
  out = {"mesh": {"data": p.data, "model": p.model, "kv": p.kv, "kv_replication": p.rep},
         "devices": p.n_devices,
         "bytes_per_device": bytes_per_device(c, cache_specs(c), p),
         "ideal_bytes_per_device": -(-total // p.n_devices)}
  if with_params:
    w = jax.eval_shape(lambda: model.init_params(cfg.model, 0))
    specs = param_specs(w, cfg)
    out["param_bytes"] = bytes_per_device(w, specs, Plan(1, 1, 1))
    out["param_bytes_per_device"] = bytes_per_device(w, specs, p)
  return out
