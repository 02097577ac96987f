"""The prepared device run behind scripts/device_check.sh: its stages, in priority order,
each with the seconds it may take, and a dry run that checks them on any machine.

    python scripts/bench_accelerator.py RESULTS_DIR --plan device [--budget SECONDS]
    python scripts/device_plan.py [--dry-run]     (the plan; --dry-run: check it, run nothing)

Stages run in this order; each gets min(its seconds, what is left of the budget), and a
stage that would start with under 20 s left is skipped, so the lower priorities go first
when the budget is short:

  roofline-8b-long  Llama-3-8B shape, bf16 weights, bf16/int8/int4/fp8 caches, batch 16 x 32k
  roofline-8b       the same at batch 8 x 8k        (configs/accel/roofline_llama3_8b.yaml)
  pallas            the Pallas read vs XLA `grouped` vs JAX's paged kernel, one layer at
                    Llama-3-8B heads, 4k-32k, batch 1/8/16 (scripts/bench_pallas.py)
  pallas-sweep      the kernel's block/split/warps/stages knobs (configs/accel/pallas_sweep.yaml)
  gpu-tests         tests/test_pallas.py, test_decode.py, test_accel.py on the GPU, float32
                    matmuls at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest)
  roofline-smollm2  SmolLM2-135M's shape (configs/roofline_smollm2.yaml), batch 1/8/32
  peer              kvjax vs transformers on the same GPU (configs/peer.yaml, trimmed)

Nothing in the list needs more than the 139 GiB device: the dry run (`--dry-run`) loads
every config with its overrides, expands its cells and runs each experiment's own host
checks (the memory estimate among them) under the accelerator program and an H200's
memory (KVJAX_MEMORY_LIMIT, default 0.92 x 139 GiB), and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H200_LIMIT = int(0.92 * 139 * 2**30)  # what XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 leaves JAX
CODECS = ["bf16", "int8", "int4", "fp8_e4m3"]
GPU_TESTS = ["tests/test_pallas.py", "tests/test_decode.py", "tests/test_accel.py"]


def stages() -> list[dict]:
  """The device plan, most wanted first; `seconds` is each stage's share at most."""
  r8 = {"config": "roofline_llama3_8b", "experiment": "roofline", "out": "roofline_llama3_8b"}
  return [
      {**r8, "name": "roofline-8b-long", "seconds": 150,
       "set": {"grid.cache.codec": CODECS, "grid.workload.batch": [16],
               "grid.workload.prompt_len": [32760]}},
      {**r8, "name": "roofline-8b", "seconds": 100,
       "set": {"grid.cache.codec": CODECS, "grid.workload.batch": [8],
               "grid.workload.prompt_len": [8184]}},
      {"name": "pallas", "kind": "script", "script": "scripts/bench_pallas.py", "out": "pallas",
       "seconds": 110, "args": ["--contexts", "4096,8192,16384,32768", "--batches", "1,8,16",
                                "--codecs", "bf16,int8,int4", "--repeats", "10",
                                "--budget", "90", "--no-sweep"]},
      {"name": "pallas-sweep", "kind": "script", "script": "scripts/bench_pallas.py",
       "out": "pallas_sweep", "seconds": 120,
       "args": ["--sweep", str(ROOT / "configs/accel/pallas_sweep.yaml"), "--budget", "100"]},
      {"name": "gpu-tests", "kind": "pytest", "out": "gpu_tests", "seconds": 150,
       "tests": GPU_TESTS,
       "env": {"JAX_PLATFORMS": "cuda", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}},
      {"name": "roofline-smollm2", "config": "roofline_smollm2", "experiment": "roofline",
       "out": "roofline_smollm2", "seconds": 60,
       "set": {"grid.model.attention": ["auto"], "grid.workload.prompt_len": [4096],
               "grid.workload.batch": [1, 8, 32], "params.bandwidth_mib": 4096}},
      {"name": "peer", "config": "peer", "out": "peer", "seconds": 60,
       "set": {"grid.workload.batch": [1], "grid.model.vocab_size": [32000],
               "workload.gen_len": 64, "workload.repeats": 3,
               "params.peers": ["kvjax", "dynamic", "static"]}},
  ]


def config_path(name: str) -> Path:
  """A stage's config: the accelerator version (configs/accel/) where there is one."""
  accel = ROOT / "configs" / "accel" / f"{name}.yaml"
  return accel if accel.is_file() else ROOT / "configs" / f"{name}.yaml"


def dry_run(plan: list[dict]) -> int:
  """Load, expand and host-check every stage's cells as the device would (accelerator
  program, an H200's memory); print one line per stage; 0 when all pass, else 2."""
  os.environ.setdefault("KVJAX_MEMORY_LIMIT", str(H200_LIMIT))
  from kvjax.errors import KvjaxError
  from kvjax.runner import grid
  bad = 0
  for stage in plan:
    if stage.get("kind") in ("script", "pytest"):
      missing = [p for p in [stage.get("script"), *stage.get("tests", [])]
                 if p and not (ROOT / p).is_file()]
      print(f"  {stage['name']:<18} {stage['seconds']:>4} s  "
            + (f"MISSING {missing}" if missing else "ok (no config)"))
      bad += bool(missing)
      continue
    path = config_path(stage["config"])
    try:
      base, cells = grid.expand(path, {**stage["set"], "model.program": "accelerator"})
      module = grid.load_experiment(base.experiment)
      grid.check_params(module, cells)
      for cell in cells:
        if hasattr(module, "check"):
          module.check(cell.cfg)
      print(f"  {stage['name']:<18} {stage['seconds']:>4} s  ok: {len(cells)} cells of "
            f"{path.relative_to(ROOT)} pass the host checks")
    except KvjaxError as e:
      bad += 1
      print(f"  {stage['name']:<18} {stage['seconds']:>4} s  REFUSED: {e}")
  return 2 if bad else 0


def main() -> int:
  ap = argparse.ArgumentParser(description="the prepared device run's stages (see the "
                               "module docstring); scripts/device_check.sh runs them")
  ap.add_argument("--dry-run", action="store_true", help="load and host-check every "
                  "stage's cells (accelerator program, an H200's memory); run nothing")
  args = ap.parse_args()
  if args.dry_run:
    sys.path.insert(0, str(ROOT))
    return dry_run(stages())
  for stage in stages():
    print(f"{stage['name']:<18} {stage['seconds']:>4} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
