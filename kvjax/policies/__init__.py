"""Token eviction policies (`cache.policy`): which tokens a cache keeps, at prefill and
during decode.

The registry and the `Policy` contract (prefill selection, decode rule, the `Slots` a
compacted layout lends it) are in `base`, the budgets and their checks in `budget`, the
shared decode rules in `window` (ring) and `replace` (score-and-replace); every module of
this folder is imported here, and each policy's module registers it (see `base` for the
table of policies).
"""

from kvjax import config as config_lib
from kvjax import plugins
from kvjax.errors import KvjaxError
from kvjax.policies.base import (FULL, KEEP, POLICIES, Context, Policy, Slots,  # noqa: F401
                                 effective_budget, evicts, get, held, register, static_budget,
                                 top_positions)
from kvjax.policies.token_budget import (budgets, capacity, check_config,  # noqa: F401
                                   check_lengths, held_tokens)

plugins.import_all(__name__, __path__)


def check(cache_cfg, model_cfg) -> None:
  """The policy registry's config checks (`config.validate`)."""
  check_config(cache_cfg, model_cfg)
  if evicts(cache_cfg) and model_cfg.windowed:  # it evicts on the full-attention layers
    if not any(model_cfg.window_of(i) == 0 for i in range(model_cfg.n_layers)):
      raise KvjaxError(f"cache.policy={cache_cfg.policy} evicts on a model's full-attention "
                       "layers, and every layer here is windowed (model.sliding_window with "
                       "model.global_every=0); set cache.policy=full, or model.global_every")
    if cache_cfg.layout == "paged":
      raise KvjaxError(f"cache.policy={cache_cfg.policy} on a model with sliding-window layers "
                       "needs their rings, which the paged layout does not keep; use "
                       "cache.layout=contiguous, or model.sliding_window=0")


config_lib.add_check(check)  # config.validate runs it (the config imports no registry)
