"""Sharding on a device mesh (kvjax.decode.sharding): same greedy tokens as one device, intended layouts.

The multi-device checks run in ONE child process with 4 forced CPU devices (this file run
as a script), so the rest of the suite keeps one device; the child prints JSON and the
parent asserts. Pure rules (specs, plans, errors, sizes) run in-process: they need no devices.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from kvjax import cli
from kvjax import config as config_lib
from kvjax.decode import generate
from kvjax.decode import sharding
from kvjax.decode import step
from kvjax.errors import KvjaxError

TINY = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4}
CASES = [("MHA", 4, "fp32"), ("GQA-2", 2, "int8"), ("MQA", 1, "fp32")]
# The meshes each case runs on (data x model). MHA takes all three splits (model only, both,
# data only); GQA-2 int8 the split heads with split scales (2x2) and 2 KV heads over 4
# devices (replicated in pairs, 1x4); MQA the fully replicated head (1x4). The other four
# pairs add no rule: data-only (4x1) is MHA's for any K, MQA on 2x2 is replication as on 1x4.
MESHES = {"MHA": [(1, 4), (2, 2), (4, 1)], "GQA-2": [(1, 4), (2, 2)], "MQA": [(1, 4)]}
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [3, 3]]
NEW = 5


def _cfg(**over):
  return config_lib.load(None, {**TINY, **over})


# -- the child: everything that needs 4 devices -------------------------------------------------
def _leaf_report(cache) -> list[dict]:
  """Per cache leaf: global and per-device shapes, and whether its sharding is the rule
  (written out here by hand: batch over `data`, KV heads over `kv`)."""
  from jax.sharding import NamedSharding
  out = []
  for path, x in jax.tree_util.tree_leaves_with_path(cache):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if names[0] in ("lengths", "block_table"):
      rule = P("data")
    elif hasattr(cache, "block_table"):  # a paged pool: pages shared by the batch
      rule = P(None, None, "kv")
    else:
      rule = P(None, "data", "kv")
    out.append({"path": names, "shape": list(x.shape),
                "shard": list(x.addressable_shards[0].data.shape),
                "intended": x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, rule),
                                                        x.ndim)})
  return out


def child() -> dict:
  from kvjax import model

  res: dict = {"devices": len(jax.devices()), "runs": [], "errors": {}}
  for name, K, codec in CASES:
    cfg = _cfg(**{"model.n_kv_heads": K, "cache.codec": codec})
    params = model.init_params(cfg.model, 0)
    ref = generate.generate(cfg, params, PROMPTS, NEW, timed=False)
    for d, m in MESHES[name]:
      c = config_lib.apply_overrides(cfg, {"mesh.data": d, "mesh.model": m})
      out = generate.generate(c, params, PROMPTS, NEW, timed=False, return_cache=True)
      res["runs"].append({"case": name, "K": K, "mesh": [d, m], "same": out["tokens"] == ref["tokens"],
                          "bytes": out["cache_bytes"], "per_device": out["cache_bytes_per_device"],
                          "leaves": _leaf_report(out["cache"])})
    if name == "MHA":  # the recompute and paged layouts, and unrolled layers, on a 2x2 mesh
      for layout in ("none", "paged", "unrolled"):
        over = {"model.scan_unroll": cfg.model.n_layers} if layout == "unrolled" else \
            {"cache.layout": layout, "cache.page_size": 4}
        c = config_lib.apply_overrides(cfg, {"mesh.data": 2, "mesh.model": 2, **over})
        out = generate.generate(c, params, PROMPTS, NEW, timed=False, return_cache=True)
        res[f"{layout}_same"] = out["tokens"] == ref["tokens"]
        if layout == "paged":
          res["paged_leaves"] = _leaf_report(out["cache"])
  # a hybrid cache (rings for the windowed layer) on a 2x2 mesh, against one device
  wcfg = _cfg(**{"model.n_kv_heads": 2, "model.global_every": 2, "model.sliding_window": 3})
  wparams = model.init_params(wcfg.model, 0)
  wref = generate.generate(wcfg, wparams, PROMPTS, NEW, timed=False)
  c = config_lib.apply_overrides(wcfg, {"mesh.data": 2, "mesh.model": 2})
  out = generate.generate(c, wparams, PROMPTS, NEW, timed=False, return_cache=True)
  res["window_same"] = out["tokens"] == wref["tokens"]
  res["window_leaves"] = _leaf_report(out["cache"])
  res["kernel"] = _kernel_operands()
  cfg = _cfg(**{"mesh.data": 2})
  for label, c, prompts in (("batch", cfg, PROMPTS[:3]),
                            ("devices", _cfg(**{"mesh.data": 4, "mesh.model": 2}), PROMPTS)):
    try:
      generate.generate(c, model.init_params(c.model, 0), prompts, 2, timed=False)
      res["errors"][label] = None
    except KvjaxError as e:
      res["errors"][label] = str(e)
  return res


def _kernel_operands() -> dict:
  """The CPU read kernel's query operand in the compiled, partitioned decode step of GQA-2
  int8 on a 2x2 mesh: its rows (B x K) per device, and how many calls there are."""
  import re

  import jax.numpy as jnp
  from kvjax import decode, kernels, model
  c = _cfg(**{"model.n_kv_heads": 2, "cache.codec": "int8", "mesh.data": 2, "mesh.model": 2})
  mesh = sharding.make_mesh(c)
  params = sharding.shard_params(step.prepare_params(c, model.init_params(c.model, 0)), c, mesh)
  cache = sharding.init_cache(c, 4, 24, mesh)
  token = sharding.put_batch(jnp.zeros((4,), jnp.int32), mesh)
  text = decode.decode.lower(params, cache, token, jax.random.PRNGKey(0),
                             **generate.statics(c, decode.Sampler(), steps=2)).compile().as_text()
  calls = [line for line in text.splitlines() if 'custom_call_target="kvjax_read"' in line]
  rows = [int(re.search(r"= \(f32\[(\d+),", line).group(1)) for line in calls]
  return {"status": kernels.status(), "rows": rows}


@pytest.fixture(scope="module")
def four_devices() -> dict:
  env = dict(os.environ)
  # Four CPU devices, on top of the run's cheaper-compile flags (conftest.py; both sides of
  # every comparison run under the same flags).
  env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4",
                               "--xla_backend_optimization_level=0",
                               "--xla_llvm_disable_expensive_passes=true"]).strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_meshes_give_the_same_greedy_tokens_as_one_device(four_devices):
  assert four_devices["devices"] == 4
  runs = four_devices["runs"]
  assert {(r["case"], tuple(r["mesh"])) for r in runs} == \
      {(c[0], m) for c in CASES for m in MESHES[c[0]]}
  bad = [(r["case"], r["mesh"]) for r in runs if not r["same"]]
  assert not bad, f"tokens differ from one device: {bad}"
  assert four_devices["none_same"] and four_devices["paged_same"]
  assert four_devices["unrolled_same"]  # weights split per layer after sharding them


def test_the_cpu_read_kernel_runs_per_device(four_devices):
  """Under a mesh the kernel reads each device's own rows (batch 4 over `data`=2, 2 KV heads
  over `kv`=2: 2 x 1 rows a device), not inputs gathered whole onto every device (8 rows)."""
  got = four_devices["kernel"]
  if got["status"] != "active":
    assert not shutil.which("g++"), f"g++ exists but the kernel is {got['status']}"
    pytest.skip("no C++ compiler: the kernel is not built")
  assert got["rows"] and set(got["rows"]) == {2}, got


def test_paged_pool_splits_kv_heads_and_the_block_table_splits_the_batch(four_devices):
  leaves = four_devices["paged_leaves"]
  assert all(leaf["intended"] for leaf in leaves), leaves
  for leaf in leaves:
    if leaf["path"][0] in ("k", "v"):   # [L, P, K, page, D] on a 2x2 mesh: heads halved
      L, Pg, Kh, *rest = leaf["shape"]
      assert leaf["shard"] == [L, Pg, Kh // 2, *rest]
    elif leaf["path"][0] == "block_table":
      assert leaf["shard"] == [leaf["shape"][0] // 2, leaf["shape"][1]]


def test_a_hybrid_cache_splits_its_rings_like_its_full_layers(four_devices):
  assert four_devices["window_same"]
  leaves = {leaf["path"][0]: leaf for leaf in four_devices["window_leaves"]
            if leaf["path"][0] in ("k", "v", "k_ring", "v_ring")}
  assert set(leaves) == {"k", "v", "k_ring", "v_ring"}
  for leaf in leaves.values():  # [L', B, K, S or W, D] on a 2x2 mesh: batch and heads halved
    L, B, Kh, *rest = leaf["shape"]
    assert leaf["intended"] and leaf["shard"] == [L, B // 2, Kh // 2, *rest], leaf
  assert leaves["k_ring"]["shape"][3] == 3 and leaves["k"]["shape"][0] == 1


def test_cache_leaves_carry_the_intended_shardings(four_devices):
  for r in four_devices["runs"]:
    d, m = r["mesh"]
    K = r["K"]
    kv = m if K % m == 0 else K      # KV heads split over `kv`, replicated over `rep`
    kv_leaves = [leaf for leaf in r["leaves"] if leaf["path"][0] in ("k", "v")]
    assert kv_leaves, r["leaves"]
    for leaf in kv_leaves:  # codes and codec scales alike: [L, B, K, S, ...]
      assert leaf["intended"], leaf
      L, B, Kh, *rest = leaf["shape"]
      assert leaf["shard"] == [L, B // d, Kh // kv, *rest], (r["case"], r["mesh"], leaf)
    (lengths,) = [leaf for leaf in r["leaves"] if leaf["path"] == ["lengths"]]
    assert lengths["intended"] and lengths["shard"] == [len(PROMPTS) // d]
    # Bytes on the fullest device: the global cache split over data x kv (no more, no less).
    kv_bytes = r["bytes"] - 4 * len(PROMPTS)
    assert r["per_device"] == kv_bytes // (d * kv) + 4 * len(PROMPTS) // d


def test_int8_scales_shard_with_their_codes(four_devices):
  (r,) = [r for r in four_devices["runs"] if r["case"] == "GQA-2" and r["mesh"] == [2, 2]]
  names = {leaf["path"][-1] for leaf in r["leaves"] if leaf["path"][0] == "k"}
  assert {"codes", "scale"} <= names
  for leaf in r["leaves"]:
    if leaf["path"][0] in ("k", "v"):
      assert leaf["shard"][1:3] == [leaf["shape"][1] // 2, leaf["shape"][2] // 2]


def test_mqa_replicates_kv_over_the_model_axis(four_devices):
  """The documented rule for K < mesh.model: each KV head is held whole by the devices that
  read it, so MQA on 1x4 keeps the full cache on every device."""
  (r,) = [r for r in four_devices["runs"] if r["case"] == "MQA" and r["mesh"] == [1, 4]]
  assert r["per_device"] == r["bytes"]


def test_bad_meshes_fail_with_one_line_errors(four_devices):
  errs = four_devices["errors"]
  assert errs["batch"] and "mesh.data=2" in errs["batch"] and "\n" not in errs["batch"]
  assert errs["devices"] and "needs 8 devices, 4 visible" in errs["devices"]


# -- pure rules (one device is enough) ----------------------------------------------------------
def _specs(cfg):
  from kvjax import model
  shapes = jax.eval_shape(lambda: model.init_params(cfg.model, 0))
  return shapes, sharding.param_specs(shapes, cfg)


def test_params_are_split_megatron_style():
  cfg = _cfg(**{"model.n_kv_heads": 2, "model.vocab_size": 264, "mesh.model": 4})
  _, specs = _specs(cfg)
  layers = specs["layers"]
  TP = ("kv", "rep")
  for name in ("q_proj", "gate_proj", "up_proj"):
    assert layers[name]["kernel"] == P(None, None, TP)
  for name in ("k_proj", "v_proj"):
    assert layers[name]["kernel"] == P(None, None, "kv")
  for name in ("o_proj", "down_proj"):
    assert layers[name]["kernel"] == P(None, TP, None)
  assert layers["input_layernorm"]["weight"] == P() and specs["norm"]["weight"] == P()
  assert specs["embed_tokens"]["embedding"] == P(TP, None)
  assert specs["lm_head"]["kernel"] == P(None, TP)


def test_qkv_biases_split_with_their_kernels():
  cfg = _cfg(**{"model.n_kv_heads": 2, "model.qkv_bias": True, "mesh.model": 2})
  _, specs = _specs(cfg)
  assert specs["layers"]["q_proj"]["bias"] == P(None, ("kv", "rep"))
  assert specs["layers"]["k_proj"]["bias"] == P(None, "kv")


def test_vocab_and_dff_that_do_not_divide_are_replicated():
  """Documented fallback: a weight whose split axis does not divide stays whole."""
  cfg = _cfg(**{"model.vocab_size": 262, "model.d_ff": 90, "mesh.model": 4})
  _, specs = _specs(cfg)
  assert specs["embed_tokens"]["embedding"] == P()
  assert specs["lm_head"]["kernel"] == P()
  for name in ("gate_proj", "up_proj", "down_proj"):
    assert specs["layers"][name]["kernel"] == P()
  assert specs["layers"]["q_proj"]["kernel"] == P(None, None, ("kv", "rep"))


@pytest.mark.parametrize("over,fragment", [
    ({"mesh.model": 3}, "does not divide model.n_heads=4"),
    ({"model.n_heads": 6, "model.n_kv_heads": 3, "model.head_dim": 8, "mesh.model": 2},
     "one must divide the other"),
])
def test_meshes_that_cut_heads_are_one_line_errors(over, fragment):
  with pytest.raises(KvjaxError, match=fragment) as e:
    sharding.plan(_cfg(**over))
  assert "\n" not in str(e.value)


def test_plan_replicates_kv_heads_only_as_needed():
  assert sharding.plan(_cfg(**{"model.n_heads": 8, "model.n_kv_heads": 8, "mesh.model": 4})) == \
      sharding.Plan(1, 4, 1)
  assert sharding.plan(_cfg(**{"model.n_heads": 8, "model.n_kv_heads": 2, "mesh.model": 8})) == \
      sharding.Plan(1, 2, 4)
  assert sharding.plan(_cfg(**{"model.n_kv_heads": 1, "mesh.model": 4, "mesh.data": 2})) == \
      sharding.Plan(2, 1, 4)


def test_one_device_cannot_hold_a_bigger_mesh():
  with pytest.raises(KvjaxError, match="needs 2 devices, 1 visible"):
    sharding.make_mesh(_cfg(**{"mesh.model": 2}))


def test_size_report_counts_bytes_per_device_and_replication():
  mqa = _cfg(**{"model.n_kv_heads": 1, "mesh.data": 2, "mesh.model": 4})
  r = sharding.size_report(mqa, batch=4, capacity=64, with_params=True)
  one = sharding.size_report(_cfg(**{"model.n_kv_heads": 1}), batch=4, capacity=64,
                             with_params=True)
  total = one["bytes_per_device"]
  assert r["mesh"] == {"data": 2, "model": 4, "kv": 1, "kv_replication": 4}
  assert r["bytes_per_device"] == total // 2          # split over data only: K=1 is replicated
  assert r["ideal_bytes_per_device"] == -(-total // 8)
  assert r["param_bytes"] == one["param_bytes"] > r["param_bytes_per_device"]


def test_cli_size_reports_bytes_per_device(capsys):
  argv = ["size", "--layers", "4", "--heads", "8", "--kv-heads", "8", "--head-dim", "16",
          "--seq-len", "128", "--batch", "4", "--set", "mesh.data=2", "--set", "mesh.model=4",
          "--json"]
  assert cli.main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  lengths = 4 * 4  # [B] int32, split over data only
  assert out["devices"] == 8
  assert out["bytes_per_device"] == (out["total_bytes"] - lengths) // 8 + lengths // 2
  assert cli.main(argv[:-3] + ["mesh.model=3"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("kvjax: error:") and "mesh.model=3" in err and "\n" not in err


def test_distributed_flags_must_come_together(monkeypatch):
  from kvjax import distributed
  assert sharding.initialize_distributed is distributed.initialize_distributed  # old home
  for name in distributed.ENV.values():
    monkeypatch.delenv(name, raising=False)
  assert distributed.initialize_distributed() is False   # one process: nothing to do
  with pytest.raises(KvjaxError, match="together"):
    distributed.initialize_distributed(coordinator="10.0.0.1:1234")
  monkeypatch.setenv("KVJAX_NUM_PROCESSES", "two")
  with pytest.raises(KvjaxError, match="KVJAX_NUM_PROCESSES must be an integer"):
    distributed.initialize_distributed()


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
  print(json.dumps(child()))


def _cache_classes():
  """Every cache pytree class of the layouts (a flax struct with a static `spec`)."""
  import dataclasses
  import importlib
  import pkgutil
  import kvjax.cache
  out = []
  for m in pkgutil.iter_modules(kvjax.cache.__path__):
    mod = importlib.import_module(f"kvjax.cache.{m.name}")
    for obj in vars(mod).values():
      if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__ \
          and "spec" in {f.name for f in dataclasses.fields(obj)} and hasattr(obj, "replace"):
        out.append(obj)
  return out


def test_every_cache_field_names_its_logical_axes():
  """Each layout's cache class names the axes of every pytree field it has, each axis one
  the rules table maps: no leaf is replicated by omission."""
  import dataclasses
  classes = _cache_classes()
  assert {c.__name__ for c in classes} >= {"KVCache", "CompactedCache", "LatentCache",
                                           "PagedCache", "CompactedPagedCache", "TokenBuffer"}
  for cls in classes:
    fields = {f.name for f in dataclasses.fields(cls) if f.metadata.get("pytree_node", True)}
    assert fields == set(cls.AXES), (cls.__name__, fields ^ set(cls.AXES))
    assert all(a in sharding.RULES for axes in cls.AXES.values() for a in axes), cls.__name__


def test_cache_specs_follow_the_declared_axes_and_refuse_an_undeclared_leaf():
  from kvjax import cache as cache_lib
  from kvjax.cache import compact
  cfg = _cfg(**{"cache.codec": "int8", "cache.residual": 4})
  c = jax.eval_shape(lambda: cache_lib.init_cache(cfg, 2, 16))
  specs = {tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in p): s
           for p, s in jax.tree_util.tree_leaves_with_path(
               sharding.cache_specs(c), is_leaf=lambda s: isinstance(s, P))}
  assert {p[0] for p in specs} == {"k", "v", "k_win", "v_win", "lengths"}
  for path, spec in specs.items():  # codes, scales and the residual window alike
    want = ("data",) if path[0] == "lengths" else (None, "data", "kv")
    assert tuple(spec)[:len(want)] == want and set(tuple(spec)[len(want):]) <= {None}, path
  # a compacted cache's per-sequence counters split the batch like its lengths
  for field in ("held", "budget", "prompt_end"):
    assert sharding.cache_leaf_spec([field], 1, compact.CompactedCache.AXES) == P("data")
  assert sharding.cache_leaf_spec(["head_held"], 3, compact.CompactedCache.AXES) == \
      P(None, "data", "kv")
  with pytest.raises(KvjaxError, match=r"cache leaf held of layout compacted has no logical"):
    sharding.cache_leaf_spec(["held"], 1, {"k": ("layers",)}, "compacted")
