"""Shared plot style: one colour per attention variant and one line style per codec,
the same in every plot, so a reader learns the legend once. Plots read results rows only.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

# Colour per variant, by name (tab10 colours). GQA-<k> by its kv-head count.
VARIANT_COLORS = {"MHA": "#1f77b4", "MQA": "#d62728", "GQA-2": "#2ca02c", "GQA-4": "#9467bd",
                  "GQA-8": "#ff7f0e", "GQA-16": "#8c564b", "GQA-32": "#e377c2"}
_SPARE = ["#17becf", "#bcbd22", "#7f7f7f", "#8c564b", "#e377c2"]
# Line style and marker per codec.
CODEC_STYLES = {"fp32": ("-", "o"), "bf16": ("--", "s"), "fp16": ((0, (8, 2)), "D"),
                "fp8_e4m3": ("-.", "^"), "fp8_e5m2": ((0, (3, 1, 1, 1, 1, 1)), "v"),
                "int8": (":", "P"), "int4": ((0, (4, 1, 1, 1)), "X"),
                "int2": ((0, (1, 3)), "*")}
LAYOUT_COLORS = {"none": "#444444", "contiguous": "#1f77b4", "paged": "#2ca02c"}


def _kvjax(name: str):
  """This checkout's `kvjax.<name>`, whichever kvjax is installed."""
  import importlib
  import sys
  root = str(Path(__file__).resolve().parents[2])
  if root not in sys.path:
    sys.path.insert(0, root)
  return importlib.import_module(f"kvjax.{name}")


def bytes_per_token(row: dict) -> float:
  """A row's cache bytes per token as `kvjax.held` counts them: what the cache held at the
  row's context (window, scales, a policy's state in), for rows of any vintage."""
  return _kvjax("held").row_bytes(row)["bytes_per_token"]


def wilson(right: float, asked: int) -> list[float]:
  """Wilson 95 % interval of `right` out of `asked` (`kvjax.intervals.wilson`)."""
  return _kvjax("intervals").wilson(int(round(right)), int(asked))


def wilson_yerr(right, asked) -> list:
  """[[below], [above]] distances from right/asked to its Wilson interval, for errorbar."""
  lo, hi = [], []
  for k, n in zip(right, asked):
    a, b = wilson(k, n)
    lo.append(max(k / n - a, 0.0))
    hi.append(max(b - k / n, 0.0))
  return [lo, hi]


def variant_color(name: str) -> str:
  if name in VARIANT_COLORS:
    return VARIANT_COLORS[name]
  return _SPARE[zlib.crc32(name.encode()) % len(_SPARE)]


def _base_codec(label: str) -> str:
  """The codec a cache label starts with ("int4 g8 R64" -> int4, "Kint8/Vint4" -> int8)."""
  text = label[1:] if label.startswith("K") else label
  for name in sorted(CODEC_STYLES, key=len, reverse=True):
    if text.startswith(name):
      return name
  return ""


def codec_style(name: str) -> tuple:
  return CODEC_STYLES.get(name) or CODEC_STYLES.get(_base_codec(name), ("-", "."))


def cache_label(row: dict) -> str:
  """The whole cache variant of a row as one label, so two settings of one codec never share
  a line, bar or point: the paired setting's name when the row has one, else the codec with
  its per-channel keys, group size and residual window (from the variant or the config)."""
  v = row.get("variant", {})
  if v.get("setting"):
    return str(v["setting"])
  c = row.get("config", {}).get("cache", {})
  parts = [str(v.get("codec") or c.get("k_codec", "?"))]
  if v.get("k_axis", c.get("k_axis")) == "channel":
    parts.append("Kch")
  if v.get("group_size", c.get("group_size")):
    parts.append(f"g{v.get('group_size', c.get('group_size'))}")
  if v.get("residual", c.get("residual")):
    parts.append(f"R{v.get('residual', c.get('residual'))}")
  return " ".join(parts)


def variant_order(name: str) -> tuple:
  """MHA, then GQA by decreasing kv heads, then MQA: from most to least cache."""
  if name == "MHA":
    return (0, 0)
  if name.startswith("GQA-"):
    return (1, -int(name[4:]) if name[4:].isdigit() else 0)
  return (2, 0) if name == "MQA" else (3, name)


def codec_order(name: str) -> tuple:
  order = list(CODEC_STYLES)
  base = name if name in order else _base_codec(name)
  return (order.index(base) if base in order else len(order), name)


