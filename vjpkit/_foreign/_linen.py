"""Flax linen: every bound module's ``__call__`` is a vjpkit layer call, with no wrapping.

Contract: ``linen_interception()`` registers a ``flax.linen.intercept_methods`` interceptor.
While a vjpkit transform traces (``_context.current()`` is not None), each call of a bound,
non-initialising linen module's ``__call__`` becomes ``_primitive.call`` with

* name: the module path joined with ``/`` (``"Dense_0"``, ``"Encoder_0/Dense_1"``, or the
  ``name=`` given), under any enclosing vjpkit name scope; the root module (empty path) is
  named by its class;
* ``params``: that module's ``params`` collection, keyed as Flax keys it (a plain dict);
* ``fn``: the module re-applied to the given params through Flax's own lifting
  (``flax.core.lift.pack``), so RNG streams, other collections and child names are those of the
  un-intercepted call. Child module calls inside are layer calls too.

When the apply has mutable collections (``mutable=["batch_stats"]``), their updates must leave
the rule as outputs: the record's ``output`` is then ``(y, updates)``.
Outside vjpkit transforms the interceptor passes every call straight through.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
from flax.core import lift, unfreeze
from flax.core.scope import is_filter_empty

from .. import _context, _kinds
from . import _call

_local = threading.local()


def _paths() -> list[tuple[str, ...]]:
    if not hasattr(_local, "paths"):
        _local.paths = []
    return _local.paths


def _pairs(v: Any, n: int = 2) -> tuple[int, ...]:
    if v is None:
        return (1,) * n
    if isinstance(v, int):
        return (v,) * n
    return tuple(int(a) for a in v)


def _kind(module: nn.Module) -> _kinds.LayerKind | None:
    """The per-example kind of a linen layer, or None (no fast path)."""
    if type(module) is nn.Dense:
        return _kinds.LayerKind("dense", {"kernel": "weight", "bias": "bias"})
    if type(module) is nn.DenseGeneral:
        axis = (module.axis,) if isinstance(module.axis, int) else tuple(module.axis)
        n = len(axis)
        if not module.batch_dims and sorted(axis) == list(range(-n, 0)):
            return _kinds.LayerKind("dense", {"kernel": "weight", "bias": "bias"}, in_ndim=n)
        return _local_kind(module)
    if type(module) is nn.Conv:
        ks = (module.kernel_size,) if isinstance(module.kernel_size, int) else tuple(module.kernel_size)
        n, pad = len(ks), module.padding
        if isinstance(pad, int):
            pad = ((pad, pad),) * n
        elif not isinstance(pad, str) and not callable(pad):
            pad = tuple((p, p) if isinstance(p, int) else tuple(p) for p in pad)
        ok = (
            n in (1, 2)
            and module.feature_group_count == 1
            and _pairs(module.input_dilation, n) == (1,) * n
            and getattr(module, "mask", None) is None
            and getattr(module, "conv_general_dilated", None) is None
            and getattr(module, "conv_general_dilated_cls", None) is None
            and not callable(pad)
            and pad not in ("CIRCULAR", "CAUSAL", "REFLECT")
            and (isinstance(pad, str) or len(pad) == n)
        )
        if ok:
            return _kinds.LayerKind(
                "conv",
                {"kernel": "weight", "bias": "bias"},
                strides=_pairs(module.strides, n),
                padding=pad,
                dilation=_pairs(module.kernel_dilation, n),
            )
        return _local_kind(module)
    if type(module) is nn.BatchNorm:
        running = module.use_running_average
        if running is False or (running is None and module.is_mutable_collection("batch_stats")):
            return _kinds.LayerKind("batch")  # statistics of the batch: examples are not independent
        return None
    if type(module) in (nn.Embed, nn.LayerNorm, nn.RMSNorm):
        return _local_kind(module)
    return None


def _local_kind(module: nn.Module) -> _kinds.LayerKind:
    unbound = module.clone(parent=None)
    return _kinds.LayerKind("local", fn=lambda p, x: unbound.apply({"params": p}, x), batched=True)


def _relative(path: tuple[str, ...]) -> tuple[str, ...]:
    """The components ``path`` adds to the innermost intercepted module's path."""
    paths = _paths()
    outer = paths[-1] if paths else ()
    if path[: len(outer)] == outer:
        return path[len(outer) :]
    return path


def _interceptor(next_fun, args, kwargs, context):
    module = context.module
    if (
        context.method_name != "__call__"
        or _context.current() is None
        or module.scope is None
        or module.is_initializing()
    ):
        return next_fun(*args, **kwargs)
    if getattr(_local, "reentry", None) is module:  # our own lifted re-application
        _local.reentry = None
        return next_fun(*args, **kwargs)
    path = tuple(module.path)
    default = type(module).__name__
    mutable = not is_filter_empty(module.scope.mutable)
    method = type(module).__call__

    def body(mdl, *xs, **kw):
        _local.reentry = mdl
        return method(mdl, *xs, **kw)

    def transform(body_fn, scope, *xs, **kw):
        def inner(scope_fn, repack_fn, variable_groups, rng_groups, *xs, **kw):
            (params,), (others,) = variable_groups
            params = unfreeze(params.get("params", {}))

            def apply(p, *ins, **kw):
                s = scope_fn((({"params": p},), (others,)), rng_groups)
                y = body_fn(s, *ins, **kw)
                return (y, repack_fn(s)) if mutable else y

            out = _call.layer_call(apply, params, xs, kw, default, lambda: _kind(module))
            return out if mutable else (out, ((),))

        out_filters = (True,) if mutable else ()
        packed = lift.pack(inner, ("params", True), out_filters, (True,), name="vjpkit", enable_kwargs=True)
        return packed(scope, *xs, **kw)

    components = _relative(path)
    paths = _paths()
    with contextlib.ExitStack() as stack:
        for c in components:
            stack.enter_context(_context.name_scope(c))
        paths.append(path)
        try:
            return nn.transforms.lift_direct_transform(
                transform, (body,), module, *args, multi_scope=False, **kwargs
            )
        finally:
            paths.pop()


@contextlib.contextmanager
def linen_interception() -> Iterator[None]:
    """Makes linen module calls vjpkit layer calls while a vjpkit transform traces."""
    with nn.intercept_methods(_interceptor):
        yield
