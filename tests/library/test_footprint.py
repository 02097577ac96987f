"""`kvjax.footprint`: the bytes every report prints are what the cache tree holds at that context
(window, scales, rounding, policy state, pages included), for every layout; the reports
(`eval`, `size`) print those bytes; a window holding over a quarter of the tokens is warned
about."""

import json

import jax
import pytest
import yaml

from conftest import tiny_config
from kvjax import cache as cache_lib
from kvjax import cli, config, footprint

CONTEXTS = (64, 256, 2048)
B = 2
# One tiny shape (L=2, K=2, D=8) per layout, each with what that layout can hold.
KIVI = {"cache.codec": "int4", "cache.k_axis": "channel", "cache.group_size": 4,
        "cache.residual": 32}
SETTINGS = {
    "contiguous_kivi": KIVI,
    "contiguous_window_int2_g4": {"cache.codec": "int2", "cache.group_size": 4,
                                  "cache.residual": 16},
    "contiguous_k8v4": {"cache.k_codec": "int8", "cache.v_codec": "int4"},
    "paged_int4_g4": {"cache.layout": "paged", "cache.codec": "int4", "cache.group_size": 4,
                      "cache.page_size": 24},
    "compacted_h2o": {"cache.policy": "h2o", "cache.budget": 48, "cache.codec": "int8"},
    "compacted_snapkv_ratio": {"cache.policy": "snapkv", "cache.ratio": 0.25},
    "paged_compacted_h2o": {"cache.layout": "paged", "cache.policy": "h2o",
                            "cache.budget": 40, "cache.page_size": 16},
    "latent": {"cache.layout": "latent", "model.latent_rank": 4, "cache.codec": "int8"},
    "none": {"cache.layout": "none"},
    # one windowed layer of two: its ring stops growing at 8 tokens, on either layout
    "contiguous_rings": {"model.sliding_window": 8, "model.global_every": 2},
    "paged_rings": {"model.sliding_window": 8, "model.global_every": 2, "cache.layout": "paged",
                    "cache.page_size": 16},
}


def _cfg(over: dict) -> config.Config:
  return tiny_config(**{"model.n_kv_heads": 2, "model.max_seq_len": 4096, **over})


def _measured(cfg: config.Config, context: int) -> float:
  """Bytes of the cache tree the setting builds for B sequences of `context` tokens, per
  sequence (shapes only: no 2,048-token tree is allocated)."""
  h = footprint.count(cfg, context)
  spec = cache_lib.CacheSpec.from_config(cfg, B, h.tokens)
  tree = jax.eval_shape(lambda: cache_lib.LAYOUTS[h.layout].init(spec))
  return cache_lib.tree_bytes(tree) / B


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_reported_bytes_are_the_tree_at_each_context(name):
  cfg = _cfg(SETTINGS[name])
  for T in CONTEXTS:
    h = footprint.count(cfg, T, batch=B)
    assert h.bytes == _measured(cfg, T), (name, T)
    assert h.per_token == pytest.approx(h.bytes / T)
    assert h.fields()["bytes_per_token"] == h.per_token
  # The per-token cost tends to the asymptote (a policy's: per held token; `none`: ids),
  # unless a fixed budget bounds what is held: then the bytes stop growing.
  long = footprint.count(cfg, 1 << 20)
  if long.tokens == 1 << 20 or "ratio" in name:
    assert long.bytes / long.tokens == pytest.approx(long.asymptotic, rel=0.02), name
  else:
    assert long.bytes == footprint.count(cfg, 256).bytes < 256 * long.asymptotic


def test_window_is_counted_and_dominates_short_contexts():
  """R=32 fp32 slots beside the int4 history: at 64 tokens half the tokens are fp32."""
  cfg = _cfg(KIVI)
  L, K, D = 2, 2, 8
  fp32_token = L * 2 * K * D * 4
  short, mid = footprint.count(cfg, 64), footprint.count(cfg, 2048)
  window = 32 * fp32_token
  assert short.bytes == 32 * short.asymptotic + window + 4  # + int32 length
  assert short.per_token > 1.5 * short.asymptotic > mid.per_token > short.asymptotic
  assert short.bits_per_element == pytest.approx(8 * short.per_token / (L * 2 * K * D))


