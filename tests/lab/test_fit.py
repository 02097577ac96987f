"""kvjax.lab.convert.fit: fitting a pooled model's q/k/v layer by layer brings its attention, and
so its logits, closer to the original's; the budget and inputs are checked on the host."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax.errors import KvjaxError
from kvjax.lab import convert
from kvjax.lab.convert import align, fit
from kvjax.model import Transformer

CALIB = np.random.default_rng(0).integers(0, 64, size=(40, 24)).astype(np.int32)
HELD = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(2, 24)), jnp.int32)


def _logits(cfg, params):
  pos = jnp.broadcast_to(jnp.arange(HELD.shape[1]), HELD.shape)
  return np.asarray(Transformer(cfg.model).apply({"params": params}, HELD, pos)[0])


@pytest.mark.parametrize("inputs", fit.INPUTS)
def test_fit_lowers_every_layers_error_and_the_logits_error(inputs):
  cfg = tiny_config(**{"model.n_kv_heads": 4, "model.qkv_bias": True, "seed": 9})
  params = tiny_params(cfg)
  mqa_cfg, pooled = convert.mean_pool(cfg, align.align(cfg, params, 1, CALIB), 1)
  settings = fit.FitSettings(minutes=60, max_steps=60, lr=3e-3, batch=8, inputs=inputs)
  seen = []
  fitted, reports = fit.fit(mqa_cfg, pooled, cfg, params, CALIB, settings,
                            on_layer=lambda layer, p, r: seen.append(layer))
  assert seen == [0, 1] and [r.steps for r in reports] == [60, 60]
  for r in reports:
    assert r.after < 0.8 * r.before, r
  want = _logits(cfg, params)
  err = lambda p: np.abs(_logits(mqa_cfg, p) - want).mean()  # noqa: E731
  assert err(fitted) < 0.9 * err(pooled)
  untouched = ("o_proj", "gate_proj", "up_proj", "down_proj")
  for name in untouched:
    np.testing.assert_array_equal(fitted["layers"][name]["kernel"], pooled["layers"][name]["kernel"])


def test_a_resumed_fit_leaves_the_layers_before_it_alone():
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 9})
  params = tiny_params(cfg)
  mqa_cfg, pooled = convert.mean_pool(cfg, params, 1)
  settings = fit.FitSettings(minutes=60, max_steps=5, lr=3e-3)
  fitted, reports = fit.fit(mqa_cfg, pooled, cfg, params, CALIB, settings, start_layer=1)
  assert [r.layer for r in reports] == [1]
  np.testing.assert_array_equal(fitted["layers"]["k_proj"]["kernel"][0],
                                pooled["layers"]["k_proj"]["kernel"][0])
  assert np.abs(np.asarray(fitted["layers"]["k_proj"]["kernel"][1])
                - np.asarray(pooled["layers"]["k_proj"]["kernel"][1])).max() > 0


@pytest.mark.parametrize("settings, says", [
    (fit.FitSettings(minutes=float("nan")), "--minutes"),
    (fit.FitSettings(minutes=-1), "--minutes"),
    (fit.FitSettings(inputs="mixed"), "converted, original"),
    (fit.FitSettings(batch=0), "batch"),
])
def test_impossible_settings_are_one_line(settings, says):
  with pytest.raises(KvjaxError) as e:
    settings.check()
  assert says in str(e.value) and "\n" not in str(e.value)


def test_a_model_that_is_not_the_source_is_refused():
  cfg = tiny_config(**{"model.n_kv_heads": 2})
  other = tiny_config(**{"model.n_kv_heads": 1, "model.n_layers": 1})
  with pytest.raises(KvjaxError, match="converted from"):
    fit.fit(other, tiny_params(other), cfg, tiny_params(cfg), CALIB)


def test_a_fit_that_does_not_help_a_layer_keeps_it_as_it_was():
  """An absurd learning rate wrecks every layer on the fitted windows; the held-out windows
  see it, and each layer is kept as the pooled model had it."""
  cfg = tiny_config(**{"model.n_kv_heads": 2, "seed": 9})
  params = tiny_params(cfg)
  mqa_cfg, pooled = convert.mean_pool(cfg, params, 1)
  settings = fit.FitSettings(minutes=60, max_steps=4, lr=5.0)
  fitted, reports = fit.fit(mqa_cfg, pooled, cfg, params, CALIB, settings)
  assert all(r.kept and r.after == r.before for r in reports), reports
  for name in fit.FITTED:
    np.testing.assert_array_equal(fitted["layers"][name]["kernel"], pooled["layers"][name]["kernel"])
