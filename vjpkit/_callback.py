"""``host_call``: an effect-free host callback that hands numpy buffers to Python without copies.

Contract: ``host_call(fn, *operands)`` returns a float32 zero token and, when the token is used,
runs ``fn(*numpy arrays)`` once on the host. It is a private primitive lowered with
``mlir.emit_python_callback`` (no JAX effect, so jitted steps keep the fast dispatch path),
which passes XLA's host buffers to ``fn`` directly: ``jax.pure_callback`` first copies them
into ``jax.Array`` objects, which costs more than the rest of a small step. The arrays ``fn``
receives are only valid during the call: copy what you keep. Under ``vmap`` it runs once per
example (sequentially), and ``batch_index()`` tells ``fn`` which example it runs for; its token
has no tangent. Where this JAX lacks that lowering helper,
``host_call`` falls back to ``jax.pure_callback``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from . import _compat

_TOKEN = jax.ShapeDtypeStruct((), jnp.float32)


def _direct_lowering_available() -> bool:
    emit = getattr(mlir, "emit_python_callback", None)
    try:
        params = inspect.signature(emit).parameters
    except (TypeError, ValueError):
        return False
    return {"has_side_effect", "returns_token"} <= set(params)


host_p = jcore.Primitive("vjpkit_host_call")


def _abstract_eval(*avals, fn):
    return jax.core.ShapedArray((), jnp.float32)


def _op_sharding(ctx):
    """Where the callback runs in an SPMD program: once, on one device (MAXIMAL), for a jit over
    sharded arrays (the record is the global array); per device (MANUAL) inside ``shard_map``.

    Without it, SPMD partitioning replicates the callback on every device: a host hook would
    run once per device. This is ``jax.pure_callback``'s own placement.
    """
    placement = _compat.callback_op_sharding()
    if placement is None:  # pragma: no cover - a JAX without the helper: no annotation
        return None
    return placement(ctx.module_context.axis_context, None, ctx.avals_out)


def _lowering(ctx, *args, fn):
    def callback(*bufs):
        fn(*bufs)
        return (np.zeros((), np.float32),)

    result, _, _ = mlir.emit_python_callback(
        ctx,
        callback,
        None,
        list(args),
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=False,
        returns_token=False,
        sharding=_op_sharding(ctx),
    )
    return result


_example = threading.local()


def batch_index() -> tuple[int, ...]:
    """Inside a ``host_call`` function run under ``vmap``: the example's index on each vmapped
    axis, outermost first; ``()`` elsewhere (and with the ``jax.pure_callback`` fallback)."""
    return getattr(_example, "index", ())


class _PerExample:
    """``fn`` under one ``vmap``: its last operand is the example's index, which ``batch_index()``
    returns (after the enclosing vmaps' indices) while ``fn`` runs on the rest."""

    def __init__(self, fn: Callable[..., None]):
        self.fn = fn

    def __call__(self, *bufs):
        outer = batch_index()
        _example.index = (*outer, int(bufs[-1]))
        try:
            self.fn(*bufs[:-1])
        finally:
            _example.index = outer


def _batch(args, dims, *, fn):
    mapped = [isinstance(d, int) for d in dims]  # an unmapped operand's dim is None
    size = next(a.shape[d] for a, d, m in zip(args, dims, mapped) if m)
    moved = [
        jnp.moveaxis(a, d, 0) if m else jnp.broadcast_to(a, (size, *a.shape))
        for a, d, m in zip(args, dims, mapped)
    ]
    per_example = _PerExample(fn)
    index = jnp.arange(size, dtype=jnp.int32)
    return jax.lax.map(lambda xs: host_p.bind(*xs, fn=per_example), (*moved, index)), 0


def _jvp(primals, tangents, *, fn):
    out = host_p.bind(*primals, fn=fn)
    return out, ad.Zero.from_primal_value(out)


host_p.def_impl(lambda *args, fn: jax.jit(lambda *a: host_p.bind(*a, fn=fn))(*args))
host_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[host_p] = _batch
ad.primitive_jvps[host_p] = _jvp
mlir.register_lowering(host_p, _lowering)

DIRECT = _direct_lowering_available()


def host_call(fn: Callable[..., None], *operands: jax.Array) -> jax.Array:
    """Runs ``fn(*operands as numpy arrays)`` on the host once the returned token is used."""
    if DIRECT:
        return host_p.bind(*operands, fn=fn)

    def callback(*bufs):
        fn(*(np.asarray(b) for b in bufs))
        return np.zeros((), np.float32)

    return jax.pure_callback(callback, _TOKEN, *operands, vmap_method="sequential")
