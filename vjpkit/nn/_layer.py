"""The layer abstraction: a NamedTuple ``(init, apply)`` of pure functions, as in stax.

Contract: ``init(key, *example_inputs) -> params`` and ``apply(params, *inputs, **kwargs) ->
output``. ``init`` may receive ``jax.ShapeDtypeStruct`` example inputs (from ``serial``), so it
reads only ``.shape`` and ``.dtype``. Every layer made by ``layer`` is hookable: its
``apply`` runs through ``vjpkit._primitive.call``, which is a plain call outside vjpkit
transforms. Keyword arguments a layer's function does not declare are ignored, so that a
combinator can pass ``key=`` or ``deterministic=`` to all of its children.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import _primitive
from .._errors import ConfigError


class Layer(NamedTuple):
    """A layer: two pure functions.

    Attributes:
        init: ``init(key, *example_inputs) -> params``.
        apply: ``apply(params, *inputs, **kwargs) -> output``.

    Examples:
        >>> fc = nn.dense(4)
        >>> params = fc.init(jax.random.key(0), jnp.ones((2, 3)))
        >>> fc.apply(params, jnp.ones((2, 3))).shape
        (2, 4)
    """

    init: Callable[..., Any]
    apply: Callable[..., Any]


def _accepted_kwargs(fn: Callable) -> Callable[[dict], dict]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return lambda kw: kw
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return lambda kw: kw
    names = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return lambda kw: {k: v for k, v in kw.items() if k in names}


def _no_params(key, *inputs) -> dict:
    del key, inputs
    return {}


def layer(fn: Callable, init: Callable | None = None, *, name: str | None = None) -> Layer:
    """Makes a pure function ``fn(params, *inputs, **kwargs)`` a named, hookable layer.

    Args:
        fn: the layer's computation. Keyword-only parameters it declares (``key``,
            ``deterministic``, ...) are passed through; it must not close over traced values.
        init: ``init(key, *example_inputs) -> params``; defaults to no parameters (``{}``).
        name: the layer's name when no combinator names it (defaults to ``fn.__name__``).

    Examples:
        >>> scale = nn.layer(lambda p, x: p["s"] * x, lambda key, x: {"s": jnp.ones(())}, name="scale")
        >>> vk.grad(lambda p, x: scale.apply(p, x).sum(), hooks={"scale": vk.on_host(print)})
    """
    if not callable(fn):
        raise ConfigError(f"nn.layer needs a callable fn(params, *inputs), got {type(fn).__name__}.")
    if init is not None and not callable(init):
        raise ConfigError(f"nn.layer: init must be callable init(key, *inputs), got {type(init).__name__}.")
    default = name or getattr(fn, "__name__", "layer")
    if default == "<lambda>":
        default = "layer"
    if "/" in default:
        raise ConfigError(f"nn.layer: the name {default!r} contains '/', which separates nested names.")
    accept = _accepted_kwargs(fn)

    def apply(params, *inputs, **kwargs):
        return _primitive.call(fn, params, inputs, accept(kwargs), default)

    return Layer(init if init is not None else _no_params, apply)


def positive_pair(what: str, arg: str, v) -> tuple[int, int]:
    """``v`` as ``(h, w)`` from an int or a pair of positive ints; a ``ConfigError`` otherwise."""
    pair = (v, v) if isinstance(v, (int, np.integer)) else tuple(v) if isinstance(v, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(k, (int, np.integer)) and k > 0 for k in pair):
        raise ConfigError(f"{what}: {arg} must be a positive int or a pair of them (h, w), got {v!r}.")
    return pair


def require_param(params: Any, key: str, who: str, shape: str) -> Any:
    """``params[key]``, or a ``ConfigError`` naming the layer, the missing key and what it has."""
    if isinstance(params, dict) and key in params:
        return params[key]
    has = f"keys {sorted(params)}" if isinstance(params, dict) else f"a {type(params).__name__}"
    raise ConfigError(
        f"{who}: params has no {key!r} (it has {has}). This layer's params are a dict with "
        f"{key!r} of shape {shape}, as its init returns. Pass this layer's own entry of the "
        "model's params (params['fc1'] for the layer named 'fc1'), or params from model.init of "
        "this model."
    )
