"""compression: token eviction, latent caches and quantization on one bytes axis.

A cell is one paired setting (`params.setting`, a name from `params.settings`): a cache
policy with its budget or ratio (`cache.policy`, `cache.ratio`, `cache.window`, ...), a
codec, or a latent rank (`params.latent_rank`: the model's K/V projections factored by
`kvjax.cache.latent.factor`, read through `cache.layout: latent`). For each model of
`params.models` and each of `eval_seqs` text windows of `context + continuation` tokens
(`params.text`, as in the quality experiment), the context is prefilled (and compacted by
the policy), then the continuation is teacher-forced token by token through the cache
(`kvjax.evict.continuation_logprobs`).

Row metrics: `ppl` of the continuation through this cache, `ppl_ref` through the
uncompressed fp32 cache of the original model, `dppl_rel` = ppl / ppl_ref - 1,
`agreement` (argmax equal to the reference's), `cache_bytes` held at the end (batch of
all windows), `bytes_per_token` = cache_bytes / (windows x (context + continuation))
(so eviction, codecs and latents compare per token seen; measured, so windows, scales and
a policy's state are in), `bytes_per_token_asymptotic` (`kvjax.held`: the long-context cost
per stored token), `kept` = cache_bytes over the
uncompressed fp32 cache's bytes per token.

Not measured here: the long-context retrieval tasks (passkey, needle, variable tracking)
do not exist in kvjax yet, and nothing is timed.
"""

from __future__ import annotations

import numpy as np

from kvjax import experiments as ex
from kvjax.experiments import quality
from kvjax import data, evaluate, held
from kvjax import evict
from kvjax.cache import latent
from kvjax import config as config_lib

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = quality.PARAMS | frozenset({"context", "continuation", "eval_seqs", "latent_rank",
                                     "text"})

_REF: dict = {}


def check(cfg) -> None:
  ex.check_int_params(cfg, {"context": (512, 2), "continuation": (64, 2), "eval_seqs": (2, 1),
                            "latent_rank": (0, 0)})
  quality.check(cfg)


def _tokens(cfg, mcfg, tok):
  n = cfg.param_int("context", 512) + cfg.param_int("continuation", 64)
  text = data.eval_text(str(cfg.param("text", "stdlib")), what="params.text")
  return evaluate.text_windows(tok, text, n, cfg.param_int("eval_seqs", 2),
                               ("params.context + params.continuation", "params.eval_seqs",
                                "params.text"))


def _reference(src, cfg, mcfg, params, tok):
  key = (str(src), cfg.param("context", 512), cfg.param("continuation", 64),
         cfg.param("eval_seqs", 2), cfg.param("text", "stdlib"))
  if key not in _REF:
    _REF.clear()
    ref_cfg = evaluate.reference_config(quality.cell_config(cfg, mcfg))
    toks = _tokens(cfg, mcfg, tok)
    T = cfg.param_int("context", 512)
    lp, nbytes = evict.continuation_logprobs(ref_cfg, params, toks[:, :T], toks[:, T:])
    _REF[key] = (toks, np.asarray(lp), nbytes)
  return _REF[key]


def _nll(lp_BMV, cont_BM) -> float:
  return float(-np.mean(np.take_along_axis(np.asarray(lp_BMV), cont_BM[..., None], -1)))


def run_cell(cfg) -> list[dict]:
  rows = []
  T = cfg.param_int("context", 512)
  for src in quality.models(cfg):
    mcfg, params, tok = quality.load_model(src)
    toks, ref_lp, ref_bytes = _reference(src, cfg, mcfg, params, tok)
    rank = cfg.param_int("latent_rank", 0)
    if rank:
      mcfg, params = latent.factor(mcfg, params, rank)
    tcfg = quality.cell_config(cfg, mcfg)
    if rank:
      tcfg = config_lib.replace(tcfg, **{"cache.layout": "latent"})
    cont = toks[:, T:]
    lp, nbytes = evict.continuation_logprobs(tcfg, params, toks[:, :T], cont)
    lp = np.asarray(lp)
    ppl, ppl_ref = np.exp(_nll(lp, cont)), np.exp(_nll(ref_lp, cont))
    B, M = cont.shape  # M continuation tokens after the T of context
    c = tcfg.cache
    var = ex.variant(tcfg, setting=cfg.param("setting", ""), model=src.name, policy=c.policy,
                     budget=c.budget, ratio=c.ratio, window=c.window, sinks=c.sinks,
                     latent_rank=rank)
    rows.append({"variant": var,
                 "workload": {"task": "text", "batch": B, "context": T,
                              "continuation": M, "data": str(cfg.param("text", "stdlib"))},
                 "metrics": {"ppl": ppl, "ppl_ref": ppl_ref, "dppl_rel": ppl / ppl_ref - 1,
                             "agreement": float(np.mean(lp.argmax(-1) == ref_lp.argmax(-1))),
                             "cache_bytes": nbytes, "cache_bytes_ref": ref_bytes,
                             "bytes_per_token": nbytes / (B * (T + M)),
                             "bytes_per_token_asymptotic": held.asymptotic(tcfg),
                             "kept": nbytes / ref_bytes}})
  return rows