def scan_rows(results_dir: str | Path) -> tuple[dict[str, list[dict]], list[str]]:
  """(rows of every *.jsonl under a folder grouped by experiment, what was skipped and why).
  A cell's row (same experiment, config and row number) that an earlier line or file of the
  same folder already holds (runs that shared it, or `--shard` parts) is skipped: the first
  one wins (the same cell in another folder, another machine's run say, is kept)."""
  out: dict[str, list[dict]] = {}
  skipped = []
  root = Path(results_dir)
  seen = set()
  for path in sorted(root.rglob("*.jsonl")):
    torn = foreign = repeated = 0
    for line in path.read_text().splitlines():
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        torn += 1
        continue
      cell = row.get("cell") if isinstance(row, dict) else None
      key = None if not isinstance(cell, dict) else json.dumps(
          [str(path.parent), cell.get("row")] + [row.get(k) for k in ("experiment",
                                                                    "config_hash", "config")],
          sort_keys=True, default=str)
      if key is not None and key in seen:
        repeated += 1
      elif isinstance(row, dict) and "experiment" in row and "metrics" in row:
        if key is not None:
          seen.add(key)
        out.setdefault(row["experiment"], []).append(row)
      else:
        foreign += 1
    where = path.relative_to(root) if path != root else path
    if foreign:
      skipped.append(f"{where}: {foreign} rows that are not `kvjax run` results rows (no "
                     "experiment/metrics fields; a benchmark script's own output, shown as a "
                     "table in the docs, not plotted)")
    if torn:
      skipped.append(f"{where}: {torn} unreadable lines (torn or not JSON)")
    if repeated:
      skipped.append(f"{where}: {repeated} rows of cells already read (the first is kept)")
  return out, skipped


def load_rows(results_dir: str | Path) -> dict[str, list[dict]]:
  """Rows of every *.jsonl under a folder, grouped by experiment (torn lines skipped)."""
  return scan_rows(results_dir)[0]


def human_bytes(n: float, _pos=None) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
    if abs(n) < 1024 or unit == "PiB":
      return f"{n:.3g} {unit}"
    n /= 1024
  return str(n)


BYTES = FuncFormatter(human_bytes)
PLAIN = FuncFormatter(lambda y, _pos=None: f"{y:g}")
# Minor ticks of a log axis labelled at 2, 3 and 5 x 10^k only, so they do not crowd.
SPARSE = FuncFormatter(lambda y, _pos=None: f"{y:g}" if f"{y:.0e}"[0] in "235" else "")
TOKENS = FuncFormatter(lambda n, _pos=None: f"{n / 1024:g}k" if n >= 1024 else f"{n:g}")


def log2_axis(axis, formatter=None, every: int = 1) -> None:
  """Log base-2 scale with ticks every `every` powers of two and readable labels."""
  from matplotlib.ticker import LogLocator, NullFormatter
  (axis.axes.set_xscale if axis.axis_name == "x" else axis.axes.set_yscale)("log", base=2)
  axis.set_major_locator(LogLocator(base=2 ** every))
  axis.set_minor_formatter(NullFormatter())
  if formatter is not None:
    axis.set_major_formatter(formatter)


def legend_handles(variants: list[str], codecs: list[str], extra=None) -> list:
  handles = [Line2D([], [], color=variant_color(v), lw=2.5, label=v) for v in variants]
  if len(codecs) > 1 or extra:
    handles += [Line2D([], [], color="black", ls=codec_style(c)[0], marker=codec_style(c)[1],
                       label=c) for c in codecs]
  return handles + (extra or [])


def legends(ax, variants: list[str], codecs: list[str], loc: str = "best", extra=None) -> None:
  """Two legends: colour = attention variant, line style = codec."""
  handles = legend_handles(variants, codecs, extra)
  ax.legend(handles=handles, loc=loc, fontsize=8, ncol=2 if len(handles) > 6 else 1)


def subtitle(rows: list[dict]) -> str:
  """Model shape and device, from the first row: the conditions every number holds under."""
  r = rows[0]
  m = r.get("config", {}).get("model", {})
  env = r.get("env", {})
  shape = f"L={m.get('n_layers')} E={m.get('d_model')} H={m.get('n_heads')}" if m else ""
  backend, kind = env.get("backend", "?"), env.get("device_kind", "?")
  device = backend if kind == backend else f"{backend}: {kind}"
  return f"{shape}  {device}"


def save(fig, out_dir: Path, stem: str) -> list[Path]:
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
  if not fig.get_layout_engine():
    fig.tight_layout()
  fig.savefig(paths[0], dpi=110)
  fig.savefig(paths[1])
  plt.close(fig)
  return paths
