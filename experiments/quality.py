"""quality: what each cache setting costs in output quality, measured through the cache.

A cell is one cache setting (`params.setting`, a name from `params.settings`: a mapping
of cache overrides such as codec, k_axis, group_size, residual) on one layout. For each
trained checkpoint in `params.checkpoints` (MHA, GQA, MQA comparison models) it returns:

  - a `task: text` row: validation text streamed token by token (`params.chunk`) through
    the cache; `ppl`, `ppl_ref` (same model, fp32 cache), `dppl_rel`, `kl`, `agreement`
    (teacher-forced greedy tokens vs the fp32 cache), `gen_agreement` (free-running greedy
    decode of `workload.gen_len` tokens after `workload.prompt_len`), `cache_bytes`;
  - `task: recall` rows, one per context in `params.recall_contexts`: associative-recall
    accuracy through this cache (`recall`) and through the fp32 cache (`recall_ref`).

The cell's own `model:` section is ignored: each checkpoint brings its config.
References are computed once per checkpoint and reused by every cell of a run.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import experiments as ex
from kvjax import checkpoint, data, evaluate
from kvjax import config as config_lib
from kvjax.errors import KvjaxError

_REF: dict = {}


def _checkpoints(cfg) -> list[str]:
  paths = cfg.param("checkpoints", ())
  if isinstance(paths, str):
    paths = (paths,)
  if not paths:
    raise KvjaxError("quality needs params.checkpoints: a list of folders written by "
                     "`kvjax train configs/train_mha.yaml --out checkpoints/mha`")
  return list(paths)


def check(cfg) -> None:
  for path in _checkpoints(cfg):
    if not (Path(path) / "config.yaml").is_file():
      raise KvjaxError(f"checkpoint {path} not found; train it first, e.g. "
                       f"`kvjax train configs/train_mha.yaml --out {path}`")


@functools.lru_cache(maxsize=8)
def _load(path: str):
  return checkpoint.load(path)


def cell_config(cfg, model_cfg: config_lib.Config) -> config_lib.Config:
  """The checkpoint's model and data with this cell's cache and workload (the runner has
  already applied the cell's `params.setting`)."""
  merged = dataclasses.replace(model_cfg, cache=cfg.cache, workload=cfg.workload, seed=cfg.seed)
  return config_lib.validate(config_lib.resolve(merged))


def _text(cfg, model_cfg: config_lib.Config):
  n, seqs = int(cfg.param("eval_tokens", 512)), int(cfg.param("eval_seqs", 4))
  corpus = data.load_corpus(model_cfg.train.data)
  return data.eval_windows(corpus.validation, seqs, n - 1), corpus


def _reference(path: str, cfg, mcfg, params) -> dict:
  key = (path, cfg.param("eval_tokens", 512), cfg.param("eval_seqs", 4), cfg.param("chunk", 1),
         tuple(cfg.param("recall_contexts", ())), cfg.param("recall_seqs", 32), cfg.seed,
         cfg.workload.prompt_len, cfg.workload.gen_len)
  if key not in _REF:
    ref_cfg = evaluate.reference_config(cell_config(cfg, mcfg))
    tokens, corpus = _text(cfg, mcfg)
    lp, nbytes = evaluate.stream_logprobs(ref_cfg, params, tokens, int(cfg.param("chunk", 1)))
    recall = {}
    for L in cfg.param("recall_contexts", ()):
      seqs, mask = evaluate.recall_set(cfg.seed, int(cfg.param("recall_seqs", 32)), int(L),
                                       mcfg.train.recall_pairs, corpus.validation)
      recall[int(L)] = (seqs, mask, evaluate.recall_accuracy(ref_cfg, params, seqs, mask,
                                                             int(cfg.param("chunk", 1))))
    gen = None
    n_gen, P = int(cfg.param("gen_prompts", 4)), cfg.workload.prompt_len
    if n_gen and cfg.workload.gen_len:
      prompts = [list(map(int, t[:P])) for t in tokens[:n_gen]]
      gen = (prompts, evaluate.greedy_tokens(ref_cfg, params, prompts, cfg.workload.gen_len))
    _REF[key] = {"tokens": tokens, "lp": lp, "bytes": nbytes, "recall": recall, "gen": gen}
  return _REF[key]


def run_cell(cfg) -> list[dict]:
  rows = []
  chunk = int(cfg.param("chunk", 1))
  for path in _checkpoints(cfg):
    mcfg, params = _load(path)
    tcfg = cell_config(cfg, mcfg)
    ref = _reference(path, cfg, mcfg, params)
    c = tcfg.cache
    var = ex.variant(tcfg, k_axis=c.k_axis, group_size=c.group_size, residual=c.residual,
                     setting=cfg.param("setting", ""), model=Path(path).name)
    lp, nbytes = evaluate.stream_logprobs(tcfg, params, ref["tokens"], chunk)
    metrics = evaluate.compare(lp, ref["lp"], ref["tokens"])
    B, N = ref["tokens"].shape
    metrics.update(cache_bytes=nbytes, cache_bytes_ref=ref["bytes"],
                   bytes_per_token=ex.bytes_per_token(tcfg),
                   cache_bytes_per_token=nbytes / (B * N))
    if ref["gen"] is not None:
      prompts, ref_gen = ref["gen"]
      got = evaluate.greedy_tokens(tcfg, params, prompts, tcfg.workload.gen_len)
      metrics["gen_agreement"] = evaluate.generation_agreement(got, ref_gen)
    rows.append({"variant": var, "workload": {"task": "text", "batch": B, "context": N,
                                              "chunk": chunk, "data": mcfg.train.data},
                 "metrics": metrics})
    for L, (seqs, mask, acc_ref) in ref["recall"].items():
      acc = evaluate.recall_accuracy(tcfg, params, seqs, mask, chunk)
      rows.append({"variant": var, "workload": {"task": "recall", "context": L,
                                                "batch": len(seqs), "chunk": chunk,
                                                "n_pairs": mcfg.train.recall_pairs},
                   "metrics": {"recall": acc, "recall_ref": acc_ref}})
  return rows


def summary(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    if r["workload"].get("task") == "text":
      v, m = r["variant"], r["metrics"]
      out.append({"model": v.get("variant"), "setting": v.get("setting"),
                  "ppl": m["ppl"], "ppl_ref": m["ppl_ref"], "dppl_%": 100 * m["dppl_rel"],
                  "kl": m["kl"], "agreement": m["agreement"],
                  "bytes_per_token": m.get("bytes_per_token")})
  return out
