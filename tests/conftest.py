"""Shared fixtures: tiny configs and parameters, built once per session."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from kvjax import config as config_lib  # noqa: E402
from kvjax import model  # noqa: E402

TINY = {"model.vocab_size": 64, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
        "model.n_kv_heads": 4, "model.d_ff": 48}
KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}


def tiny_config(**overrides) -> config_lib.Config:
  return config_lib.apply_overrides(config_lib.Config(), {**TINY, **overrides})


_PARAMS = {}


def tiny_params(cfg: config_lib.Config):
  """Parameters cached per model shape: tests share them instead of re-initialising."""
  key = (cfg.model, cfg.seed)
  if key not in _PARAMS:
    _PARAMS[key] = model.init_params(cfg.model, cfg.seed)
  return _PARAMS[key]


@pytest.fixture(params=sorted(KV_HEADS), ids=lambda v: v)
def variant_cfg(request):
  """The tiny model as MHA, GQA and MQA (fp32 cache)."""
  return tiny_config(**{"model.n_kv_heads": KV_HEADS[request.param]})
