"""Combinators: ``serial`` (named composition) and ``residual``.

Contract: combinators return ``Layer`` and are transparent to hooks: they name their
children (``serial`` pushes each child's name, joined with ``/``) but make no record of their
own. To hook a whole block, wrap it with ``nn.layer(block.apply, block.init, name=...)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from .. import _context
from .._errors import ConfigError
from . import _random
from ._layer import Layer


def _children(layers: tuple, named: dict) -> list[tuple[str, Layer]]:
    children: list[tuple[str, Layer]] = []
    for i, item in enumerate(layers):
        if isinstance(item, tuple) and not isinstance(item, Layer) and len(item) == 2:
            children.append((item[0], item[1]))
        else:
            children.append((str(i), item))
    children.extend(named.items())
    if not children:
        raise ConfigError("nn.serial needs at least one child layer.")
    seen: dict[str, int] = {}
    for position, (name, child) in enumerate(children):
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(
                f"nn.serial: child {position} has name {name!r}; names must be non-empty strings "
                "without '/' ('/' joins nested names)."
            )
        if not isinstance(child, Layer):
            raise ConfigError(
                f"nn.serial: child {name!r} is a {type(child).__name__}, not an nn.Layer. "
                "Build layers with nn.dense(...), nn.relu(), nn.layer(fn, init), ..."
            )
        if name in seen:
            raise ConfigError(
                f"nn.serial: two children are named {name!r} (positions {seen[name]} and {position}). "
                "Names must be unique: they key params and select hooks. Rename one."
            )
        seen[name] = position
    return children


def serial(*layers: Any, **named_layers: Layer) -> Layer:
    """Composes layers in order and names them, like ``torch.nn.Sequential``.

    Positional children are named ``"0"``, ``"1"``, ...; a positional ``(name, layer)`` pair or
    a keyword gives the name. Keyword children come after positional ones. ``params`` maps
    each name to that child's params; parameter-less children have no entry. ``apply`` passes
    its keyword arguments to every child, splitting ``key=`` into one subkey per child.

    Examples:
        >>> model = nn.serial(fc1=nn.dense(20), relu1=nn.relu(), fc2=nn.dense(2))
        >>> params = model.init(jax.random.key(0), jnp.ones((8, 3)))
        >>> sorted(params)
        ['fc1', 'fc2']
    """
    children = _children(layers, named_layers)
    names = [name for name, _ in children]

    def init(key, *inputs):
        params = {}
        xs = inputs
        for (name, child), k in zip(children, _random.split(key, len(children))):
            k_init, k_apply = _random.split(k)
            p = child.init(k_init, *xs)
            if jax.tree.leaves(p) or (p and not isinstance(p, dict)):
                params[name] = p
            xs = (jax.eval_shape(functools.partial(child.apply, key=k_apply), p, *xs),)
        return params

    def apply(params, *inputs, key=None, **kwargs):
        extra = set(params) - set(names) if isinstance(params, dict) else set()
        if extra:
            raise ConfigError(
                f"nn.serial: params has entries {sorted(extra)} that are not children of this serial "
                f"(children: {names}). Were these params made by another model's init?"
            )
        keys = _random.split(key, len(children)) if key is not None else [None] * len(children)
        xs = inputs
        for (name, child), k in zip(children, keys):
            kw = dict(kwargs, key=k) if k is not None else kwargs
            with _context.name_scope(name):
                y = child.apply(params.get(name, {}), *xs, **kw)
            xs = (y,)
        return y

    return Layer(init, apply)


def residual(inner: Layer) -> Layer:
    """``x + inner(x)``, with ``inner``'s params and names unchanged.

    Examples:
        >>> block = nn.residual(nn.serial(fc=nn.dense(8), act=nn.relu()))
    """
    if not isinstance(inner, Layer):
        raise ConfigError(f"nn.residual needs an nn.Layer, got {type(inner).__name__}.")

    def apply(params, x, **kwargs):
        return x + inner.apply(params, x, **kwargs)

    return Layer(inner.init, apply)
