"""Token eviction policies (`cache.policy`): which prompt tokens a cache keeps.

The registry, the `Policy` contract and the budget rules are in `base`; every module of this
folder is imported here and registers its policy (see `base` for the table of policies).
"""

from kvjax import config as config_lib
from kvjax import plugins
from kvjax.policies.base import (KEEP, POLICIES, Context, Policy, budgets,  # noqa: F401
                                 check_config, check_lengths, effective_budget, get, held,
                                 register, static_budget, top_positions)

plugins.import_all(__name__, __path__)


def check(cache_cfg, model_cfg) -> None:
  """The policy registry's config checks (`config.validate`)."""
  check_config(cache_cfg, model_cfg)


config_lib.add_check(check)  # config.validate runs it (the config imports no registry)
