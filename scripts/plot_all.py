"""An alias of `kvjax plot` for this checkout (kvjax.lab.plots), kept for older notes:

    python scripts/plot_all.py RESULTS_DIR --out DIR   ==   kvjax plot RESULTS_DIR --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvjax

from kvjax.cli import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main(["plot", *sys.argv[1:]]))
