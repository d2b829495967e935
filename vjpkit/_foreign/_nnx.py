"""Flax NNX: ``vk.hookable(model)`` makes every submodule call a vjpkit layer call.

Contract: the classes of all modules in the model graph get a patched ``__call__`` (see
``_patch``); the model returned is the model given, so ``nnx.split``/``merge``, ``nnx.state``,
``jit`` and ``vmap`` see the original. Inside a vjpkit transform a call of module ``m`` is
``_rule.call`` with ``params = nnx.to_pure_dict(nnx.state(m, nnx.Param))`` (nested dicts keyed
as NNX keys the state) and ``fn`` re-merging ``m`` with the given params. When ``m`` holds
RNG streams or batch statistics (``Dropout``, ``BatchNorm``, and their parents), NNX forbids
writing their updates back from inside the rule: such a call runs plain, with no record of its
own, and its children are recorded as usual.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from flax import nnx

from . import _call, _kinds, _patch


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
    return None


def layer(module: Any, original, args: tuple, kwargs: dict, default: str) -> Any:
    graphdef, params_state, rest = nnx.split(module, nnx.Param, ...)
    if _stateful(rest):
        # RNG counters or batch statistics would have to be written back from inside the rule,
        # which NNX forbids across trace levels: a plain call (children are still recorded).
        with _patch.running(module):
            return original(module, *args, **kwargs)
    params = nnx.to_pure_dict(params_state)

    def apply(p, *xs, **kw):
        state = jax.tree.map(lambda a: a, params_state)
        nnx.replace_by_pure_dict(state, p)
        m = nnx.merge(graphdef, state, rest)
        _patch.reenter(m)
        return type(m).__call__(m, *xs, **kw)

    return _call.layer_call(apply, params, args, kwargs, default, lambda: _kind(module))


def _stateful(rest: Any) -> bool:
    """Whether ``rest`` holds state a call may update (RNG counters, batch statistics)."""
    leaves = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return any(isinstance(v, (nnx.RngState, nnx.BatchStat)) for v in leaves)


def make_hookable(model: Any) -> Any:
    """Patches the classes of every module in ``model``'s graph; returns ``model``."""
    framework = sys.modules[__name__]
    for _, m in nnx.iter_modules(model):
        if "__call__" in dir(type(m)):
            _patch.patch(type(m), framework)
    return model
