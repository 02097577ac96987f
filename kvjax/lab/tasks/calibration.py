"""The suite's calibration rule, read by its summary, its docs table and its plots: a
(model, context, task) whose fp32 cache scores below `CALIBRATED` is beyond the model
there; a family is scored over the tasks the model answers, and is beyond the model only
where it answers none of them (`family_rows`)."""

from __future__ import annotations

import numpy as np

CALIBRATED = 0.8  # the fp32 cache's mean score below which a (model, context, task) is not ranked


def _where(r: dict) -> tuple:  # a row's (model, context, task)
  return r["variant"].get("model"), r["workload"]["context"], r["workload"]["task"]


def calibration(rows: list[dict]) -> dict[tuple, float]:
  """The fp32 cache's mean score per (model, context, task) of the suite's rows."""
  acc: dict = {}
  for r in rows:
    if r["variant"].get("setting") == "fp32":
      acc.setdefault(_where(r), []).append(r["metrics"]["score"])
  return {k: float(np.mean(v)) for k, v in acc.items()}


def family_rows(rows: list[dict], cal: dict[tuple, float] | None = None
                ) -> tuple[list[dict], bool | None]:
  """The rows a family's score is read from (all of one model, context and family): those of
  its calibrated tasks, and True; where no task is calibrated, all of them, and False; all
  of them and None where no task has fp32 rows to calibrate it."""
  cal = calibration(rows) if cal is None else cal
  if not any(_where(r) in cal for r in rows):
    return rows, None
  ok = [r for r in rows if cal.get(_where(r), 0.0) >= CALIBRATED]
  return (ok, True) if ok else (rows, False)
