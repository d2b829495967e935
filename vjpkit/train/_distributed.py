"""Several processes (JAX's multi-controller model): who does what, and agreeing across processes.

Contract: every helper here is a no-op, or a plain local computation, in a single-process run.
- ``primary()`` is true on process 0 only: ``fit`` shows its progress bar, calls
  ``on_metrics`` and ``on_records``, and warns there only.
- ``gather(values)`` returns every process's ``values`` (a small numpy array of the same shape
  and dtype in every process) stacked as ``(process_count, *shape)``, through
  ``jax.experimental.multihost_utils.process_allgather``. It is a
  collective: every process calls it at the same point of the program, or all of them wait.
- ``barrier(name)`` waits until every process reaches it.
- ``initialize()`` calls ``jax.distributed.initialize`` with the layout that
  ``python -m vjpkit.train.launch`` puts in the environment (``VJPKIT_COORDINATOR``,
  ``VJPKIT_NUM_PROCESSES``, ``VJPKIT_PROCESS_ID``); without them, with no arguments, so that
  JAX reads a Slurm, Open MPI or Cloud TPU layout itself.
"""

from __future__ import annotations

import os

import jax
import numpy as np

__all__ = ["barrier", "gather", "initialize", "multi", "primary"]

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "VJPKIT_COORDINATOR", "VJPKIT_NUM_PROCESSES", "VJPKIT_PROCESS_ID"


def multi() -> bool:
    """True when this run has more than one process."""
    return jax.process_count() > 1


def primary() -> bool:
    """True on process 0, the one that prints, logs and calls ``on_records``."""
    return jax.process_index() == 0


def gather(values: np.ndarray | list[int]) -> np.ndarray:
    """``values`` of every process, stacked: ``(process_count, *shape)`` (a list: int32)."""
    local = np.asarray(values, np.int32 if isinstance(values, list) else None)
    if not multi():
        return local[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local)).reshape(jax.process_count(), *local.shape)


def barrier(name: str) -> None:
    """Waits until every process has reached ``barrier(name)``."""
    if multi():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def initialize() -> None:
    """``jax.distributed.initialize`` for a script started by ``python -m vjpkit.train.launch``.

    Call it first, before any JAX computation. The launcher sets ``VJPKIT_COORDINATOR``,
    ``VJPKIT_NUM_PROCESSES`` and ``VJPKIT_PROCESS_ID`` (and ``JAX_NUM_CPU_DEVICES`` for
    ``--cpu-devices``). Without them it calls ``jax.distributed.initialize()`` with no
    arguments, which reads the layout of a Slurm, Open MPI or Cloud TPU job.

    Examples:
        >>> vk.train.initialize()   # in train.py, run as: python -m vjpkit.train.launch -n 2 train.py
    """
    address = os.environ.get(COORDINATOR)
    if address is None:
        jax.distributed.initialize()
        return
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(os.environ[NUM_PROCESSES]),
        process_id=int(os.environ[PROCESS_ID]),
    )
