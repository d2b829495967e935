"""Parameter-less layers: activations, ``flatten``, ``dropout``, ``max_pool``, ``avg_pool``.

Contract: each returns a hookable ``Layer`` with empty params. Pools are NHWC; ``avg_pool``
divides by the window size (padding counts as 0). Non-overlapping pools (stride == window, the
default) pad, reshape to ``(B, Ho, wh, Wo, ww, C)`` and reduce: their gradient is a plain
elementwise mask, where ``lax.reduce_window``'s (``select_and_scatter``) made a 2x2 max-pool
the slowest op of a small CNN's step on XLA:CPU. Overlapping pools use ``lax.reduce_window``.
For ``max_pool`` the gradient is the same except on ties inside one window: the
non-overlapping path shares it equally between the tied maxima (as ``jnp.max`` does), where
``reduce_window`` gives it all to one of them.
``dropout`` takes its randomness explicitly: ``apply(params, x, key=k)``, or
``deterministic=True`` for the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import ConfigError
from ._layer import Layer, layer, positive_pair


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


def _reduce_blocks(x, fill, window, padding, reducer):
    """``reduce_window`` for stride == window, as pad + reshape + reduce."""
    wh, ww = window
    if isinstance(padding, str):
        pads = jax.lax.padtype_to_pads(x.shape[1:3], window, window, padding)
    else:
        pads = [tuple(p) for p in padding]
    if any(p != (0, 0) for p in pads):
        x = jax.lax.pad(x, fill, [(0, 0, 0), (*pads[0], 0), (*pads[1], 0), (0, 0, 0)])
    b, h, w, c = x.shape
    ho, wo = (h - wh) // wh + 1, (w - ww) // ww + 1
    blocks = x[:, : ho * wh, : wo * ww].reshape(b, ho, wh, wo, ww, c)
    return blocks.max(axis=(2, 4)) if reducer is jax.lax.max else blocks.sum(axis=(2, 4))


def _pool(reducer, init_value, window, stride, padding, average: bool, default_name: str, name):
    what = f"nn.{default_name}" + (f" {name!r}" if name else "")
    wh, ww = positive_pair(what, "window", window)
    sh, sw = (wh, ww) if stride is None else positive_pair(what, "stride", stride)
    if not (
        padding in ("SAME", "VALID")
        or (
            isinstance(padding, (tuple, list))
            and len(padding) == 2
            and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in padding)
            and all(isinstance(k, (int, np.integer)) for p in padding for k in p)
        )
    ):
        raise ConfigError(
            f"{what}: padding must be 'SAME', 'VALID' or [(top, bottom), (left, right)] ints, "
            f"got {padding!r}."
        )

    def fn(params, x):
        del params
        if jnp.ndim(x) != 4:
            raise ConfigError(
                f"{what}: expects NHWC input (batch, height, width, channels), got shape "
                f"{tuple(jnp.shape(x))} {jnp.result_type(x)}."
            )
        fill = np.array(init_value, x.dtype)
        if (sh, sw) == (wh, ww):
            y = _reduce_blocks(x, fill, (wh, ww), padding, reducer)
        else:
            pads = padding if isinstance(padding, str) else [(0, 0), *map(tuple, padding), (0, 0)]
            y = jax.lax.reduce_window(x, fill, reducer, (1, wh, ww, 1), (1, sh, sw, 1), pads)
        return y / jnp.array(wh * ww, x.dtype) if average else y

    return layer(fn, name=name or default_name)


def max_pool(window=2, stride=None, padding="VALID", *, name: str | None = None) -> Layer:
    """Max over ``window`` patches of NHWC input (stride defaults to the window).

    Args:
        window: ``k`` or ``(kh, kw)``.
        stride: ``s`` or ``(sh, sw)``; default: the window (non-overlapping, the fast path).
        padding: ``"VALID"``, ``"SAME"`` or ``[(lo, hi), (lo, hi)]``; padding is ``-inf``.
        name: the name when no combinator names it.

    On a tie inside one window, the non-overlapping pool shares the gradient equally between
    the tied maxima (as ``jnp.max``); an overlapping pool gives it to one of them.

    Examples:
        >>> nn.max_pool(2).apply({}, jnp.ones((1, 4, 4, 3))).shape
        (1, 2, 2, 3)
    """
    return _pool(jax.lax.max, -np.inf, window, stride, padding, False, "max_pool", name)


def avg_pool(window=2, stride=None, padding="VALID", *, name: str | None = None) -> Layer:
    """Mean over ``window`` patches of NHWC input (stride defaults to the window).

    Arguments as :func:`max_pool`; padding counts as 0 and the divisor is always ``kh * kw``.

    Examples:
        >>> nn.avg_pool(2).apply({}, jnp.ones((1, 4, 4, 3))).shape
        (1, 2, 2, 3)
    """
    return _pool(jax.lax.add, 0, window, stride, padding, True, "avg_pool", name)
