"""Random draws for parameter initialisers, with one compiled program per process.

Contract: ``uniform(key, shape, lo, hi, dtype)`` and ``normal(key, shape, dtype)`` depend only
on ``key`` and ``shape``. Their bits come from threefry in fixed-size chunks
(``bits[i] = jax.random.bits(fold_in(key, i), (CHUNK,))``), drawn by one jitted program, and
are turned into floats on the host with numpy when ``key`` is concrete (inside a trace, with
``jax.numpy``; the values are the same). XLA:CPU takes 1 to 3 s to compile the threefry program
for every new shape, so ``jax.random.uniform`` per parameter made ``init`` of a small CNN take
seconds; here a new shape compiles nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 1 << 16


@jax.jit
def _chunk(key: jax.Array, index: jax.Array) -> jax.Array:
    return jax.random.bits(jax.random.fold_in(key, index), (CHUNK,), jnp.uint32)


def _bits(key: jax.Array, n: int) -> tuple[Any, Any]:
    """``n`` uint32 random bits, and the array module to finish with (numpy when concrete)."""
    chunks = [_chunk(key, i) for i in range(max(1, -(-n // CHUNK)))]
    if isinstance(key, jax.core.Tracer):
        return jnp.concatenate(chunks)[:n], jnp
    return np.concatenate([np.asarray(c) for c in chunks])[:n], np


def _unit(bits: Any, xp: Any) -> Any:
    """Floats in [0, 1) from the top 23 bits, as ``jax.random.uniform`` makes them."""
    mantissa = (bits >> xp.uint32(9)) | xp.uint32(0x3F800000)
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) if xp is jnp else mantissa.view(np.float32)
    return floats - xp.float32(1.0)


def uniform(key: jax.Array, shape: tuple[int, ...], lo: float, hi: float, dtype: Any) -> jax.Array:
    """Uniform on ``[lo, hi)`` with ``shape`` and ``dtype``.

    Examples:
        >>> uniform(jax.random.key(0), (3, 4), -0.5, 0.5, jnp.float32).shape
        (3, 4)
    """
    n = int(np.prod(shape, dtype=np.int64))
    bits, xp = _bits(key, n)
    values = xp.float32(lo) + xp.float32(hi - lo) * _unit(bits, xp)
    return _finish(values.reshape(shape), dtype, xp)


def normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Standard normal with ``shape`` and ``dtype`` (Box-Muller on two uniforms per value).

    Examples:
        >>> normal(jax.random.key(0), (5,), jnp.float32).shape
        (5,)
    """
    n = int(np.prod(shape, dtype=np.int64))
    bits, xp = _bits(key, 2 * n)
    u1 = xp.float32(1.0) - _unit(bits[:n], xp)  # in (0, 1]: the log is finite
    u2 = _unit(bits[n:], xp)
    values = xp.sqrt(xp.float32(-2.0) * xp.log(u1)) * xp.cos(xp.float32(2 * np.pi) * u2)
    return _finish(values.astype(xp.float32).reshape(shape), dtype, xp)


def _finish(values: Any, dtype: Any, xp: Any) -> jax.Array:
    """As a JAX array of ``dtype``; cast on the host when concrete (no program per shape)."""
    if xp is np:
        return jax.device_put(values.astype(jnp.dtype(dtype)))
    return values.astype(dtype)


_fold = jax.jit(jax.random.fold_in)


def split(key: jax.Array, num: int = 2) -> list[jax.Array]:
    """``num`` independent keys derived from ``key`` (``fold_in`` of 0, 1, ...: one program).

    Examples:
        >>> k_weight, k_bias = split(jax.random.key(0))
    """
    return [_fold(key, i) for i in range(num)]
