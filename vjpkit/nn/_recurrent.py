"""Recurrent layers: the ``gru`` cell, and ``rnn``, which runs a cell over a sequence with ``lax.scan``.

Contract: a cell is a hookable layer ``apply(params, h, x) -> h_new`` on ``h (batch,
features)`` and ``x (batch, in)``; its record has ``input = (h, x)``. ``gru`` follows
PyTorch's ``GRUCell`` (gates ``r, z, n`` in that order along the ``3 * features`` axis, with
``weight_ih (in, 3F)``, ``weight_hh (F, 3F)``, ``bias_ih``, ``bias_hh (3F,)``, the ``x @ W``
layout of ``dense``). ``rnn(cell, features)`` is a combinator that makes no record of its own:
it scans the cell over axis 1 of ``xs (batch, time, in)``, one cell call per step, named as
the cell is (its path inside ``serial``, else the cell's own name).
Records of calls inside ``lax.scan`` follow the core's rules for control flow (see
docs/hooks.md); the gradients are those of the unrolled loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import ConfigError
from . import _random
from ._layer import Layer, layer
from ._linear import _param_dtype, _uniform
from ._linear import describe as _describe


def _positive(what: str, arg: str, v) -> None:
    if not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0):
        raise ConfigError(f"{what}: {arg} must be a positive int, got {v!r}.")


def gru(features: int, *, dtype=None, name: str | None = None) -> Layer:
    """A GRU cell, ``apply(params, h, x) -> h_new``, as PyTorch's ``GRUCell``.

    With ``gi = x @ weight_ih + bias_ih`` and ``gh = h @ weight_hh + bias_hh`` split into
    ``(r, z, n)`` thirds: ``r = sigmoid(gi_r + gh_r)``, ``z = sigmoid(gi_z + gh_z)``,
    ``n = tanh(gi_n + r * gh_n)`` and ``h_new = (1 - z) * n + z * h``.

    Args:
        features: the hidden size ``F``.
        dtype: parameter dtype; default: the input's float dtype.
        name: the name when no combinator names it.

    Run it over a sequence with ``nn.rnn(nn.gru(F), F)``.

    Examples:
        >>> cell = nn.gru(8)
        >>> h, x = jnp.zeros((2, 8)), jnp.ones((2, 3))
        >>> params = cell.init(jax.random.key(0), h, x)
        >>> params["weight_ih"].shape, cell.apply(params, h, x).shape
        ((3, 24), (2, 8))
    """
    what = "nn.gru" + (f" {name!r}" if name else "")
    _positive(what, "features", features)

    def check(h, x):
        for arg, a, expected in (("x", x, "(batch, in)"), ("h", h, f"(batch, {features})")):
            if not hasattr(a, "shape") or len(a.shape) != 2 or not jnp.issubdtype(a.dtype, jnp.floating):
                raise ConfigError(f"{what}: {arg} must be a float array {expected}, got {_describe(a)}.")
        if h.shape != (x.shape[0], features):
            raise ConfigError(
                f"{what}: h must have shape (batch, features) = {(x.shape[0], features)}, got {_describe(h)} "
                f"(x has {_describe(x)})."
            )

    def init(key, h, x):
        check(h, x)
        n_in, dt = x.shape[-1], _param_dtype(x, dtype)
        k1, k2, k3, k4 = _random.split(key, 4)
        f3 = 3 * features
        return {
            "weight_ih": _uniform(k1, (n_in, f3), features, dt),
            "weight_hh": _uniform(k2, (features, f3), features, dt),
            "bias_ih": _uniform(k3, (f3,), features, dt),
            "bias_hh": _uniform(k4, (f3,), features, dt),
        }

    def fn(params, h, x):
        check(h, x)
        if params["weight_ih"].shape[0] != x.shape[-1]:
            raise ConfigError(
                f"{what}: x has {x.shape[-1]} features ({_describe(x)}) but weight_ih "
                f"{tuple(params['weight_ih'].shape)} expects {params['weight_ih'].shape[0]}."
            )
        gi = x @ params["weight_ih"] + params["bias_ih"]
        gh = h @ params["weight_hh"] + params["bias_hh"]
        i_r, i_z, i_n = jnp.split(gi, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(i_r + h_r)
        z = jax.nn.sigmoid(i_z + h_z)
        n = jnp.tanh(i_n + r * h_n)
        return (1.0 - z) * n + z * h

    return layer(fn, init, name=name or "gru")


def rnn(cell: Layer, features: int, *, return_sequences: bool = True, reverse: bool = False) -> Layer:
    """Runs a cell ``apply(params, h, x) -> h_new`` over time with ``lax.scan``.

    ``apply(params, xs, *, h0=None)`` takes ``xs (batch, time, in)`` and the initial state
    ``h0 (batch, features)`` (zeros by default), and returns every state ``(batch, time,
    features)``, or the last one ``(batch, features)`` with ``return_sequences=False``.
    ``params`` are the cell's, shared by every step. Other keyword arguments are ignored.

    Args:
        cell: a cell layer such as ``nn.gru(features)``.
        features: the cell's state size.
        return_sequences: return all states (default) or the last.
        reverse: scan from the last time step to the first (the outputs stay in time order).

    Examples:
        >>> enc = nn.rnn(nn.gru(8), 8)
        >>> xs = jnp.ones((2, 5, 3))
        >>> params = enc.init(jax.random.key(0), xs)
        >>> enc.apply(params, xs).shape
        (2, 5, 8)
    """
    what = "nn.rnn"
    if not isinstance(cell, Layer):
        raise ConfigError(
            f"{what} needs a cell nn.Layer such as nn.gru(features), got {type(cell).__name__}."
        )
    _positive(what, "features", features)

    def check(xs, h0):
        if not hasattr(xs, "shape") or len(xs.shape) != 3 or not jnp.issubdtype(xs.dtype, jnp.floating):
            raise ConfigError(f"{what}: xs must be a float array (batch, time, in), got {_describe(xs)}.")
        if xs.shape[1] == 0:
            raise ConfigError(f"{what}: xs has no time steps ({_describe(xs)}).")
        if h0 is not None and (not hasattr(h0, "shape") or tuple(h0.shape) != (xs.shape[0], features)):
            raise ConfigError(
                f"{what}: h0 must have shape (batch, features) = {(xs.shape[0], features)}, "
                f"got {_describe(h0)}."
            )

    def init(key, xs, h0=None):
        check(xs, h0)
        h = h0 if h0 is not None else jax.ShapeDtypeStruct((xs.shape[0], features), xs.dtype)
        return cell.init(key, h, jax.ShapeDtypeStruct((xs.shape[0], xs.shape[2]), xs.dtype))

    def apply(params, xs, *, h0=None, **kwargs):
        del kwargs  # keyword arguments meant for other layers (key=, mask=, ...)
        check(xs, h0)
        h = h0 if h0 is not None else jnp.zeros((xs.shape[0], features), xs.dtype)

        def step(h, x_t):
            h = cell.apply(params, h, x_t)
            return h, h

        last, hs = jax.lax.scan(step, h, jnp.swapaxes(xs, 0, 1), reverse=reverse)
        return jnp.swapaxes(hs, 0, 1) if return_sequences else last

    return Layer(init, apply)
