"""The scripts under scripts/: every one answers --help, and the benchmarks run at tiny
size (one context, one repeat) and write the rows they promise. Timings are never asserted.
bench_axis_order (fixed multi-MiB shapes), bench_xla_cpu, bench_prefill (torch) and
bench_accelerator (a multi-minute driver of the others) are covered by --help only. What
an experiment measures is an experiment's config, not a script (tests/lab/test_bench_configs.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
TINY = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2"]


def _run(*argv, timeout=240):
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_every_script_is_listed():
  assert {"bench_accelerator.py", "bench_axis_order.py", "bench_pallas.py", "bench_sharding.py",
          "plot_all.py"} <= set(SCRIPTS)
  # folded into experiment configs (configs/codec_speed.yaml, cache_vs_recompute_b8.yaml,
  # the peer configs): no second home for the same measurement
  assert not {"bench_codecs.py", "bench_decode.py", "bench_layer_loop.py"} & set(SCRIPTS)


# Every script's `--help` as `python scripts/X.py --help` would run it (run as __main__),
# all in ONE child process: one jax import instead of one per script.
HELP_CHILD = """
import contextlib, io, json, runpy, sys
res = {}
for path in sys.argv[1:]:
  out, err, code = io.StringIO(), io.StringIO(), "no exit"
  sys.argv = [path, "--help"]
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
      code = e.code
  res[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
  proc = _run("-c", HELP_CHILD, *(f"scripts/{s}" for s in SCRIPTS), timeout=240)
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, helps):
  got = helps[f"scripts/{script}"]
  assert got["code"] in (0, None), got["stderr"][-2000:]
  assert got["stdout"].startswith("usage:") and "--help" in got["stdout"]
  assert got["stderr"] == ""


def _rows(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_bench_sharding_tiny(tmp_path):
  out = tmp_path / "rows.jsonl"
  proc = _run("scripts/bench_sharding.py", "--devices", "2", "--meshes", "1x1,1x2",
              "--repeats", "1", *TINY, "--set", "workload.prompt_len=8",
              "--set", "workload.gen_len=3", "--set", "workload.batch=2", "--json", str(out))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = _rows(out)
  assert [r["mesh"] for r in rows] == ["1x1", "1x2"]
  assert all(r["same_tokens_as_first"] for r in rows)
  assert rows[1]["cache_bytes_per_device"] < rows[0]["cache_bytes_per_device"]


def test_bench_pallas_smoke(tmp_path):
  out = tmp_path / "rows.jsonl"
  proc = _run("scripts/bench_pallas.py", str(out), "--contexts", "32", "--batches", "1",
              "--codecs", "bf16", "--repeats", "1", "--budget", "120")
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = _rows(out)
  assert rows and all(r["smoke"] for r in rows)  # CPU: interpret mode, flagged as a smoke run


def test_layer_bits_simulated_cache_reads_what_the_codec_cache_holds():
  """scripts/layer_bits.py's per-layer cache (a float32 store whose writes pass each layer
  through its own codec) gives the log-probabilities of the real codec cache when every
  layer has that codec, in a rotated basis too; and its bits per element follow the
  per-layer codecs."""
  import importlib.util

  import jax.numpy as jnp
  import numpy as np

  from conftest import tiny_config, tiny_params
  from kvjax import config as config_lib
  from kvjax.lab import evaluate
  from kvjax.codecs import base as codecs

  spec = importlib.util.spec_from_file_location("layer_bits", ROOT / "scripts" / "layer_bits.py")
  lb = importlib.util.module_from_spec(spec)
  sys.modules.setdefault("layer_bits", lb)  # dataclasses look their module up there
  spec.loader.exec_module(lb)
  cfg = tiny_config(**{"model.n_kv_heads": 2, "cache.rotate": "hadamard",
                       "model.attention": "reference"})
  params = tiny_params(cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 24)).astype(np.int32)
  n, K, D = cfg.model.n_layers, cfg.model.n_kv_heads, cfg.model.D
  int4 = codecs.for_role("int4", cfg.cache, "k")
  k, v = lb.assignment("all4", n, int4, codecs.for_role("int8", cfg.cache, "k"))
  codecs.register(lb.LayerMix("layer_mix_test_k", jnp.float32, tuple(k)))
  codecs.register(lb.LayerMix("layer_mix_test_v", jnp.float32, tuple(v)))
  try:
    sim = config_lib.apply_overrides(cfg, {"cache.k_codec": "layer_mix_test_k",
                                           "cache.v_codec": "layer_mix_test_v"})
    real = config_lib.apply_overrides(cfg, {"cache.codec": "int4"})
    lp_sim, _ = evaluate.stream_logprobs(sim, params, tokens, chunk=4)
    lp_real, _ = evaluate.stream_logprobs(real, params, tokens, chunk=4)
    fp32, _ = evaluate.stream_logprobs(config_lib.apply_overrides(cfg, {"cache.codec": "fp32"}),
                                       params, tokens, chunk=4)
    bits = lb.bits_per_element(sim)
  finally:
    for name in ("layer_mix_test_k", "layer_mix_test_v"):
      codecs.CODECS.pop(name)
  np.testing.assert_allclose(np.asarray(lp_sim), np.asarray(lp_real), atol=2e-5)
  assert float(np.max(np.abs(np.asarray(lp_real) - np.asarray(fp32)))) > 1e-3  # int4 is lossy
  assert bits == 8 * int4.bytes_per_token(K, D) / (K * D)
  k, v = lb.assignment("only:1-1", n, int4, None)  # layer 0 full precision, layer 1 int4
  assert k == v == [lb.FULL, int4]
  mix = lb.LayerMix("layer_mix_test", jnp.float32, tuple(k))
  assert 8 * mix.bytes_per_token(K, D) / (K * D) == \
      (32 + 8 * int4.bytes_per_token(K, D) / (K * D)) / 2
  with pytest.raises(lb.KvjaxError, match="outside 0-1"):
    lb.assignment("k8:0-2", n, int4, int4)
  with pytest.raises(lb.KvjaxError, match="is not A-B"):
    lb.assignment("only:", n, int4, int4)


