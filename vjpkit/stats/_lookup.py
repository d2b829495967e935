"""Which table row each position of an embedding lookup reads.

Contract. ``lookup_index(closed)`` takes a lookup call's own program (a closed jaxpr holding one
``gather`` of a table, as the engine records the call) and returns the function of that
program's operands that gives the gather's row indices as the program builds them (jnp's
indexing wraps negative ids and adds an index axis first), without the index axis:
``index(*operands)`` has the ids' shape. Out-of-range indices are left as they are: the caller
applies the gather's mode (clip, or no gradient). ``Rows.lookup`` takes the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore

from .. import _compat


def lookup_index(closed: Any) -> Callable[..., jax.Array]:
    """The row index of each position, as the lookup program ``closed`` computes it.

    Args:
        closed: the call's program; its first ``gather`` is the lookup.

    Returns:
        ``index(*operands)``: the gather's index operand without its trailing index axis.

    Examples:
        >>> table, ids = jnp.arange(12.0).reshape(6, 2), jnp.array([[0, -1], [2, 3]])
        >>> closed = jax.make_jaxpr(lambda t, i: t[i])(table, ids)
        >>> lookup_index(closed)(table, ids)  # -1 wrapped to the last row, as jnp indexes
        Array([[0, 5],
               [2, 3]], dtype=int32)
    """
    jaxpr = closed.jaxpr
    gather = next(e for e in jaxpr.eqns if e.primitive.name == "gather")
    program = _compat.open_jaxpr(
        jaxpr.constvars, jaxpr.invars, [gather.invars[1]], jaxpr.eqns, jaxpr.effects, jaxpr.debug_info
    )
    fn = jcore.jaxpr_as_fun(_compat.closed_jaxpr(program, getattr(closed, "consts", [])))
    return lambda *operands: fn(*operands)[0][..., 0]
