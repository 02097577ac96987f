"""Environment variables kvjax reads are parsed by kvjax.envcheck and checked before JAX
makes a device: a bad value is exit 2 and one line naming the variable, not a traceback
(`KVJAX_MEMORY_LIMIT=1.2.3GiB`), an XLA abort with a page of flags
(`XLA_FLAGS=--xla_force_host_platform_device_count=two`) or a setting silently ignored."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvjax import cli, envcheck, memory
from kvjax.errors import KvjaxError

SIZE = ["size", "--layers", "1", "--heads", "1", "--kv-heads", "1", "--head-dim", "8",
        "--seq-len", "8"]


@pytest.mark.parametrize("name, value, needle", [
    ("KVJAX_MEMORY_LIMIT", "1.2.3GiB", "is not a size"),
    ("KVJAX_MEMORY_LIMIT", "9" * 400 + "GiB", "is not a size"),
    ("KVJAX_MEMORY_LIMIT", "99999999999TiB", "more than 1 EiB"),
    ("KVJAX_MEMORY_LIMIT", "0", "is zero"),
    ("KVJAX_MEMORY_LIMIT", "16 parsecs", "is not a size"),
    ("XLA_FLAGS", "--xla_force_host_platform_device_count=two", "whole number of devices"),
    ("XLA_FLAGS", "--xla_force_host_platform_device_count=0", "whole number of devices"),
    ("KVJAX_NUM_PROCESSES", "two", "KVJAX_NUM_PROCESSES must be a whole number"),
    ("KVJAX_PROCESS_ID", "-1", "KVJAX_PROCESS_ID must be a whole number"),
    ("KVJAX_KERNEL", "false-ish", "neither on nor off"),
])
def test_a_bad_variable_is_one_line_before_anything_runs(monkeypatch, capsys, name, value,
                                                         needle):
  monkeypatch.setenv(name, value)
  with pytest.raises(KvjaxError, match=needle):
    envcheck.check()
  assert cli.main(SIZE) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and name in err[0] and needle in err[0]


@pytest.mark.parametrize("text, want", [("2048", 2048), ("1.5KiB", 1536), ("2 GiB", 2 * 2**30),
                                        ("3M", 3 * 2**20), (" 1T ", 2**40)])
def test_memory_limit_sizes(monkeypatch, text, want):
  monkeypatch.setenv("KVJAX_MEMORY_LIMIT", text)
  assert envcheck.memory_limit() == want == memory.available_bytes()[0]


def test_a_fine_environment_passes(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_foo=bar")
  monkeypatch.delenv("KVJAX_MEMORY_LIMIT", raising=False)
  envcheck.check()


def test_xla_device_count_is_refused_before_xla_aborts(tmp_path):
  """In a fresh process (XLA reads XLA_FLAGS once): exit 2 and one line, not an abort."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=two",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "kvjax.cli", *SIZE], env=env,
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert len(proc.stderr.strip().splitlines()) == 1 and "XLA_FLAGS" in proc.stderr


@pytest.mark.parametrize("budget, needle", [("9" * 400 + "GiB", "too many digits"),
                                            ("99999999999TiB", "more than 1 EiB")])
def test_a_huge_budget_is_one_line(capsys, budget, needle):
  assert cli.main(SIZE + ["--budget", budget]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and needle in err[0]
