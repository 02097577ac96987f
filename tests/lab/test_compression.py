"""kvjax/lab/experiments/compression.py: rows of eviction, latent and codec settings on one bytes axis."""

import pytest
from conftest import tiny_config, tiny_params

from kvjax import config as config_lib
from kvjax.io import checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  cfg = tiny_config(**{"model.vocab_size": 260})
  path = tmp_path_factory.mktemp("ckpt") / "tiny"
  checkpoint.save(path, cfg, tiny_params(cfg), step=0)
  return path


def cell(ckpt, **cache):
  return config_lib.from_dict({
      "experiment": "compression", "model": {"vocab_size": 260},
      "cache": cache.pop("cache", {}),
      "params": {"checkpoints": [str(ckpt)], "context": 24, "continuation": 6,
                 "eval_seqs": 2, **cache}})


def test_full_is_the_reference_and_eviction_holds_fewer_bytes(ckpt):
  from kvjax.lab.experiments import compression
  full = compression.run_cell(cell(ckpt))[0]["metrics"]
  assert full["dppl_rel"] == pytest.approx(0, abs=1e-6) and full["kept"] == 1
  # L · (K + V) · heads · D · fp32, plus 4 bytes of lengths per sequence over 30 tokens
  assert full["bytes_per_token"] == pytest.approx(2 * 2 * 4 * 8 * 4 + 4 / 30)
  row = compression.run_cell(cell(ckpt, cache={"policy": "sinks", "ratio": 0.5, "sinks": 2}))[0]
  m = row["metrics"]
  assert row["variant"]["policy"] == "sinks" and m["kept"] < 0.6
  assert m["cache_bytes"] < full["cache_bytes"] and m["ppl_ref"] == full["ppl_ref"]
  lat = compression.run_cell(cell(ckpt, latent_rank=8))[0]
  assert lat["variant"]["latent_rank"] == 8 and lat["variant"]["layout"] == "latent"
  assert lat["metrics"]["bytes_per_token"] < full["bytes_per_token"] / 3


def test_rows_carry_intervals_and_the_bf16_unit(ckpt):
  from kvjax.lab.experiments import compression
  full = compression.run_cell(cell(ckpt))[0]["metrics"]
  assert full["kl"] == pytest.approx(0, abs=1e-6) and full["dppl_rel_ci95"] == pytest.approx([0, 0])
  # the unit: the same model's bf16 cache at the same 30 tokens (2 bytes an element)
  assert full["bf16_bytes_per_token"] == pytest.approx(2 * 2 * 4 * 8 * 2 + 4 / 30)
  assert full["of_bf16"] == pytest.approx(full["bytes_per_token"] / full["bf16_bytes_per_token"])
  m = compression.run_cell(cell(ckpt, cache={"codec": "int4"}))[0]["metrics"]
  lo, hi = m["dppl_rel_ci95"]
  assert lo <= m["dppl_rel"] <= hi and m["kl"] > 0 and m["of_bf16"] < 0.75  # scales in


def test_summary_reads_dppl_in_percent_with_its_interval(ckpt):
  from kvjax.lab.experiments import compression
  rows = compression.run_cell(cell(ckpt, cache={"codec": "int4"}))
  rec, = compression.summary(rows)
  m = rows[0]["metrics"]
  assert rec["dppl_%"] == pytest.approx(100 * m["dppl_rel"]) and rec["setting"] is not None
  lo, hi = (float(x) for x in rec["dppl_%_ci95"].strip("[]").split(","))
  assert (lo, hi) == pytest.approx([100 * x for x in m["dppl_rel_ci95"]], abs=1e-3)
  assert rec["of_bf16"] == m["of_bf16"] and rec["reference"] == "fp32 cache"


def test_a_converted_checkpoint_is_a_setting_with_its_recipe(ckpt, tmp_path):
  from kvjax.lab import convert
  from kvjax.lab.experiments import compression
  cfg, params = checkpoint.load(ckpt)
  mqa_cfg, mqa = convert.mean_pool(cfg, params, 1)
  checkpoint.save(tmp_path / "mqa", mqa_cfg, mqa, step=0,
                  meta={"method": "mean_pool", "recipe": {"method": "pool", "kv_heads": 1}})
  full = compression.run_cell(cell(ckpt))[0]
  row = compression.run_cell(cell(ckpt, converted=str(tmp_path / "mqa")))[0]
  v, m = row["variant"], row["metrics"]
  assert v["kv_heads"] == 1 and v["conversion"] == "pool" and v["recipe"] == "kv_heads=1"
  assert m["ppl_ref"] == full["metrics"]["ppl_ref"] and m["dppl_rel"] != 0  # the original's ref
  assert m["of_bf16"] == pytest.approx(full["metrics"]["of_bf16"] / 4, rel=0.01)  # 1 of 4 heads


def test_params_reference_is_read_not_ignored(ckpt):
  """params.reference=int4: the int4 setting is then the reference itself (Δppl 0, KL 0) and
  the fp32 cache is not; the rows name their reference."""
  from kvjax.lab.experiments import compression
  int4 = compression.run_cell(cell(ckpt, cache={"codec": "int4"}, reference="int4"))[0]
  fp32 = compression.run_cell(cell(ckpt, reference="int4"))[0]
  assert int4["metrics"]["kl"] == pytest.approx(0, abs=1e-6)
  assert int4["metrics"]["dppl_rel"] == pytest.approx(0, abs=1e-6)
  assert fp32["metrics"]["kl"] > 0
  assert int4["workload"]["reference"] != "fp32 cache" and "int4" in int4["workload"]["reference"]
  plain = compression.run_cell(cell(ckpt))[0]
  assert plain["workload"]["reference"] == "fp32 cache"
