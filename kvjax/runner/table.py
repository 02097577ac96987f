"""The summary table of results rows: rows flattened to records, values as text (times in
ms, bytes in KiB/MiB/GiB) and records as an aligned plain-text table. Bytes per token are
what the cache held at the row's context (`kvjax.held.row_bytes`), for older rows too.
"""

from __future__ import annotations

from typing import Any

from kvjax import memory

# Metric columns of the summary table, in this order when present.
TABLE_METRICS = ("bytes_per_token", "bytes_per_token_asymptotic", "bits_per_element",
                 "cache_bytes", "closed_form_bytes", "max_concurrency",
                 "ttft_s", "tpot_s", "tokens_per_s", "speedup_vs_recompute", "peak_bytes",
                 "roofline_fraction", "ppl", "ppl_ref", "kl", "agreement", "recall",
                 "memory_utilization", "prefix_hit_rate")


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
    from kvjax import held                         # version wrote the row (kvjax.held)
    metrics = {**metrics, **{k: v for k, v in held.row_bytes(row).items() if v is not None}}
  for k in TABLE_METRICS:
    if metrics.get(k) is not None:
      rec[k] = metrics[k]
  if all_metrics:
    for k, v in metrics.items():
      if k.endswith("_ci95") and isinstance(v, list) and len(v) == 2:  # 95 % intervals
        rec[f"{k}_lo"], rec[f"{k}_hi"] = v
      elif k not in rec and not isinstance(v, (dict, list)):
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
    return memory.human(v, fmt=".3g")
  if is_seconds(key):
    return f"{v * 1e3:,.0f}" if v * 1e3 >= 1e4 else f"{v * 1e3:.4g}"
  if abs(v) >= 1e4:
    return f"{v:,.0f}"
  return f"{v:.4g}" if isinstance(v, float) else str(v)


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
  body = [[cell_text(k, rec.get(k)) for k in keys] for rec in records]
  widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(heads)]
  line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
  return "\n".join([line(heads), line(["-" * w for w in widths])] + [line(r) for r in body])