def test_bench_distill_writes_one_row_at_a_tiny_shape(tmp_path, monkeypatch, capsys):
  """scripts/bench_distill.py (run in this process: one jax import for the suite): a row
  with the median step, its interval and tokens per second (batch x seq_len over the
  median step); a bad option is one line, exit 2."""
  monkeypatch.syspath_prepend(str(ROOT / "scripts"))
  import bench_distill
  shape = tmp_path / "tiny.yaml"
  shape.write_text("name: tiny\nmodel: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, "
                   "n_kv_heads: 2, head_dim: 8, d_ff: 64, max_seq_len: 64}\n")
  out = tmp_path / "d.jsonl"

  def run(*argv):
    monkeypatch.setattr(sys, "argv", ["bench_distill.py", str(out), "--shape", str(shape), *argv])
    return bench_distill.main()

  assert run("--batch", "2", "--seq-len", "16", "--steps", "3") == 0
  (row,) = [json.loads(line) for line in out.read_text().splitlines()]
  assert row["kv_heads"] == 1 and row["teacher_kv_heads"] == 2 and row["steps_timed"] == 3
  lo, hi = row["step_s_ci"]
  assert 0 < lo <= row["step_s"] <= hi
  assert row["tokens_per_s"] == pytest.approx(32 / row["step_s"])
  capsys.readouterr()
  assert run("--kv-heads", "3") == 2
  assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bench_accelerator_turns_a_pytest_stage_into_a_row(tmp_path):
  """The device run's test stage is committed as a row read from its JUnit XML."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import bench_accelerator
  junit = tmp_path / "junit.xml"
  junit.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.test_a" name="t_ok" time="1.5"/>'
                   '<testcase classname="tests.test_a" name="t_bad" time="0.5">'
                   '<failure message="x"/></testcase></testsuite></testsuites>')
  row = bench_accelerator.test_row({"tests": ["tests/test_a.py"]}, junit, {"kind": "H200"})
  assert row["passed"] == 1 and row["failed"] == ["tests/test_a.py::t_bad"]
  assert row["seconds"] == 2.0 and row["slowest"][0] == {"test": "tests/test_a.py::t_ok",
                                                         "seconds": 1.5}
  junit.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="t_')
  assert bench_accelerator.test_row({"tests": []}, junit, {}) is None  # cut short: no row


KILLED_AFTER_TWO = """
import runpy, sys
from kvjax.lab import lockstep
real, calls = lockstep.terms, []
def terms(*a, **k):
  calls.append(1)
  if len(calls) == 3:
    raise SystemExit("killed")
  return real(*a, **k)
lockstep.terms = terms
sys.argv = ["scripts/interval_coverage.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_interval_coverage_resumes_a_killed_run_at_its_next_batch(tmp_path):
  """Killed in its third batch, the coverage study keeps the two batches done; the next run
  says it resumes after batch 2 and its per-window terms equal a run never killed. A
  malformed line in the rows file is refused in one line."""
  import numpy as np
  import yaml
  model = tmp_path / "tiny.yaml"
  model.write_text(yaml.safe_dump({"tokenizer": "bytes", "model": {
      "vocab_size": 260, "d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
      "head_dim": 8, "max_seq_len": 96}}))
  args = ["--model", f"config:{model}", "--text", "stdlib", "--codecs", "int4", "--sets", "4",
          "--windows", "2", "--tokens", "40", "--chunk", "8", "--resamples", "100",
          "--deals", "2"]
  cache, fresh = tmp_path / "cache", tmp_path / "fresh"
  proc = _run("-c", KILLED_AFTER_TWO, *args, "--cache", str(cache), "--out",
              str(tmp_path / "a.jsonl"))
  assert proc.returncode == 1 and "killed" in proc.stderr
  assert "batch 2/4" in proc.stderr and not (tmp_path / "a.jsonl").exists()
  proc = _run("scripts/interval_coverage.py", *args, "--cache", str(cache), "--out",
              str(tmp_path / "a.jsonl"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "resuming after batch 2/4" in proc.stderr and "batch 1/4" not in proc.stderr
  assert not list(cache.glob("*.partial.npz"))
  proc = _run("scripts/interval_coverage.py", *args, "--cache", str(fresh), "--out",
              str(tmp_path / "b.jsonl"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  (a,), (b,) = cache.glob("*.npz"), fresh.glob("*.npz")
  with np.load(a) as za, np.load(b) as zb:
    assert za["nll"].shape == (8, 39)
    for k in ("nll", "ref", "kl", "agree"):
      np.testing.assert_array_equal(za[k], zb[k])
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"variant": {"model": "x"}, "workload": {"data": "stdlib"}}\n{oops\n')
  proc = _run("scripts/interval_coverage.py", *args, "--cache", str(fresh), "--out", str(bad))
  assert proc.returncode == 2 and "bad.jsonl line 2 is not a coverage row" in proc.stderr
  assert proc.stderr.strip().count("\n") == 0, proc.stderr
