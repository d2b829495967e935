"""The unfolded patches of a channels-last convolution's input: its rows in matrix form.

Contract. ``patches(x, window, strides, padding, dilation)`` of ``x (N, *spatial, c_in)`` is
``(N, *out_spatial, prod(window) * c_in)``, features ordered as an HWIO kernel's leading axes
``(*window, c_in)``, so that the convolution is ``patches @ kernel.reshape(-1, c_out)`` at every
output position. Data movement only: one strided slice of the padded input per window offset
(``lax.conv_general_dilated_patches`` would multiply by a one-hot kernel, ``prod(kernel)`` times
the work of the layer's input). ``columns`` returns those slices, ``(N, *out_spatial, c_in)``
each in window order, without concatenating them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def patches(x: jax.Array, window: Sequence[int], strides: Sequence[int] = (), padding: Any = "VALID",
            dilation: Sequence[int] = ()) -> jax.Array:  # fmt: skip
    """The unfolded patches of ``x`` (see the module contract); ``()`` strides or dilation: 1."""
    return jnp.concatenate(columns(x, window, strides, padding, dilation), axis=-1)


def columns(x: jax.Array, window: Sequence[int], strides: Sequence[int] = (), padding: Any = "VALID",
            dilation: Sequence[int] = ()) -> list[jax.Array]:  # fmt: skip
    """The input each window offset reads at every output position (see the module contract)."""
    xp, out, strides, dilation = padded(x, window, strides, padding, dilation)
    return [
        column(xp, offset, out, strides, dilation)
        for offset in itertools.product(*(range(k) for k in window))
    ]


def padded(x: jax.Array, window: Sequence[int], strides: Sequence[int] = (), padding: Any = "VALID",
           dilation: Sequence[int] = ()) -> tuple[jax.Array, tuple, tuple, tuple]:  # fmt: skip
    """``(padded x, output spatial shape, strides, dilation)`` of the convolution."""
    window = tuple(int(k) for k in window)
    nd = len(window)
    spatial = x.shape[1 : 1 + nd]
    strides = tuple(strides) or (1,) * nd
    dilation = tuple(dilation) or (1,) * nd
    extent = tuple((k - 1) * d + 1 for k, d in zip(window, dilation))
    pads = lax.padtype_to_pads(spatial, extent, strides, padding) if isinstance(padding, str) else padding
    config = [(0, 0, 0), *((int(lo), int(hi), 0) for lo, hi in pads), (0, 0, 0)]
    xp = lax.pad(x, jnp.zeros((), x.dtype), config)
    out = tuple((xp.shape[1 + i] - extent[i]) // strides[i] + 1 for i in range(nd))
    return xp, out, strides, dilation


def column(xp: jax.Array, offset: Any, out: tuple, strides: tuple, dilation: tuple) -> jax.Array:
    """What window ``offset`` (ints, or a traced ``(nd,)`` array) reads: ``(N, *out, c_in)``."""
    reach = tuple((n - 1) * st + 1 for n, st in zip(out, strides))
    start = [0, *(offset[i] * dilation[i] for i in range(len(out))), 0]
    if all(isinstance(v, int) for v in start):
        limit = (xp.shape[0], *(s + r for s, r in zip(start[1:], reach)), xp.shape[-1])
        return lax.slice(xp, start, limit, (1, *strides, 1))
    start = [jnp.asarray(v, jnp.int32) for v in start]
    window = lax.dynamic_slice(xp, start, (xp.shape[0], *reach, xp.shape[-1]))
    return lax.slice(window, (0,) * xp.ndim, window.shape, (1, *strides, 1))
