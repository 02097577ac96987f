"""Distil a converted model's attention toward the original model's next-token distributions.

A conversion (pool, align, fit) changes each layer's K/V heads; `fit` matches each layer's
attention output on its own. Here the whole converted model (the student) is trained end to
end against the model it was converted from (the teacher), on calibration windows of
training text:

    loss = mean over tokens of KL(p_teacher || p_student)

where p are the two models' next-token distributions from the same full forward pass
(`kvjax.model.Transformer`). Only the attention projections are trained (the q/k/v/o
kernels and biases of every layer; a latent student's K/V kernel as its two factors and the
rotated key columns beside them, so it keeps its rank, and its up-projection is then the
orthonormal basis of what was trained); the embeddings, norms and MLPs stay as they are. The
KL is taken in float32 over CHUNK token rows at a time, each chunk's logits recomputed in
the backward pass (`jax.checkpoint`), so no [tokens, vocab] array of a whole batch is held;
the student's layers are recomputed there too (`Transformer(remat=True)`), so a long window
holds one layer's [T, T] attention at a time.

Adam with global-norm gradient clipping; the learning rate warms up linearly over the first
steps, then decays by a cosine to zero at the run's expected last step: `max_steps`, or
sooner where the time budget (`minutes`) ends first at the speed of the steps so far (the
first step of a call, its compile, not counted). The batch for step s is fixed by
(seed, s) (each epoch visits the windows in its own permutation), so a run ended by its
step count, resumed from its checkpoint, trains exactly as an uninterrupted one would. The
last tenth of the windows (at least one) is held out; its KL before and after is the report.

With `partial`, the trained weights (float32), the optimizer state and the step are saved
there every SAVE_EVERY steps and SAVE_SECONDS; a call with the same recipe resumes from
them, another recipe is refused. `cli` is `kvjax convert --method distill`.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.cache import latent as latent_cache
from kvjax.config import Config, ModelConfig
from kvjax.errors import KvjaxError
from kvjax.model import Transformer, trainable
from kvjax.model.layers import linear, lm_head

TRAINED = ("q_proj", "k_proj", "v_proj", "o_proj")
CHUNK = 256            # token rows per KL chunk: bounds the [rows, vocab] logits held at once
SAVE_EVERY, SAVE_SECONDS = 200, 120.0


@dataclass(frozen=True)
class DistillSettings:
  minutes: float = 30.0   # the whole run's time budget, resumed runs included
  max_steps: int = 2000
  lr: float = 1e-4        # Adam's peak learning rate
  batch: int = 2          # calibration windows per step
  warmup: int = 20        # steps of linear warm-up (at most a tenth of max_steps)
  clip: float = 1.0       # global gradient norm
  seed: int = 0

  def check(self) -> None:
    if not (self.minutes > 0 and np.isfinite(self.minutes)):
      raise KvjaxError(f"--minutes must be a positive number, got {self.minutes}")
    if self.batch < 1 or self.max_steps < 1 or not self.lr > 0 or not self.clip > 0:
      raise KvjaxError("distill settings need batch >= 1, max_steps >= 1, lr > 0 and clip > 0")

  def lr_at(self, step: int, total: int) -> float:
    """Step `step`'s learning rate in a run expected to end after `total` steps."""
    warm = max(1, min(self.warmup, total // 10))
    decay = 0.5 * (1.0 + math.cos(math.pi * min(step / max(total, 1), 1.0)))
    return self.lr * min(1.0, (step + 1) / warm) * decay


@dataclass
class Report:
  before: float     # held-out KL(teacher || student), nats per token, before the run
  after: float
  steps: int
  seconds: float    # training time, resumed runs included
  resumed_from: int


def check(student: ModelConfig, teacher: ModelConfig) -> None:
  """Student and teacher must differ in their KV heads (or cache form) alone."""
  keys = ("vocab_size", "n_layers", "d_model", "n_heads", "D")
  diff = [k for k in keys if getattr(student, k) != getattr(teacher, k)]
  if diff:
    raise KvjaxError(f"the student and the teacher differ in {', '.join(diff)}; distill a "
                     "conversion toward the model it was converted from (--teacher)")


def _hidden(cfg: ModelConfig, params, tokens_BT):
  """The final-normed residual stream [B, T, E]: the full forward, its lm_head left unused."""
  B, T = tokens_BT.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  _, state = Transformer(trainable(cfg), remat=True).apply(
      {"params": params}, tokens_BT, pos, None,
      capture_intermediates=lambda m, _: m.name == "norm", mutable=["intermediates"])
  return state["intermediates"]["norm"]["__call__"][0]


def _logprobs(cfg: ModelConfig, params, h_NE):
  dtype = jnp.dtype(cfg.dtype)
  if cfg.tie_embeddings:
    logits = lm_head(h_NE, params["embed_tokens"]["embedding"], dtype)
  else:
    logits = linear(h_NE, params["lm_head"], dtype)
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _kl_sum(cfg, params, h_s, tcfg, teacher, h_t):
  """Sum over token rows of KL(teacher || student), CHUNK rows at a time."""
  E = h_s.shape[-1]
  h_s, h_t = h_s.reshape(-1, E), h_t.reshape(-1, h_t.shape[-1])
  n = h_s.shape[0]
  pad = -n % CHUNK
  mask = jnp.arange(n + pad) < n
  h_s, h_t = (jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, CHUNK, h.shape[-1]) for h in (h_s, h_t))

  @jax.checkpoint
  def chunk(total, xs):
    hs, ht, m = xs
    lt = _logprobs(tcfg, teacher, ht)
    kl = jnp.sum(jnp.exp(lt) * (lt - _logprobs(cfg, params, hs)), axis=-1)
    return total + jnp.sum(jnp.where(m, kl, 0.0)), None

  total, _ = jax.lax.scan(chunk, jnp.float32(0.0), (h_s, h_t, mask.reshape(-1, CHUNK)))
  return total


def _theta(m: ModelConfig, params) -> dict:
  """The trained weights in float32: q/k/v/o of every layer; for a latent student, q and o,
  the K/V biases, and the K/V kernel as its factors (`latent`: down [L, E, A] and up
  [L, A, Y], with the rotated key columns [L, E, K, 2r] kept beside the latent), so it keeps
  its rank while it trains."""
  layers = params["layers"]
  f32 = lambda leaves: {leaf: jnp.array(a, jnp.float32) for leaf, a in leaves.items()}  # noqa
  if not m.latent_rank:
    return {n: f32(layers[n]) for n in TRAINED}
  theta = {n: f32(layers[n]) for n in ("q_proj", "o_proj")}
  theta.update({n: {"bias": jnp.array(layers[n]["bias"], jnp.float32)}
                for n in ("k_proj", "v_proj") if "bias" in layers[n]})
  W, w_rope, _ = latent_cache.split_kv(m, layers, params.get("rope_keep"))
  up = jnp.asarray(layers["latent_up"], jnp.float32)
  theta["latent"] = {"down": jnp.einsum("ley,lay->lea", W, up), "up": up,
                     **({"rope": w_rope} if m.rope_pairs else {})}
  return theta


def _merge(params, theta, m: ModelConfig):
  """params with the trained weights of `theta` in place (a latent's kernels from its
  factors)."""
  layers = dict(params["layers"])
  for name, leaves in theta.items():
    if name != "latent":
      layers[name] = {**layers[name], **leaves}
  if "latent" in theta:
    lat = theta["latent"]
    W = jnp.einsum("lea,lay->ley", lat["down"], lat["up"])
    cols = latent_cache.columns(params, m) if m.rope_pairs else None
    Wk, Wv = latent_cache.join_kv(m, W, lat.get("rope"), cols)
    layers["k_proj"] = {**layers["k_proj"], "kernel": Wk}
    layers["v_proj"] = {**layers["v_proj"], "kernel": Wv}
  return {**params, "layers": layers}


def _stored(m: ModelConfig, params, theta) -> Any:
  """The student after training, in its params' dtypes; a latent's up-projection the
  orthonormal rows its trained K/V kernel spans (so its cache stays exact)."""
  merged = _merge(params, theta, m)
  layers = dict(jax.tree.map(lambda a, ref: jnp.asarray(a, ref.dtype), merged["layers"],
                             params["layers"]))
  if m.latent_rank:
    W = np.einsum("lea,lay->ley", np.asarray(theta["latent"]["down"], np.float64),
                  np.asarray(theta["latent"]["up"], np.float64))
    up = np.stack([np.linalg.svd(w, full_matrices=False)[2][:m.latent_rank] for w in W])
    layers["latent_up"] = jnp.asarray(up, params["layers"]["latent_up"].dtype)
  return {**merged, "layers": layers}


@functools.lru_cache(maxsize=4)
def _fns(cfg: ModelConfig, tcfg: ModelConfig, clip: float):
  opt = optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam())

  def kl(theta, frozen, teacher, tokens_BT):
    params = _merge(frozen, theta, cfg)
    h_t = jax.lax.stop_gradient(_hidden(tcfg, teacher, tokens_BT))
    h_s = _hidden(cfg, params, tokens_BT)
    return _kl_sum(cfg, params, h_s, tcfg, teacher, h_t) / tokens_BT.size

  def step(theta, opt_state, frozen, teacher, tokens_BT, lr):
    loss, g = jax.value_and_grad(kl)(theta, frozen, teacher, tokens_BT)
    upd, opt_state = opt.update(g, opt_state, theta)
    return jax.tree.map(lambda p, u: p - lr * u, theta, upd), opt_state, loss

  return opt, jax.jit(step, donate_argnums=(0, 1)), jax.jit(kl)


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


