"""What a plot must not do to be read at a glance, checked on a drawn figure (the plot test
draws every plot `kvjax plot` makes from the committed rows and runs `problems` on each):

  - text leaving the figure (`texts.clipped_text`) or overlapping other text (a title over
    tick labels, two annotations on each other), or a title over a plot area;
  - a text label on an interval (an error bar), where it hides what the bar says;
  - an interval that runs beyond its axis without an arrow at the cut (`style.cut_arrows`,
    which `style.save` runs, draws them: an arrow marker with gid `cut-arrow`);
  - a legend entry that draws nothing, or a legend that names a colour key over entries of
    one colour;
  - points of one category spread away from its tick: on an axis whose ticks name
    categories (set with set_xticks / set_yticks), every marker sits near a tick, not pushed
    across the panel as if it were another category;
  - tick labels that do not read as numbers: a mantissa times a power (`1.7×10⁰`), or a
    numeric axis with data on it and fewer than two labelled ticks in view;
  - one legend label given to two entries (two points, one name).
"""

from __future__ import annotations

import numpy as np
from matplotlib.container import ErrorbarContainer
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.ticker import FixedLocator

from kvjax.lab.plots.style import CUT_GID
from kvjax.lab.plots.texts import clipped_text, shown_texts

PAD = 1.0  # pixels of overlap tolerated (antialiasing)


def problems(fig) -> list[str]:
  """Every defect of a drawn figure as one line each; empty when it reads at a glance."""
  fig.draw_without_rendering()
  r = fig.canvas.get_renderer()
  out = [f"text leaves the figure: {t!r}" for t in clipped_text(fig, drawn=True)]
  out += overlapping_text(fig, r) + text_on_intervals(fig, r) + uncut_intervals(fig)
  out += empty_legend_entries(fig) + spread_categories(fig) + unreadable_ticks(fig)
  out += shared_legend_labels(fig)
  return out


def _overlap(a, b) -> bool:
  return min(a.x1, b.x1) - max(a.x0, b.x0) > PAD and min(a.y1, b.y1) - max(a.y0, b.y0) > PAD


def overlapping_text(fig, renderer) -> list[str]:
  """Pairs of shown texts whose boxes overlap, and titles over a plot area."""
  texts = [(t, t.get_window_extent(renderer)) for t in shown_texts(fig, drawn=True)]
  out = []
  for i, (a, ba) in enumerate(texts):
    for b, bb in texts[i + 1:]:
      if _overlap(ba, bb) and not _same_legend(a, b) and _rotated_overlap(a, ba, b, bb, renderer):
        out.append(f"text overlaps text: {a.get_text()!r} and {b.get_text()!r}")
  titles = [fig._suptitle] if getattr(fig, "_suptitle", None) is not None else []
  titles += [ax.title for ax in fig.axes] + [ax._left_title for ax in fig.axes] \
      + [ax._right_title for ax in fig.axes]
  for t in titles:
    if t is None or not t.get_visible() or not t.get_text().strip():
      continue
    bt = t.get_window_extent(renderer)
    for ax in fig.axes:
      if ax.get_visible() and ax.patch.get_visible() and _overlap(bt, ax.bbox):
        out.append(f"title over a plot area: {t.get_text()[:60]!r}")
        break
  return out


def _rotated_overlap(a, ba, b, bb, renderer) -> bool:
  """For two texts turned by the same angle, whether their turned boxes overlap (their
  upright boxes always do, side by side at 45 degrees); True for any other pair."""
  r = a.get_rotation()
  if r % 90 == 0 or abs(b.get_rotation() - r) > 1e-6:
    return True
  size = []
  for t in (a, b):
    t.set_rotation(0)
    e = t.get_window_extent(renderer)
    t.set_rotation(r)
    size.append((e.width, e.height))
  th = np.radians(r)
  u, v = np.array([np.cos(th), np.sin(th)]), np.array([-np.sin(th), np.cos(th)])
  d = np.array([(bb.x0 + bb.x1 - ba.x0 - ba.x1) / 2, (bb.y0 + bb.y1 - ba.y0 - ba.y1) / 2])
  return abs(d @ u) + PAD < (size[0][0] + size[1][0]) / 2 and \
      abs(d @ v) + PAD < (size[0][1] + size[1][1]) / 2


