"""The summary table of results rows: rows flattened to records, values as text (times in
ms, bytes in KiB/MiB/GiB; one number format per column) and records as an aligned
plain-text table. Bytes per token are what the cache held at the row's context
(`kvjax.footprint.row_bytes`), for older rows too.

Identity: `identity` names, per cell config, every cache and model key whose value differs
between the cells (codec, k_axis, group_size, residual, policy, ratio, sinks, ... and the paired
setting), so two rows never look alike in a table; `with_identity` puts those columns in
front of an experiment's summary records (matched to their rows by the metric values they
carry).
"""

from __future__ import annotations

import math
from typing import Any

from kvjax import memory

# Metric columns of the summary table, in this order when present.
TABLE_METRICS = ("bytes_per_token", "bytes_per_token_asymptotic", "bits_per_element",
                 "cache_bytes", "closed_form_bytes", "max_concurrency",
                 "ttft_s", "tpot_s", "tokens_per_s", "speedup_vs_recompute", "peak_bytes",
                 "roof_fraction", "ppl", "ppl_ref", "kl", "agreement", "recall",
                 "memory_utilization", "prefix_hit_rate")


# Row fields shown under one name only (kvjax.lab.figures): the roof fraction is `roof_fraction`
# (with `roof_check`), whichever field the row stored it in.
ONE_NAME = ("roof_fraction", "roofline_fraction", "roofline_fraction_iqr")


def flatten(row: dict, all_metrics: bool = False) -> dict:
  """Variant and workload fields, then the known metrics (`TABLE_METRICS`), as one flat
  record; with `all_metrics`, every other scalar metric after them (`kvjax results`)."""
  rec = {}
  for section in ("variant", "workload"):
    for k, v in row.get(section, {}).items():
      if not isinstance(v, (dict, list)):
        rec[k] = v
  metrics = row.get("metrics", {})
  if metrics.get("bytes_per_token") is not None:  # as held at the row's context, whatever
    from kvjax import footprint                    # version wrote the row (kvjax.footprint)
    metrics = {**metrics, **{k: v for k, v in footprint.row_bytes(row).items() if v is not None}}
  from kvjax.lab import figures
  metrics = {**metrics, **figures.roof_fields(metrics)}  # one roof fraction, > 1 flagged
  for k in TABLE_METRICS + ("roof_check",):
    if metrics.get(k) is not None:
      rec[k] = metrics[k]
  if all_metrics:
    for k, v in metrics.items():
      if k.endswith("_ci95") and isinstance(v, list) and len(v) == 2:  # 95 % intervals
        rec[f"{k}_lo"], rec[f"{k}_hi"] = v
      elif k not in rec and k not in ONE_NAME and not isinstance(v, (dict, list)):
        rec[k] = v
  return rec


def is_seconds(key: str) -> bool:
  """Whether a metric is in seconds (`ttft_s`, not `tokens_per_s`): shown in ms."""
  return key.endswith("_s") and not key.endswith("per_s")


def cell_text(key: str, v: Any) -> str:
  """One value as table text, by its key: bytes humanized, seconds in ms, `-` for none."""
  if v is None:
    return "-"
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return str(v)
  if key.endswith("bytes"):
    return footprint.human(v, fmt=".3g")
  if is_seconds(key):
    return f"{v * 1e3:,.0f}" if v * 1e3 >= 1e4 else f"{v * 1e3:.4g}"
  if abs(v) >= 1e4:
    return f"{v:,.0f}"
  return f"{v:.4g}" if isinstance(v, float) else str(v)


def _numbers(xs: list[float]) -> list[str]:
  """One format for a column of numbers: integers with thousands separators when all are
  whole, else the fewest fixed decimals (at most 6) that give four significant digits to
  values down to a thousandth of the largest."""
  if all(float(x).is_integer() and abs(x) < 1e15 for x in xs):
    return [f"{int(x):,}" for x in xs]
  top = max(abs(x) for x in xs)
  if top < 1e-4:
    return [f"{x:.2e}" for x in xs]
  ref = max(min(abs(x) for x in xs if x), top * 1e-3)  # small values keep digits too
  d = min(max(3 - math.floor(math.log10(ref)), 0), 6)
  d = next(e for e in range(d + 1) if all(round(x, e) == round(x, d) for x in xs))
  texts = [f"{x:,.{d}f}" for x in xs]
  return [t[1:] if t.startswith("-") and not t.strip("-0.,") else t for t in texts]  # no -0


