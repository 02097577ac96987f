"""latency: time to first token (prefill) and time per output token (decode) per variant.

One cell = one attention variant x codec x layout x batch x prompt length. The prompt
(`workload.prompt_len` random tokens per sequence) is prefilled, then `gen_len - 1`
tokens are decoded in one compiled `lax.scan`; TTFT and TPOT are the medians of
`workload.repeats` timed repeats after a warm-up, each with a fresh cache allocated
outside the timed region (kvjax.metrics.DecodeTimer). The cache holds
`prompt_len + gen_len` tokens (`context` in the rows), so TPOT is the decode cost at
that context. Weights are random: speed does not depend on their values.
"""

from __future__ import annotations

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import experiments as ex
from kvjax import metrics


def capacity(cfg: config_lib.Config) -> int:
  w = cfg.workload
  return cfg.cache.capacity or w.prompt_len + max(w.gen_len, 2)


def check(cfg: config_lib.Config) -> None:
  ex.check_context(cfg, capacity(cfg))
  ex.check_memory(cfg, cfg.workload.batch, capacity(cfg), cfg.workload.prompt_len)


def run_cell(cfg: config_lib.Config) -> list[dict]:
  w = cfg.workload
  params = ex.random_params(cfg.model, cfg.seed)
  tokens, lengths = ex.prompts(cfg, w.batch, w.prompt_len)
  S = capacity(cfg)
  timer = metrics.DecodeTimer(cfg, params, tokens, lengths, steps=max(w.gen_len - 1, 1),
                              capacity=S)
  m = metrics.bench_interleaved({"cell": timer}, repeats=w.repeats)["cell"]
  spec = cache_lib.CacheSpec.from_config(cfg, w.batch, S)
  m.update({
      "tokens_per_s": w.batch / m["tpot_s"],
      "prefill_tokens_per_s": w.batch * w.prompt_len / m["ttft_s"],
      "closed_form_bytes": cache_lib.LAYOUTS[cfg.cache.layout].closed_form_bytes(spec),
      "bytes_per_token": ex.bytes_per_token(cfg),
  })
  return [{
      "variant": ex.variant(cfg),
      "workload": {"batch": w.batch, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                   "context": S, "decode_steps": timer.steps},
      "metrics": m,
  }]


def summary(rows: list[dict]) -> list[dict]:
  """One line per cell, with TPOT relative to MHA-bf16 (else the first variant) at the same
  batch and context, the ratio the protocol trusts on a shared machine."""
  def key(r):
    return (r["workload"]["batch"], r["workload"]["context"], r["variant"]["layout"])

  ref = {}
  for r in rows:
    v = r["variant"]
    if v["variant"] == "MHA" and v["codec"] == "bf16":
      ref[key(r)] = r["metrics"]["tpot_s"]
  for r in rows:
    ref.setdefault(key(r), r["metrics"]["tpot_s"])
  out = []
  for r in rows:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    out.append({"variant": v["variant"], "codec": ex.cache_name(v), "layout": v["layout"],
                "batch": w["batch"], "context": w["context"],
                "bytes_per_token": m["bytes_per_token"], "cache_bytes": m["cache_bytes"],
                "ttft_s": m["ttft_s"], "tpot_s": m["tpot_s"], "tpot_iqr_s": m["tpot_s_iqr"],
                "tpot_vs_ref": m["tpot_s"] / ref[key(r)], "tokens_per_s": m["tokens_per_s"]})
  return out