def _same_legend(a, b) -> bool:
  for leg in _legends(a.get_figure()):
    inside = leg.get_texts() + [leg.get_title()]
    if a in inside and b in inside:
      return True
  return False


def _legends(fig) -> list:
  return [leg for leg in list(fig.legends) + [ax.get_legend() for ax in fig.axes]
          if leg is not None and leg.get_visible()]


def _error_segments(ax) -> list[np.ndarray]:
  """The error bars' segments of an axes, in data coordinates."""
  segs = []
  for c in ax.containers:
    if isinstance(c, ErrorbarContainer):
      for lc in c.lines[2]:
        if lc.get_visible():
          segs += [np.asarray(s, float) for s in lc.get_segments() if len(s) == 2]
  return segs


def text_on_intervals(fig, renderer) -> list[str]:
  """Annotations of an axes (its texts, not titles or ticks) lying on an error bar."""
  out = []
  for ax in fig.axes:
    segs = _error_segments(ax)
    if not segs:
      continue
    to_px = ax.transData.transform
    for t in ax.texts:
      if not t.get_visible() or not t.get_text().strip():
        continue
      bb = t.get_window_extent(renderer)
      for s in segs:
        (x0, y0), (x1, y1) = to_px(s)
        if _segment_in_box(x0, y0, x1, y1, bb):
          out.append(f"text on an interval: {t.get_text()!r}")
          break
  return out


def _segment_in_box(x0, y0, x1, y1, bb, n: int = 24) -> bool:
  for f in np.linspace(0, 1, n):
    x, y = x0 + f * (x1 - x0), y0 + f * (y1 - y0)
    if bb.x0 + PAD < x < bb.x1 - PAD and bb.y0 + PAD < y < bb.y1 - PAD:
      return True
  return False


def uncut_intervals(fig) -> list[str]:
  """Error bars that run beyond their axis's limits with no cut arrow where they leave."""
  out = []
  for ax in fig.axes:
    arrows = [ln for ln in ax.lines if ln.get_gid() == CUT_GID]
    marks = [(float(np.ravel(a.get_xdata())[0]), float(np.ravel(a.get_ydata())[0]))
             for a in arrows]
    for s in _error_segments(ax):
      for beyond in cut_ends(ax, s):
        if not any(np.allclose(beyond, m, rtol=1e-6, atol=1e-9) for m in marks):
          out.append(f"interval beyond the axis without an arrow: {s.tolist()}")
  return out


def cut_ends(ax, seg) -> list[tuple[float, float]]:
  """Where a vertical or horizontal segment leaves the axes' view (the edge point), for
  each of its ends beyond the limits; none for a segment wholly outside the view."""
  (x0, y0), (x1, y1) = seg
  xl, yl = sorted(ax.get_xlim()), sorted(ax.get_ylim())
  out = []
  if x0 == x1 and xl[0] <= x0 <= xl[1] and max(y0, y1) >= yl[0] and min(y0, y1) <= yl[1]:
    out = [(x0, yl[0]) for y in (y0, y1) if y < yl[0]] + \
        [(x0, yl[1]) for y in (y0, y1) if y > yl[1]]
  elif y0 == y1 and yl[0] <= y0 <= yl[1] and max(x0, x1) >= xl[0] and min(x0, x1) <= xl[1]:
    out = [(xl[0], y0) for x in (x0, x1) if x < xl[0]] + \
        [(xl[1], y0) for x in (x0, x1) if x > xl[1]]
  return out


def _draws(h) -> bool:
  if not h.get_visible() or (h.get_alpha() is not None and h.get_alpha() == 0):
    return False
  if isinstance(h, Line2D):
    line = h.get_linestyle() not in ("None", "none", "", " ") and h.get_linewidth() > 0
    marker = h.get_marker() not in (None, "None", "none", "", " ") and h.get_markersize() > 0
    return line or marker
  if isinstance(h, Patch):
    return h.get_facecolor()[3] > 0 or bool(h.get_hatch()) or \
        (h.get_edgecolor()[3] > 0 and h.get_linewidth() > 0)
  return True


