"""The experiment configs that replaced scripts/bench_codecs.py and the cache-vs-recompute
part of scripts/bench_decode.py: they expand to the cells those scripts timed, every
paired setting passes the host checks, and a tiny run gives the fields the scripts wrote
(per setting: tpot_s, tpot_s_iqr, its ratio to bf16, cache_bytes; the program that ran)."""

from pathlib import Path

from kvjax.lab import experiments as ex
from kvjax.lab import runner
from kvjax.lab.experiments import latency

ROOT = Path(__file__).resolve().parents[2]

# scripts/bench_codecs.py's VARIANTS, by name
CODECS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp16": ("fp16", "fp16"),
          "fp8_e4m3": ("fp8_e4m3", "fp8_e4m3"), "fp8_e5m2": ("fp8_e5m2", "fp8_e5m2"),
          "int8": ("int8", "int8"), "int4": ("int4", "int4"), "int4_g32": ("int4", "int4"),
          "int2": ("int2", "int2"), "int2_kivi": ("int2", "int2"), "k8v4": ("int8", "int4")}


def test_codec_speed_pairs_every_codec_with_bf16_at_each_context_and_read():
  _, cells = runner.expand(ROOT / "configs" / "codec_speed.yaml")
  got = {(c.cfg.model.attention, c.cfg.workload.prompt_len + c.cfg.workload.gen_len)
         for c in cells}
  assert got == {(a, s) for a in ("native", "grouped") for s in (256, 1024, 4096)}
  for cell in cells:
    latency.check(cell.cfg)  # every paired setting fits and validates on the host
    cfgs = ex.interleaved(cell.cfg)
    assert next(iter(cfgs)) == "bf16"  # the reference, first
    assert {n: (c.cache.k_codec, c.cache.v_codec) for n, c in cfgs.items()} == CODECS
    kivi = cfgs["int2_kivi"].cache
    assert (kivi.k_axis, kivi.group_size, kivi.residual) == ("channel", 32, 128)
    assert cfgs["int4_g32"].cache.group_size == 32


def test_codec_speed_rows_carry_what_bench_codecs_wrote(tmp_path):
  out = tmp_path / "out"
  runner.run_file(ROOT / "configs" / "codec_speed.yaml", out_dir=out, progress=False, overrides=[
      "model.d_model=64", "model.n_layers=1", "model.max_seq_len=64", "workload.gen_len=3",
      "workload.repeats=1", "grid.workload.prompt_len=[8]", "grid.model.attention=[grouped]",
      "params.bandwidth_mib=4",
      "params.interleave={bf16: {}, k8v4: {cache.k_codec: int8, cache.v_codec: int4}}"])
  rows = runner.read_rows(out / "latency.jsonl")
  by = {r["variant"]["setting"]: r for r in rows}
  assert list(by) == ["bf16", "k8v4"]
  assert by["bf16"]["metrics"]["tpot_vs_ref"] == 1.0
  assert by["k8v4"]["metrics"]["cache_bytes"] < by["bf16"]["metrics"]["cache_bytes"]
  for r in rows:
    assert r["workload"]["context"] == 11 and r["workload"]["batch"] == 1
    assert r["variant"]["program"] == "cpu" and r["variant"]["attention"] == "grouped"
    assert r["metrics"]["tpot_s"] > 0 and r["metrics"]["tpot_s_iqr"] >= 0


def test_cache_vs_recompute_b8_is_bench_decodes_grid():
  _, cells = runner.expand(ROOT / "configs" / "cache_vs_recompute_b8.yaml")
  assert sorted(c.cfg.workload.prompt_len for c in cells) == [128, 512, 1024]
  for c in cells:
    assert c.cfg.workload.batch == 8 and c.cfg.workload.repeats == 5
    assert (c.cfg.cache.k_codec, c.cfg.param("steps")) == ("fp32", 16)
    assert list(c.cfg.param("layouts")) == ["none", "contiguous"]


