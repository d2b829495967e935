"""Equinox: ``vk.hookable(model)`` makes every submodule call a vjpkit layer call.

Contract: the classes of all modules in the model get a patched ``__call__`` (see
``_patch``); the model returned is the model given, so its pytree structure, ``jit``/``vmap``
behaviour and serialisation are those of the original. Inside a vjpkit transform a call of
module ``m`` is ``_primitive.call`` with ``params = eqx.filter(m, eqx.is_inexact_array)`` (an
Equinox module of arrays, keyed by field) and ``fn(p, *xs) = eqx.combine(p, static)(*xs)``.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from .. import _kinds
from . import _call, _patch


def _key_name(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_in(parent: Any, child: Any) -> tuple[str, ...] | None:
    """The attribute path of ``child`` inside ``parent`` (by identity), or None."""
    found: list[tuple[str, ...]] = []

    def is_leaf(x):
        return x is child and not found

    for path, leaf in jax.tree_util.tree_flatten_with_path(parent, is_leaf=is_leaf)[0]:
        if leaf is child:
            return tuple(_key_name(k) for k in path)
    return None


def _kind(module: Any) -> _kinds.LayerKind | None:
    roles = {"weight": "weight", "bias": "bias"}
    if type(module) is eqx.nn.Linear:
        if module.in_features == "scalar" or module.out_features == "scalar":
            return None
        return _kinds.LayerKind("dense", roles, transpose=True, batched=False)
    if type(module) in (eqx.nn.Embedding, eqx.nn.LayerNorm, eqx.nn.RMSNorm) or (
        isinstance(module, eqx.nn.Conv) and module.num_spatial_dims == 2
    ):
        static = eqx.filter(module, eqx.is_inexact_array, inverse=True)
        fn = lambda p, x: _patch.unpatched(type(module))(eqx.combine(p, static), x)
        return _kinds.LayerKind("local", fn=fn, batched=False)
    if type(module) is eqx.nn.BatchNorm and not module.inference:
        return _kinds.LayerKind("batch")  # statistics of the batch: examples are not independent
    return None


def layer(module: Any, original, args: tuple, kwargs: dict, default: str) -> Any:
    params, static = eqx.partition(module, eqx.is_inexact_array)

    def apply(p, *xs, **kw):
        m = eqx.combine(p, static)
        _patch.reenter(m)
        return type(m).__call__(m, *xs, **kw)

    return _call.layer_call(apply, params, args, kwargs, default, lambda: _kind(module))


def make_hookable(model: Any) -> Any:
    """Patches the classes of every module in ``model``; returns ``model``."""
    import sys

    framework = sys.modules[__name__]
    seen: set[type] = set()
    _classes(model, seen)
    for cls in seen:
        if callable(cls) and "__call__" in dir(cls):
            _patch.patch(cls, framework)
    return model


def _classes(node: Any, seen: set) -> None:
    seen.add(type(node))
    for x in jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, eqx.Module) and x is not node):
        if isinstance(x, eqx.Module):
            _classes(x, seen)
