"""Host delivery: run Python functions on records, one effect-free transfer per backward pass.

Contract: ``on_host(fn, every=1)`` serves two ways.

* As a hook inside ``vk.grad`` / ``vk.value_and_grad`` / ``vk.vjp``, it is *deferred*: the
  record it sees leaves the backward pass with the others, and ``send_records`` makes ONE host
  transfer per backward pass for all hooked calls, however many. On the host ``fn(rec)`` then
  runs with numpy arrays, in backward order, once per layer call (per iteration under
  ``lax.scan``, per example under ``vmap`` of the transform).
* As ``vk.capture(..., host=on_host(fn, every=N))``, ``fn(captured)`` receives the whole step's
  captured dict in one transfer.

Elsewhere (``vk.jvp`` tangent hooks, inside ``vk.hook_chain``) each call emits its own ordered
``jax.debug.callback``.

``every=N`` hands ``fn`` the records of the 1st, (N+1)th, ... backward pass. When the function
threads ``hook_state=`` (``vk.init_hook_state``; ``fit`` does), the count lives in the hook
state and the decision is made inside the graph: a skipped step transfers nothing. Without
``hook_state`` the count is kept on the host, and every step pays the transfer. It then counts
steps, not callbacks: inside ``jax.pmap`` / ``jax.shard_map`` every device makes its own
callback each step, so the transfer carries the device's index on the named axes
(``_position``) and the host keeps one count per index (and per example under ``vmap``, by
``_callback.batch_index``), under a lock, as the devices' callbacks may run at the same time.
A ``jit`` over sharded arrays makes one callback per step (on one device), and one count.

Transfers are ``_callback.host_call`` calls (no JAX effect, so a jitted step keeps JAX's fast
dispatch path) chained to each other and tied to every array the transform returns: a step's
host functions have run, in order, once its outputs are ready (``jax.block_until_ready``), and
before any later step that uses them. They run even when only part of the output is used.
An exception in ``fn`` is re-raised as ``HostHookError`` naming the layer(s); under ``jit``
JAX surfaces it when the step's result is awaited.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _callback, _compat
from ._callback import host_call
from ._errors import ConfigError, HostHookError
from ._hook_base import at_iteration
from ._records import Cotangents


def _pack(tree: Any) -> tuple[list, Callable[[Sequence], Any]]:
    """``(buffers, unpack)``: ``tree``'s leaves in one flat buffer per dtype, inside the graph.

    A host callback then costs one operand per dtype, not one per leaf; ``unpack(host
    buffers)`` rebuilds the tree with numpy arrays.
    """
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = sorted({np.dtype(leaf.dtype).name for leaf in leaves})
    groups = {dt: [i for i, leaf in enumerate(leaves) if np.dtype(leaf.dtype).name == dt] for dt in dtypes}
    sizes = [int(np.prod(np.shape(leaf), dtype=np.int64)) for leaf in leaves]
    # lax, not jnp: a jnp function traces once per shape, and a capture packs dozens of leaves
    flat = [lax.reshape(leaf, (size,)) for leaf, size in zip(leaves, sizes)]
    buffers = [lax.concatenate([flat[i] for i in groups[dt]], 0) for dt in dtypes]
    slices: list = [None] * len(leaves)  # (buffer index, start, stop, shape) per leaf
    for b, dt in enumerate(dtypes):
        start = 0
        for i in groups[dt]:
            slices[i] = (b, start, start + sizes[i], tuple(np.shape(leaves[i])))
            start += sizes[i]

    def unpack(bufs: Sequence) -> Any:
        host = [np.asarray(buf) for buf in bufs]
        return jax.tree.unflatten(treedef, [host[b][lo:hi].reshape(shape) for b, lo, hi, shape in slices])

    return buffers, unpack


_gates = threading.local()


@contextlib.contextmanager
def gate(live: jax.Array):
    """Transfers made inside run only where ``live`` (a traced bool) is true.

    ``make_step`` uses it under ``nan_policy="stop"``: the steps after a non-finite one leave
    the state unchanged, and their host functions do not run.
    """
    stack = _gates.__dict__.setdefault("stack", [])
    stack.append(live)
    try:
        yield
    finally:
        stack.pop()


def transfer(
    fn: Callable[[Any], None], tree: Any, after: jax.Array | None = None, when: jax.Array | None = None
) -> jax.Array:
    """Calls ``fn(tree with numpy arrays)`` on the host, once; returns a float32 zero token.

    One ``_callback.host_call`` with one operand per dtype (``_pack``). It carries no JAX effect,
    so it runs only if the token is used: pass it to ``tie`` (or as ``after`` of the next
    transfer, which then runs after this one). Under ``vmap`` it runs once per example. With
    ``when`` (a traced bool), or inside ``gate``, it runs only where they are true; a skipped
    transfer moves nothing and returns ``after``'s token.
    """
    stack = _gates.__dict__.get("stack")
    if stack:
        when = stack[-1] if when is None else stack[-1] & when
    if when is None:
        return _send(fn, tree, after)
    skip = lambda tree, after: jnp.zeros((), jnp.float32) if after is None else after
    return jax.lax.cond(when, functools.partial(_send, fn), skip, tree, after)


def _send(fn: Callable[[Any], None], tree: Any, after: jax.Array | None) -> jax.Array:
    buffers, unpack = _pack(jax.lax.stop_gradient(tree))
    if not any(isinstance(b, jax.core.Tracer) for b in buffers):  # an eager call: run it here
        fn(unpack(buffers))
        return jnp.zeros((), jnp.float32)
    operands = buffers if after is None else [*buffers, jax.lax.stop_gradient(after)]
    n = len(buffers)
    return host_call(lambda *bufs: fn(unpack([np.array(b) for b in bufs[:n]])), *operands)


def tie(token: jax.Array | None, tree: Any) -> Any:
    """``tree``, each array made to depend on ``token`` (a ``select`` XLA fuses into consumers).

    The token is zero, so every value is unchanged; the dependency keeps the transfer alive
    and orders it before anything computed from ``tree``.
    """
    if token is None:
        return tree
    ok = lax.eq(token, np.zeros((), token.dtype))

    def tied(x):  # lax, not jnp.where: a jnp function traces once per shape
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.inexact):
            fill = np.nan
        elif jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
            fill = 0
        else:
            return x  # PRNG keys: not tied
        x = jnp.asarray(x)
        return lax.select(lax.broadcast(ok, x.shape), x, lax.full_like(x, fill))

    return jax.tree.map(tied, tree)


def _position() -> jax.Array | None:
    """This device's index on each named axis the step is traced under (``jax.pmap``,
    ``jax.shard_map``, a named ``vmap``), as float32; ``None`` outside them.

    Each device (or mapped example) makes its own host callback per step; the host counts
    ``every`` per position, so a step is counted once whatever the number of devices.
    """
    names = _compat.axis_names()
    if not names:
        return None
    return jnp.stack([jnp.asarray(jax.lax.axis_index(name), jnp.float32) for name in names])


def _where(position: Any) -> tuple[int, ...]:
    """On the host: the key of the counter a callback counts in (device position, example)."""
    return (*(int(v) for v in np.ravel(position)), *_callback.batch_index())


def _bare(hook: Any) -> Any:
    """A host hook without its iteration wrapper (the ``due`` flags are keyed by it)."""
    return hook.hook if isinstance(hook, at_iteration) else hook


def send_records(payload: list, order: list, due: dict, after: jax.Array | None = None) -> jax.Array:
    """One transfer that hands each ``vk.on_host`` hook its records, in backward order.

    Args:
        payload: per layer call, ``(records, ran)``: one record per host hook of the call (leaves
            stacked over its enclosing scans) and the per-iteration "the backward pass ran" flags.
        order: per group of calls that share their enclosing scans and shard_maps, ``(their
            sizes, which are shard_maps, [hooks of each call])``, in backward order; ``payload``
            lists the same calls in the same order. A hook gets one record per scan iteration,
            with the shards of the enclosing shard_maps on its leading axes (as capture).
        due: ``{hook: traced bool}`` for hooks whose ``every`` is decided in the graph; the
            others count backward passes on the host.
        after: a token this transfer must follow.

    Returns:
        The transfer's token.
    """
    gated = list(due)
    hooks_all = list({h: None for *_, per_call in order for hooks in per_call for h in hooks})
    counted = any(h.every > 1 for h in hooks_all if _bare(h) not in due)  # every counted on the host
    position = _position() if counted else None

    def deliver(tree):
        calls, flags = iter(tree[0]), dict(zip(gated, tree[1]))
        where = _where(tree[2]) if counted else ()
        counted_once: dict = {}  # one count per host hook and pass, however many globs give it

        def passes_for(h):
            bare = _bare(h)
            if bare in flags:
                return bool(flags[bare])
            if bare not in counted_once:
                counted_once[bare] = bare._count_pass(where)
            return counted_once[bare]

        passes = {h: passes_for(h) for h in hooks_all}
        for lengths, sharded, hooks_per_call in order:
            group = [(hooks, next(calls)) for hooks in hooks_per_call]
            loops = [1 if s else n for n, s in zip(lengths, sharded)]
            for index in reversed(list(np.ndindex(*loops))):  # last iteration first
                at = tuple(slice(None) if s else i for i, s in zip(index, sharded))  # every shard
                scan_index = tuple(i for i, s in zip(index, sharded) if not s)
                for hooks, (records, ran) in group:
                    if np.any(ran[at] > 0):
                        for hook, rec in zip(hooks, records):
                            if passes[hook] and (
                                not isinstance(hook, at_iteration) or hook.wants(scan_index)
                            ):
                                hook._deliver(jax.tree.map(lambda a, i=at: a[i], rec) if at else rec)

    flags = [jnp.asarray(due[h], jnp.float32) for h in gated]  # float32 like the records: one buffer
    # when every hook skips steps, nothing at all crosses to the host on a step where none is due
    when = jnp.any(jnp.stack(flags) > 0) if gated and len(gated) == len(hooks_all) else None
    return transfer(deliver, (payload, flags, [] if position is None else [position]), after, when)


class on_host:  # noqa: N801  (a hook factory, used like a function)
    """A hook that runs ``fn(rec)`` on the host with numpy arrays.

    Args:
        fn: called with a ``Cotangents`` (or ``Tangents``) of numpy arrays, or with a
            ``{call key: Cotangents}`` dict when used as ``vk.capture(..., host=...)``.
            Its return value is ignored: host functions observe, they cannot rewrite.
        every: run on the records of one backward pass in ``every`` (the 1st, (N+1)th, ...).
            With ``hook_state=`` threaded, skipped passes transfer nothing (module docstring).
            It counts steps, each device (under ``pmap`` / ``shard_map``) its own, never callbacks.

    Examples:
        >>> seen = []
        >>> g = vk.grad(loss, hooks={"fc*": vk.on_host(lambda rec: seen.append(rec.key))})
        >>> jax.block_until_ready(jax.jit(g)(params, x))  # the hooks have run once it is ready
    """

    deferred = True  # inside vjpkit transforms, its records leave in the step's one transfer

    def __init__(self, fn: Callable, every: int = 1):
        if not callable(fn):
            raise ConfigError(f"vk.on_host needs a callable, got {type(fn).__name__}.")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"vk.on_host: every must be a positive int, got {every!r}.")
        self.fn = fn
        self.every = every
        # backward passes seen, when every > 1 is counted on the host: per device position
        self.passes: collections.Counter = collections.Counter()
        self.counts: collections.Counter = collections.Counter()  # per (position, call key), __call__
        self._lock = threading.Lock()  # the devices of a mesh call back at the same time
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, rec: Cotangents) -> None:
        position = _position() if self.every > 1 else None

        def deliver(rec, position):  # here every call is its own callback: count per call key
            key = (_where(position) if position is not None else (), rec.key)
            with self._lock:
                seen = self.counts[key]
                self.counts[key] = seen + 1
            if seen % self.every == 0:
                self._run(jax.tree.map(np.asarray, rec), f"layer {rec.name!r} (call {rec.call})")

        jax.debug.callback(deliver, rec, position, ordered=True)

    def send(self, captured: dict, due: jax.Array | None = None, after: jax.Array | None = None):
        """One transfer of a step's captured records to ``fn``; returns its token.

        ``due`` (a traced bool) skips the transfer inside the graph; without it, ``every`` is
        counted on the host.
        """
        where = f"captured records of {sorted(captured)}"
        position = _position() if due is None and self.every > 1 else None

        def deliver(tree):
            records, at = tree
            if due is not None or self._count_pass(_where(at)):
                self._run(records, where)

        return transfer(deliver, (captured, [] if position is None else [position]), after, due)

    def _count_pass(self, where: tuple[int, ...] = ()) -> bool:
        """Counts one backward pass on the host at ``where`` (the calling device's position, and
        example under ``vmap``); whether ``fn`` sees this one. Thread-safe."""
        with self._lock:
            seen = self.passes[where]
            self.passes[where] = seen + 1
        return seen % self.every == 0

    def _deliver(self, rec: Cotangents) -> None:
        self._run(rec, None)

    def _run(self, payload: Any, where: str | None) -> None:
        try:
            self.fn(payload)
        except Exception as err:
            if where is None:  # a record: named only when needed (this runs once per call per step)
                where = f"layer {payload.name!r} (call {payload.call})"
            wrapped = HostHookError(
                f"{where}: the on_host function {getattr(self.fn, '__qualname__', self.fn)!r} raised "
                f"{type(err).__name__}: {err}. The traceback above it shows where; the step's outputs "
                "are not valid."
            )
            wrapped.original = err
            raise wrapped from err

    def __repr__(self) -> str:
        return f"on_host({getattr(self.fn, '__qualname__', self.fn)}, every={self.every})"
