"""Every registry at once: the attention variants, cache layouts, codecs and policies.

Importing this module imports those four packages, each of which fills its registry from
its own folder (`kvjax.plugins`) and adds its config check to `config.validate` (the names
it knows and each variant's own limits; the config, the ground floor, imports none of
them). So every entry point that builds a config from user input (the CLI's commands, the
Python API, `kvjax run`'s grid, the model sources) imports this module first, and a bad
name is one line before any weight loads. `names` lists what a registry holds, for help
texts and comparisons, so a variant added as one module is listed with no other edit.
"""

from __future__ import annotations

from kvjax import attention, cache, codecs, policies

__all__ = ["attention", "cache", "codecs", "policies", "names"]


def names(kind: str) -> list[str]:
  """Registered names of `kind` (`codec`, `layout`, `attention` or `policy`), in
  registration order; layouts only those a user chooses (`cache.layout`), not the ones a
  policy builds (`internal`)."""
  if kind == "codec":
    return list(codecs.CODECS)
  if kind == "layout":
    return [n for n, lay in cache.LAYOUTS.items() if not getattr(lay, "internal", False)]
  if kind == "attention":
    return attention.names()
  if kind == "policy":
    return list(policies.POLICIES)
  raise ValueError(f"no registry of {kind!r}")
