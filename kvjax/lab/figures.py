"""One definition per figure: what a speed ratio and a roof fraction are, for every run
summary, `kvjax results`, plot and doc that shows them.

Ratios of decode time to a reference (TPOT over the reference's TPOT), two estimators under
two names, never one name for both:

  tpot_vs_ref    the median of per-repeat ratios of variants timed in turn within each
                 repeat (`params.interleave`, kvjax.lab.intervals.paired_ratio), with
                 `tpot_vs_ref_ci95`, its 95 % bootstrap interval over repeats: the ratio a
                 shared machine's noise cancels from. Computed when the row is measured and
                 read from the row everywhere after.
  tpot_over_ref  the ratio of two medians of cells timed one after another (no pairing, so
                 no interval); told apart only when the two IQRs do not overlap.

`verdict` says "faster", "slower" or "not told apart" (the interval holds 1, or the IQRs
overlap): a table or plot never ranks two settings it cannot tell apart.

Roof fraction, one name: `roof_fraction` = roof_s / tpot_s, where roof_s is the higher of
the step's two lower bounds (bytes / measured bandwidth, FLOPs / measured dot throughput;
kvjax.lab.experiments.roofline.roofs). Rows written before the second roof carry only the bytes
roof's `roofline_fraction`, read as the roof fraction then. A value above 1 says the step ran
faster than its own lower bound: the probe or the timing is at fault, not the cache, so it
is flagged (`roof_check`) and never shown as a result.
"""

from __future__ import annotations

PAIRED = "median of paired per-repeat ratios, 95 % bootstrap interval"
UNPAIRED = "ratio of medians of cells timed apart (no interval; IQRs compared)"
ROOF_FAULT = "FAULT: above 1, faster than the roof (a probe or timing fault)"
APART = ("faster", "slower", "not told apart")


def paired(m: dict) -> tuple[float, list[float] | None] | None:
  """(tpot_vs_ref, its interval) of a row timed in turn with its reference, else None."""
  if m.get("tpot_vs_ref") is None:
    return None
  return float(m["tpot_vs_ref"]), m.get("tpot_vs_ref_ci95")


def over_ref(m: dict, ref: dict, key: str = "tpot_s") -> float | None:
  """tpot_over_ref: the ratio of two medians (cells timed apart)."""
  if not ref or not ref.get(key) or m.get(key) is None:
    return None
  return float(m[key]) / float(ref[key])


def verdict_ci(ratio: float, ci: list[float] | None) -> str:
  """faster / slower / not told apart, by whether the interval holds 1."""
  if not ci:
    return APART[2]
  if ci[1] < 1.0:
    return APART[0]
  if ci[0] > 1.0:
    return APART[1]
  return APART[2]


def iqr_band(m: dict, key: str = "tpot_s") -> tuple[float, float]:
  """The median ± half its IQR: the band two unpaired medians are compared by."""
  half = float(m.get(f"{key}_iqr") or 0.0) / 2
  return float(m[key]) - half, float(m[key]) + half


def verdict_iqr(m: dict, ref: dict, key: str = "tpot_s") -> str:
  """faster / slower / not told apart, by whether the two IQR bands overlap."""
  (a0, a1), (b0, b1) = iqr_band(m, key), iqr_band(ref, key)
  if m is ref or not (a1 < b0 or b1 < a0):
    return APART[2]
  return APART[0] if a1 < b0 else APART[1]


def ratio_fields(m: dict, ref: dict | None) -> dict:
  """The summary columns of a row's speed against its reference: the paired
  `tpot_vs_ref` with its interval where the row has one, else `tpot_over_ref`, and `vs_ref`
  (the verdict); {} without a reference."""
  p = paired(m)
  if m is ref or (p is not None and p[1] == [1.0, 1.0] and p[0] == 1.0):
    return {("tpot_vs_ref" if p else "tpot_over_ref"): 1.0, "vs_ref": "reference"}
  if p is not None:
    ratio, ci = p
    return {"tpot_vs_ref": ratio, "vs_ref_ci95": ci_text(ci), "vs_ref": verdict_ci(ratio, ci)}
  r = over_ref(m, ref or {})
  if r is None:
    return {}
  return {"tpot_over_ref": r, "vs_ref": verdict_iqr(m, ref)}


def ci_text(ci: list[float] | None, fmt: str = "{:.3f}") -> str:
  return "[" + ", ".join(fmt.format(x) for x in ci) + "]" if ci else ""


def roof_fraction(m: dict) -> float | None:
  """The one roof fraction of a row (module docstring), None when it has none."""
  v = m.get("roof_fraction", m.get("roofline_fraction"))
  return None if v is None else float(v)


def roof_fault(m: dict) -> bool:
  """Whether the row's roof fraction exceeds 1 (faster than its own lower bound)."""
  v = roof_fraction(m)
  return v is not None and v > 1.0


def roof_fields(m: dict) -> dict:
  """`roof_fraction` and `roof_check` of a row for a table: a fraction above 1 is not shown
  as a result; `roof_check` names the fault instead."""
  v = roof_fraction(m)
  if v is None:
    return {}
  if v > 1.0:
    return {"roof_fraction": None, "roof_check": f"{ROOF_FAULT}: {v:.2f}"}
  return {"roof_fraction": v, "roof_check": "ok"}


def faults(rows: list[dict]) -> list[str]:
  """One line per row whose roof fraction is above 1, for the end of a summary."""
  out = []
  for r in rows:
    if roof_fault(r.get("metrics") or {}):
      v, w = r.get("variant") or {}, r.get("workload") or {}
      name = v.get("setting") or v.get("codec")
      out.append(f"{v.get('variant')} {name} batch {w.get('batch')} context {w.get('context')}"
                 f": roof fraction {roof_fraction(r['metrics']):.2f} > 1, {ROOF_FAULT[7:]}")
  return out