def test_roofline_smollm2_paired_times_every_codec_against_bf16_in_each_cell():
  from kvjax.lab.experiments import roofline
  _, cells = runner.expand(ROOT / "configs" / "roofline_smollm2_paired.yaml")
  assert sorted((c.cfg.workload.batch, c.cfg.workload.prompt_len) for c in cells) == [
      (1, 1024), (1, 4096), (8, 1024), (8, 4096)]
  for cell in cells:
    roofline.check(cell.cfg)  # every variant's cache fits, all alive at once
    cfgs = ex.interleaved(cell.cfg)
    assert next(iter(cfgs)) == "bf16"
    assert {n for n, c in cfgs.items() if c.model.attention == "grouped"} == {
        "xla_bf16", "xla_int8", "xla_int4"}
    assert cfgs["int4_kivi"].cache.k_axis == "channel" and cfgs["int4_g32"].cache.group_size == 32


def test_each_frontier_setting_is_timed_at_its_shape_by_the_frontier_speed_config():
  """configs/frontier_speed_X.yaml times every setting of configs/frontier_X.yaml at the shape
  and codec it has there: KV heads (every conversion here is to one KV head, or to a latent
  of rank 192), K/V codecs, key axis, groups, rotation, and a policy as the tokens it leaves
  of the 4k context (ratio x 4,096)."""
  from kvjax.lab.experiments import roofline
  for model in ("smollm2", "qwen", "gemma3"):
    _, front = runner.expand(ROOT / "configs" / f"frontier_{model}.yaml")
    quality = {c.cfg.param("setting"): c.cfg for c in front}  # each with its setting applied
    _, (cell,) = runner.expand(ROOT / "configs" / f"frontier_speed_{model}.yaml")
    roofline.check(cell.cfg)  # every variant fits and validates on the host
    timed = ex.interleaved(cell.cfg)
    assert next(iter(timed)) == "bf16"
    assert set(timed) == set(quality), model
    for name, c in timed.items():
      q = quality[name]
      latent = bool(q.param("latent_rank", 0)) or "latent" in str(q.param("converted", ""))
      kv = 1 if q.param("converted", None) and not latent else q.model.n_kv_heads
      assert (c.model.n_kv_heads, c.model.latent_rank) == (kv, 192 if latent else 0), name
      for key in ("k_codec", "v_codec", "k_axis", "group_size", "residual", "rotate"):
        assert getattr(c.cache, key) == getattr(q.cache, key), (model, name, key)
      ratio = q.cache.ratio if q.cache.policy != "full" else 1.0
      assert c.workload.prompt_len == int(ratio * cell.cfg.workload.prompt_len), (model, name)
      assert c.cache.policy == "full"  # timed as the cache the policy leaves


def test_roofline_variants_of_another_shape_or_fewer_held_tokens(tmp_path):
  """An interleaved variant with fewer KV heads or a latent gets weights of its own shape; one
  holding fewer tokens is timed from that many; more than the cell's is one line."""
  import pytest
  from kvjax.errors import KvjaxError
  from kvjax.lab.experiments import roofline

  base = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
          "model.head_dim=8", "model.d_ff=32", "model.vocab_size=64", "model.max_seq_len=64",
          "workload.batch=2", "workload.prompt_len=16", "workload.gen_len=3",
          "workload.repeats=1", "params.bandwidth_mib=4"]
  table = ("params.interleave={bf16: {}, mqa: {model.n_kv_heads: 1}, latent: "
           "{model.latent_rank: 8, cache.layout: latent}, held: {workload.prompt_len: 4}}")
  config = ROOT / "configs" / "frontier_speed_smollm2.yaml"
  out = tmp_path / "out"
  runner.run_file(config, out_dir=out, progress=False, overrides=[*base, table])
  by = {r["variant"]["setting"]: r for r in runner.read_rows(out / "roofline.jsonl")}
  assert set(by) == {"bf16", "mqa", "latent", "held"}
  assert by["mqa"]["variant"]["kv_heads"] == 1 and by["bf16"]["variant"]["kv_heads"] == 2
  kv = {n: r["metrics"]["kv_bytes"] for n, r in by.items()}
  assert kv["mqa"] < kv["bf16"] and kv["held"] < kv["bf16"] and kv["latent"] < kv["bf16"]
  assert by["held"]["workload"]["held"] == 4 and "held" not in by["bf16"]["workload"]
  _, (cell,) = runner.expand(config, overrides=[*base, "params.interleave={bf16: {}, more: "
                                                "{workload.prompt_len: 32}}"])
  with pytest.raises(KvjaxError, match="more than the cell's 16"):
    roofline.check(cell.cfg)
