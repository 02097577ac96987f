"""Config inputs a new user gets wrong: malformed YAML files (duplicate keys, alias cycles,
non-UTF-8), numbers that do not survive float32 / int32, settings kvjax does not implement.
Each must be one KvjaxError line naming the key or file, never a traceback or a silent
run; everything here is host-side and takes milliseconds."""

from __future__ import annotations

import dataclasses
import typing

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import config as config_lib
from kvjax.config import checks, schema
from kvjax.errors import KvjaxError
from conftest import tiny_config, tiny_params


def _one_line(err) -> str:
  text = str(err.value)
  assert "\n" not in text and text
  return text


@pytest.mark.parametrize("text, needles", [
    ("model:\n  d_model: 32\ncache:\n  codec: int8\nmodel:\n  n_layers: 1\n",
     ("line 5", "duplicate key 'model'", "first at line 1")),
    ("model:\n  d_model: 32\n  d_model: 64\n", ("line 3", "duplicate key 'd_model'")),
    ("params:\n  settings:\n    a: {cache.codec: int8, cache.codec: int4}\n",
     ("line 3", "duplicate key 'cache.codec'")),
    ("model: &m\n  x: *m\n", ("refers to itself", "cycle")),
    ("params: &p\n  - [*p]\n", ("cycle",)),
    ("a: &a [1,2,3,4,5,6,7,8,9,10]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
     "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
     "e: [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n", ("expand to more than",)),
    ("model: [" * 2000, ("nests too deeply",)),
    ("model:\n  d_model: 32\n    n_layers: 1\n", ("malformed YAML", "line 3")),
    ("{[1]: 2}\n", ("mapping key must be a scalar",)),
])
def test_malformed_yaml_is_one_line_naming_file_and_line(tmp_path, text, needles):
  path = tmp_path / "c.yaml"
  path.write_text(text)
  with pytest.raises(KvjaxError) as err:
    config_lib.load(path)
  msg = _one_line(err)
  assert str(path) in msg and all(n in msg for n in needles), msg


