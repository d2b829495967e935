"""How a captured record travels out of the backward pass, exactly, as a probe's cotangent.

Contract: a handler's probe part is a ``Part``: ``part(avals)`` gives the shapes that carry a
tree of the shapes ``avals``, ``encode`` the values that travel, ``decode`` puts a carried leaf
back in its dtype. Cotangents are floats, so integer and boolean
leaves travel as 16-bit chunks in float32 (exact, whatever is added to them), one chunk axis
in front of the leaf's own axes; a PRNG key travels as its key data.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


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


FLAGS = ("ran", "seen")  # the parts ``_handlers.chain`` adds to every probe


class Part(NamedTuple):
    """One named part of a layer call's probe (a handler's, ``_handlers``).

    Attributes:
        carried: the ``ShapeDtypeStruct`` tree that travels as the probe's cotangent.
        dtypes: the dtype each carried leaf decodes to (``decode``), the same structure.
        unreached: the part wants the call's record also when the loss does not reach the call
            (the plan then gives the call a "live" carrier, ``Site.carrier``).
    """

    carried: Any
    dtypes: Any
    unreached: bool = True


def part(avals: Any, unreached: bool = True) -> Part:
    """The probe part that carries a tree of the shapes ``avals`` (any dtypes) exactly."""
    return Part(jax.tree.map(_carried, avals), jax.tree.map(lambda a: a.dtype, avals), unreached)


def zeros(p: Part) -> Any:
    """The part's value when its handler put nothing in it."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), p.carried)


def read(plan: Any, probe_grads: dict, name: str, mask: bool = True) -> dict:
    """``{call key: value}`` of the part ``name`` of every call whose probe has it, decoded, in
    backward order. With ``mask``, a call of a ``lax.cond`` branch not taken gives NaN
    (integers 0), never plausible zeros."""
    out = {}
    for key in reversed(plan.order):
        site = plan.by_key[key]
        if key not in probe_grads or site.slot is None or name not in site.slot:
            continue
        g = probe_grads[key]
        lead = len(site.stack)
        value = jax.tree.map(lambda c, dt, lead=lead: decode(c, dt, lead), g[name], site.slot[name].dtypes)
        if mask and site.in_cond:
            ran = g["seen"] > 0  # the call ran in the branch taken (reached by the loss or not)

            def fill(x, ran=ran):
                r = ran.reshape(ran.shape + (1,) * (x.ndim - ran.ndim))
                nan = jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0
                return jnp.where(r, x, jnp.asarray(nan, x.dtype))

            value = jax.tree.map(fill, value)
        out[key] = value
    return out


def select(plan: Any, records: dict) -> dict:
    """The captured records of ``read``, each call's kept iterations only: a glob ``blocks[2]``
    keeps that iteration's record, as ``"blocks[2]"``; a glob without ``[i]`` the whole stack."""
    out = {}
    for key, rec in records.items():
        site = plan.by_key[key]
        kept = site.spec.iterations(site.name, site.call)
        if kept is None:
            out[key] = rec
        for wanted in kept or ():
            index = iter(wanted)
            at = tuple(slice(None) if s else next(index) for s in site.sharded)
            at = tuple(slice(None) if i is None else i for i in at)
            name = key + "".join(f"[{'*' if i is None else i}]" for i in wanted)
            out[name] = jax.tree.map(lambda a, at=at: a[at], rec)
    return out