def _colour(h):
  from matplotlib.colors import to_hex
  if isinstance(h, Line2D):
    face = h.get_markerfacecolor()
    return to_hex(face if face not in ("none", "white") else h.get_color())
  if isinstance(h, Patch):
    return to_hex(h.get_facecolor())
  return None


def empty_legend_entries(fig) -> list[str]:
  out = []
  for leg in _legends(fig):
    handles, texts = leg.legend_handles, leg.get_texts()
    for h, t in zip(handles, texts):
      if h is None or not _draws(h):
        out.append(f"legend entry draws nothing: {t.get_text()!r}")
    words = " ".join([leg.get_title().get_text()] + [t.get_text() for t in texts]).lower()
    if "colour" in words or "color" in words:
      colours = {_colour(h) for h in handles if h is not None} - {None}
      if len(colours) < 2:
        out.append(f"legend names a colour key over one colour: {words[:60]!r}")
  return out


def spread_categories(fig) -> list[str]:
  """Markers on a category axis (fixed ticks) that sit far from every tick."""
  out = []
  for ax in fig.axes:
    for axis, k in ((ax.xaxis, 0), (ax.yaxis, 1)):
      if not isinstance(axis.get_major_locator(), FixedLocator):
        continue
      lo, hi = sorted(axis.get_view_interval())
      ticks = [t for t in axis.get_majorticklocs() if lo <= t <= hi]
      if not ticks:
        continue
      px = (lambda v: ax.transData.transform([(v, 0)])[0][0]) if k == 0 else \
          (lambda v: ax.transData.transform([(0, v)])[0][1])
      tp = sorted(px(t) for t in ticks)
      span = abs(px(hi) - px(lo))
      # nearer its own tick than the midpoint to the next; one category: off the edges
      room = 0.45 * min(np.diff(tp)) if len(tp) > 1 else 0.4 * span
      for ln in ax.lines:
        if ln.get_gid() == CUT_GID or not ln.get_visible() or ln.get_marker() in \
            (None, "None", "none", "", "_", "|"):  # (caps belong to their bars)
          continue
        vals = np.ravel(ln.get_xdata() if k == 0 else ln.get_ydata()).astype(float)
        for v in vals[np.isfinite(vals)]:
          if lo <= v <= hi and min(abs(px(v) - t) for t in tp) > room:
            out.append(f"a point of {ln.get_label()!r} lies between categories of the "
                       f"{'x' if k == 0 else 'y'} axis (at {v:g})")
            break
  return out


def unreadable_ticks(fig) -> list[str]:
  """Tick labels in mantissa-times-power form, and numeric axes (with lines on them) that
  label fewer than two ticks in view."""
  out = []
  for ax in fig.axes:
    if not ax.get_visible() or not ax.lines:
      continue
    for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
      if isinstance(axis.get_major_locator(), FixedLocator) or not axis.get_visible():
        continue  # a category axis names its own ticks
      lo, hi = sorted(axis.get_view_interval())
      shown = []
      for which in (axis.get_majorticklabels(), axis.get_minorticklabels()):
        shown += [t.get_text() for t in which if t.get_visible() and t.get_text().strip()]
      powered = [t for t in shown if "times" in t or "×" in t]
      if powered:
        out.append(f"{name} tick label in mantissa-times-power form: {powered[0]!r}")
      locs = [v for v in axis.get_majorticklocs() if lo <= v <= hi]
      if len(shown) < 2 and len(locs) < 2 and axis.get_scale() != "linear":
        out.append(f"{name} axis labels fewer than two ticks ({lo:g} to {hi:g})")
  return out


def shared_legend_labels(fig) -> list[str]:
  """A legend that gives one label to two entries."""
  out = []
  for leg in _legends(fig):
    seen: set = set()
    for t in leg.get_texts():
      if t.get_text() in seen:
        out.append(f"legend label given twice: {t.get_text()!r}")
      seen.add(t.get_text())
  return out
