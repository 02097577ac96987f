import pytest

from kvjax import config as config_lib
from kvjax.errors import KvjaxError


def test_yaml_and_set_overrides_coerce_types(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("model:\n  n_heads: 8\n  n_kv_heads: 8\ncache:\n  codec: bf16\n")
  cfg = config_lib.load(path, ["model.n_kv_heads=2", "model.norm_eps=1e-6", "seed=3",
                               "model.qkv_bias=true", "cache.layout=none"])
  assert (cfg.model.n_heads, cfg.model.n_kv_heads, cfg.seed) == (8, 2, 3)
  assert cfg.model.norm_eps == pytest.approx(1e-6) and cfg.model.qkv_bias is True
  assert (cfg.cache.k_codec, cfg.cache.v_codec, cfg.cache.layout) == ("bf16", "bf16", "none")
  assert cfg.model.variant == "GQA-2"


def test_codec_sets_both_and_separate_codecs_stay_separate():
  cfg = config_lib.load(None, {"cache.k_codec": "fp16", "cache.v_codec": "bf16"})
  assert (cfg.cache.k_codec, cfg.cache.v_codec) == ("fp16", "bf16")
  cfg = config_lib.replace(cfg, **{"cache.codec": "fp32"})
  assert (cfg.cache.k_codec, cfg.cache.v_codec) == ("fp32", "fp32")


def test_config_is_hashable_and_hash_is_stable():
  a = config_lib.load(None, ["model.n_kv_heads=1"])
  b = config_lib.load(None, {"model.n_kv_heads": 1})
  assert hash(a) == hash(b) and a.hash() == b.hash()
  assert a.hash() != config_lib.load(None).hash()


def test_grid_and_params_are_frozen_mappings(tmp_path):
  path = tmp_path / "g.yaml"
  path.write_text("experiment: latency\ngrid:\n  model.n_kv_heads: [4, 2, 1]\n"
                  "params:\n  contexts: [16, 32]\n")
  cfg = config_lib.load(path)
  assert dict(cfg.grid) == {"model.n_kv_heads": (4, 2, 1)}
  assert cfg.param("contexts") == (16, 32) and cfg.param("missing", 5) == 5
  assert cfg.to_dict()["grid"] == {"model.n_kv_heads": [4, 2, 1]}


@pytest.mark.parametrize("overrides, needle", [
    ({"model.n_kv_heads": 3}, "not divisible"),
    ({"model.head_dim": 7}, "odd"),
    ({"model.n_layers": 0}, "must be positive"),
    ({"cache.layout": "ring"}, "unknown cache.layout"),
    ({"cache.codec": "int9"}, "unknown codec"),
    ({"model.dtype": "float8"}, "unknown model.dtype"),
    ({"model.attention": "sparse"}, "unknown attention"),
    ({"model.nope": 1}, "unknown config key"),
    ({"model.n_heads": "four"}, "expects int"),
    ({"workload.top_p": 0.0}, "top_p"),
])
def test_bad_configs_raise_one_line_errors(overrides, needle):
  with pytest.raises(KvjaxError) as err:
    config_lib.load(None, overrides)
  assert needle in str(err.value) and "\n" not in str(err.value)


def test_malformed_and_missing_yaml(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("model: [1, 2\n")
  with pytest.raises(KvjaxError, match="malformed YAML"):
    config_lib.load(bad)
  with pytest.raises(KvjaxError, match="not found"):
    config_lib.load(tmp_path / "missing.yaml")
  bad.write_text("model: 3\n")
  with pytest.raises(KvjaxError, match="must be a mapping"):
    config_lib.load(bad)
