"""kvjax.lab.metrics: the timing protocol's arithmetic on fake clocks and fake timers (warm-up
excluded, median and spread, round-robin order, per-program peak bytes), and the
environment recorded beside every row."""

import statistics

import pytest

from kvjax.lab import metrics, timers


def test_summarize_median_spread_and_count():
  s = metrics.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
  assert s == {"median": 3.0, "min": 1.0, "max": 5.0, "n": 5,
               "iqr": pytest.approx(4.5 - 1.5)}  # exclusive quartiles of 1..5: 1.5, 4.5
  assert metrics.summarize([2.0, 4.0])["median"] == 3.0
  one = metrics.summarize([0.25])
  assert one == {"median": 0.25, "min": 0.25, "max": 0.25, "iqr": 0.0, "n": 1}


def test_time_call_drops_warmup_and_times_each_repeat(monkeypatch):
  ticks = iter([10.0, 10.5, 20.0, 21.0, 30.0, 30.25])  # three repeats: 0.5, 1.0, 0.25 s
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(ticks))
  calls = []
  out = metrics.time_call(lambda: calls.append(1) or 0, repeats=3, warmup=2)
  assert len(calls) == 5  # 2 warm-ups (untimed) + 3 timed
  assert out["median"] == 0.5 and out["min"] == 0.25 and out["max"] == 1.0 and out["n"] == 3


class FakeTimer:
  """A DecodeTimer stand-in returning scripted (ttft, tpot) pairs and logging its calls."""

  def __init__(self, name, pairs, log):
    self.name, self.pairs, self.log = name, iter(pairs), log
    self.compile_s, self.cache_bytes, self.peak_bytes = 1.5, 1024, 4096

  def once(self):
    self.log.append(self.name)
    return next(self.pairs)


def test_bench_interleaved_round_robin_without_warmup_samples():
  log = []
  a = FakeTimer("a", [(99.0, 99.0), (1.0, 0.1), (3.0, 0.3), (2.0, 0.2)], log)
  b = FakeTimer("b", [(99.0, 99.0), (4.0, 0.4), (6.0, 0.8), (5.0, 0.5)], log)
  out = metrics.bench_interleaved({"a": a, "b": b}, repeats=3, warmup=1)
  assert log == ["a", "b"] * 4  # interleaved: each repeat visits every timer once
  assert out["a"]["ttft_s"] == 2.0 and out["a"]["tpot_s"] == 0.2 and out["a"]["repeats"] == 3
  assert out["b"]["tpot_s"] == 0.5 and out["b"]["tpot_s_min"] == 0.4
  q = statistics.quantiles([0.4, 0.5, 0.8], n=4)
  assert out["b"]["tpot_s_iqr"] == pytest.approx(q[2] - q[0])
  assert out["a"]["compile_s"] == 1.5 and out["a"]["cache_bytes"] == 1024
  assert out["a"]["peak_bytes"] == 4096


def test_decode_timer_reports_compiled_peak_and_cache_bytes(monkeypatch):
  """The real timer on a tiny model: per-token time is the decode time / steps."""
  import numpy as np

  from conftest import tiny_config, tiny_params
  cfg = tiny_config()
  tokens = np.ones((2, 4), np.int32)
  timer = timers.DecodeTimer(cfg, tiny_params(cfg), tokens, np.full((2,), 4, np.int32),
                              steps=4)
  assert timer.capacity == 4 + 4 + 1 and timer.compile_s > 0
  ticks = iter([1.0, 1.25, 2.25])  # prefill 0.25 s, then decode 1 s over 4 steps
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(ticks))
  ttft, tpot = timer.once()
  assert (ttft, tpot) == (0.25, 0.25)
  from kvjax import cache
  spec = cache.CacheSpec.from_config(cfg, 2, timer.capacity)
  assert timer.cache_bytes == cache.LAYOUTS["contiguous"].closed_form_bytes(spec)


def test_environment_names_the_machine_and_commit():
  env = metrics.environment()
  assert env["backend"] == "cpu" and env["device_count"] >= 1 and env["cpu_count"] >= 1
  assert set(env) >= {"jax", "device_kind", "host", "python", "git_commit", "time"}
  assert env["git_commit"] != "" and env["time"].endswith("+00:00")
