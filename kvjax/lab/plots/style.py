"""The look every plot shares, so a reader learns the legend once: one colour per codec
family (fp32; bf16/fp16; fp8; int8; int4; int2; nf4; nf2), a marker per cache setting
distinct from every other setting in the figure (int4, KIVI-int4 and a rotated int4 share the
int4 colour, never a marker), a line style per model, legends that name the model. Bytes
axes: the bytes the cache held at the row's context (`kvjax.footprint`). Plots read rows only.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from kvjax import footprint  # noqa: E402
from kvjax.lab import intervals  # noqa: E402
from kvjax.lab.plots import texts  # noqa: E402

# Colour per model variant, by name (tab10 colours), where models are what a plot compares
# (uptrain's targets, budget's bars). GQA-<k> by its kv-head count.
VARIANT_COLORS = {"MHA": "#1f77b4", "MQA": "#d62728", "GQA-2": "#2ca02c", "GQA-4": "#9467bd",
                  "GQA-8": "#ff7f0e", "GQA-16": "#8c564b", "GQA-32": "#e377c2"}
_SPARE = ["#17becf", "#bcbd22", "#7f7f7f", "#8c564b", "#e377c2"]
CODEC_ORDER = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2", "nf4", "nf2")
# Colour per codec family: the codecs of one family differ by marker only.
FAMILY = {"fp32": "fp32", "bf16": "16-bit float", "fp16": "16-bit float", "fp8_e4m3": "fp8",
          "fp8_e5m2": "fp8", "int8": "int8", "int4": "int4", "int2": "int2", "nf4": "nf4",
          "nf2": "nf2"}
FAMILY_COLORS = {"fp32": "#3b3b3b", "16-bit float": "#1f77b4", "fp8": "#9467bd",
                 "int8": "#2ca02c", "int4": "#ff7f0e", "int2": "#d62728", "nf4": "#8c564b",
                 "nf2": "#e377c2", "": "#7f7f7f"}
# Markers handed out in order to the settings of one figure; past the end, hollow again.
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "<", ">", "h", "p", "d", "8", "H")
LINES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
LAYOUT_COLORS = {"none": "#444444", "contiguous": "#1f77b4", "paged": "#2ca02c"}


def bytes_per_token(row: dict) -> float:
  """A row's cache bytes per token as `kvjax.footprint` counts them: what the cache held at the
  row's context (window, scales, a policy's state in), for rows of any vintage."""
  return footprint.row_bytes(row)["bytes_per_token"]


def wilson(right: float, asked: int) -> list[float]:
  """Wilson 95 % interval of `right` out of `asked` (`kvjax.lab.intervals.wilson`)."""
  return intervals.wilson(int(round(right)), int(asked))


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
  """The first codec a label names ("int4 g8 R64" -> int4, "Kint8/Vint4" -> int8,
  "quanto_int4" -> int4), or ""."""
  hit = re.search("|".join(sorted(CODEC_ORDER, key=len, reverse=True)), label)
  return hit.group(0) if hit else ""


def codec_family(row: dict) -> str:
  """The codec family of a row's cache (its K codec's): a key of FAMILY_COLORS."""
  v = row.get("variant", {})
  return FAMILY.get(_base_codec(str(v.get("k_codec") or v.get("codec") or cache_label(row))),
                    "")


def model_label(row: dict) -> str:
  """The model a row ran, as a legend names it: its name with its attention variant
  ("smollm2-135m (GQA-3)"), else the variant with its heads ("MHA (H=4, K=4)")."""
  v = row.get("variant", {})
  name, variant = v.get("model"), v.get("variant", "?")
  unnamed = {str(variant).lower(), str(row.get("experiment")),
             str(row.get("config", {}).get("name"))}  # a model named after its run
  if name and str(name).lower() not in unnamed:
    return f"{str(name).removeprefix('gguf:')} ({variant})"
  m = row.get("config", {}).get("model", {})
  heads, kv = v.get("heads") or m.get("n_heads"), v.get("kv_heads") or m.get("n_kv_heads")
  return f"{variant} (H={heads}, K={kv})" if heads and kv else str(variant)


class Look:
  """The look of one figure's rows: `color(setting)` by codec family, `marker(setting)`
  distinct for every setting of the figure, `line(model)` distinct for every model, and
  `legend(ax)` naming both (the models by `model_label`)."""

  def __init__(self, rows: list[dict]):
    self.settings = sorted({cache_label(r) for r in rows}, key=codec_order)
    self.models = sorted({r["variant"]["variant"] for r in rows}, key=variant_order)
    self.family = {cache_label(r): codec_family(r) for r in rows}
    self.names = {r["variant"]["variant"]: model_label(r) for r in rows}

  def color(self, setting: str) -> str:
    return FAMILY_COLORS.get(self.family.get(setting, ""), FAMILY_COLORS[""])

  def marker(self, setting: str) -> dict:
    i = self.settings.index(setting)
    hollow = (i // len(MARKERS)) % 2 == 1
    return dict(marker=MARKERS[i % len(MARKERS)], mfc="white" if hollow else self.color(setting))

  def line(self, model: str):
    return LINES[self.models.index(model) % len(LINES)]

  def style(self, model: str, setting: str) -> dict:
    """plot/errorbar keywords of one (model, setting) line."""
    return dict(color=self.color(setting), ls=self.line(model), ms=5, **self.marker(setting))

  def handles(self, extra=None) -> list:
    hs = [Line2D([], [], color=self.color(s), ls="none", ms=6, label=s, **self.marker(s))
          for s in self.settings]
    if len(self.models) > 1 or extra:
      hs += [Line2D([], [], color="black", ls=self.line(m), lw=1.5, label=self.names[m])
             for m in self.models]
    return hs + (extra or [])

  def legend(self, ax, loc: str = "best", extra=None, **kw):
    hs = self.handles(extra)
    return ax.legend(handles=hs, loc=loc, fontsize=7.5, ncol=2 if len(hs) > 8 else 1, **kw)


HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "--", "++")


def bar_look(rows: list[dict]) -> dict:
  """bar() keywords per setting of a figure: colour by codec family, and a hatch telling
  the settings of one family apart (bf16 and fp16, int4 and KIVI-int4)."""
  look, seen, out = Look(rows), {}, {}
  for s in look.settings:
    k = seen[look.family.get(s, "")] = seen.get(look.family.get(s, ""), -1) + 1
    out[s] = dict(color=look.color(s), hatch=HATCHES[k % len(HATCHES)], edgecolor="white",
                  lw=0.5)
  return out


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
  order = list(CODEC_ORDER)
  base = name if name in order else _base_codec(name)
  return (order.index(base) if base in order else len(order), name)


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


def plain_log(axis) -> None:
  """A log axis read in plain numbers (2, 0.5: never 2×10⁰): every major tick, and the
  minor ticks at 2, 3 and 5 x 10^k when the view spans under about a decade and a half (so
  an axis never shows a single tick, and a wide one does not crowd)."""
  def minor(v, _pos=None):
    lo, hi = sorted(axis.get_view_interval())
    return SPARSE(v) if lo > 0 and hi < 30 * lo else ""
  axis.set_major_formatter(PLAIN)
  axis.set_minor_formatter(FuncFormatter(minor))


def log2_axis(axis, formatter=None, every: int = 1) -> None:
  """Log base-2 scale with ticks every `every` powers of two and readable labels."""
  from matplotlib.ticker import LogLocator, NullFormatter
  (axis.axes.set_xscale if axis.axis_name == "x" else axis.axes.set_yscale)("log", base=2)
  axis.set_major_locator(LogLocator(base=2 ** every))
  axis.set_minor_formatter(NullFormatter())
  if formatter is not None:
    axis.set_major_formatter(formatter)


def subtitle(rows: list[dict]) -> str:
  """Model shape and device, from the first row: the conditions every number holds under."""
  r = rows[0]
  m = r.get("config", {}).get("model", {})
  env = r.get("env", {})
  shape = f"L={m.get('n_layers')} E={m.get('d_model')} H={m.get('n_heads')}" if m else ""
  backend, kind = env.get("backend", "?"), env.get("device_kind", "?")
  device = backend if kind == backend else f"{backend}: {kind}"
  return f"{shape}  {device}"


def fit_text(fig) -> None:
  """Wrap the figure's title, and each panel's title and x label, to the width they have."""
  W = fig.get_figwidth()
  for t in fig.texts:
    if fig.get_suptitle() and t.get_text() == fig.get_suptitle():
      t.set_text(fit(t.get_text(), fig, t.get_fontsize()))
  for ax in fig.axes:
    share = ax.get_position().width * 1.1
    for t in (ax.title, ax.xaxis.label):
      if t.get_text() and share * W > 1:
        t.set_text(fit(t.get_text(), fig, t.get_fontsize(), share))


def save(fig, out_dir: Path, stem: str) -> list[Path]:
  """`stem`.png and .svg in `out_dir`, the texts wrapped to fit (`fit_text`) and the figure
  laid out; the figure is closed."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  fit_text(fig)
  paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
  if not fig.get_layout_engine():
    fig.tight_layout()
  texts.place(fig)
  cut_arrows(fig)
  fig.savefig(paths[0], dpi=110)
  fig.savefig(paths[1])
  plt.close(fig)
  return paths


