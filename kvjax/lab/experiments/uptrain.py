"""uptrain: MHA -> GQA/MQA by mean-pooling, and how much uptraining recovers (GQA paper, Table 1).

A cell is one target `model.n_kv_heads`. It loads the trained MHA checkpoint
(`params.mha`), mean-pools its K/V heads into the target (kvjax.lab.convert), and then
uptrains copies for each fraction in `params.fractions` of the MHA's own training steps,
with the MHA's recipe (same data, lr, schedule shape, warmup scaled by the fraction).
Rows, all evaluated the same way (validation loss of the full forward pass on fixed
windows, `ppl = exp(loss)`, and associative recall through the fp32 cache):

  method: mha        the MHA checkpoint itself (the bar)
  method: converted  mean-pooled, no uptraining (fraction 0)
  method: uptrained  mean-pooled + fraction x steps of uptraining
  method: scratch    a model of the target shape trained from scratch with the full budget
                     (`params.scratch`: {kv_heads: checkpoint folder}), when given

Uptrained checkpoints go to `params.work_dir/kv<K>_f<fraction>`; a rerun reuses them.
The cell's own `model:` section only needs n_heads for validation; weights and the
rest of the shape come from the MHA checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint
from kvjax.lab import convert
from kvjax.lab import data, evaluate, train
from kvjax.lab import experiments as ex

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"fractions", "mha", "progress", "recall_contexts", "recall_seqs",
                    "scratch", "work_dir"})


def _scratch(cfg) -> dict:
  return {int(k): str(v) for k, v in dict(cfg.param("scratch", ())).items()}


def check(cfg) -> None:
  mha = cfg.param("mha", "")
  if not mha or not (Path(mha) / "config.yaml").is_file():
    raise KvjaxError(f"uptrain needs params.mha, a trained MHA checkpoint ('{mha}' not found); "
                     "run `kvjax train configs/train_mha.yaml --out checkpoints/mha` first")
  saved = checkpoint.read_config(Path(mha))
  if saved.tokenizer not in ("bytes", "none", ""):
    raise KvjaxError(f"params.mha={mha} reads its own tokenizer ({saved.tokenizer[:60]}), but "
                     "uptrain trains and evaluates on byte-level ids; point it at a byte-level "
                     "checkpoint (kvjax train configs/train_mha.yaml)")
  if saved.model.n_kv_heads != saved.model.n_heads:
    raise KvjaxError(f"params.mha={mha} is {saved.model.variant}, not MHA (its rows would be "
                     "labelled 'mha'); point it at an MHA checkpoint, or expand it first with "
                     "`kvjax convert --kv-heads N`")
  for f in cfg.param("fractions", (0.05, 0.1)):
    if not 0 < float(f) <= 1:
      raise KvjaxError(f"params.fractions must be in (0, 1], got {f}")


def _evaluate(cfg: config_lib.Config, params, contexts, n_recall: int) -> dict:
  corpus = data.load_corpus(cfg.train.data)
  loss = train.validation_loss(cfg, params, corpus)
  out = {"val_loss": loss, "ppl": math.exp(loss)}
  ref = evaluate.reference_config(cfg)
  for L in contexts:
    seqs, mask = evaluate.recall_set(cfg.seed, n_recall, int(L), cfg.train.recall_pairs,
                                     corpus.validation)
    out[f"recall@{int(L)}"] = evaluate.recall_accuracy(ref, params, seqs, mask, chunk=int(L))
  if contexts:
    out["recall"] = out[f"recall@{int(max(contexts))}"]
  return out


def _row(cfg, method: str, fraction: float, steps: int, metrics: dict, **extra) -> dict:
  var = ex.variant(cfg, method=method, uptrain_fraction=fraction, **extra)
  return {"variant": var, "workload": {"task": "uptrain", "uptrain_steps": steps,
                                       "eval_seq_len": cfg.train.seq_len},
          "metrics": metrics}


def run_cell(cfg) -> list[dict]:
  mha_cfg, mha_params = checkpoint.load(cfg.param("mha"))
  kv = cfg.model.n_kv_heads
  convert.check_target(mha_cfg.model, kv)
  contexts = [int(c) for c in cfg.param("recall_contexts", (mha_cfg.train.seq_len,))]
  n_recall = cfg.param_int("recall_seqs", 32)
  base_steps = mha_cfg.train.steps
  rows = [_row(mha_cfg, "mha", 0.0, 0, _evaluate(mha_cfg, mha_params, contexts, n_recall))]

  conv_cfg, conv_params = convert.mean_pool(mha_cfg, mha_params, kv)
  rows.append(_row(conv_cfg, "converted", 0.0, 0,
                   _evaluate(conv_cfg, conv_params, contexts, n_recall)))

  work = Path(cfg.param("work_dir", "checkpoints/uptrain"))
  for f in cfg.param("fractions", (0.05, 0.1)):
    f = float(f)
    steps = max(1, round(f * base_steps))
    t = dataclasses.replace(conv_cfg.train, steps=steps,
                            warmup=max(1, round(f * conv_cfg.train.warmup)),
                            eval_every=steps, checkpoint_every=steps,
                            log_every=max(1, min(conv_cfg.train.log_every, steps)))
    up_cfg = dataclasses.replace(conv_cfg, train=t, name=f"uptrain_kv{kv}_f{f:g}")
    t0 = time.perf_counter()
    out = train.train(up_cfg, work / f"kv{kv}_f{f:g}", params=conv_params,
                      progress=bool(cfg.param("progress", True)))
    metrics = _evaluate(up_cfg, out["final_params"], contexts, n_recall)
    metrics["uptrain_s"] = time.perf_counter() - t0
    rows.append(_row(up_cfg, "uptrained", f, steps, metrics))

  scratch = _scratch(cfg).get(kv)
  if scratch:
    s_cfg, s_params = checkpoint.load(scratch)
    if s_cfg.model.n_kv_heads != kv:
      raise KvjaxError(f"params.scratch[{kv}] = {scratch} has n_kv_heads="
                       f"{s_cfg.model.n_kv_heads}; point it at a {kv}-KV-head checkpoint")
    rows.append(_row(s_cfg, "scratch", 1.0, s_cfg.train.steps,
                     _evaluate(s_cfg, s_params, contexts, n_recall)))
  return rows


def summary(rows: list[dict]) -> list[dict]:
  return [{"variant": r["variant"]["variant"], "method": r["variant"]["method"],
           "fraction": r["variant"]["uptrain_fraction"], "ppl": r["metrics"]["ppl"],
           "val_loss": r["metrics"]["val_loss"], "recall": r["metrics"].get("recall")}
          for r in rows]