def test_warning_only_when_the_window_holds_over_a_quarter():
  cfg = _cfg(KIVI)
  assert footprint.window_warning(cfg, 128) is None and footprint.window_warning(_cfg({}), 8) is None
  line = footprint.window_warning(cfg, 127)
  assert "\n" not in line and "cache.residual=32" in line and "at least 128 tokens" in line


TINY = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 256}, "tokenizer": "bytes", "seed": 3}


def test_eval_json_reports_held_bytes_and_warns(tmp_path, capsys):
  """`eval --json`: bytes_per_token is the filled cache tree the stream measured over the
  tokens (a KIVI window of 16 beside the history), the asymptote beside it, one warning."""
  (tmp_path / "model.yaml").write_text(yaml.safe_dump(TINY))
  (tmp_path / "text.txt").write_text("the cache holds what it holds, window and all. " * 20)
  argv = ["eval", "--config", str(tmp_path / "model.yaml"), "--text", str(tmp_path / "text.txt"),
          "--tokens", "48", "--seqs", "1", "--chunk", "8", "--codec", "int4", "--set",
          "cache.k_axis=channel",
          "--set", "cache.group_size=4", "--set", "cache.residual=16", "--json"]
  assert cli.main(argv) == 0
  out, err = capsys.readouterr()
  res = json.loads(out)
  assert res["bytes_per_token"] == res["cache_bytes"] / 48  # one sequence, all it holds
  assert res["bytes_per_token"] > res["bytes_per_token_asymptotic"]
  # the window's warning, 48 tokens' rough interval, and one window's
  window, blocks, windows = err.splitlines()
  assert "warning" in window and "cache.residual=16" in window and "bootstrap blocks" in blocks
  assert "at least 4 windows" in windows
  assert res["bits_per_element"] == pytest.approx(
      8 * res["bytes_per_token"] / (2 * 2 * 2 * 8))


def test_size_reports_held_bytes_at_seq_len(capsys):
  argv = ["size", "--layers", "30", "--heads", "9", "--kv-heads", "3", "--head-dim", "64",
          "--codec", "int4", "--set", "cache.k_axis=channel", "--set", "cache.group_size=32",
          "--set", "cache.residual=128", "--json"]
  for seq, bpt in ((2048, 9630), (256, 26640)):
    assert cli.main(argv + ["--seq-len", str(seq)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert round(res["bytes_per_token"]) == bpt
    assert res["bytes_per_token_asymptotic"] == 7200
    assert res["total_bytes"] == pytest.approx(res["bytes_per_token"] * seq)


def test_committed_real_rows_are_what_count_says_they_held():
  """Every kvjax row of the committed SmolLM2 quality run: the cache tree it measured is
  `count` of the setting it records, on the packaged shape, at its context; `row_bytes`
  reads it back (the KIVI int4 R=128 setting: 9,630 B/token held, 7,200 in the limit)."""
  from pathlib import Path
  root = Path(__file__).resolve().parents[2]
  rows = [json.loads(line) for line in
          (root / "results" / "real" / "quality.jsonl").read_text().splitlines()]
  own = [r for r in rows if not r["variant"].get("peer")]
  assert len(own) >= 15
  for r in own:
    w, m = r["workload"], r["metrics"]
    cfg = footprint.row_config(r)
    assert footprint.count(cfg, w["context"], batch=w["batch"]).bytes * w["batch"] == \
        m["cache_bytes"], r["variant"]["setting"]
  kivi = next(r for r in own if r["variant"]["setting"] == "int4_kch_r128")
  got = footprint.row_bytes(kivi)
  assert round(got["bytes_per_token"]) == 9630 and got["bytes_per_token_asymptotic"] == 7200
  assert round(got["bits_per_element"], 2) == 6.69
  peer = footprint.row_bytes(next(r for r in rows if r["variant"].get("peer")))
  assert peer["bytes_per_token_asymptotic"] is None and peer["bits_per_element"] > 0
  # `kvjax results` / the run summary read the committed (older) row the same way
  from kvjax.lab.runner import table
  rec = table.flatten(kivi)
  assert round(rec["bytes_per_token"]) == 9630 and rec["bytes_per_token_asymptotic"] == 7200
