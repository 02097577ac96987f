"""The text a figure shows (`shown_texts`), what of it leaves the canvas (`clipped_text`),
and labels beside plotted points (`label_points`), placed once the figure is laid out:
each at the first spot near its point that overlaps no other text, no error bar and stays
inside the axes."""

from __future__ import annotations

import numpy as np
from matplotlib.container import ErrorbarContainer

_LABELS: dict = {}  # id(axes) -> (axes, [(x, y, text, colour)]) placed by `save`
# offsets (points) tried for a point's label: beside it, then farther with a line back
_SPOTS = [(5, 3, "left"), (5, -10, "left"), (-5, 3, "right"), (-5, -10, "right"),
          (0, 8, "center"), (0, -16, "center")] + \
    [spot for k in range(1, 13) for spot in ((6, 3 + 9 * k, "left"), (6, -10 - 9 * k, "left"),
                                            (-6, 3 + 9 * k, "right"))]


def label_points(ax, items) -> None:
  """Label points (x, y, text, colour) of `ax`, each placed by `save` once the figure is laid
  out, at the first spot near its point (`_SPOTS`) that overlaps no other text, no error bar
  and stays inside the axes."""
  _LABELS.setdefault(id(ax), (ax, []))[1].extend(items)


def place(fig) -> None:
  """Every label `label_points` queued for `fig`'s axes, at its spot (`style.save` calls it
  once the figure is laid out)."""
  mine = [(ax, items) for ax, items in (_LABELS.pop(id(a), (None, None)) for a in fig.axes)
          if ax is not None]
  if not mine:
    return
  fig.draw_without_rendering()
  r = fig.canvas.get_renderer()
  taken = [t.get_window_extent(r) for t in shown_texts(fig, drawn=True)]

  def conflicts(bb, ax, segs) -> int:
    """What a label box would cover: 100 outside the axes, else texts and error bars."""
    if bb.x0 < ax.bbox.x0 or bb.x1 > ax.bbox.x1 or bb.y0 < ax.bbox.y0 or bb.y1 > ax.bbox.y1:
      return 100
    n = sum(min(bb.x1, o.x1) > max(bb.x0, o.x0) and min(bb.y1, o.y1) > max(bb.y0, o.y0)
            for o in taken)
    for (x0, y0), (x1, y1) in segs:
      f = np.linspace(0, 1, 24)
      x, y = x0 + f * (x1 - x0), y0 + f * (y1 - y0)
      n += bool(np.any((bb.x0 < x) & (x < bb.x1) & (bb.y0 < y) & (y < bb.y1)))
    return n

  for ax, items in mine:
    segs = [ax.transData.transform(np.asarray(s, float)) for c in ax.containers
            if isinstance(c, ErrorbarContainer) for lc in c.lines[2] for s in lc.get_segments()
            if len(s) == 2]
    for x, y, text, color in items:
      best = None
      for k, (dx, dy, ha) in enumerate(_SPOTS):  # the first free spot, else the least covered
        t = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha,
                        fontsize=6.5, color=color, va="bottom",
                        arrowprops=dict(arrowstyle="-", lw=0.4, color=color) if k > 5 else None)
        bb = t.get_window_extent(r)
        n = conflicts(bb, ax, segs)
        t.remove()
        if best is None or n < best[0]:
          best = (n, k)
        if n == 0:
          break
      dx, dy, ha = _SPOTS[best[1]]
      taken.append(ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy),
                               ha=ha, fontsize=6.5, color=color, va="bottom", arrowprops=dict(
                                   arrowstyle="-", lw=0.4, color=color) if best[1] > 5 else
                               None).get_window_extent(r))


def shown_texts(fig, drawn: bool = False) -> list:
  """Every text a figure shows: visible, not empty, tick labels only where the axis draws
  them, in no hidden axes or legend (`drawn`: the caller has just drawn it, unchanged)."""
  from matplotlib.text import Text
  if not drawn:
    fig.draw_without_rendering()  # the layout and every position, no pixels
  shown = set()
  for ax in fig.axes:  # only the ticks an axis draws (those inside its view interval)
    for axis in (ax.xaxis, ax.yaxis):
      lo, hi = sorted(axis.get_view_interval())
      for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        if lo - 1e-9 * abs(hi - lo) <= tick.get_loc() <= hi + 1e-9 * abs(hi - lo):
          shown |= {id(tick.label1), id(tick.label2)}
  ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
           for tk in axis.get_major_ticks() + axis.get_minor_ticks()
           for t in (tk.label1, tk.label2)}
  out = []
  for t in fig.findobj(Text):
    if not t.get_visible() or not t.get_text().strip() or (id(t) in ticks and id(t) not in shown):
      continue
    if any(not a.get_visible() for a in _parents(t)):
      continue
    out.append(t)
  return out


def clipped_text(fig, drawn: bool = False) -> list[str]:
  """Every piece of text a drawn figure shows that lies (partly) outside its canvas, as
  'text' strings: a clipped title, label, legend or colour-bar label. Empty when all fits."""
  texts = shown_texts(fig, drawn)
  renderer = fig.canvas.get_renderer()
  W, H = fig.bbox.width, fig.bbox.height
  out = []
  for t in texts:
    bb = t.get_window_extent(renderer)
    if bb.x0 < -0.5 or bb.y0 < -0.5 or bb.x1 > W + 0.5 or bb.y1 > H + 0.5:
      out.append(t.get_text())
  return out


def _parents(artist):
  """The axes and legend (if any) an artist is drawn inside."""
  found = [getattr(artist, "axes", None)]
  fig = artist.get_figure()
  for leg in (fig.legends if fig else []) + [ax.get_legend() for ax in (fig.axes if fig else [])]:
    if leg is not None and artist in leg.get_texts() + [leg.get_title()]:
      found.append(leg)
  return [a for a in found if a is not None]
