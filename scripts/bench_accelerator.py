"""The accelerator benchmark behind scripts/bench_accelerator.sh (read that file's header).

Every stage is a plain `kvjax run CONFIG --set ... --out DIR` (or `kvjax generate` for the
sharded stage) in its own process, with a timeout from a shared wall-clock budget: each
stage gets its share of the time left, so a fast stage's savings roll over and the whole
run ends within `--budget` seconds. A stage that fails or times out keeps the rows it
flushed (the runner writes row by row and resumes by cell) and the next stage runs.
This process never imports JAX, so it never holds accelerator memory its children need.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_plan  # noqa: E402  (scripts/device_plan.py, beside this file)

ROOT = Path(__file__).resolve().parent.parent

# Llama-3-8B's shape (kvjax/shapes/llama3-8b.yaml) in bf16, random weights.
LLAMA3_8B = {"model.vocab_size": 128256, "model.d_model": 4096, "model.n_layers": 32,
             "model.n_heads": 32, "model.n_kv_heads": 8, "model.head_dim": 128,
             "model.d_ff": 14336, "model.rope_theta": 500000.0, "model.dtype": "bfloat16",
             "model.param_dtype": "bfloat16", "model.max_seq_len": 32768}
TINY = {"model.vocab_size": 260, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
        "model.n_kv_heads": 2, "model.head_dim": 16, "model.d_ff": 176,
        "model.dtype": "float32", "model.param_dtype": "float32", "model.max_seq_len": 8192}


def _latency(name, kv, codecs, batch, context, prompt, gen=32, repeats=5):
  """One latency stage: cells kv x codecs at one batch and cache capacity (TPOT is read
  at `context`: the contiguous cache reads every slot, so a short prompt suffices)."""
  return {"name": name, "config": "latency", "out": "latency",
          "set": {"grid.model.n_kv_heads": kv, "grid.cache.codec": codecs,
                  "workload.batch": batch, "workload.prompt_len": prompt,
                  "cache.capacity": context, "workload.gen_len": gen,
                  "workload.repeats": repeats}}


# Decode attention, Pallas kernel vs XLA (scripts/bench_pallas.py; a smoke run off GPU).
PALLAS = {"name": "pallas", "kind": "script", "script": "scripts/bench_pallas.py",
          "out": "pallas", "weight": 2}


def accelerator_stages() -> list[dict]:
  shape = {k: v for k, v in LLAMA3_8B.items() if k != "model.n_kv_heads"}
  return [
      # SmolLM2-135M's shape (configs/roofline_smollm2.yaml), GQA-3, 4k tokens in the cache:
      # where a quantized cache should beat bf16 once the cache dominates (batch 8).
      {"name": "roofline-smollm2", "config": "roofline_smollm2", "experiment": "roofline",
       "out": "roofline_smollm2",
       "weight": 3, "set": {"grid.model.n_kv_heads": [3], "grid.workload.prompt_len": [4096],
                            "grid.workload.batch": [1, 8, 32]}},
      PALLAS,
      {**_latency("latency-codecs", [4], ["int8", "int4", "fp8_e4m3"], 8, 8192, 1024),
       "weight": 3},
      {"name": "memory", "config": "memory", "out": "memory", "weight": 1,
       "set": {**shape, "grid.model.n_kv_heads": [32, 8, 1],
               "params.contexts": [1024, 8192, 32768, 131072], "params.alloc_limit_mib": 8192,
               "model.max_seq_len": 131072}},
      {**_latency("latency-variants", [16, 4, 1], ["bf16"], 8, 8192, 1024), "weight": 3},
      {**_latency("latency-32k", [4], ["bf16", "int8"], 4, 32768, 512), "weight": 2},
      {**_latency("latency-batch64", [4], ["bf16", "int8"], 64, 2048, 256), "weight": 2},
      {"name": "roofline", "config": "roofline", "out": "roofline", "weight": 1,
       "set": {**shape, "grid.model.n_kv_heads": [8], "grid.workload.prompt_len": [4096, 16384]}},
      {"name": "quality", "config": "quality", "out": "quality", "weight": 1, "set": {},
       "needs_checkpoints": True},
      {"name": "peer", "config": "peer", "out": "peer", "weight": 2,
       "set": {"grid.workload.batch": [1], "grid.model.vocab_size": [32000],
               "workload.gen_len": 64, "workload.repeats": 3,
               "params.peers": ["kvjax", "dynamic", "static"]}},
      {"name": "sharded-generate", "kind": "generate", "out": "sharding", "weight": 1,
       "set": {**LLAMA3_8B, "cache.codec": "bf16"}, "batch": 8, "prompt": 1024, "new": 64},
  ]


def tiny_stages() -> list[dict]:
  small = {"grid.workload.prompt_len": [32], "grid.workload.batch": [2]}
  return [
      {"name": "memory", "config": "memory", "out": "memory", "weight": 1,
       "set": {**TINY, "grid.model.n_kv_heads": [4, 1], "grid.cache.codec": ["bf16", "int8"],
               "params.contexts": [256, 1024], "params.shapes": ["llama3-8b"]}},
      {"name": "latency", "config": "latency", "out": "latency", "weight": 2,
       "set": {**TINY, **small, "grid.model.n_kv_heads": [2], "grid.cache.codec": ["bf16", "int8"],
               "workload.gen_len": 8, "workload.repeats": 2}},
      {"name": "roofline", "config": "roofline", "out": "roofline", "weight": 1,
       "set": {**TINY}},
      {"name": "peer", "config": "peer", "out": "peer", "weight": 2,
       "set": {"grid.workload.batch": [1], "grid.model.vocab_size": [1024], "model.d_model": 64,
               "model.n_layers": 2, "model.d_ff": 176, "workload.prompt_len": 16,
               "workload.gen_len": 16, "workload.repeats": 2,
               "params.peers": ["kvjax", "dynamic"]}},
      {"name": "sharded-generate", "kind": "generate", "out": "sharding", "weight": 1,
       "set": {**TINY}, "batch": 2, "prompt": 16, "new": 8},
      PALLAS,
  ]


def _config_path(name: str, accel: bool) -> Path | None:
  for cand in ([f"configs/accel/{name}.yaml"] if accel else []) + [f"configs/{name}.yaml"]:
    if (ROOT / cand).is_file():
      return ROOT / cand
  return None


def _experiment_exists(name: str) -> bool:
  return (ROOT / "kvjax" / "experiments" / f"{name}.py").is_file()


def _set_args(items: dict) -> list[str]:
  out = []
  for k, v in items.items():
    out += ["--set", f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}"]
  return out


def _device(env: dict) -> dict:
  code = ("import jax, jaxlib, json; d = jax.devices(); print(json.dumps({'backend': "
          "jax.default_backend(), 'count': len(d), 'kind': d[0].device_kind, 'jax': "
          "jax.__version__, 'jaxlib': jaxlib.__version__, 'platform_version': "
          "str(d[0].client.platform_version)}))")
  try:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=180, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])
  except (subprocess.SubprocessError, json.JSONDecodeError, IndexError):
    return {"backend": "unknown", "count": 0, "kind": "unknown"}


def _command(stage: dict, results: Path, accel: bool, dev: dict) -> tuple[list[str] | None, str]:
  """The stage's command line, or None and why it is skipped."""
  py = [sys.executable, "-m", "kvjax.cli"]
  if stage.get("kind") == "generate":
    n = dev["count"]
    if n < 2:
      return None, f"one {dev['kind']} device: nothing to shard (mesh.model needs >= 2)"
    heads = stage["set"]["model.n_heads"]
    m = max(d for d in range(1, n + 1) if heads % d == 0 and n % d == 0)
    ids = ",".join(str(i % 250 + 1) for i in range(stage["prompt"]))
    return py + ["generate", "--config", str(ROOT / "kvjax/shapes/llama3-8b.yaml"),
                 *_set_args({**stage["set"], "mesh.model": m, "mesh.data": n // m}),
                 *sum((["--prompt-ids", ids] for _ in range(stage["batch"])), []),
                 "--max-new-tokens", str(stage["new"]), "--greedy", "--json"], ""
  if stage.get("kind") == "script":
    return [sys.executable, str(ROOT / stage["script"]),
            str(results / stage["out"] / f"{stage['out']}.jsonl"), *stage.get("args", [])], ""
  if stage.get("kind") == "pytest":
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            f"--junitxml={results / stage['out'] / 'junit.xml'}", *stage["tests"]], ""
  exp = stage.get("experiment", stage["config"])
  if not _experiment_exists(exp):
    return None, f"no experiment '{exp}' (experiments/{exp}.py) yet"
  path = _config_path(stage["config"], accel)
  if path is None:
    return None, f"no config for '{stage['config']}' (configs/{stage['config']}.yaml) yet"
  if stage.get("needs_checkpoints"):
    import yaml
    ckpts = (yaml.safe_load(path.read_text()).get("params") or {}).get("checkpoints", [])
    missing = [c for c in ckpts if not (ROOT / c).exists()]
    if missing:
      return None, (f"needs trained checkpoints ({', '.join(missing)}); train them with "
                    "kvjax train configs/train_{mha,gqa,mqa}.yaml first")
  return py + ["run", str(path), "--out", str(results / stage["out"]),
               *_set_args(stage["set"])], ""


def test_row(stage: dict, junit: Path, dev: dict) -> dict | None:
  """A pytest stage's outcome as one results row, read from its JUnit XML: passed, the
  failed tests' ids, seconds, and the 15 slowest tests. None when the file is not whole
  XML (pytest killed while writing it): the run goes on to its next stage."""
  import xml.etree.ElementTree as ET
  try:
    root = ET.parse(junit).getroot()
  except ET.ParseError:
    return None
  cases = [(c.get("classname", "").replace(".", "/") + ".py::" + c.get("name", ""),
            float(c.get("time", 0)), c.find("failure") is not None or c.find("error") is not None)
           for c in root.iter("testcase")]
  slow = sorted(cases, key=lambda c: -c[1])[:15]
  return {"bench": "gpu_tests", "files": stage["tests"], "env": stage.get("env", {}),
          "passed": sum(not bad for *_, bad in cases), "failed": [n for n, _, bad in cases if bad],
          "seconds": round(sum(t for _, t, _ in cases), 2),
          "slowest": [{"test": n, "seconds": round(t, 2)} for n, t, _ in slow], "device": dev}


def run(results: Path, budget: float, tiny: bool, env: dict, plan: str = "auto") -> dict:
  t_start = time.monotonic()
  deadline = t_start + budget
  dev = _device(env)
  accel = dev["backend"] not in ("cpu", "unknown") and not tiny
  stages = device_plan.stages() if plan == "device" else \
      accelerator_stages() if accel else tiny_stages()
  (results / "logs").mkdir(parents=True, exist_ok=True)
  manifest = {"device": dev, "mode": "accelerator" if accel else "tiny", "budget_s": budget,
              "stages": []}
  print(f"bench_accelerator: {dev['count']} x {dev['kind']} ({dev['backend']}), "
        f"{manifest['mode']} version, budget {budget:.0f} s -> {results}", flush=True)
  plan = [(stage, *_command(stage, results, accel, dev)) for stage in stages]
  for i, (stage, cmd, why) in enumerate(plan):
    rec = {"name": stage["name"]}
    left = deadline - time.monotonic()
    weights = sum(s.get("weight", 1) for s, c, _ in plan[i:] if c is not None)
    timeout = min(stage["seconds"], left) if "seconds" in stage else \
        left * stage.get("weight", 1) / max(weights, 1)
    if cmd is None:
      rec.update(status="skipped", reason=why)
    elif timeout < 15:
      rec.update(status="skipped", reason=f"budget spent ({left:.0f} s left)")
    else:
      log = results / "logs" / f"{stage['name']}.log"
      t0 = time.monotonic()
      with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
          (results / stage["out"]).mkdir(parents=True, exist_ok=True)
          proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True,
                                env={**env, **stage.get("env", {})}, timeout=timeout, cwd=ROOT)
          rec["status"] = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
          junit = results / stage["out"] / "junit.xml"
          row = test_row(stage, junit, dev) if stage.get("kind") == "pytest" and \
              junit.is_file() else None
          if row is not None:
            (results / stage["out"] / "gpu_tests.jsonl").write_text(json.dumps(row) + "\n")
          if stage.get("kind") == "generate" and proc.returncode == 0:
            (results / stage["out"]).mkdir(parents=True, exist_ok=True)
            (results / stage["out"] / "generate.json").write_text(proc.stdout)
          else:
            f.write(proc.stdout)
        except subprocess.TimeoutExpired:
          rec["status"] = f"timed out after {timeout:.0f} s (rows written so far are kept)"
      rec.update(seconds=round(time.monotonic() - t0, 1), log=str(log.relative_to(results)))
    print(f"  {stage['name']:<18} {rec['status']}"
          + (f" ({rec['seconds']} s)" if "seconds" in rec else "")
          + (f": {rec['reason']}" if "reason" in rec else ""), flush=True)
    manifest["stages"].append(rec)
  plots = subprocess.run([sys.executable, "-m", "kvjax.cli", "plot", str(results),
                          "--out", str(results / "plots")], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=30)
  manifest["plots"] = "ok" if plots.returncode == 0 else plots.stderr.strip()[-300:]
  manifest["wall_s"] = round(time.monotonic() - t_start, 1)
  (results / "bench_accelerator.json").write_text(json.dumps(manifest, indent=2) + "\n")
  print(f"bench_accelerator: done in {manifest['wall_s']} s; manifest "
        f"{results / 'bench_accelerator.json'}", flush=True)
  return manifest


def main() -> int:
  ap = argparse.ArgumentParser(description="accelerator benchmark (see bench_accelerator.sh)")
  ap.add_argument("results", metavar="RESULTS_DIR")
  ap.add_argument("--budget", type=float, default=float(os.environ.get("KVJAX_BENCH_BUDGET", 420)),
                  help="wall-clock seconds for all stages (default 420: with device "
                       "detection and plots the whole run stays under 8 minutes)")
  ap.add_argument("--tiny", action="store_true", help="the tiny version even on an accelerator")
  ap.add_argument("--plan", choices=("auto", "device"), default="auto",
                  help="device: the prepared device run in priority order (device_plan.py)")
  ap.add_argument("--dry-run", action="store_true", help="with --plan device: load and "
                  "host-check every stage's cells (accelerator program, an H200's memory)")
  args = ap.parse_args()
  if args.dry_run:
    sys.path.insert(0, str(ROOT))
    return device_plan.dry_run(device_plan.stages())
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # one child at a time holds the device
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  results = Path(args.results).resolve()
  results.mkdir(parents=True, exist_ok=True)
  manifest = run(results, args.budget, args.tiny, env, args.plan)
  bad = [s["name"] for s in manifest["stages"] if s["status"] not in ("ok", "skipped")]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
