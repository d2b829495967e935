"""Parameter-less layers: activations, ``flatten``, ``dropout``, ``max_pool``, ``avg_pool``.

Contract: each returns a hookable ``Layer`` with empty params. Pools are NHWC
and use ``lax.reduce_window``; ``avg_pool`` divides by the window size (padding counts as 0).
``dropout`` takes its randomness explicitly: ``apply(params, x, key=k)``, or
``deterministic=True`` for the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import ConfigError
from ._layer import Layer, layer


def _activation(f, default_name: str, doc: str):
    def make(*, name: str | None = None) -> Layer:
        def fn(params, x):
            del params
            return f(x)

        return layer(fn, name=name or default_name)

    make.__name__ = make.__qualname__ = default_name
    make.__doc__ = f"{doc}\n\n    Example:\n        >>> nn.serial(fc=nn.dense(4), act=nn.{default_name}())\n"
    return make


relu = _activation(jax.nn.relu, "relu", "Elementwise ``max(x, 0)``.")
tanh = _activation(jnp.tanh, "tanh", "Elementwise ``tanh(x)``.")
sigmoid = _activation(jax.nn.sigmoid, "sigmoid", "Elementwise ``1 / (1 + exp(-x))``.")


def gelu(approximate: bool = False, *, name: str | None = None) -> Layer:
    """GELU; exact (erf) by default like ``torch.nn.GELU``, tanh form with ``approximate=True``.

    Examples:
        >>> nn.serial(fc=nn.dense(4), act=nn.gelu())
    """

    def fn(params, x):
        del params
        return jax.nn.gelu(x, approximate=approximate)

    return layer(fn, name=name or "gelu")


def flatten(*, name: str | None = None) -> Layer:
    """Reshapes ``(batch, ...)`` to ``(batch, -1)``.

    Examples:
        >>> nn.flatten().apply({}, jnp.ones((2, 3, 4))).shape
        (2, 12)
    """

    def fn(params, x):
        del params
        return x.reshape(x.shape[0], -1)

    return layer(fn, name=name or "flatten")


def dropout(rate: float, *, name: str | None = None) -> Layer:
    """Zeroes each element with probability ``rate`` and scales the rest by ``1 / (1 - rate)``.

    ``apply(params, x, key=k)`` draws the mask from ``k``; ``deterministic=True`` is the identity.

    Examples:
        >>> drop = nn.dropout(0.5)
        >>> drop.apply({}, jnp.ones(4), key=jax.random.key(0)).shape
        (4,)
    """
    if not 0.0 <= rate < 1.0:
        raise ConfigError(f"nn.dropout: rate must be in [0, 1), got {rate!r}.")

    def fn(params, x, *, key=None, deterministic=False):
        del params
        if not isinstance(deterministic, (bool, np.bool_)):
            raise ConfigError(
                f"nn.dropout: deterministic must be a Python bool, got {type(deterministic).__name__}. "
                "It decides the graph, so under jax.jit make it static: "
                "jax.jit(apply, static_argnames='deterministic') or "
                "functools.partial(apply, deterministic=True)."
            )
        if deterministic or rate == 0.0:
            return x
        if key is None:
            raise ConfigError(
                f"nn.dropout({rate}) needs randomness: call apply(params, x, key=jax.random.key(...)) "
                "(serial splits it for its children), or pass deterministic=True for evaluation."
            )
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))

    return layer(fn, name=name or "dropout")


def _pool(reducer, init_value, window, stride, padding, average: bool, default_name: str, name):
    wh, ww = (window, window) if isinstance(window, int) else tuple(window)
    if stride is None:
        sh, sw = wh, ww
    else:
        sh, sw = (stride, stride) if isinstance(stride, int) else tuple(stride)

    def fn(params, x):
        del params
        y = jax.lax.reduce_window(
            x, np.array(init_value, x.dtype), reducer, (1, wh, ww, 1), (1, sh, sw, 1), padding
        )
        return y / jnp.array(wh * ww, x.dtype) if average else y

    return layer(fn, name=name or default_name)


def max_pool(window=2, stride=None, padding="VALID", *, name: str | None = None) -> Layer:
    """Max over ``window`` patches of NHWC input (stride defaults to the window).

    Examples:
        >>> nn.max_pool(2).apply({}, jnp.ones((1, 4, 4, 3))).shape
        (1, 2, 2, 3)
    """
    return _pool(jax.lax.max, -np.inf, window, stride, padding, False, "max_pool", name)


def avg_pool(window=2, stride=None, padding="VALID", *, name: str | None = None) -> Layer:
    """Mean over ``window`` patches of NHWC input (stride defaults to the window).

    Examples:
        >>> nn.avg_pool(2).apply({}, jnp.ones((1, 4, 4, 3))).shape
        (1, 2, 2, 3)
    """
    return _pool(jax.lax.add, 0, window, stride, padding, True, "avg_pool", name)
