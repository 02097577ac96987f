"""Configuration: frozen dataclasses, YAML loading, dotted overrides, host-side validation.

Every setting that changes a compiled shape or a code path lives here, so a config is
hashable and can be passed to `jax.jit` as a static argument. Shape letters used across
kvjax: B batch, T new tokens, S cache capacity, L layers, H query heads, K kv heads,
G = H // K query heads per kv head, D head_dim, E d_model, F d_ff, V vocab.

This package face re-exports the public names of its modules: `schema` (the dataclasses
and their keys), `loader` (YAML, `--set`, overrides, packaged shapes) and `checks` (ranges
and validation).
"""

from kvjax.config.checks import check_number, validate
from kvjax.config.loader import (SHAPES_DIR, apply_overrides, expand_codec, flat, from_dict,
                                 load, parse_set, replace, resolve, shape_names, shape_path)
from kvjax.config.schema import (DTYPES, SECTIONS, CacheConfig, Config, MeshConfig, ModelConfig,
                                 TrainConfig, WorkloadConfig, field_type, known_keys)

__all__ = ["DTYPES", "SECTIONS", "SHAPES_DIR", "CacheConfig", "Config", "MeshConfig",
           "ModelConfig", "TrainConfig", "WorkloadConfig", "apply_overrides", "check_number",
           "expand_codec", "field_type", "flat", "from_dict", "known_keys", "load", "parse_set",
           "replace", "resolve", "shape_names", "shape_path", "validate"]
