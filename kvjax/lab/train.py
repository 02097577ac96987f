"""Training: `kvjax train FILE.yaml --out DIR`.

optax AdamW (decoupled weight decay on matrices only) with linear warmup and cosine decay
to `lr * min_lr_ratio`, global-norm gradient clipping, and one jit-compiled step. The
batch for step s is drawn from an RNG seeded by (seed, s), so a resumed run sees exactly
the batches an uninterrupted one would have. Checkpoints (kvjax.io.checkpoint) are saved
every `checkpoint_every` steps and at the end; rerunning the same command resumes from
the latest one (a run killed at any point loses only the steps after its last checkpoint,
and their log rows are dropped, so every step is trained and logged exactly once). `log.jsonl` gets one row per log/eval point and `summary.json` the final
validation loss next to the validation unigram entropy (the bar a model must clear).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import config as config_lib
from kvjax import memory
from kvjax.config import Config, ModelConfig, jsonfile
from kvjax.errors import KvjaxError
from kvjax.io import checkpoint
from kvjax.lab import data
from kvjax.lab import claims
from kvjax.model import Transformer, init_params, trainable


def schedule(cfg: Config) -> optax.Schedule:
  t = cfg.train
  warmup = min(t.warmup, max(t.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(0.0, t.lr, warmup, max(t.steps, warmup + 1),
                                            end_value=t.lr * t.min_lr_ratio)


def optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW + clipping; one object per distinct schedule, so jit reuses the compiled step."""
  t = cfg.train
  return _optimizer(t.lr, t.min_lr_ratio, t.warmup, t.steps, t.weight_decay, t.b1, t.b2,
                    t.grad_clip)


@functools.lru_cache(maxsize=16)
def _optimizer(lr, min_lr_ratio, warmup, steps, weight_decay, b1, b2, grad_clip):
  t = config_lib.TrainConfig(lr=lr, min_lr_ratio=min_lr_ratio, warmup=warmup, steps=steps,
                             weight_decay=weight_decay, b1=b1, b2=b2, grad_clip=grad_clip)
  cfg = Config(train=t)
  decay_mask = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, _: getattr(path[-1], "key", "") in ("kernel", "embedding"), p)
  return optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(schedule(cfg), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                                 mask=decay_mask))


def loss_fn(params, model_cfg: ModelConfig, inputs_BT, targets_BT, mask_BT):
  """Masked mean next-token cross-entropy (nats) of the full forward pass."""
  B, T = inputs_BT.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits, _ = Transformer(trainable(model_cfg)).apply({"params": params}, inputs_BT, positions,
                                                      None)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets_BT)
  m = mask_BT.astype(jnp.float32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


@functools.partial(jax.jit, static_argnames=("model_cfg", "opt"),
                   donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, inputs, targets, mask, *, model_cfg: ModelConfig, opt):
  loss, grads = jax.value_and_grad(loss_fn)(params, model_cfg, inputs, targets, mask)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)


@functools.partial(jax.jit, static_argnames=("model_cfg",))
def eval_loss(params, inputs, targets, mask, *, model_cfg: ModelConfig):
  return loss_fn(params, model_cfg, inputs, targets, mask)


def validation_loss(cfg: Config, params, corpus: data.Corpus, n_windows: int | None = None,
                    seq_len: int | None = None) -> float:
  """Mean loss over fixed, evenly spaced validation windows (the same every call)."""
  t = cfg.train
  T = seq_len or t.seq_len
  n = n_windows or t.eval_batches * t.batch
  win = data.eval_windows(corpus.validation, n, T)
  losses = []
  for i in range(0, n, t.batch):
    w = win[i:i + t.batch]
    losses.append(float(eval_loss(params, w[:, :-1], w[:, 1:], np.ones_like(w[:, 1:], bool),
                                  model_cfg=cfg.model)) * len(w))
  return sum(losses) / n


def _check(cfg: Config) -> None:
  """Cross-field limits of training (each field's own range is checked by config.validate)."""
  t = cfg.train
  if t.seq_len > cfg.model.max_seq_len:
    raise KvjaxError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len="
                     f"{cfg.model.max_seq_len}; lower one or raise the other")
  if cfg.model.vocab_size < 257:
    raise KvjaxError("byte-level training needs model.vocab_size >= 257 (256 bytes + BOS)")
  if cfg.tokenizer not in ("bytes", "none", ""):
    raise KvjaxError(f"kvjax train feeds byte-level ids, but this model reads its own "
                     f"tokenizer ({cfg.tokenizer[:60]}): its ids would be wrong; train "
                     "byte-level models here, and convert real models with `kvjax convert`")


def _log(out_dir: Path, row: dict) -> None:
  with open(out_dir / "log.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")


def _trim_log(out_dir: Path, step: int) -> None:
  """On resume from `step`, drop log rows of later steps (and a torn last line): a killed
  run logged steps past its last checkpoint, which the resumed run trains and logs again."""
  path = out_dir / "log.jsonl"
  if not path.is_file():
    return
  keep = []
  for line in path.read_text().splitlines():
    try:
      row = jsonfile.loads(line)
    except jsonfile.JsonProblem:  # torn, or not strict JSON (deep nesting, a huge number)
      continue
    if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
      keep.append(line + "\n")
  tmp = path.with_suffix(".jsonl.tmp")
  tmp.write_text("".join(keep))
  os.replace(tmp, path)  # atomic: a kill here leaves the old log or the trimmed one


