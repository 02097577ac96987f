"""Two processes for real (kvjax.distributed): `kvjax generate` started twice on this
machine, coordinated by `jax.distributed` over loopback with the gloo CPU collectives and
one 2 x 2 mesh across both processes' forced CPU devices, prints the same greedy tokens as
one process on one device; a process whose peer dies, or never joins, ends with one line
instead of a hang or a C++ stack trace. Every child runs under a wall-clock limit and
`--distributed-timeout` bounds JAX's own waits, so no test here can hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvjax import cli, distributed

TINY = ["--set", "model.vocab_size=64", "--set", "model.d_model=32", "--set",
        "model.n_layers=2", "--set", "model.n_heads=4", "--set", "model.n_kv_heads=4",
        "--set", "model.d_ff=48"]
GEN = ["generate", *TINY, "--prompt-ids", "1,2,3,4", "--prompt-ids", "5,6,7",
       "--max-new-tokens", "4", "--greedy", "--json"]
KVJAX = [sys.executable, "-c", "import sys; from kvjax.cli import main; sys.exit(main())"]
LIMIT = 240  # seconds for any child: far above a healthy run (~10 s), far below a hang


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(port: int) -> dict:
  """Two forced CPU devices per process, gloo collectives, the coordinator bound to
  loopback only; the suite's XLA flags (conftest) are kept."""
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu",
          "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
          "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}


def _start(cmd: list[str], port: int) -> subprocess.Popen:
  return subprocess.Popen(cmd, env=_env(port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
  """(exit status, stdout, stderr) of each; past LIMIT every process group is killed and
  the test fails (a hang is the failure this file exists to catch)."""
  deadline, out = time.monotonic() + LIMIT, []
  try:
    for p in procs:
      o, e = p.communicate(timeout=max(1, deadline - time.monotonic()))
      out.append((p.returncode, o, e))
  except subprocess.TimeoutExpired:
    for p in procs:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    pytest.fail(f"a distributed child ran past {LIMIT} s: it hung")
  return out


def _flags(port: int, i: int, timeout: int) -> list[str]:
  return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
          str(i), "--distributed-timeout", str(timeout)]


def test_two_process_generate_equals_one_process_token_for_token(capsys):
  assert cli.main(GEN) == 0  # one process, one device: the reference
  ref = json.loads(capsys.readouterr().out)
  port = _free_port()
  mesh = ["--set", "mesh.data=2", "--set", "mesh.model=2"]  # 4 devices: 2 per process
  runs = _finish([_start([*KVJAX, *GEN, *mesh, *_flags(port, i, 120)], port) for i in (0, 1)])
  for rc, _, err in runs:
    assert rc == 0, err[-2000:]
  lead, other = runs[0][1], runs[1][1]
  assert len(lead.splitlines()) == 1, lead  # one JSON line: gloo's notices are not in it
  got = json.loads(lead)
  assert got["mesh"] == {"data": 2, "model": 2}
  assert got["tokens"] == ref["tokens"]
  assert other == ""  # only process 0 prints


def test_a_lost_peer_leaves_the_other_process_one_line():
  """Both ways to lose a peer, run side by side (each ends by JAX's own timeout): one that
  joins the run and exits without a word before the first collective, one never started."""
  dies, alone = _free_port(), _free_port()
  gen = [*KVJAX, *GEN, "--set", "mesh.model=4"]  # 4 devices: 2 here, 2 on the lost peer
  procs = [_start([*gen, *_flags(dies, 0, 4)], dies), _start([*gen, *_flags(alone, 0, 2)], alone),
           _start([sys.executable, "-c", (
               "import os; from kvjax import distributed; distributed.initialize_distributed("
               f"'127.0.0.1:{dies}', 2, 1, timeout=4); os._exit(3)")], dies)]
  t0 = time.monotonic()
  runs = _finish(procs)
  assert time.monotonic() - t0 < 120  # JAX's own waits (seconds here) ended them, not LIMIT
  for (rc, out, err), port in zip(runs[:2], (dies, alone)):
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("kvjax: error: process 0 of 2 stopped (jax.distributed: ")
    assert f"--coordinator 127.0.0.1:{port} is unreachable" in lines[0]
    assert "start all 2 processes again together" in lines[0]
  assert "stopped sending heartbeats" in runs[0][2]  # the peer that died was noticed as such
  assert runs[2][0] == 3


def test_bad_distributed_timeouts_are_one_line(capsys, monkeypatch):
  base = ["generate", *TINY, "--prompt-ids", "1", "--coordinator", "127.0.0.1:1",
          "--num-processes", "2", "--process-id", "0"]
  assert cli.main([*base, "--distributed-timeout", "0"]) == 2
  assert "--distributed-timeout must be" in capsys.readouterr().err
  monkeypatch.setenv("KVJAX_DISTRIBUTED_TIMEOUT", "soon")
  assert cli.main(base) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "KVJAX_DISTRIBUTED_TIMEOUT must be whole seconds" in err
  monkeypatch.setenv("KVJAX_DISTRIBUTED_TIMEOUT", "90000")
  with pytest.raises(Exception, match="1..86400"):
    distributed.settings("127.0.0.1:1", 2, 0)


@pytest.mark.parametrize("debug", ["", "1"])
def test_the_supervised_child_keeps_native_writes_off_stdout(debug):
  """gloo's notices are written by native threads to descriptor 1, interleaved anywhere:
  the child sends that descriptor to the null device and keeps Python's prints."""
  code = ("import os; from kvjax import distributed; distributed.python_stdout_only(); "
          "os.write(1, b'[Gloo] Rank 1 is connected to 1\\n'); print('{\"tokens\": [1]}')")
  env = {**os.environ, "KVJAX_DEBUG": debug}
  got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=LIMIT)
  assert got.returncode == 0, got.stderr[-2000:]
  native = "[Gloo] Rank 1 is connected to 1\n"
  assert got.stdout == (native if debug else "") + '{"tokens": [1]}\n'
