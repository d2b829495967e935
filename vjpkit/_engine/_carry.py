"""How a captured record travels out of the backward pass, exactly, as a probe's cotangent.

Contract: ``slot_avals(record, spec)`` gives the probe's shapes for a call whose record has the
shapes ``record``; ``slot_value(spec, rec)`` is the probe cotangent the rule returns;
``decode`` puts a carried leaf back in its dtype. Cotangents are floats, so integer and boolean
leaves travel as 16-bit chunks in float32 (exact, whatever is added to them), one chunk axis
in front of the leaf's own axes; a PRNG key travels as its key data.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._capture import reduce_record
from .._records import Cotangents


def _chunks(dtype: Any) -> int:
    dtype = np.dtype(dtype)
    return 1 if dtype == np.bool_ else max(1, dtype.itemsize // 2)


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _carried(a: Any) -> Any:
    if _is_key(a.dtype):  # a PRNG key travels as its key data
        a = jax.eval_shape(jax.random.key_data, a)
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return a
    return jax.ShapeDtypeStruct((_chunks(a.dtype), *a.shape), jnp.float32)


def _unsigned(dtype: Any) -> Any:
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dtype).itemsize]


def encode(x: jax.Array) -> jax.Array:
    if _is_key(x.dtype):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if x.dtype == jnp.bool_:
        return x.astype(jnp.float32)[None]
    u = jax.lax.bitcast_convert_type(x, _unsigned(x.dtype))
    return jnp.stack([((u >> (16 * k)) & 0xFFFF).astype(jnp.float32) for k in range(_chunks(x.dtype))])


def decode(c: jax.Array, dtype: Any, lead: int) -> jax.Array:
    if _is_key(dtype):
        return jax.random.wrap_key_data(decode(c, jnp.uint32, lead), impl=dtype._impl)
    if jnp.issubdtype(dtype, jnp.inexact):
        return c.astype(dtype)
    c = jnp.moveaxis(c, lead, 0)
    if np.dtype(dtype) == np.bool_:
        return c[0] > 0.5
    u = _unsigned(dtype)
    total = sum(c[k].astype(u) << u(16 * k) for k in range(c.shape[0]))
    return jax.lax.bitcast_convert_type(total.astype(u), dtype)


def slot_avals(record: Cotangents, spec: Any, n_host: int = 0) -> dict:
    """The probe's (unstacked) shape tree: the captured record for ``spec``, and ``n_host``
    whole records for the call's ``vk.on_host`` hooks."""
    reduced = reduce_record(record, spec, shapes=True) if spec is not None else None
    return {
        "captured": jax.tree.map(_carried, reduced),
        "dtypes": jax.tree.map(lambda a: a.dtype, reduced),
        "host": tuple(jax.tree.map(_carried, record) for _ in range(n_host)),
        "host_dtypes": jax.tree.map(lambda a: a.dtype, record),
        "ran": jax.ShapeDtypeStruct((), jnp.float32),
        "seen": jax.ShapeDtypeStruct((), jnp.float32),
    }


def slot_value(spec: Any, rec: Cotangents, host: Any = (), ran: bool = True) -> dict:
    """The probe cotangent that carries ``rec`` (and the records host hooks saw) out.

    ``ran``: the call's backward pass ran (``False`` for a call the loss does not reach, whose
    record has its forward values and zero cotangents); ``seen`` is 1 either way.
    """
    captured = jax.tree.map(encode, reduce_record(rec, spec)) if spec is not None else None
    return {
        "captured": captured,
        "host": tuple(jax.tree.map(encode, r) for r in host),
        "ran": jnp.asarray(1.0 if ran else 0.0, jnp.float32),
        "seen": jnp.ones((), jnp.float32),
    }