def test_non_utf8_config_names_the_file_and_byte(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_bytes(b"model:\n  d_model: 32  # caf\xe9\n")
  with pytest.raises(KvjaxError) as err:
    config_lib.load(path)
  assert _one_line(err) == (f"config file {path} is not UTF-8 text (byte 27 is 0xe9); "
                            "save it as UTF-8")


def test_merge_keys_still_override_and_lists_still_load(tmp_path):
  """`<<: *base` followed by an explicit key is YAML's override idiom, not a duplicate."""
  path = tmp_path / "c.yaml"
  path.write_text("base: &b {d_model: 32, n_layers: 1}\nmodel:\n  <<: *b\n  d_model: 64\n"
                  "params: {xs: &x [1, 2], ys: *x}\n")
  data = config_lib.read_yaml(path)
  assert data["model"] == {"d_model": 64, "n_layers": 1}
  assert data["params"] == {"xs": [1, 2], "ys": [1, 2]}


@pytest.mark.parametrize("item, needle", [
    ("params.settings={a: {cache.codec: int8}, a: {cache.codec: int4}}", "duplicate key 'a'"),
    ("grid=&g {x: *g}", "cycle"),
])
def test_set_values_are_read_strictly(item, needle):
  with pytest.raises(KvjaxError) as err:
    config_lib.parse_set([item])
  assert needle in _one_line(err) and "--set" in str(err.value)


def test_set_text_that_is_not_yaml_stays_text():
  assert config_lib.parse_set(["train.data=[a.txt", "cache.codec=int8"]) == \
      {"train.data": "[a.txt", "cache.codec": "int8"}


# -- numbers -----------------------------------------------------------------------------------
def _numeric_keys() -> list[tuple[str, type]]:
  out = []
  for sec, cls in [(None, schema.Config), *schema.SECTIONS.items()]:
    for f in dataclasses.fields(cls):
      typ = typing.get_type_hints(cls)[f.name]
      if typ in (int, float):
        out.append((f.name if sec is None else f"{sec}.{f.name}", typ))
  return out


def test_every_numeric_key_has_a_finite_range_that_holds_its_default():
  keys = _numeric_keys()
  assert len(keys) > 40 and set(k for k, _ in keys) == set(checks._RANGES)
  for key, typ in keys:
    lo, _, hi, _ = checks._RANGES[key]
    assert lo is not None and hi is not None, key
    limit = checks.I32 if typ is int else checks.F32_MAX
    assert -limit <= lo <= hi <= max(limit, 2**32 - 1), key
  config_lib.validate(config_lib.Config())  # every default inside its range


@pytest.mark.parametrize("key, value", [
    ("model.rope_theta", 1e-300), ("model.rope_theta", 1.0), ("model.rope_theta", 1e39),
    ("model.norm_eps", 1e300), ("model.norm_eps", 1e-300), ("model.norm_eps", 2.0),
    ("workload.top_p", 1e-300), ("train.lr", 1e-300), ("train.lr", 1e300),
    ("train.grad_clip", 1e-300), ("train.grad_clip", 1e300), ("train.weight_decay", 1e300),
    ("workload.temperature", 1e300), ("seed", 2**32), ("seed", 18446744073709551616),
    ("model.d_model", 2**31), ("workload.batch", 10**30), ("cache.capacity", 2**40),
])
def test_numbers_that_overflow_float32_or_int32_are_refused(key, value):
  with pytest.raises(KvjaxError) as err:
    config_lib.load(None, {key: value})
  msg = _one_line(err)
  assert msg.startswith(f"{key} must be ") and f"set {key} to such a value" in msg


def test_whole_interval_shown_when_the_value_is_above_the_dtype_limit():
  with pytest.raises(KvjaxError, match=r"model.d_model must be an integer in \(0, 2147483647\]"):
    config_lib.load(None, {"model.d_model": 2**31})
  with pytest.raises(KvjaxError, match=r"model.d_model must be an integer > 0, got 0"):
    config_lib.load(None, {"model.d_model": 0})


def test_tiny_temperature_samples_greedily_and_huge_stays_finite():
  """The one key made robust instead of bounded: a temperature below float32's smallest
  normal is greedy, and one just above it picks the best logit too (the best is 0 before
  dividing), where dividing raw logits made inf - inf = NaN."""
  from kvjax.decode import Sampler
  import jax
  logits = jnp.array([[3.0, 9.0, -2.0, 8.5], [40.0, -1.0, 41.0, 0.0]])
  key = jax.random.PRNGKey(0)
  greedy = np.asarray(Sampler()(logits, key))
  for t in (1e-300, 1e-37, 1e-20):
    np.testing.assert_array_equal(np.asarray(Sampler(t)(logits, key)), greedy)
  hot = np.asarray(Sampler(3e38)(logits, key))
  assert ((0 <= hot) & (hot < 4)).all()


def test_non_finite_logits_end_generate_with_one_line():
  from kvjax.decode import generate
  cfg = tiny_config(**{"model.n_layers": 1})  # one new token: prefill only, one compile
  params = tiny_params(cfg)
  path = next(p for p, _ in jax_leaves_with_path(params) if "norm" in p)
  with pytest.raises(KvjaxError, match="non-finite logits") as err:
    generate.generate(cfg, set_leaf(params, path, np.nan), [[1, 2, 3]], 1, timed=False)
  _one_line(err)


def jax_leaves_with_path(tree):
  import jax
  return [(jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_leaves_with_path(tree)]


def set_leaf(tree, path: str, value: float):
  import jax
  return jax.tree_util.tree_map_with_path(
      lambda p, v: jnp.full_like(v, value) if jax.tree_util.keystr(p) == path else v, tree)


# -- settings kvjax does not implement ---------------------------------------------------------
@pytest.mark.parametrize("scaling, needle", [
    ({"rope_type": "yarn", "factor": 4}, "rope_type 'yarn' is not implemented; kvjax "
                                         "implements default, llama3"),
    ({"factor": 4}, "model.rope_scaling names no rope_type; kvjax implements default, llama3"),
    ({"rope_type": "default", "factor": 4}, "model.rope_scaling.factor is not used by "
                                            "rope_type default"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64, "beta_fast": 32},
     "model.rope_scaling.beta_fast is not used by rope_type llama3"),
    ({"rope_type": "llama3", "factor": 8.0}, "missing low_freq_factor, high_freq_factor"),
])
def test_unimplemented_rope_scaling_is_refused(scaling, needle):
  with pytest.raises(KvjaxError) as err:
    config_lib.load(None, {"model.rope_scaling": scaling})
  assert needle in _one_line(err)


def test_implemented_rope_scaling_still_loads():
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
  assert dict(config_lib.load(None, {"model.rope_scaling": llama3}).model.rope_scaling) == llama3
  assert config_lib.load(None, {"model.rope_scaling": {"rope_type": "default"}})


@pytest.mark.parametrize("key, value", [
    ("model.rope_scaling", 4), ("model.rope_scaling", [1, 2]), ("params", [1]),
    ("grid", "x"), ("params", 3.5),
])
def test_mapping_keys_refuse_other_shapes(key, value):
  with pytest.raises(KvjaxError, match=f"config key '{key}' expects a mapping") as err:
    config_lib.load(None, {key: value})
  _one_line(err)
