"""Multi-process JAX: `jax.distributed.initialize` from `--coordinator/--num-processes/
--process-id/--distributed` flags or the KVJAX_* environment variables, so one command line
runs on a single host or across hosts (docs/scaling.md). The device mesh over all hosts'
devices is kvjax.sharding's.
"""

from __future__ import annotations

import os

import jax

from kvjax.errors import KvjaxError

ENV = {"coordinator": "KVJAX_COORDINATOR", "num_processes": "KVJAX_NUM_PROCESSES",
       "process_id": "KVJAX_PROCESS_ID", "distributed": "KVJAX_DISTRIBUTED"}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, auto: bool = False) -> bool:
  """`jax.distributed.initialize` from flags or KVJAX_* environment variables.

  With nothing given (and KVJAX_DISTRIBUTED unset) this does nothing: one process. `auto`
  (or KVJAX_DISTRIBUTED=1) lets JAX detect the cluster (Cloud TPU, SLURM, Open MPI);
  otherwise coordinator, process count and id must all be given. Returns whether it ran.
  """
  coordinator = coordinator or os.environ.get(ENV["coordinator"]) or None
  num_processes = num_processes if num_processes is not None else \
      _env_int(ENV["num_processes"])
  process_id = process_id if process_id is not None else _env_int(ENV["process_id"])
  auto = auto or os.environ.get(ENV["distributed"], "") not in ("", "0")
  explicit = [v is not None for v in (coordinator, num_processes, process_id)]
  if not auto and not any(explicit):
    return False
  if any(explicit) and not all(explicit):
    raise KvjaxError("multi-host needs --coordinator HOST:PORT, --num-processes N and "
                     "--process-id I together (or KVJAX_COORDINATOR/..._NUM_PROCESSES/"
                     "..._PROCESS_ID), or --distributed alone for TPU/SLURM/MPI auto-detection")
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id)
  except (RuntimeError, ValueError) as e:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise KvjaxError(f"jax.distributed.initialize failed: {msg}; check the coordinator "
                     "address and that every process was started") from None
  return True


def _env_int(name: str) -> int | None:
  raw = os.environ.get(name, "")
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise KvjaxError(f"{name} must be an integer, got '{raw}'") from None
