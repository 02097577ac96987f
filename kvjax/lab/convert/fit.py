"""Fit a converted model's merged projections, layer by layer, to the original's attention.

After pooling, layer l's attention (its q, k and v projections; W_q costs no cache bytes)
is fitted by Adam to the original layer's attention on the same inputs:

    loss_l = |attn_c(x) - attn_o(x)|^2 / |attn_o(x)|^2

With `inputs="converted"` (the default) x is the converted model's own stream entering
layer l, already carrying the error of the layers before it, so each layer is fitted on
the inputs it will see; `inputs="original"` fits every layer on the original model's
stream (the layers are then independent of each other).

The time budget is shared out as the layers go: each layer gets the time left over the
layers left, its step count fixed after timing its first step, with a cosine decay of the
learning rate over those steps. A tenth of the sequences (at least one) is held out of the
fit and the relative error on it, before and after, is what each layer reports; a layer
whose held-out error the fit did not lower is kept as it was (`kept` in its report).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.config import Config, ModelConfig
from kvjax.errors import KvjaxError
from kvjax.lab.convert import layerwise

FITTED = ("q_proj", "k_proj", "v_proj")
INPUTS = ("converted", "original")


@dataclass(frozen=True)
class Dense:
  """What a fit trains in a layer: the q/k/v projections as they are (`theta`), and the
  layer weights they make (`weights`, whole sub-trees of the layer's params)."""

  def theta(self, p: dict) -> dict:
    return {n: {leaf: jnp.asarray(a, jnp.float32) for leaf, a in p[n].items()} for n in FITTED}

  def weights(self, theta: dict, p: dict) -> dict:
    return theta

  def store(self, params: Any, layer: int, theta: dict) -> Any:
    return layerwise.set_layer(params, layer, theta)


@dataclass(frozen=True)
class FitSettings:
  minutes: float = 30.0     # the whole fit's time budget
  lr: float = 3e-3          # Adam's peak learning rate (cosine decay to 0 per layer)
  batch: int = 4            # calibration sequences per step
  max_steps: int = 2000     # per layer, whatever the budget
  inputs: str = "converted"
  seed: int = 0

  def check(self) -> None:
    if not (self.minutes > 0 and np.isfinite(self.minutes)):
      raise KvjaxError(f"--minutes must be a positive number, got {self.minutes}")
    if self.inputs not in INPUTS:
      raise KvjaxError(f"fit inputs '{self.inputs}' unknown; use one of {', '.join(INPUTS)}")
    if self.batch < 1 or self.max_steps < 1 or not self.lr > 0:
      raise KvjaxError("fit settings need batch >= 1, max_steps >= 1 and lr > 0")


@dataclass
class LayerReport:
  layer: int
  before: float   # held-out relative error of the pooled (unfitted) layer
  after: float    # and after the fit
  steps: int
  seconds: float
  kept: bool = False  # the fit did not lower the held-out error: the layer is as it was


@functools.lru_cache(maxsize=4)
def _step_fns(cfg: ModelConfig, parts=Dense()):
  def loss(theta, p, x, target, scale, layer):
    o = layerwise.attention_out(cfg, {**p, **parts.weights(theta, p)}, x, layer)
    return jnp.mean(jnp.sum((o - target) ** 2, axis=-1)) / scale

  grad = jax.jit(jax.value_and_grad(loss))
  return jax.jit(loss), grad


def _rel_error(cfg, parts, p, x, target, scale, layer) -> float:
  loss, _ = _step_fns(cfg, parts)
  errs = [float(loss(parts.theta(p), p, jnp.asarray(x[i:i + layerwise.CHUNK]),
                     jnp.asarray(target[i:i + layerwise.CHUNK]), scale, layer))
          * len(x[i:i + layerwise.CHUNK]) for i in range(0, len(x), layerwise.CHUNK)]
  return sum(errs) / len(x)


def _fit_layer(cfg: ModelConfig, parts, p: dict, x_NSE, target_NSE, scale, layer: int,
               seconds: float, s: FitSettings, rng: np.random.Generator,
               on_step: Callable[[float], None]) -> tuple[dict, int]:
  """Adam on layer `layer`'s `parts` within `seconds`; returns them and the steps."""
  _, grad = _step_fns(cfg, parts)
  theta, fixed = parts.theta(p), p
  n = len(x_NSE)

  def batch():
    idx = rng.choice(n, size=min(s.batch, n), replace=False)
    return jnp.asarray(x_NSE[idx]), jnp.asarray(target_NSE[idx])

  t0 = time.perf_counter()
  grad(theta, fixed, *batch(), scale, layer)[0].block_until_ready()  # compile, once per shape
  t1 = time.perf_counter()
  grad(theta, fixed, *batch(), scale, layer)[0].block_until_ready()
  per_step = time.perf_counter() - t1
  steps = int(max(1, min(s.max_steps, (seconds - (time.perf_counter() - t0)) // max(per_step, 1e-6))))
  opt = optax.adam(optax.cosine_decay_schedule(s.lr, steps))
  state = opt.init(theta)

  @jax.jit
  def update(theta, state, g):
    upd, state = opt.update(g, state, theta)
    return optax.apply_updates(theta, upd), state

  for _ in range(steps):
    value, g = grad(theta, fixed, *batch(), scale, layer)
    theta, state = update(theta, state, g)
    on_step(float(value))
  return theta, steps


def fit(cfg: Config, params: Any, original_cfg: Config, original: Any, tokens_NS: np.ndarray,
        s: FitSettings = FitSettings(), start_layer: int = 0,
        on_layer: Callable[[int, Any, LayerReport], None] | None = None,
        on_step: Callable[[int, float], None] | None = None,
        parts=Dense()) -> tuple[Any, list[LayerReport]]:
  """params (the converted model's) with every layer from `start_layer` on fitted; layers
  before it are taken as already fitted (a resumed run). `on_layer(layer, params, report)`
  is called after each layer (the CLI checkpoints there); `on_step(layer, loss)` after each
  Adam step. `parts` says what is trained and how it makes the layer's weights (`Dense`:
  the q/k/v projections; `kvjax.lab.convert.latent.Factored`: q and a rank-A K/V)."""
  s.check()
  m, mo = cfg.model, original_cfg.model
  if (m.n_layers, m.d_model, m.n_heads, m.D) != (mo.n_layers, mo.d_model, mo.n_heads, mo.D):
    raise KvjaxError("the converted model and the original differ in more than their KV "
                     "heads; fit a conversion against the model it was converted from")
  if tokens_NS.ndim != 2 or len(tokens_NS) < 2:
    raise KvjaxError("fitting needs at least two calibration sequences; raise --calib-tokens")
  held = max(1, len(tokens_NS) // 10)
  rng = np.random.default_rng(s.seed)
  x_c = layerwise.embed(m, params, tokens_NS)
  deadline = time.perf_counter() + 60.0 * s.minutes
  reports: list[LayerReport] = []
  for layer in range(m.n_layers):
    if layer >= start_layer:
      t0 = time.perf_counter()
      target = layerwise.attend(mo, original, layer, x_c)  # the original layer on x_c
      scale = jnp.float32(np.mean(np.sum(target.astype(np.float64) ** 2, axis=-1)) + 1e-12)
      p = layerwise.layer_params(params, layer)
      lj = jnp.int32(layer)
      before = _rel_error(m, parts, p, x_c[-held:], target[-held:], scale, lj)
      left = max(deadline - time.perf_counter(), 0.0) / (m.n_layers - layer)
      theta, steps = _fit_layer(m, parts, p, x_c[:-held], target[:-held], scale, lj, left, s, rng,
                                lambda v, layer=layer: on_step and on_step(layer, v))
      fitted = parts.store(params, layer, theta)
      after = _rel_error(m, parts, layerwise.layer_params(fitted, layer), x_c[-held:],
                         target[-held:], scale, lj)
      if after < before:  # else the held-out windows say the fit overfitted: keep the layer
        params = fitted
      after = min(after, before)
      report = LayerReport(layer, before, after, steps, time.perf_counter() - t0,
                           kept=params is not fitted)
      reports.append(report)
      if on_layer is not None:
        on_layer(layer, params, report)
    if s.inputs == "original":  # x_c is the original stream: its attention is the target
      x_c = layerwise.advance(mo, original, layer, x_c, target if layer >= start_layer else None)
    else:
      x_c = layerwise.advance(m, params, layer, x_c)
  return params, reports
