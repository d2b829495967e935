"""The unfolded patches of a channels-last convolution's input: its rows in matrix form.

Contract. ``patches(x, window, strides, padding, dilation)`` of ``x (N, *spatial, c_in)`` is
``(N, *out_spatial, prod(window) * c_in)``, features ordered as an HWIO kernel's leading axes
``(*window, c_in)``, so that the convolution is ``patches @ kernel.reshape(-1, c_out)`` at every
output position. Data movement only: one strided slice of the padded input per window offset
(``lax.conv_general_dilated_patches`` would multiply by a one-hot kernel, ``prod(kernel)`` times
the work of the layer's input).
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
    cols = []
    for offset in itertools.product(*(range(k) for k in window)):
        start = (0, *(o * d for o, d in zip(offset, dilation)), 0)
        limit = (
            xp.shape[0],
            *(s + (n - 1) * st + 1 for s, n, st in zip(start[1:], out, strides)),
            xp.shape[-1],
        )
        cols.append(lax.slice(xp, start, limit, (1, *strides, 1)))
    return jnp.concatenate(cols, axis=-1)
