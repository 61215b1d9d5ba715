"""Multi-host start-up: ``jax.distributed.initialize`` from the standard environment variables.

Call :func:`initialize` once per process, before anything touches a device (before
``jax.devices()``, ``make_mesh``, loading a checkpoint). Every host runs the same command; JAX's
coordinator (process 0) connects them over TCP, then XLA's collectives run over NCCL (NVIDIA) /
RCCL (AMD) between all devices of all hosts, and ``jax.devices()`` lists every process's devices.

Sources, first match wins:

1. explicit arguments;
2. ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES``,
   ``JAX_PROCESS_ID`` and optionally ``JAX_LOCAL_DEVICE_IDS`` (``0,1,2,3``) — the variables
   JAX itself reads (``DSV41_COORDINATOR_ADDRESS`` / ``DSV41_NUM_PROCESSES`` / ``DSV41_PROCESS_ID``
   are accepted as aliases);
3. a cluster JAX detects itself: SLURM (``srun``), Open MPI (``mpirun``), Kubernetes (JobSet /
   indexed Job), Cloud TPU — ``jax.distributed.initialize()`` with no arguments.

With none of these (a single host), nothing is done and :func:`initialize` returns False.

    # host 0                                                    # host 1
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2   JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 \\
    JAX_PROCESS_ID=0 python -m dsv41_jax.generate --mesh ...    JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 ...
"""

from __future__ import annotations

import os

import jax

_ENV = {
    "coordinator_address": ("JAX_COORDINATOR_ADDRESS", "DSV41_COORDINATOR_ADDRESS"),
    "num_processes": ("JAX_NUM_PROCESSES", "DSV41_NUM_PROCESSES"),
    "process_id": ("JAX_PROCESS_ID", "DSV41_PROCESS_ID"),
    "local_device_ids": ("JAX_LOCAL_DEVICE_IDS", "DSV41_LOCAL_DEVICE_IDS"),
}

_CLUSTER_HINTS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JOBSET_NAME", "TPU_WORKER_HOSTNAMES",
                  "MEGASCALE_COORDINATOR_ADDRESS")

_initialized = False


def env_config(environ=None) -> dict:
    """The ``jax.distributed.initialize`` keyword arguments the environment gives (may be empty)."""
    env = os.environ if environ is None else environ
    out: dict = {}
    for key, names in _ENV.items():
        for n in names:
            if env.get(n):
                out[key] = env[n]
                break
    if "num_processes" in out:
        out["num_processes"] = int(out["num_processes"])
    if "process_id" in out:
        out["process_id"] = int(out["process_id"])
    if "local_device_ids" in out:
        out["local_device_ids"] = [int(i) for i in str(out["local_device_ids"]).split(",") if i.strip()]
    return out


def in_cluster(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return any(env.get(h) for h in _CLUSTER_HINTS)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, *, force: bool = False) -> bool:
    """Join the multi-host run described by the arguments or the environment. Returns True when
    ``jax.distributed.initialize`` was called (now or earlier), False on a single host.

    Raises ``ValueError`` if only part of the explicit configuration is given (a process that
    would wait forever for peers is worse than an error)."""
    global _initialized
    if _initialized:
        return True
    kw = env_config()
    for k, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                 ("process_id", process_id), ("local_device_ids", local_device_ids)):
        if v is not None:
            kw[k] = v
    if kw:
        need = ("coordinator_address", "num_processes", "process_id")
        missing = [k for k in need if k not in kw]
        if missing and not in_cluster():
            raise ValueError(
                "multi-host run: set all of JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID "
                f"(missing: {', '.join('JAX_' + m.upper() for m in missing)})")
        if kw.get("num_processes") == 1 and not force:
            return False
        jax.distributed.initialize(**kw)
    elif in_cluster() or force:
        jax.distributed.initialize()
    else:
        return False
    _initialized = True
    return True


def process_info() -> dict:
    """Where this process stands: index, count, local and global device counts."""
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(), "devices": jax.device_count(),
            "platform": jax.devices()[0].platform}


def is_coordinator() -> bool:
    """True on process 0 (the one that should print, write files and serve)."""
    return jax.process_index() == 0
