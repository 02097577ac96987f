import pytest

from kvjax import config as config_lib
from kvjax import registries  # noqa: F401  (the registries add their name checks to validate)
from kvjax.config import checks as config_checks
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
    ({"model.n_layers": 0}, "model.n_layers must be an integer > 0, got 0"),
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


# Every numeric key with a value outside its range (or not finite): one line naming the key
# and the value. NaN / inf / 0 where a positive float is needed used to run and emit token 0.
@pytest.mark.parametrize("key, value", [
    ("model.norm_eps", float("nan")), ("model.norm_eps", 0.0), ("model.norm_eps", -1e-5),
    ("model.rope_theta", float("inf")), ("model.rope_theta", 0.0), ("model.rope_theta", -1.0),
    ("model.d_model", -64), ("model.n_heads", 0), ("model.n_kv_heads", -1),
    ("model.vocab_size", 0), ("model.max_seq_len", 0), ("model.head_dim", -2),
    ("model.d_ff", -8), ("model.scan_unroll", 0),
    ("cache.capacity", -1), ("cache.residual", -4), ("cache.page_size", 0),
    ("cache.group_size", -8), ("cache.num_pages", -1),
    ("workload.temperature", float("nan")), ("workload.temperature", -0.5),
    ("workload.temperature", float("inf")), ("workload.top_p", 1.5),
    ("workload.top_p", float("nan")), ("workload.top_k", -1), ("workload.eos_id", -2),
    ("workload.batch", 0), ("workload.repeats", 0), ("workload.gen_len", -1),
    ("mesh.data", 0), ("mesh.model", -2), ("seed", -1),
    ("train.lr", float("nan")), ("train.lr", 0.0), ("train.b1", 1.0), ("train.b2", -0.1),
    ("train.grad_clip", 0.0), ("train.recall_mix", 1.5), ("train.min_lr_ratio", 2.0),
    ("train.steps", 0), ("train.weight_decay", float("-inf")), ("train.warmup", -1),
])
def test_every_numeric_key_is_range_checked(key, value):
  with pytest.raises(KvjaxError) as err:
    config_lib.load(None, {key: value})
  msg = str(err.value)
  assert msg.startswith(f"{key} must be") and repr(value) in msg and "\n" not in msg


@pytest.mark.parametrize("raw", ["nan", ".nan", "inf", "-inf", "0", "-1e-5"])
def test_norm_eps_from_set_strings_is_refused(raw):
  with pytest.raises(KvjaxError, match=r"model.norm_eps must be a finite number in \[1.1754944e-38, 1\]"):
    config_lib.load(None, [f"model.norm_eps={raw}"])


def test_integer_keys_refuse_fractions_and_bools():
  with pytest.raises(KvjaxError, match="'model.d_model' expects int"):
    config_lib.load(None, {"model.d_model": 64.5})
  with pytest.raises(KvjaxError, match="'cache.capacity' expects int"):
    config_lib.load(None, {"cache.capacity": True})
  # a Config built in Python (not through _coerce) is checked too
  import dataclasses
  bad = dataclasses.replace(config_lib.Config(), model=dataclasses.replace(
      config_lib.ModelConfig(), n_layers=2.0))
  with pytest.raises(KvjaxError, match="model.n_layers must be an integer"):
    config_lib.validate(bad)


@pytest.mark.parametrize("overrides, needle", [
    ({"cache.capacity": 16, "cache.residual": 32}, "cache.residual=32 exceeds cache.capacity=16"),
    ({"workload.eos_id": 260}, "workload.eos_id=260 is outside the vocabulary"),
    ({"workload.top_k": 1000}, "workload.top_k=1000 exceeds model.vocab_size=260"),
    ({"model.rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "high_freq_factor=4.0 must exceed"),
    ({"model.rope_scaling": {"rope_type": "llama3", "factor": float("nan"),
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}},
     "model.rope_scaling.factor must be a finite number in [1.1754944e-38, 3.4028235e+38], got nan"),
])
def test_cross_field_limits(overrides, needle):
  with pytest.raises(KvjaxError) as err:
    config_lib.load(None, overrides)
  assert needle in str(err.value) and "\n" not in str(err.value)


def test_limits_accept_their_edges():
  cfg = config_lib.load(None, {"workload.top_p": 1.0, "workload.temperature": 0.0,
                               "workload.top_k": 260, "workload.eos_id": 259,
                               "cache.capacity": 32, "cache.residual": 32, "seed": 0,
                               "train.b1": 0.0, "train.recall_mix": 1.0})
  assert cfg.cache.residual == cfg.cache.capacity == 32


def test_every_numeric_field_has_a_range():
  import dataclasses
  numeric = [f"{sec}.{f.name}" for sec, cls in config_lib.SECTIONS.items()
             for f in dataclasses.fields(cls)
             if config_lib.field_type(cls, f.name) in (int, float)]
  assert sorted(set(numeric) - set(config_checks._RANGES)) == []


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


def test_hash_ignores_fields_at_their_default():
  """A new option with a default that changes nothing must not change any config's hash
  (every committed results row is identified by it): the hash covers non-default fields."""
  import hashlib
  import json
  base = config_lib.Config()
  assert base.hash() == hashlib.sha256(json.dumps({}).encode()).hexdigest()[:12]
  moved = config_lib.apply_overrides(base, {"cache.codec": "int8"})
  assert moved.hash() != base.hash()
  back = config_lib.apply_overrides(moved, {"cache.k_codec": "fp32", "cache.v_codec": "fp32",
                                            "cache.codec": ""})
  assert back.hash() == base.hash()
