"""memory: how many bytes the cache takes, and how many requests fit a memory budget.

Per cell (an attention variant x codec of the config's model):
  - `part: cache_bytes` rows, one per context in `params.contexts`: the cache pytree's
    bytes (`kvjax.cache.tree_bytes`) next to the closed form
    `2 * layers * kv_heads * head_dim * tokens * bytes_per_element` (+ codec metadata),
    `bytes_per_token` held at that context (`kvjax.footprint`, a window in) and
    `bytes_per_token_asymptotic`, the per-token cost the summary and plot show.
    Caches up to `params.alloc_limit_mib` are really allocated; larger ones are measured
    on the abstract pytree (`jax.eval_shape`: same leaves, no memory), marked `abstract`.
  - `part: max_concurrency` rows for each real model shape in `params.shapes`
    (kvjax/shapes/*.yaml), closed form only: how many sequences of each context in
    `params.concurrency_contexts` fit in `params.budget_gib` after the weights, with the
    cell's codec and the cell's kind of attention mapped onto the shape (MHA: all heads
    keep K/V; GQA: the shape's own kv heads; MQA: one kv head).
"""

from __future__ import annotations

import jax

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import footprint
from kvjax.errors import KvjaxError
from kvjax.lab import experiments as ex

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"alloc_limit_mib", "budget_gib", "budget_gib_per_shape",
                    "concurrency_contexts", "contexts", "shapes"})

GIB = 2 ** 30


def check(cfg: config_lib.Config) -> None:
  for s in cfg.param("contexts", []):
    if int(s) <= 0:
      raise KvjaxError(f"params.contexts must be positive, got {s}")
  for name in cfg.param("shapes", []):
    ex.load_shape(name)


def run_cell(cfg: config_lib.Config) -> list[dict]:
  rows = [_bytes_row(cfg, int(s)) for s in
          cfg.param("contexts", [cfg.workload.prompt_len + cfg.workload.gen_len])]
  for name in cfg.param("shapes", []):
    rows += _concurrency_rows(cfg, name)
  return rows


def _bytes_row(cfg: config_lib.Config, context: int) -> dict:
  B = cfg.workload.batch
  closed = footprint.cache_bytes(cfg, B, context)
  if closed <= cfg.param("alloc_limit_mib", 256) * 2 ** 20:
    c = cache_lib.init_cache(cfg, B, context)
    measured, source = cache_lib.tree_bytes(jax.block_until_ready(c)), "allocated"
    del c
  else:
    c = jax.eval_shape(lambda: cache_lib.init_cache(cfg, B, context))
    measured, source = cache_lib.tree_bytes(c), "abstract"
  return {
      "variant": ex.variant(cfg, model=cfg.name or "config"),
      "workload": {"part": "cache_bytes", "batch": B, "context": context, "measured": source},
      "metrics": {"cache_bytes": measured, "closed_form_bytes": closed,
                  **footprint.count(cfg, context, batch=B).fields(),  # held at this context
                  "measured_bytes_per_token": measured / (B * context)},
  }


def shape_config(cfg: config_lib.Config, name: str) -> config_lib.Config:
  """The cell's cache settings on a real model shape, with the cell's kind of attention."""
  shape = ex.load_shape(name).model
  kind = cfg.model.variant
  kv = shape.n_heads if kind == "MHA" else 1 if kind == "MQA" else shape.n_kv_heads
  over = {f"model.{f.name}": getattr(shape, f.name)
          for f in shape.__dataclass_fields__.values()}
  over["model.n_kv_heads"] = kv
  return config_lib.apply_overrides(cfg, over)


def _concurrency_rows(cfg: config_lib.Config, name: str) -> list[dict]:
  from kvjax import model

  scfg = shape_config(cfg, name)
  weights = jax.eval_shape(lambda: model.init_params(scfg.model, 0))
  weight_bytes = cache_lib.tree_bytes(weights)
  budgets = cfg.param("budget_gib_per_shape", {}) or {}
  budget = float(dict(budgets).get(name, cfg.param("budget_gib", 80))) * GIB
  per_token = ex.bytes_per_token(scfg)
  rows = []
  for context in cfg.param("concurrency_contexts", [2048, 8192, 32768, 131072]):
    per_seq = footprint.cache_bytes(scfg, 1, int(context), layout="contiguous")
    free = budget - weight_bytes
    rows.append({
        "variant": ex.variant(scfg, model=name),
        "workload": {"part": "max_concurrency", "context": int(context),
                     "budget_gib": budget / GIB},
        "metrics": {"max_concurrency": max(int(free // per_seq), 0) if free > 0 else 0,
                    "bytes_per_token": per_seq / int(context),
                    "bytes_per_token_asymptotic": per_token, "cache_bytes": per_seq,
                    "weight_bytes": weight_bytes, "budget_bytes": int(budget)},
    })
  return rows


def summary(rows: list[dict]) -> dict[str, list[dict]]:
  """Per cell: bytes per token, and measured vs closed-form bytes at the longest context;
  per real shape and variant: sequences that fit at `params.table_context`, per codec."""
  sized = [r for r in rows if r["workload"]["part"] == "cache_bytes"]
  cells: dict = {}
  for r in sized:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    rec = cells.setdefault(r["config_hash"], {
        "variant": v["variant"], "codec": ex.cache_name(v),
        "bytes_per_token": m.get("bytes_per_token_asymptotic", m["bytes_per_token"]),
        "context": 0, "matches_closed_form": "yes", "allocated_up_to": 0})
    if m["cache_bytes"] != m["closed_form_bytes"]:
      rec["matches_closed_form"] = "NO"
    if w["measured"] == "allocated":
      rec["allocated_up_to"] = max(rec["allocated_up_to"], w["context"])
    if w["context"] >= rec["context"]:
      rec.update(context=w["context"], cache_bytes=m["cache_bytes"],
                 closed_form_bytes=m["closed_form_bytes"])
  fits = [r for r in rows if r["workload"]["part"] == "max_concurrency"]
  tables = {"cache bytes per cell: pytree-measured vs closed form": list(cells.values())}
  if fits:
    ctx = int(fits[0]["config"]["params"].get("table_context", 8192))
    ctx = min({r["workload"]["context"] for r in fits}, key=lambda c: abs(c - ctx))
    shapes: dict = {}
    for r in fits:
      v, w, m = r["variant"], r["workload"], r["metrics"]
      if w["context"] == ctx:
        rec = shapes.setdefault((v["model"], v["variant"]), {
            "model": v["model"], "variant": v["variant"], "weight_bytes": m["weight_bytes"]})
        rec[ex.cache_name(v)] = m["max_concurrency"]
    title = (f"max concurrent sequences of {ctx} tokens in {fits[0]['workload']['budget_gib']:g}"
             " GiB (per-shape budgets in params), by cache codec (closed form)")
    tables[title] = sorted(shapes.values(), key=lambda rec: rec["model"])
  return tables