def column_text(key: str, values: list) -> list[str]:
  """A column's values as text in one format: bytes in the one unit its largest value
  reads in, seconds in ms, numbers by `_numbers`; `-` for none, text as it is."""
  nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
          and math.isfinite(v)]
  unit, scale = "", 1.0
  if nums and key.endswith("bytes"):
    top = max(abs(v) for v in nums)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
      if top < 1024 * scale or unit == "TiB":
        break
      scale *= 1024
    unit = " " + unit
  elif is_seconds(key):
    scale = 1e-3
  texts = iter(_numbers([v / scale for v in nums]) if nums else [])
  return [next(texts) + unit if v in nums and not isinstance(v, bool) else
          "-" if v is None else cell_text(key, v) for v in values]


def identity(configs: list[dict]) -> list[dict]:
  """Per config (a row's `config`, `Config.to_dict()`), the cache and model keys that
  differ between the configs, by their names (`codec`: K and V together; `k_axis`,
  `group_size`, `residual`, `policy`, `ratio`, `sinks`, ..., `vocab_size`; the KV heads are
  the rows' `variant`), and the paired setting's name if any."""
  def items(cfg: dict) -> dict:
    c = dict(cfg.get("cache") or {})
    k, v = c.pop("k_codec", None), c.pop("v_codec", None)
    c.pop("codec", None)
    out = {"setting": (cfg.get("params") or {}).get("setting") or None,
           "codec": k if k == v else f"K{k}/V{v}"}
    model = {k: v for k, v in (cfg.get("model") or {}).items() if k != "n_kv_heads"}
    return {**out, **c, **{k if k not in c else f"model.{k}": v for k, v in model.items()}}
  each = [items(c) for c in configs]
  keys = [k for k in (each[0] if each else {})
          if len({repr(e.get(k)) for e in each}) > 1]
  return [{k: e.get(k) for k in keys} for e in each]


def _matches(rec: dict, row: dict) -> bool:
  """Whether a summary record carries this row's values: every workload field the two
  share is equal, so is the named setting and model when both carry one (two settings
  may share every figure, a policy's bytes at one ratio), and so are at least half of
  the metrics they share (a summary may show another figure under a metric's name), at
  least one."""
  metrics, work = row.get("metrics") or {}, row.get("workload") or {}
  variant = row.get("variant") or {}
  shared = [k for k in rec if k in metrics]
  same = sum(rec[k] == metrics[k] for k in shared)
  named = all(rec[k] == variant[k] for k in ("setting", "model")
              if k in rec and variant.get(k) and k not in metrics and k not in work)
  return same >= 1 and 2 * same >= len(shared) and named and \
      all(rec[k] == work[k] for k in rec if k in work and k not in metrics)


def with_identity(records: list[dict], rows: list[dict]) -> list[dict]:
  """The summary `records` with the identity columns of the rows they came from in front
  (one a record already holds with another value as `cache.NAME`), when every record
  matches a row in order; columns that are empty in every record dropped."""
  ids = identity([r.get("config") or {} for r in rows])
  pairs, i = [], 0
  for rec in records if ids and ids[0] else ():
    while i < len(rows) and not _matches(rec, rows[i]):
      i += 1
    if i == len(rows):
      pairs = []
      break
    pairs.append((ids[i], rec))
    i += 1  # each row stands behind one record at most
  # a record's own column of the same name and other values (a `codec` holding the
  # setting's name): the identity column comes as cache.NAME; of the same values: left out
  clash = {k for d, rec in pairs for k in d if k in rec and rec[k] != d[k]}
  out = [{**{(f"cache.{k}" if k in clash else k): v for k, v in d.items()
              if k in clash or k not in rec}, **rec} for d, rec in pairs] or records
  empty = {k for rec in out for k in rec
           if all(r.get(k) in (None, "") for r in out)}
  return [{k: v for k, v in rec.items() if k not in empty} for rec in out]


def format_table(records: list[dict], drop_constant: bool = False) -> str:
  """A plain aligned text table; with `drop_constant`, non-metric columns that never vary
  are dropped (the generic table of an experiment without its own `summary`)."""
  if not records:
    return "(no rows)"
  keys: list[str] = []
  for rec in records:
    keys += [k for k in rec if k not in keys]
  if drop_constant and len(records) > 1:
    metric_like = set(TABLE_METRICS)
    keys = [k for k in keys if k in metric_like or len({str(r.get(k)) for r in records}) > 1]
  heads = [k[:-2] + "_ms" if is_seconds(k) else k for k in keys]
  cols = [column_text(k, [rec.get(k) for rec in records]) for k in keys]
  body = [list(cells) for cells in zip(*cols)]
  widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(heads)]
  line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
  return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(r) for r in body])
