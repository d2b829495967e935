"""One foreign submodule call as one vjpkit layer call (shared by linen, NNX and Equinox).

Contract: ``layer_call(apply, params, args, kwargs, name, kind)`` computes
``apply(params, *args, **kwargs)`` through ``vjpkit._primitive.call`` under the layer name
``name`` (relative to the current name scope). Positional arguments whose leaves are all
arrays are the record's ``input`` (one such argument: the array itself; several: a tuple);
other positional arguments (flags, ``None``, Python numbers) are static. Keyword arguments
that are float arrays may need a gradient, so they join the inputs as a trailing dict; other
array keyword arguments (masks, PRNG keys) are passed through as non-differentiable operands;
the rest are static.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _kinds, _primitive


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _dynamic(x: Any) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(_is_array(leaf) for leaf in leaves)


def _float_tree(x: Any) -> bool:
    return any(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in jax.tree.leaves(x))


def layer_call(
    apply: Callable,
    params: Any,
    args: tuple,
    kwargs: dict,
    name: str,
    kind: Callable[[], _kinds.LayerKind | None] | None = None,
    extra: dict | None = None,
) -> Any:
    """``apply(params, *args, **kwargs)`` as the vjpkit layer call ``name``.

    ``extra``: keyword arguments of arrays that ``apply`` receives as operands of the call that
    are not part of the record (a module's non-parameter state).
    """
    positions = [i for i, a in enumerate(args) if _dynamic(a)]
    dyn_kw = {k: v for k, v in kwargs.items() if _dynamic(v)}
    float_kw = {k: v for k, v in dyn_kw.items() if _float_tree(v)}
    pass_kw = {k: v for k, v in dyn_kw.items() if k not in float_kw}
    static_kw = {k: v for k, v in kwargs.items() if k not in dyn_kw}
    pass_kw.update(extra or {})
    inputs = tuple(args[i] for i in positions)
    if float_kw:
        inputs = (*inputs, float_kw)

    def fn(p, *xs, **kw):
        full = list(args)
        if float_kw:
            *xs, extra = xs
            kw = {**kw, **extra}
        for i, x in zip(positions, xs):
            full[i] = x
        return apply(p, *full, **kw, **static_kw)

    return _primitive.call(fn, params, inputs, pass_kw, name, kind() if kind is not None else None)
