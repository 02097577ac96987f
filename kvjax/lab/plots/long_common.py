"""What the long_context plots share (kvjax.lab.plots.long_context, long_context_evict): a row's
setting name, the settings by bytes held, and the title naming the model."""

from __future__ import annotations

from kvjax.lab.plots.style import bytes_per_token, model_label


def setting(r) -> str:
  return r["variant"].get("setting") or r["variant"]["codec"]


def settings(rows) -> list[str]:
  """Settings from most to fewest bytes held per token (the most a setting holds: a
  window's share is largest early)."""
  bpt: dict = {}
  for r in rows:
    bpt[setting(r)] = max(bpt.get(setting(r), 0), bytes_per_token(r))
  return sorted(bpt, key=lambda s: (-bpt[s], s))


def title(rows) -> str:
  models = sorted({model_label(r) for r in rows})
  tasks = sorted({x["workload"]["task"] for x in rows})
  return f"{', '.join(models)}: {', '.join(tasks)} through the cache"
