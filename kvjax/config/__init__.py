"""Configuration: frozen dataclasses, YAML loading, dotted overrides, host-side validation.

Every setting that changes a compiled shape or a code path lives here, so a config is
hashable and can be passed to `jax.jit` as a static argument. Shape letters, one meaning
each across kvjax (the glossary, with the naming rules, is in docs/architecture.md):
B batch, T tokens this call, S cache slots, L layers, H query heads, K KV heads, G = H / K,
D head_dim, E d_model, V vocab, N decode steps, M teacher-forced tokens, C tokens per
attention read block, J codec blocks, R residual-window slots, O tokens leaving the window,
Q pages per sequence, A latent rank, Y latent's K/V columns (2·K·D less rope columns),
W window, X codec storage width, Z Pallas splits, I a call's own keys (the 23 letters
names use; a test keeps the two lists equal).

This package face re-exports the public names of its modules: `schema` (the dataclasses
and their keys), `loader` (YAML, `--set`, overrides, packaged shapes), `checks` (ranges
and validation, with the checks each registry adds: `add_check`) and `yamlfile` (strict
YAML: duplicate keys, alias cycles, non-UTF-8 refused). It imports no other kvjax module.
"""

from kvjax.config.checks import add_check, check_number, range_of, validate
from kvjax.config.yamlfile import read as read_yaml
from kvjax.config.loader import (SHAPES_DIR, apply_overrides, expand_codec, flat, from_dict,
                                 load, parse_set, replace, resolve, shape_names, shape_path)
from kvjax.config.schema import (DTYPES, SECTIONS, CacheConfig, Config, MeshConfig, ModelConfig,
                                 TrainConfig, WorkloadConfig, field_type, known_keys)

__all__ = ["DTYPES", "SECTIONS", "SHAPES_DIR", "CacheConfig", "Config", "MeshConfig",
           "ModelConfig", "TrainConfig", "WorkloadConfig", "add_check", "apply_overrides",
           "check_number", "expand_codec", "field_type", "flat", "from_dict", "known_keys",
           "load", "parse_set", "range_of", "read_yaml", "replace", "resolve", "shape_names",
           "shape_path", "validate"]
