"""The prepared device run behind scripts/device_check.sh: its stages, in priority order,
each with the seconds it may take, and a dry run that checks them on any machine.

    python scripts/bench_accelerator.py RESULTS_DIR --plan device [--budget SECONDS]
    python scripts/device_plan.py [--dry-run]     (the plan; --dry-run: check it, run nothing)

Stages run in this order; each gets min(its seconds, what is left of the budget), and a
stage that would start with under 20 s left is skipped, so the lower priorities go first
when the budget is short:

  roofline-8b       Llama-3-8B shape, bf16 weights, bf16/int8/int4/fp8 caches, batch 8 x 8k
                    (configs/accel/roofline_llama3_8b.yaml)
  model-smollm2     the three real models' shapes, bf16 weights, bf16/int8/int4 caches,
  model-qwen        batch 8 x 8k (configs/roofline_smollm2.yaml, configs/accel/roofline_qwen
  model-gemma3      .yaml, roofline_gemma3.yaml: Gemma's hybrid timed against its full variant)
  gpu-tests         tests/library/: test_pallas.py, test_decode.py, test_accel.py on the GPU,
                    float32 matmuls at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest)
  distill           one `kvjax convert --method distill` step's tokens per second at
                    SmolLM2's shape, GQA-3 -> MQA, batch 2 x 512 (scripts/bench_distill.py)
  roofline-8b-long  the Llama-3-8B cells at batch 16 x 32k
  pallas            the Pallas read vs XLA `grouped` vs JAX's paged kernel, one layer at
                    Llama-3-8B heads, 4k-32k, batch 1/8/16 (scripts/bench_pallas.py)
  pallas-sweep      the kernel's block/split/warps/stages knobs (configs/accel/pallas_sweep.yaml)
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
GPU_TESTS = [f"tests/library/test_{name}.py" for name in ("pallas", "decode", "accel")]


def stages() -> list[dict]:
  """The device plan, most wanted first; `seconds` is each stage's share at most."""
  r8 = {"config": "roofline_llama3_8b", "experiment": "roofline", "out": "roofline_llama3_8b"}
  models = {"grid.workload.batch": [8], "grid.workload.prompt_len": [8184],
            "grid.cache.codec": ["bf16", "int8", "int4"]}
  return [
      {**r8, "name": "roofline-8b", "seconds": 100,
       "set": {"grid.cache.codec": CODECS, "grid.workload.batch": [8],
               "grid.workload.prompt_len": [8184]}},
      {"name": "model-smollm2", "config": "roofline_smollm2", "experiment": "roofline",
       "out": "roofline_smollm2_b8", "seconds": 45,
       "set": {**models, "grid.model.attention": ["auto"], "grid.model.dtype": ["bfloat16"],
               "grid.model.param_dtype": ["bfloat16"], "params.bandwidth_mib": 4096}},
      {"name": "model-qwen", "config": "roofline_qwen", "experiment": "roofline",
       "out": "roofline_qwen", "seconds": 45, "set": models},
      {"name": "model-gemma3", "config": "roofline_gemma3", "experiment": "roofline",
       "out": "roofline_gemma3", "seconds": 60, "set": models},
      {"name": "gpu-tests", "kind": "pytest", "out": "gpu_tests", "seconds": 270,
       "tests": GPU_TESTS,
       "env": {"JAX_PLATFORMS": "cuda", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}},
      {"name": "distill", "kind": "script", "script": "scripts/bench_distill.py",
       "out": "distill_speed", "seconds": 45,
       "args": ["--shape", "smollm2-135m", "--kv-heads", "1", "--batch", "2",
                "--seq-len", "512", "--steps", "10", "--budget", "35"]},
      {**r8, "name": "roofline-8b-long", "seconds": 150,
       "set": {"grid.cache.codec": CODECS, "grid.workload.batch": [16],
               "grid.workload.prompt_len": [32760]}},
      {"name": "pallas", "kind": "script", "script": "scripts/bench_pallas.py", "out": "pallas",
       "seconds": 90, "args": ["--contexts", "4096,8192,16384,32768", "--batches", "1,8,16",
                                "--codecs", "bf16,int8,int4", "--repeats", "10",
                                "--budget", "75", "--no-sweep"]},
      {"name": "pallas-sweep", "kind": "script", "script": "scripts/bench_pallas.py",
       "out": "pallas_sweep", "seconds": 60,
       "args": ["--sweep", str(ROOT / "configs/accel/pallas_sweep.yaml"), "--budget", "50"]},
      {"name": "peer", "config": "peer", "out": "peer", "seconds": 35,
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
  from kvjax.lab.runner import grid
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
