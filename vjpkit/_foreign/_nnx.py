"""Flax NNX: ``vk.hookable(model)`` makes every submodule call a vjpkit layer call.

Contract: the classes of all modules in the model graph get a patched ``__call__`` (see
``_patch``); the model returned is the model given, so ``nnx.split``/``merge``, ``nnx.state``,
``jit`` and ``vmap`` see the original. Inside a vjpkit transform a call of module ``m`` is
``_primitive.call`` with ``params = nnx.to_pure_dict(nnx.state(m, nnx.Param))`` (nested dicts keyed
as NNX keys the state) and ``fn`` re-merging ``m`` with the given params.

Modules with other state (RNG streams of ``Dropout``, batch statistics of ``BatchNorm``, and
their parents) are layer calls too. NNX forbids mutating a Variable from a trace other than the
one that created it, and the layer's function is traced by ``jax.make_jaxpr`` inside the
enclosing trace, so that state crosses the call as values: its leaves are extra operands of the
call (not part of the record, like array keyword arguments), ``fn`` merges a fresh copy of the
module from them (``copy=True``), and when the call changed any of them (a Dropout drew a key,
a BatchNorm in training updated its statistics) the new values are outputs of the call and are
written back into ``m`` with ``nnx.update`` in the enclosing trace. The record's ``output`` is
then ``(y, updates)``, where ``updates`` is a nested dict, keyed like ``nnx.to_pure_dict``, of
the state leaves the call changed (``{"rngs": {"count": ...}}`` for a Dropout, ``{"mean": ...,
"var": ...}`` for a BatchNorm in training), as with linen's mutable collections; a call that
changes nothing records ``y`` alone.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from flax import nnx

from .. import _kinds
from .._errors import ConfigError
from . import _call, _patch


def path_in(parent: Any, child: Any) -> tuple[str, ...] | None:
    """The attribute path of ``child`` inside ``parent`` (by identity), or None."""
    for path, m in nnx.iter_modules(parent):
        if m is child:
            return tuple(str(p) for p in path)
    return None


def _kind(module: Any) -> _kinds.LayerKind | None:
    if type(module) is nnx.Linear:
        return _kinds.LayerKind("dense", {"kernel": "weight", "bias": "bias"})
    if type(module) in (nnx.Embed, nnx.LayerNorm, nnx.RMSNorm, nnx.Conv):
        graphdef, _, rest = nnx.split(module, nnx.Param, ...)
        call = _patch.unpatched(type(module))

        def fn(p, x):
            params = nnx.state(module, nnx.Param)
            nnx.replace_by_pure_dict(params, p)
            return call(nnx.merge(graphdef, params, rest), x)

        return _kinds.LayerKind("local", fn=fn, batched=True)
    if type(module) is nnx.BatchNorm and module.use_running_average is False:  # model.train()
        return _kinds.LayerKind("batch")  # statistics of the batch: examples are not independent
    return None


_STATE = "_vjpkit_nnx_state"


def layer(module: Any, original, args: tuple, kwargs: dict, default: str) -> Any:
    del original
    graphdef, params_state, rest = nnx.split(module, nnx.Param, ...)
    params = nnx.to_pure_dict(params_state)
    values = nnx.to_pure_dict(rest)
    stateful = bool(jax.tree.leaves(values))
    changed: list[bool] = []

    def apply(p, *xs, **kw):
        state = jax.tree.map(lambda a: a, params_state)
        nnx.replace_by_pure_dict(state, p)
        if not stateful:
            m = nnx.merge(graphdef, state, rest)
            _patch.reenter(m)
            return type(m).__call__(m, *xs, **kw)
        given = kw.pop(_STATE)
        others = jax.tree.map(lambda a: a, rest)
        nnx.replace_by_pure_dict(others, given)
        # Fresh Variables, created in this trace: NNX lets the call mutate them here.
        m = nnx.merge(graphdef, state, others, copy=True)
        _patch.reenter(m)
        y = type(m).__call__(m, *xs, **kw)
        new = nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Param)))
        if jax.tree.structure(new) != jax.tree.structure(given):
            raise ConfigError(
                f"vk.hookable: the NNX module {type(module).__name__} changed the structure of its "
                "non-parameter state during a call; vjpkit can pass only updated values back."
            )
        updates = _changed(given, new)
        changed.append(bool(updates))
        return (y, updates) if updates else y

    extra = {_STATE: values} if stateful else None
    out = _call.layer_call(apply, params, args, kwargs, default, lambda: _kind(module), extra)
    if not (changed and changed[-1]):
        return out
    y, updates = out
    full = _merged(values, updates)
    updated = jax.tree.map(lambda a: a, rest)
    nnx.replace_by_pure_dict(updated, full)
    nnx.update(module, updated)  # the enclosing trace created module's Variables: allowed here
    return y


def _changed(given: dict, new: dict) -> dict:
    """The leaves of ``new`` that are not the given ones, as a nested dict (empty: none)."""
    out: dict = {}
    old_leaves = jax.tree.leaves(given)
    for (path, leaf), before in zip(jax.tree_util.tree_flatten_with_path(new)[0], old_leaves):
        if leaf is not before:
            node = out
            for k in path[:-1]:
                node = node.setdefault(k.key, {})
            node[path[-1].key] = leaf
    return out


def _merged(values: dict, updates: dict) -> dict:
    """``values`` with the leaves in ``updates`` replaced."""
    merged = dict(values)
    for k, v in updates.items():
        merged[k] = _merged(values[k], v) if isinstance(v, dict) else v
    return merged


def make_hookable(model: Any) -> Any:
    """Patches the classes of every module in ``model``'s graph; returns ``model``."""
    framework = sys.modules[__name__]
    for _, m in nnx.iter_modules(model):
        if "__call__" in dir(type(m)):
            _patch.patch(type(m), framework)
    return model
