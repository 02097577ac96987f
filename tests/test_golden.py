"""Golden decode: greedy tokens and cache bytes of every attention variant, codec and layout
on a fixed seed, compared with `tests/golden/decode.json`. Written before a refactor, it
holds the refactor to "behaviour unchanged": the same tokens and the same bytes.

Regenerate only when a change is *meant* to alter them:
    KVJAX_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import json
import os
from pathlib import Path


from conftest import tiny_config, tiny_params
from kvjax.decode import generate

GOLDEN = Path(__file__).parent / "golden" / "decode.json"
PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32], [2, 7, 18, 28, 18]]

# name -> overrides; together they cover each variant, each codec, each layout and policy.
CASES = {
    "mha-fp32-none": {"model.n_kv_heads": 4, "cache.layout": "none"},
    "mha-int8": {"model.n_kv_heads": 4, "cache.codec": "int8"},
    "mqa-int4": {"model.n_kv_heads": 1, "cache.codec": "int4"},
    "gqa-fp32": {},
    "gqa-bf16": {"cache.codec": "bf16"},
    "gqa-fp16": {"cache.codec": "fp16"},
    "gqa-int8": {"cache.codec": "int8"},
    "gqa-int4-g8": {"cache.codec": "int4", "cache.group_size": 8},
    "gqa-int2": {"cache.codec": "int2"},
    "gqa-fp8_e4m3": {"cache.codec": "fp8_e4m3"},
    "gqa-fp8_e5m2": {"cache.codec": "fp8_e5m2"},
    "gqa-kivi4": {"cache.k_codec": "int4", "cache.v_codec": "int4", "cache.k_axis": "channel",
                  "cache.group_size": 4, "cache.residual": 8},
    "gqa-paged-bf16": {"cache.layout": "paged", "cache.codec": "bf16", "cache.page_size": 4},
    "gqa-paged-int4": {"cache.layout": "paged", "cache.codec": "int4", "cache.page_size": 4},
    "gqa-window": {"cache.policy": "window", "cache.budget": 8},
    "gqa-snapkv-int8": {"cache.policy": "snapkv", "cache.budget": 8, "cache.window": 4, "cache.codec": "int8"},
    "gqa-latent": {"cache.layout": "latent", "model.latent_rank": 8},
}


def run_case(overrides: dict) -> dict:
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.capacity": 32, **overrides})
  out = generate.generate(cfg, tiny_params(cfg), PROMPTS, 6, timed=False)
  return {"tokens": out["tokens"], "cache_bytes": out["cache_bytes"]}


def test_golden_decode():
  got = {name: run_case(over) for name, over in CASES.items()}
  if os.environ.get("KVJAX_UPDATE_GOLDEN"):
    GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
  want = json.loads(GOLDEN.read_text())
  assert sorted(got) == sorted(want)
  for name in CASES:
    assert got[name] == want[name], name