def batch_rows(seed: int, step: int, batch: int, n: int) -> np.ndarray:
  """The training windows of step `step`: positions step*batch.. of the epochs' permutations."""
  return np.array([_permutation(seed, k // n, n)[k % n]
                   for k in range(step * batch, (step + 1) * batch)])


def held_kl(kl_fn, theta, frozen, teacher, tokens_NS) -> float:
  return float(np.mean([float(kl_fn(theta, frozen, teacher, jnp.asarray(w[None])))
                        for w in tokens_NS]))


def distill(cfg: Config, params: Any, teacher_cfg: Config, teacher: Any, tokens_NS: np.ndarray,
            s: DistillSettings = DistillSettings(), partial: str | Path | None = None, recipe: dict | None = None,
            on_step: Callable[[int, float], None] | None = None) -> tuple[Any, Report]:
  """The student's params with their attention trained toward the teacher; `on_step(step,
  loss)` after each Adam step. With `partial`, saves there as it goes and resumes from it."""
  from tqdm import tqdm

  from kvjax.io import checkpoint

  s.check()
  check(cfg.model, teacher_cfg.model)
  if tokens_NS.ndim != 2 or len(tokens_NS) < 2:
    raise KvjaxError("distilling needs at least two calibration windows; raise --calib-tokens")
  held = max(1, len(tokens_NS) // 10)
  train, test = tokens_NS[:-held], tokens_NS[-held:]
  opt, step_fn, kl_fn = _fns(cfg.model, teacher_cfg.model, float(s.clip))
  theta = _theta(cfg.model, params)
  opt_state, start, spent = opt.init(theta), 0, 0.0
  before = None
  if partial is not None and checkpoint.latest_step(partial) is not None:
    meta = checkpoint.read_meta(partial)
    if meta.get("recipe") != recipe:
      raise KvjaxError(f"{partial} holds a partial distillation with another recipe "
                       f"({meta.get('recipe')}); delete it or choose a new --out folder")
    got = checkpoint.restore(partial, jax.eval_shape(lambda: theta),
                             jax.eval_shape(opt.init, theta))
    theta, opt_state = got["params"], got["opt_state"]
    start, spent, before = int(meta["step"]), float(meta["seconds"]), float(meta["before"])
    print(f"resuming the distillation after step {start} of at most {s.max_steps}")
  if before is None:
    before = held_kl(kl_fn, theta, params, teacher, test)

  def save(step, seconds):
    checkpoint.save(partial, cfg, theta, step, opt_state,
                    meta={"recipe": recipe, "seconds": seconds, "before": before})

  budget = 60.0 * s.minutes
  t0 = last_save = time.perf_counter()
  bar = tqdm(total=s.max_steps, initial=start, desc="distill", unit="step", dynamic_ncols=True)
  step, timed = start, None  # timed: (clock, step) after this call's first step (its compile)
  try:
    while step < s.max_steps and spent + time.perf_counter() - t0 < budget:
      now, total = time.perf_counter(), s.max_steps
      if timed is not None and step > timed[1]:
        per_step = (now - timed[0]) / (step - timed[1])
        total = min(total, step + int((budget - spent - (now - t0)) / per_step) + 1)
      lr = s.lr_at(step, total)
      rows = batch_rows(s.seed, step, s.batch, len(train))
      theta, opt_state, loss = step_fn(theta, opt_state, params, teacher,
                                       jnp.asarray(train[rows]), jnp.float32(lr))
      step += 1
      value = float(loss)
      bar.update(1)
      bar.set_postfix(kl=f"{value:.4f}", refresh=False)
      if on_step is not None:
        on_step(step, value)
      now = time.perf_counter()
      timed = timed or (now, step)
      if partial is not None and step < s.max_steps and (
          step % SAVE_EVERY == 0 or now - last_save >= SAVE_SECONDS):
        save(step, spent + now - t0)
        last_save = time.perf_counter()
  finally:
    bar.close()
  seconds = spent + time.perf_counter() - t0
  after = held_kl(kl_fn, theta, params, teacher, test)
  return _stored(cfg.model, params, theta), Report(before, after, step, seconds, start)


def cli(args, src, windows: Callable, seq_len: int) -> dict:
  """`kvjax convert --checkpoint DIR --method distill [--teacher SOURCE] --out OUT`: the
  converted checkpoint DIR distilled toward SOURCE (default: the model DIR was converted
  from, as its meta records), into OUT (resuming OUT/partial). `windows(tok, text, tokens,
  seq_len)` and `seq_len` (at most) are `kvjax.lab.convert.cli`'s calibration windows, passed in
  by it (it imports this module)."""
  from kvjax import config as config_lib
  from kvjax.io import checkpoint, sources
  from kvjax.lab import claims

  if getattr(args, "latent_rank", None) is not None:
    raise KvjaxError("--method distill trains a converted model's attention; it takes no "
                     "--latent-rank")
  s = DistillSettings(minutes=float(args.minutes), max_steps=int(args.steps),
               lr=getattr(args, "lr", None) or DistillSettings.lr)
  s.check()
  overrides = config_lib.parse_set(getattr(args, "set", None))
  meta = checkpoint.read_meta(src.ref) if src.kind == "checkpoint" else {}
  teacher = getattr(args, "teacher", None) or meta.get("converted_from")
  if not teacher:
    raise KvjaxError(f"{src} records no model it was converted from; distill a converted "
                     "checkpoint (kvjax convert --out DIR), or name the teacher: --teacher SOURCE")
  tsrc = sources.parse(teacher)
  cfg0, tcfg0 = sources.load_config(src, overrides), sources.load_config(tsrc, overrides)
  check(cfg0.model, tcfg0.model)
  from kvjax.lab.convert import judge
  judge.check(args, cfg0)
  if args.kv_heads is not None and args.kv_heads != cfg0.model.n_kv_heads:
    raise KvjaxError(f"--method distill keeps the student's {cfg0.model.n_kv_heads} KV heads; "
                     f"drop --kv-heads {args.kv_heads} (convert to it first)")
  recipe = {"method": "distill", "source": str(src), "teacher": str(tsrc), "calib": args.calib,
            "calib_tokens": int(args.calib_tokens),
            "calib_seq_len": min(seq_len, cfg0.model.max_seq_len, tcfg0.model.max_seq_len),
            "minutes": s.minutes, "steps": s.max_steps, "lr": s.lr, "batch": s.batch,
            "student_recipe": meta.get("recipe", meta.get("method"))}
  out = Path(args.out)
  with claims.sole_writer(out, "convert"):
    if checkpoint.latest_step(out) is not None:
      raise KvjaxError(f"{out} already holds a checkpoint; choose a new --out folder")
    cfg, params, tok = sources.load(src, overrides)
    if tok is None:
      raise KvjaxError(f"distillation calibrates on text, and {src} has no tokenizer; distill "
                       "a checkpoint converted from a GGUF or HF model")
    tcfg, tparams, _ = sources.load(tsrc, overrides)
    tokens = windows(tok, recipe["calib"], recipe["calib_tokens"], recipe["calib_seq_len"])
    new_params, r = distill(cfg, params, tcfg, tparams, tokens, s, out / "partial", recipe)
    report = {"held_kl_before": round(r.before, 6), "held_kl_after": round(r.after, 6),
              "steps": r.steps, "seconds": round(r.seconds, 1)}
    from kvjax.lab.convert import judge
    retrieval = judge.for_cli(args, cfg, new_params, tok)
    if retrieval is not None:
      report["retrieval"] = retrieval
    checkpoint.save(out, cfg, new_params, step=0, meta={"converted_from": str(tsrc),
                                                        "method": "distill", "recipe": recipe,
                                                        **report})
    shutil.rmtree(out / "partial", ignore_errors=True)
  m = cfg.model
  student = m.variant if not m.latent_rank else f"the rank-{m.latent_rank} latent" + (
      f" with {m.rope_pairs} rotated pairs a KV head" if m.rope_pairs else "")
  print(f"distilled {student} toward {tsrc}: held-out KL {r.before:.4f} -> "
        f"{r.after:.4f} nats/token in {r.steps} steps ({r.seconds:.0f} s); checkpoint in {out}")
  return {"from": cfg.model.variant, "to": cfg.model.variant, "out": str(out),
          "method": "distill", "recipe": recipe, **report}
