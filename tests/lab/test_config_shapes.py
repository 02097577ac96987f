"""Experiment configs name packaged shapes (`model: smollm2-135m`, or `model: {shape: ...,
KEY: value}`); the configs that pasted the shape's fields resolve to the same cells."""

from pathlib import Path

import pytest

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab.runner import grid

ROOT = Path(__file__).resolve().parents[2]
# The model: sections these configs held before they named the shape, verbatim.
PASTED = {
    "budget_smollm2": """\
model:
  vocab_size: 49152
  d_model: 576
  n_layers: 30
  n_heads: 9
  n_kv_heads: 3
  head_dim: 64
  d_ff: 1536
  rope_theta: 100000.0
  tie_embeddings: true
  max_seq_len: 8192
  dtype: float32
  param_dtype: float32
""",
    "peer_smollm2": """\
model:
  vocab_size: 49152
  d_model: 576
  n_layers: 30
  n_heads: 9
  n_kv_heads: 3
  head_dim: 64
  d_ff: 1536
  rope_theta: 100000.0
  tie_embeddings: true
  max_seq_len: 8192
  dtype: float32
""",
    "roofline_smollm2": """\
model:
  vocab_size: 49152
  d_model: 576
  n_layers: 30
  n_heads: 9
  n_kv_heads: 3
  head_dim: 64
  d_ff: 1536
  rope_theta: 100000.0
  tie_embeddings: true
  max_seq_len: 8192
  dtype: float32
  param_dtype: float32
""",
    "compression_speed": """\
model:
  vocab_size: 49152
  d_model: 576
  n_layers: 30
  n_heads: 9
  n_kv_heads: 3
  head_dim: 64
  d_ff: 1536
  rope_theta: 100000.0
  tie_embeddings: true
  max_seq_len: 8192
  dtype: float32
  param_dtype: float32
""",
}


@pytest.mark.parametrize("name", sorted(PASTED))
def test_named_shape_resolves_to_the_pasted_block(name, tmp_path):
  new = (ROOT / "configs" / f"{name}.yaml").read_text()
  line = next(ln for ln in new.splitlines() if ln.startswith("model:"))
  assert line.split("#")[0].strip() == "model: smollm2-135m"
  old = tmp_path / f"{name}.yaml"
  old.write_text(new.replace(line + "\n", PASTED[name]))
  (base_new, cells_new), (base_old, cells_old) = grid.expand(ROOT / "configs" / f"{name}.yaml"), \
      grid.expand(old)
  assert base_new.model == base_old.model and base_new.hash() == base_old.hash()
  assert [c.hash for c in cells_new] == [c.hash for c in cells_old] and cells_new


def test_shape_with_overrides_and_unknown_shapes(tmp_path):
  shape = config_lib.load("smollm2-135m").model
  cfg = config_lib.from_dict({"model": {"shape": "smollm2-135m", "n_kv_heads": 1}})
  assert cfg.model.n_kv_heads == 1 and cfg.model.variant == "MQA"
  assert cfg.model == config_lib.replace(config_lib.load("smollm2-135m"),
                                         **{"model.n_kv_heads": 1}).model
  assert config_lib.from_dict({"model": "smollm2-135m"}).model == shape
  p = tmp_path / "c.yaml"
  p.write_text("model: llama3-8b\ncache: {codec: int8}\n")
  assert config_lib.load(p).model == config_lib.load("llama3-8b").model
  for bad in ("gpt-5", {"shape": "gpt-5"}, {"shape": 3}):
    with pytest.raises(KvjaxError, match=r"^model: .* is not a packaged model shape; use one of .*smollm2-135m"):
      config_lib.from_dict({"model": bad})
