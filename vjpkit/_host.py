"""Host delivery: run a Python function on each record as a JAX callback.

Contract: ``on_host(fn, every=1)`` is a hook. Under ``jit`` it emits one ordered
``jax.debug.callback`` per layer call, so ``fn`` runs on the host with numpy arrays, in
backward order, once per layer call per step (per example under ``vmap``). ``every=N``
delivers the 1st, (N+1)th, ... record of each call key; counting happens on the host.
An exception in ``fn`` is re-raised as :class:`HostHookError` naming the layer; under
``jit`` JAX surfaces it when the step's result is awaited.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import jax
import numpy as np

from ._errors import ConfigError, HostHookError
from ._records import Cotangents


class on_host:  # noqa: N801  (a hook factory, used like a function)
    """A hook that runs ``fn(rec)`` on the host with numpy arrays.

    Args:
        fn: called with a :class:`Cotangents` (or :class:`Tangents`) of numpy arrays.
            Its return value is ignored: host hooks observe, they cannot rewrite.
        every: deliver one record in ``every`` per call key (``fc1``, ``fc1#1``, ...).

    Example:
        >>> seen = []
        >>> g = vk.grad(loss, hooks={"fc*": vk.on_host(lambda rec: seen.append(rec.key))})
        >>> jax.jit(g)(params, x); jax.effects_barrier()
    """

    def __init__(self, fn: Callable, every: int = 1):
        if not callable(fn):
            raise ConfigError(f"vk.on_host needs a callable, got {type(fn).__name__}.")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"vk.on_host: every must be a positive int, got {every!r}.")
        self.fn = fn
        self.every = every
        self.counts: collections.Counter = collections.Counter()
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, rec: Cotangents) -> None:
        jax.debug.callback(self._deliver, rec, ordered=True)

    def _deliver(self, rec: Cotangents) -> None:
        seen = self.counts[rec.key]
        self.counts[rec.key] = seen + 1
        if seen % self.every:
            return
        rec = jax.tree.map(np.asarray, rec)
        try:
            self.fn(rec)
        except Exception as err:
            wrapped = HostHookError(
                f"layer {rec.name!r} (call {rec.call}): the on_host function "
                f"{getattr(self.fn, '__qualname__', self.fn)!r} raised {type(err).__name__}: {err}. "
                "The traceback above it shows where; the step's outputs are not valid."
            )
            wrapped.original = err
            raise wrapped from err

    def __repr__(self) -> str:
        return f"on_host({getattr(self.fn, '__qualname__', self.fn)}, every={self.every})"
