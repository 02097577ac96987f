"""A long run of the model-file fuzz harness (tests/library/test_fuzz_models.py), which the test
suite runs with a few examples per test only.

    python scripts/fuzz.py                      # 2000 examples per fuzz test
    python scripts/fuzz.py --examples 300 -k gguf

Each case is a corrupted or truncated GGUF, Hugging Face folder or orbax checkpoint, which
must load with finite weights or fail with one line; the outcome counts per file kind are
printed at the end. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--examples", type=int, default=2000,
                  help="hypothesis examples per fuzz test (the suite uses a handful)")
  ap.add_argument("-k", default=None, help="a pytest -k filter, e.g. gguf, hf, checkpoint")
  args = ap.parse_args()
  if args.examples < 1:
    ap.error("--examples must be at least 1")
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "library" / "test_fuzz_models.py")]
  if args.k:
    cmd += ["-k", f"({args.k}) or outcomes"]
  env = {**os.environ, "KVJAX_FUZZ_EXAMPLES": str(args.examples), "JAX_PLATFORMS": "cpu"}
  return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
  sys.exit(main())
