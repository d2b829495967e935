"""Host delivery: run a Python function on records as a JAX callback.

Contract: ``on_host(fn, every=1)`` serves two ways.

* As a hook inside ``vk.grad`` / ``vk.value_and_grad`` / ``vk.vjp``, it is *deferred*: the
  record it sees leaves the backward pass with the others, and ``send_records`` makes ONE
  ordered ``jax.debug.callback`` per backward pass for all hooked calls, however many. On the
  host ``fn(rec)`` then runs with numpy arrays, in backward order, once per layer call per
  step (per iteration under ``lax.scan``, per example under ``vmap`` of the transform).
  ``every=N`` delivers the 1st, (N+1)th, ... record of each call key; that count is kept on
  the host, so every step still pays the transfer. Elsewhere (``vk.jvp`` tangent hooks, inside
  ``vk.hook_chain``) each call emits its own callback.
* As ``vk.capture(..., host=on_host(fn, every=N))``, ``fn(captured)`` receives the whole
  step's captured dict in one transfer; ``every=N`` is then gated inside the graph by a
  step counter in the hook state, so skipped steps transfer nothing.

An exception in ``fn`` is re-raised as ``HostHookError`` naming the layer(s); under
``jit`` JAX surfaces it when the step's result is awaited.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import ConfigError, HostHookError
from ._records import Cotangents


def _pack(tree: Any) -> tuple[list, Callable[[Sequence], Any]]:
    """``(buffers, unpack)``: ``tree``'s leaves in one flat buffer per dtype, inside the graph.

    A host callback then costs one operand per dtype, not one per leaf; ``unpack(host
    buffers)`` rebuilds the tree with numpy arrays.
    """
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = sorted({np.dtype(leaf.dtype).name for leaf in leaves})
    groups = {dt: [i for i, leaf in enumerate(leaves) if np.dtype(leaf.dtype).name == dt] for dt in dtypes}
    buffers = [jnp.concatenate([jnp.ravel(leaves[i]) for i in groups[dt]]) for dt in dtypes]
    slices: list = [None] * len(leaves)  # (buffer index, start, stop, shape) per leaf
    for b, dt in enumerate(dtypes):
        start = 0
        for i in groups[dt]:
            size = int(np.prod(leaves[i].shape, dtype=np.int64))
            slices[i] = (b, start, start + size, tuple(leaves[i].shape))
            start += size

    def unpack(bufs: Sequence) -> Any:
        host = [np.asarray(buf) for buf in bufs]
        return jax.tree.unflatten(treedef, [host[b][lo:hi].reshape(shape) for b, lo, hi, shape in slices])

    return buffers, unpack


def send_records(payload: list, order: list) -> None:
    """One ordered callback that hands each ``vk.on_host`` hook its records, in backward order.

    Args:
        payload: per layer call, ``(records, ran)``: one record per host hook of the call (leaves
            stacked over its enclosing scans) and the per-iteration "the backward pass ran" flags.
        order: per group of calls that share their enclosing scans, ``(scan lengths, [hooks of
            each call])``, in backward order; ``payload`` lists the same calls in the same order.
    """
    buffers, unpack = _pack(payload)

    def deliver(*bufs):
        calls = iter(unpack(bufs))
        for lengths, hooks_per_call in order:
            group = [(hooks, next(calls)) for hooks in hooks_per_call]
            for index in reversed(list(np.ndindex(*lengths))):  # last iteration first
                for hooks, (records, ran) in group:
                    if ran[index] > 0:
                        for hook, rec in zip(hooks, records):
                            hook._deliver(jax.tree.map(lambda a, i=index: a[i], rec))

    jax.debug.callback(deliver, *buffers, ordered=True)


class on_host:  # noqa: N801  (a hook factory, used like a function)
    """A hook that runs ``fn(rec)`` on the host with numpy arrays.

    Args:
        fn: called with a ``Cotangents`` (or ``Tangents``) of numpy arrays, or with a
            ``{call key: Cotangents}`` dict when used as ``vk.capture(..., host=...)``.
            Its return value is ignored: host functions observe, they cannot rewrite.
        every: deliver one record in ``every`` per call key (``fc1``, ``fc1#1``, ...).

    Examples:
        >>> seen = []
        >>> g = vk.grad(loss, hooks={"fc*": vk.on_host(lambda rec: seen.append(rec.key))})
        >>> jax.jit(g)(params, x); jax.effects_barrier()
    """

    deferred = True  # inside vjpkit transforms, its records leave in the step's one transfer

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

    def send(self, captured: dict) -> None:
        """Delivers a step's captured records to ``fn`` in one ordered callback (see ``_pack``)."""
        buffers, unpack = _pack(captured)

        def deliver(*bufs):
            self._run(unpack(bufs), f"captured records of {sorted(captured)}")

        jax.debug.callback(deliver, *buffers, ordered=True)

    def _deliver(self, rec: Cotangents) -> None:
        seen = self.counts[rec.key]
        self.counts[rec.key] = seen + 1
        if seen % self.every == 0:
            self._run(jax.tree.map(np.asarray, rec), f"layer {rec.name!r} (call {rec.call})")

    def _run(self, payload: Any, where: str) -> None:
        try:
            self.fn(payload)
        except Exception as err:
            wrapped = HostHookError(
                f"{where}: the on_host function {getattr(self.fn, '__qualname__', self.fn)!r} raised "
                f"{type(err).__name__}: {err}. The traceback above it shows where; the step's outputs "
                "are not valid."
            )
            wrapped.original = err
            raise wrapped from err

    def __repr__(self) -> str:
        return f"on_host({getattr(self.fn, '__qualname__', self.fn)}, every={self.every})"