# Keys a resumed run may change: how long it runs and how often it reports/saves.
_RESUMABLE = {"train.steps", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
              "train.log_every", "name"}


def _check_resume(saved: Config, cfg: Config, out_dir: Path) -> None:
  """A resumed run must train the same model on the same recipe (else it is a new run)."""
  def flat(cfg: Config) -> dict:
    d = cfg.to_dict()
    return {"seed": d["seed"], **{f"{sec}.{k}": v for sec in ("model", "train")
                                  for k, v in d[sec].items()}}

  old, new = flat(saved), flat(cfg)
  diff = sorted(k for k in old if k not in _RESUMABLE and old[k] != new.get(k))
  if diff:
    raise KvjaxError(f"{out_dir} holds a run with a different {', '.join(diff[:4])}; "
                     "resume with the same config or train into a new --out")


def train(cfg: Config, out_dir: str | Path, params: Any = None, progress: bool = True) -> dict:
  """Train (or resume) `cfg` into `out_dir`; `params` seeds a fresh run (uptraining).
  One writer per folder: a second train (or convert) into `out_dir` while this one runs is
  a one-line KvjaxError (`claims.sole_writer`) instead of two runs racing in orbax."""
  _check(cfg)
  memory.check_training(cfg)  # on the host, before any weight is made (as generate's check)
  with claims.sole_writer(out_dir, "train"):
    return _train(cfg, Path(out_dir), params, progress)


def _train(cfg: Config, out_dir: Path, params: Any, progress: bool) -> dict:
  from tqdm import tqdm

  t = cfg.train
  corpus = data.load_corpus(t.data)
  opt = optimizer(cfg)
  start = 0
  last = checkpoint.latest_step(out_dir)
  if last is not None:  # resume: same config, params, optimizer state and step
    _check_resume(checkpoint.read_config(out_dir), cfg, out_dir)
    params_like = jax.eval_shape(lambda: init_params(cfg.model, cfg.seed))
    has_opt = (out_dir / "steps" / str(last) / "opt_state").is_dir()
    got = checkpoint.restore(out_dir, params_like,
                             jax.eval_shape(opt.init, params_like) if has_opt else None)
    params, start = got["params"], int(got["meta"]["step"])
    # a converted checkpoint holds weights only: its optimizer starts fresh
    opt_state = got["opt_state"] if has_opt else opt.init(params)
    _trim_log(out_dir, start)
  else:
    params = init_params(cfg.model, cfg.seed) if params is None else params
    params = jax.tree.map(jnp.array, params)  # own copies: the step donates them
    opt_state = opt.init(params)
  checkpoint.write_config(out_dir, cfg)

  t0 = time.perf_counter()
  tokens_seen, tick, tick_tokens = 0, time.perf_counter(), 0
  loss = float("nan")
  val = None
  bar = tqdm(range(start, t.steps), initial=start, total=t.steps, disable=not progress,
             desc=cfg.name or "train", dynamic_ncols=True)
  for step in bar:
    rng = np.random.default_rng([cfg.seed, step])
    inputs, targets, mask = data.training_batch(corpus, rng, t.batch, t.seq_len, t.recall_mix,
                                                t.recall_pairs, t.recall_pairs)
    params, opt_state, loss_a, gnorm = train_step(params, opt_state, inputs, targets, mask,
                                                  model_cfg=cfg.model, opt=opt)
    tick_tokens += inputs.size
    tokens_seen += inputs.size
    done = step + 1
    if done % t.log_every == 0 or done == t.steps:
      loss = float(loss_a)
      now = time.perf_counter()
      tps = tick_tokens / (now - tick)
      tick, tick_tokens = now, 0
      bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
      row = {"step": done, "loss": loss, "grad_norm": float(gnorm), "tokens_per_s": tps,
             "lr": float(schedule(cfg)(step)), "elapsed_s": now - t0}
      if done % t.eval_every == 0 or done == t.steps:
        val = validation_loss(cfg, params, corpus)
        row["val_loss"] = val
        bar.write(f"step {done}: loss {loss:.4f}  val_loss {val:.4f}  {tps:,.0f} tok/s")
      _log(out_dir, row)
    if done % t.checkpoint_every == 0 and done != t.steps:
      checkpoint.save(out_dir, cfg, params, done, opt_state)
  bar.close()
  if val is None:
    val = validation_loss(cfg, params, corpus)
  checkpoint.save(out_dir, cfg, params, t.steps, opt_state, meta={"val_loss": val})
  summary = {"steps": t.steps, "resumed_from": start, "train_loss": loss, "val_loss": val,
             "unigram_entropy": data.unigram_entropy(corpus.validation, cfg.model.vocab_size),
             "wall_s": time.perf_counter() - t0, "tokens": tokens_seen,
             "params": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
             "variant": cfg.model.variant, "data": t.data}
  (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
  summary["final_params"] = params
  return summary


def train_file(path: str, overrides: list[str] | None, out_dir: str) -> dict:
  cfg = config_lib.load(path, overrides)
  out = train(cfg, out_dir)
  print(f"{cfg.model.variant}: val_loss {out['val_loss']:.4f} nats "
        f"(unigram entropy {out['unigram_entropy']:.4f}) after {out['steps']} steps, "
        f"{out['wall_s']:.1f} s; checkpoint in {out_dir}")
  out.pop("final_params")
  return out
