"""compression: every way to shrink the cache on one bytes axis (the frontier).

A cell is one paired setting (`params.setting`, a name from `params.settings`): a cache
policy with its budget or ratio (`cache.policy`, `cache.ratio`, `cache.window`, ...), a
codec (with rotation and clip), a latent rank (`params.latent_rank`: the model's K/V
projections factored by `kvjax.cache.latent.factor`, read through `cache.layout: latent`),
a converted checkpoint of the model (`params.converted: DIR`, fewer KV heads or a fitted
latent, made by `kvjax convert`; its recipe in the row), or any product of these. For each
model of `params.models` and each of `eval_seqs` text windows of `context + continuation`
tokens (`params.text`, as in the quality experiment), the context is prefilled (and
compacted by the policy), then the continuation is teacher-forced token by token through
the cache (`kvjax.decode.evict.continuation_logprobs`).

Row metrics, over the continuation's tokens: `ppl` through this cache, `ppl_ref` through
the original model's fp32 cache (or the cache `params.reference` names, as in the quality
experiment; the row's `workload.reference` says which), `dppl_rel` = ppl / ppl_ref - 1, `kl` (KL(ref || cache)
per token), `agreement` (argmax equal to the reference's), each of the last three with its
95 % paired interval (`kvjax.lab.intervals`); `cache_bytes` held at the end (batch
of all windows), `bytes_per_token` = cache_bytes / (windows x (context + continuation))
(so eviction, codecs, fewer heads and latents compare per token seen; measured, so
windows, scales and a policy's state are in), `of_bf16` = that over `bf16_bytes_per_token`
(the original model's bf16 cache at the same length: the frontier's unit),
`bytes_per_token_asymptotic` (`kvjax.footprint`: the long-context cost per stored token), `kept`
= cache_bytes over the fp32 cache's.

A policy compacts the context once, at prefill; the continuation's tokens are then all
kept, so a ratio r holds (r x context + continuation) tokens at the end, and `of_bf16`
says so. Nothing is timed here.
"""

from __future__ import annotations


from kvjax import config as config_lib
from kvjax import footprint
from kvjax.cache import latent
from kvjax.decode import evict
from kvjax.lab import data, evaluate, intervals
from kvjax.lab import experiments as ex
from kvjax.lab.experiments import quality

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = quality.PARAMS | frozenset({"context", "continuation", "eval_seqs", "latent_rank",
                                     "text"})

_REF: dict = {}


def check(cfg) -> None:
  ex.check_int_params(cfg, {"context": (512, 2), "continuation": (64, 2), "eval_seqs": (4, 1),
                            "latent_rank": (0, 0)})
  quality.check(cfg)  # (params.reference refused there when malformed)


def _tokens(cfg, mcfg, tok):
  n = cfg.param_int("context", 512) + cfg.param_int("continuation", 64)
  text = data.eval_text(str(cfg.param("text", "stdlib")), what="params.text")
  return evaluate.text_windows(tok, text, n, cfg.param_int("eval_seqs", 4),
                               ("params.context + params.continuation", "params.eval_seqs",
                                "params.text"))


def _reference(src, cfg, mcfg, params, tok):
  key = (str(src), repr(quality.reference_items(cfg)), cfg.param("context", 512),
         cfg.param("continuation", 64), cfg.param("eval_seqs", 4), cfg.param("text", "stdlib"))
  if key not in _REF:
    _REF.clear()
    ref_cfg = evaluate.reference_config(quality.cell_config(cfg, mcfg))
    if quality.reference_items(cfg):  # params.reference: held to that cache instead of fp32
      ref_cfg = config_lib.apply_overrides(ref_cfg, quality.reference_items(cfg))
    toks = _tokens(cfg, mcfg, tok)
    T = cfg.param_int("context", 512)
    lp, nbytes = evict.continuation_logprobs(ref_cfg, params, toks[:, :T], toks[:, T:])
    _REF[key] = (toks, lp, nbytes)  # a device array: every cell of the run reads it
  return _REF[key]


def _bf16_per_token(mcfg, context: int) -> float:
  """Bytes per token the original model's bf16 cache holds at `context` tokens: the frontier's
  unit (its own layout, so a sliding-window model's rings count as they hold)."""
  ref = config_lib.apply_overrides(mcfg, {"cache.codec": "bf16", "cache.k_codec": "bf16",
                                          "cache.v_codec": "bf16"})
  return footprint.count(ref, context).per_token


def run_cell(cfg) -> list[dict]:
  rows = []
  T = cfg.param_int("context", 512)
  for src in quality.models(cfg):
    mcfg, params, tok = quality.load_model(src)
    toks, ref_lp, ref_bytes = _reference(src, cfg, mcfg, params, tok)
    unit = _bf16_per_token(mcfg, toks.shape[1])
    rank, conversion = cfg.param_int("latent_rank", 0), {}
    if cfg.param("converted", ""):  # a checkpoint `kvjax convert` made from this model
      mcfg, params, conversion = quality.converted(cfg.param("converted"), src, mcfg)
    if rank:
      mcfg, params = latent.factor(mcfg, params, rank)
    tcfg = quality.cell_config(cfg, mcfg)
    if mcfg.model.latent_rank:  # factored here or converted: read through the latent layout
      tcfg = config_lib.replace(tcfg, **{"cache.layout": "latent"})
    cont = toks[:, T:]
    lp, nbytes = evict.continuation_logprobs(tcfg, params, toks[:, :T], cont)
    # row i of lp predicts cont[:, i]: every one of the M positions has its target
    metrics = evaluate.metrics_of(*evaluate.token_terms(lp, ref_lp, cont))
    B, M = cont.shape  # M continuation tokens after the T of context
    c = tcfg.cache
    var = ex.variant(tcfg, k_axis=c.k_axis, group_size=c.group_size, residual=c.residual,
                     setting=cfg.param("setting", ""), model=src.name, policy=c.policy,
                     budget=c.budget, ratio=c.ratio, window=c.window, sinks=c.sinks,
                     latent_rank=tcfg.model.latent_rank, **conversion)
    per_token = nbytes / (B * (T + M))
    metrics.update(cache_bytes=nbytes, cache_bytes_ref=ref_bytes, bytes_per_token=per_token,
                   bytes_per_token_asymptotic=footprint.asymptotic(tcfg), kept=nbytes / ref_bytes,
                   bf16_bytes_per_token=unit, of_bf16=per_token / unit)
    rows.append({"variant": var,
                 "workload": {"task": "text", "batch": B, "context": T,
                              "continuation": M, "data": str(cfg.param("text", "stdlib")),
                              "reference": quality.reference_name(cfg)},
                 "metrics": metrics})
  return rows


def summary(rows: list[dict]) -> list[dict]:
  """A record per row: the model, text and setting, its bytes per token against a bf16
  cache's, then Δppl % (against the row's reference) and KL with their 95 % intervals."""
  out = []
  for r in rows:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    out.append({"model": v.get("model"), "setting": v.get("setting"), "text": w.get("data"),
                "reference": w.get("reference", "fp32 cache"),
                "bytes_per_token": m.get("bytes_per_token"), "of_bf16": m.get("of_bf16"),
                "ppl": m["ppl"], "ppl_ref": m["ppl_ref"], "dppl_%": 100 * m["dppl_rel"],
                "dppl_%_ci95": intervals.text(m.get("dppl_rel_ci95"), "{:+.3f}", 100),
                "kl": m["kl"], "kl_ci95": intervals.text(m.get("kl_ci95")),
                "agreement": m["agreement"]})
  return out
