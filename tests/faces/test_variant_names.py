"""One name per attention variant (MHA, MQA, GQA-N with N the KV heads), derived from the
model's shape wherever it is shown: `kvjax models`, the README's table, the rows' and the
API's `variant`, and `kvjax run --dry-run` of a config whose real models differ from its
placeholder `model:` section."""

import re
from pathlib import Path

import pytest

from kvjax import cli
from kvjax.config.schema import variant_name
from kvjax.io import gguf, zoo

ROOT = Path(__file__).resolve().parents[2]


def test_variant_name_convention():
  assert (variant_name(8, 8), variant_name(8, 1), variant_name(14, 2)) == ("MHA", "MQA", "GQA-2")


@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_models_listing_readme_and_the_loaded_shape_agree(name):
  m = gguf.load_config(zoo.path_of(name)).model  # the shape the rows and the API report
  assert zoo.MODELS[name].heads_text == f"{m.n_heads}/{m.n_kv_heads} ({m.variant})"
  row = next(line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith(f"| `{name}` |"))
  assert re.search(rf"\b{m.n_heads} / {m.n_kv_heads}: {re.escape(m.variant)} \|", row), row


def test_dry_run_names_the_real_models_not_the_placeholder(capsys):
  """configs/long_context_models.yaml sizes its checks with Gemma 3's (MQA) shape and runs
  three models: the listing names all three variants."""
  assert cli.main(["run", "configs/long_context_models.yaml", "--dry-run"]) == 0
  table = capsys.readouterr().out
  assert "MQA, GQA-2, GQA-3" in table and "GQA-7" not in table