def fit(text: str, fig, fontsize: float = 10, share: float = 0.95) -> str:
  """`text` wrapped (at spaces, each line apart) to `share` of the figure's width at
  `fontsize`, so a title or label never runs off the canvas."""
  import textwrap
  width = max(20, int(share * fig.get_figwidth() * 72 / (0.55 * fontsize)))
  return "\n".join(textwrap.fill(line, width) for line in text.split("\n"))


CUT_GID = "cut-arrow"  # the arrow marking where an interval runs beyond its axis
def cut_arrows(fig) -> None:
  """An arrow marker (gid `cut-arrow`) at the axis edge where an error bar runs beyond the
  axis's limits, pointing the way it goes on, in the bar's colour; the limits kept."""
  import numpy as np
  from matplotlib.container import ErrorbarContainer
  for ax in fig.axes:
    xl, yl = ax.get_xlim(), ax.get_ylim()
    lo_x, hi_x, lo_y, hi_y = min(xl), max(xl), min(yl), max(yl)
    for c in ax.containers:
      if not isinstance(c, ErrorbarContainer):
        continue
      for lc in c.lines[2]:
        colors = lc.get_colors()
        for i, seg in enumerate(lc.get_segments()):
          if len(seg) != 2:
            continue
          (x0, y0), (x1, y1) = np.asarray(seg, float)
          color = colors[i % len(colors)] if len(colors) else "black"
          ends = []
          if x0 == x1 and lo_x <= x0 <= hi_x and max(y0, y1) >= lo_y and min(y0, y1) <= hi_y:
            ends = [(x0, lo_y, "v")] * any(y < lo_y for y in (y0, y1)) + \
                [(x0, hi_y, "^")] * any(y > hi_y for y in (y0, y1))
          elif y0 == y1 and lo_y <= y0 <= hi_y and max(x0, x1) >= lo_x and min(x0, x1) <= hi_x:
            ends = [(lo_x, y0, "<")] * any(x < lo_x for x in (x0, x1)) + \
                [(hi_x, y0, ">")] * any(x > hi_x for x in (x0, x1))
          for x, y, m in ends:
            ax.plot([x], [y], marker=m, ms=6, color=color, ls="none", clip_on=False,
                    gid=CUT_GID, scalex=False, scaley=False, label="_cut")
    ax.set_xlim(xl)
    ax.set_ylim(yl)
