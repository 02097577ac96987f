"""Multi-process JAX: `jax.distributed.initialize` from `--coordinator/--num-processes/
--process-id/--distributed` flags or the KVJAX_* environment variables, so one command line
runs on a single host or across hosts (docs/scaling.md). The device mesh over all hosts'
devices is kvjax.decode.sharding's.

A multi-process command runs under a small supervisor (`supervise`): the CLI starts the
same command again as a child process and relays its output. JAX shares fate between the
processes of a run: when one dies (or never joins), the others' runtime ends them with a
fatal C++ log and a stack trace after the heartbeat (or join) timeout, which no Python
code of theirs can catch. The supervisor turns that into one line naming the fix. The child
keeps the C++ runtime off stdout (`python_stdout_only`): the gloo CPU collectives print
their connection notices there from several threads at once, pieces of two notices
interleaved anywhere, so no filter of the relayed lines can remove them reliably; and
`--json` must stay one line.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import threading

import jax

from kvjax.errors import KvjaxError

ENV = {"coordinator": "KVJAX_COORDINATOR", "num_processes": "KVJAX_NUM_PROCESSES",
       "process_id": "KVJAX_PROCESS_ID", "distributed": "KVJAX_DISTRIBUTED",
       "timeout": "KVJAX_DISTRIBUTED_TIMEOUT"}
CHILD = "KVJAX_DISTRIBUTED_CHILD"   # set in the supervised child: it runs the command itself
MAX_TIMEOUT = 86400
# The C++ runtime's fatal log line (absl/glog: severity F, date, time, thread, file:line]).
_FATAL = re.compile(rb"^F\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ")
def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, auto: bool = False,
             timeout: int | None = None) -> dict | None:
  """What `initialize_distributed` would pass to JAX, from flags then KVJAX_* variables;
  None for one process. A partial explicit set is a one-line KvjaxError."""
  coordinator = coordinator or os.environ.get(ENV["coordinator"]) or None
  num_processes = num_processes if num_processes is not None else \
      _env_int(ENV["num_processes"])
  process_id = process_id if process_id is not None else _env_int(ENV["process_id"])
  timeout = timeout if timeout is not None else _env_int(ENV["timeout"])
  auto = auto or os.environ.get(ENV["distributed"], "") not in ("", "0")
  explicit = [v is not None for v in (coordinator, num_processes, process_id)]
  if not auto and not any(explicit):
    return None
  if any(explicit) and not all(explicit):
    raise KvjaxError("multi-host needs --coordinator HOST:PORT, --num-processes N and "
                     "--process-id I together (or KVJAX_COORDINATOR/..._NUM_PROCESSES/"
                     "..._PROCESS_ID), or --distributed alone for TPU/SLURM/MPI auto-detection")
  if timeout is not None and not 1 <= timeout <= MAX_TIMEOUT:
    raise KvjaxError(f"--distributed-timeout (or {ENV['timeout']}) must be 1..{MAX_TIMEOUT} "
                     f"seconds, got {timeout}")
  return {"coordinator": coordinator, "num_processes": num_processes,
          "process_id": process_id, "timeout": timeout}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, auto: bool = False,
                           timeout: int | None = None) -> bool:
  """`jax.distributed.initialize` from flags or KVJAX_* environment variables.

  With nothing given (and KVJAX_DISTRIBUTED unset) this does nothing: one process. `auto`
  (or KVJAX_DISTRIBUTED=1) lets JAX detect the cluster (Cloud TPU, SLURM, Open MPI);
  otherwise coordinator, process count and id must all be given. `timeout` (seconds, or
  KVJAX_DISTRIBUTED_TIMEOUT) bounds both the wait for every process to join and how long a
  silent process is taken for alive (JAX's defaults: 300 and 100). Returns whether it ran.
  """
  s = settings(coordinator, num_processes, process_id, auto, timeout)
  if s is None:
    return False
  kwargs = {}
  if s["timeout"] is not None:  # only the knobs this jax has (both exist in 0.5 onwards)
    known = inspect.signature(jax.distributed.initialize).parameters
    kwargs = {k: s["timeout"] for k in ("initialization_timeout", "heartbeat_timeout_seconds")
              if k in known}
  try:
    jax.distributed.initialize(s["coordinator"], s["num_processes"], s["process_id"],
                               **kwargs)
  except (RuntimeError, ValueError) as e:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise KvjaxError(f"jax.distributed.initialize failed: {msg}; check the coordinator "
                     "address and that every process was started") from None
  return True


def python_stdout_only() -> None:
  """In the supervised child, before anything runs: Python's `sys.stdout` moves to a copy of
  file descriptor 1, and descriptor 1 itself, where native code writes (gloo's notices),
  to the null device. Everything kvjax prints is Python's; KVJAX_DEBUG=1 keeps both."""
  if os.environ.get("KVJAX_DEBUG"):
    return
  sys.stdout.flush()
  python_fd = os.dup(1)
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 1)
  os.close(null)
  sys.stdout = open(python_fd, "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                    buffering=1)


def supervised() -> bool:
  """Whether this process is the supervised child of a multi-process command."""
  return os.environ.get(CHILD) == "1"


def supervise(argv: list[str], s: dict) -> int:
  """Run `kvjax *argv` as a child process and return its exit status; a child that the
  runtime ends (a fatal log, or any signal) becomes one line naming the fix, exit 2."""
  env = {**os.environ, CHILD: "1"}
  if not os.environ.get("KVJAX_DEBUG"):  # the runtime's error logs before its fatal line
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"     # (importing jax first leaves this at jax's 1)
  child = subprocess.Popen(
      [sys.executable, "-c", "import sys; from kvjax import distributed; "
       "distributed.python_stdout_only(); from kvjax.cli import main; sys.exit(main())", *argv],
      env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  fatal: list[bytes] = []
  relays = [threading.Thread(target=_relay_stdout, args=(child.stdout,), daemon=True),
            threading.Thread(target=_relay_stderr, args=(child.stderr, fatal), daemon=True)]
  for t in relays:
    t.start()
  # Ctrl-C reaches the child from the terminal itself; a TERM or HUP sent to this process
  # alone is passed on, so a killed command never leaves its child running.
  forwarded = {}
  if threading.current_thread() is threading.main_thread():  # handlers live there only
    forwarded[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    forwarded.update({sig: signal.signal(sig, lambda n, _f: child.send_signal(n))
                      for sig in (signal.SIGTERM, signal.SIGHUP)})
  try:
    rc = child.wait()
  finally:
    for sig, old in forwarded.items():
      signal.signal(sig, old)
  for t in relays:
    t.join(timeout=10)
  if rc >= 0 and not fatal:
    return rc
  if rc in (-signal.SIGINT, -signal.SIGTERM, -signal.SIGHUP) and not fatal:
    return 128 - rc
  print(f"kvjax: error: {_death_message(rc, fatal, s)}", file=sys.stderr, flush=True)
  return 2


def _death_message(rc: int, fatal: list[bytes], s: dict) -> str:
  me = "this process" if s["process_id"] is None else f"process {s['process_id']}"
  n = s["num_processes"]
  of = f" of {n}" if n else ""
  text = b" ".join(line.strip() for line in fatal).decode("utf-8", "replace")
  status = text.partition("absl::Status: ")[2] or text
  status = re.sub(r"\[type\.googleapis[^\]]*\]|\s+RPC: .*", "", status)
  status = re.sub(r"\s+", " ", status).strip().split(". ")[0]
  status = status if len(status) <= 160 else status[:160].rsplit(" ", 1)[0] + " ..."
  why = f"jax.distributed: {status}" if status else \
      f"ended by {signal.Signals(-rc).name if rc < 0 else f'exit {rc}'}"
  where = f"--coordinator {s['coordinator']}" if s["coordinator"] else "the coordinator"
  return (f"{me}{of} stopped ({why}): another process of this run died or never joined, or "
          f"{where} is unreachable; see the other processes' output, then start all "
          f"{n or 'the'} processes again together (--distributed-timeout sets the wait)")


def _relay_stdout(pipe) -> None:
  out = sys.stdout.buffer
  for line in iter(pipe.readline, b""):
    try:
      out.write(line)
      out.flush()
    except (BrokenPipeError, ValueError):  # the reader left: keep draining the child
      pass


def _relay_stderr(pipe, fatal: list[bytes]) -> None:
  """Relay the child's stderr; from the runtime's fatal line on, keep its status lines for
  the one-line message instead, and drop the stack trace (KVJAX_DEBUG=1 shows them)."""
  debug, trace = bool(os.environ.get("KVJAX_DEBUG")), False
  err = sys.stderr.buffer
  for line in iter(pipe.readline, b""):
    if fatal or _FATAL.match(line):
      trace = trace or line.startswith(b"*** Check failure")
      if not trace and len(fatal) < 8:
        fatal.append(_FATAL.sub(b"", line))
      if not debug:
        continue
    try:
      err.write(line)
      err.flush()
    except (BrokenPipeError, ValueError):
      pass


def _env_int(name: str) -> int | None:
  raw = os.environ.get(name, "")
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise KvjaxError(f"{name} must be an integer, got '{raw}'") from None
