"""``fori_loop`` over stacked weights: a slice by the loop counter becomes the scan's ``xs``.

Contract: ``hoist(closed) -> closed`` returns the same program (the same values, the same
gradients) in which every ``lax.scan`` that slices one of its consts by its iteration counter
(``W[i]``, ``lax.dynamic_index_in_dim(W, i, keepdims=False)``: ``fori_loop`` with static bounds
is such a scan) takes that const as ``xs`` instead, so that the body sees the slice as a
parameter given to the scan, exactly like ``lax.scan(body, x, W)``. Layer calls inside then
see the stacked leaf sliced per iteration (records, plain-JAX matching and the per-example fast
paths work as under ``lax.scan``); before, the slice was a value computed in the loop, never a
leaf. Programs without such a scan are returned as they are (identity kept).

A const ``W`` is moved only when the slice is provably iteration ``k``'s row ``W[k]`` for every
``k`` of the scan: the counter is a carry that starts at a literal ``c0`` and the body returns
it plus one; the start index is the counter plus a literal offset, through the casts and the
``select_n``/``lt`` that normalise negative indices (evaluated over the counter's range; other
integers known only when they are literals, or consts of the scan and of the programs around it,
never a carry's start value), with
``c0 + offset == 0`` and the scan's length equal to ``W.shape[0]``; the other start indices are
0 and the slice is one row, used only through a ``squeeze`` or ``reshape`` that drops that
axis. Anything else keeps its scan unchanged. Sub-programs (inner ``jit``, ``checkpoint``,
``cond`` branches, scan bodies) are rewritten first, found generically in equation params.
The new scan is built by the public ``lax.scan`` (re-traced from the old body), so no
version-dependent scan parameter is written here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from .. import _compat
from ._rules import nested, with_programs
from ._run import Runner
from ._site import span_of

_CMP = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
        "eq": np.equal, "ne": np.not_equal}  # fmt: skip


def hoist(closed: Any) -> Any:
    """``closed`` with counter-indexed slices of scan consts given as ``xs`` (see the contract)."""
    # an eager trace closes over the index arithmetic it computed: concrete scalars, known here
    known = {v: x for v, c in zip(closed.jaxpr.constvars, closed.consts) if (x := _scalar(c)) is not None}
    new = _program(closed.jaxpr, known)
    return closed if new is closed.jaxpr else _compat.closed_jaxpr(new, closed.consts)


def _scalar(c: Any) -> Any:
    """An integer or bool scalar's value (a literal's or a concrete const's), else None."""
    if isinstance(c, jcore.Literal):
        c = c.val
    if isinstance(c, jax.core.Tracer) or np.ndim(c) != 0:
        return None
    try:
        dtype = np.dtype(getattr(c, "dtype", type(c)))
    except TypeError:  # a PRNG key, an opaque dtype
        return None
    return np.asarray(c).item() if np.issubdtype(dtype, np.integer) or dtype == np.bool_ else None


def _program(jaxpr: Any, known: dict) -> Any:
    """``jaxpr`` rewritten; ``known``: the integer scalars among its variables, by value."""
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        ins = [_scalar(a) if isinstance(a, jcore.Literal) else known.get(a) for a in eqn.invars]
        new = _nested(eqn, ins)
        scan = [n for n in nested(new) if n.kind == "scan"]
        if scan:
            new = _scan(new, scan[0], ins) or new
        changed |= new is not eqn
        eqns.append(new)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _nested(eqn: Any, ins: list) -> Any:
    """``eqn`` with its sub-programs rewritten (``nested``); a sub-program's input is known
    where it is an equation operand that is the same value in every run of the program (as
    it is, or a loop's const; never a loop's carry or a scan's slice) and known."""
    if span_of(eqn) is not None:  # sites keep their own programs
        return eqn
    return with_programs(eqn, {n: _sub(n, n.operands(ins, "=c")) for n in nested(eqn)})


def _sub(n: Any, ins: list) -> Any:
    jaxpr = n.jaxpr
    known = {v: x for v, x in zip(jaxpr.invars, ins) if x is not None}
    new = _program(jaxpr, known)
    if new is jaxpr:
        return n.program
    return _compat.closed_jaxpr(new, n.program.consts) if isinstance(n.program, jcore.ClosedJaxpr) else new


def _counters(body: Any, nc: int, ncar: int, ins: list) -> dict:
    """``{body var: c0}`` for each carry that starts at a known ``c0`` and steps by one."""
    made = {o: e for e in body.eqns for o in e.outvars}
    found = {}
    for j in range(ncar):
        init, var, out = ins[nc + j], body.invars[nc + j], body.outvars[j]
        step = made.get(out)
        if init is None or isinstance(init, bool) or step is None or step.primitive.name != "add":
            continue
        if not jnp.issubdtype(var.aval.dtype, jnp.integer):
            continue
        a, b = step.invars
        one = b if a is var else a if b is var else None
        if isinstance(one, jcore.Literal) and int(np.asarray(one.val)) == 1:
            found[var] = int(init)
    return found


def _values(body: Any, counters: dict, length: int, known: dict) -> dict:
    """Each body variable computed from the counters and literals: an int or bool, or
    ``(counter var, offset)`` (the counter plus a literal); unknown variables are absent."""
    val: dict[Any, Any] = {**known, **{v: (v, 0) for v in counters}}

    def read(a):
        return _scalar(a) if isinstance(a, jcore.Literal) else val.get(a)

    def span(x):  # a counter value's (lowest, highest) over the iterations
        return counters[x[0]] + x[1], counters[x[0]] + x[1] + length - 1

    for e in body.eqns:
        name, ins = e.primitive.name, [read(a) for a in e.invars]
        if len(e.outvars) != 1 or any(x is None for x in ins) or e.outvars[0].aval.shape != ():
            continue
        ctr = [isinstance(x, tuple) for x in ins]
        out: Any = None
        if name == "convert_element_type":
            out = ins[0] if ctr[0] or not jnp.issubdtype(e.params["new_dtype"], jnp.floating) else None
        elif name in ("add", "sub") and not all(ctr):
            a, b = ins
            sign = 1 if name == "add" else -1
            if not any(ctr):
                out = a + sign * b
            elif ctr[0]:
                out = (a[0], a[1] + sign * b)
            elif name == "add":
                out = (b[0], b[1] + a)
        elif name in _CMP and not all(ctr):
            a, b = ins
            if not any(ctr):
                out = bool(_CMP[name](a, b))
            else:
                lo, hi = span(a if ctr[0] else b)
                ends = [_CMP[name](x, b) if ctr[0] else _CMP[name](a, x) for x in (lo, hi)]
                # a comparison with a constant is monotone in the counter: known when both ends agree
                out = bool(ends[0]) if ends[0] == ends[1] else None
        elif name == "select_n" and not ctr[0]:
            k = int(ins[0])
            out = ins[1 + k] if 0 <= k < len(ins) - 1 else None
        if out is not None:
            val[e.outvars[0]] = out
    return val


def _slices(eqn: Any, body: Any, nc: int, ncar: int, ins: list) -> dict:
    """``{const index: {var replaced by the row: None}}`` for the consts the body slices by
    iteration (see the contract); empty when there are none."""
    params = eqn.params
    if params.get("reverse"):
        return {}
    counters = _counters(body, nc, ncar, ins)
    if not counters:
        return {}
    length = params["length"]
    # only a const is the same value every iteration: a carry's start value is not its value
    known = {v: x for v, x in zip(body.invars[:nc], ins[:nc]) if x is not None}
    val = _values(body, counters, length, known)
    consts = {v: k for k, v in enumerate(body.invars[:nc])}
    users: dict[Any, list] = {}
    for e in body.eqns:
        for a in e.invars:
            if not isinstance(a, jcore.Literal):
                users.setdefault(a, []).append(e)
    found: dict[int, dict] = {}
    bad: set[int] = set()
    for e in body.eqns:
        if e.primitive.name != "dynamic_slice" or e.invars[0] not in consts:
            continue
        k = consts[e.invars[0]]
        shape = tuple(e.invars[0].aval.shape)
        start = [_scalar(a) if isinstance(a, jcore.Literal) else val.get(a) for a in e.invars[1:]]
        row = tuple(shape[1:])
        first = start[0] if start else None
        by_counter = isinstance(first, tuple) and counters[first[0]] + first[1] == 0 and length == shape[0]
        ok = (
            by_counter
            and all(s == 0 and not isinstance(s, tuple) for s in start[1:])
            and tuple(e.params["slice_sizes"]) == (1, *row)
            and e.outvars[0] not in body.outvars
        )
        uses = users.get(e.outvars[0], [])
        ok = (
            ok
            and bool(uses)
            and all(
                u.primitive.name in ("squeeze", "reshape") and tuple(u.outvars[0].aval.shape) == row
                for u in uses
            )
        )
        if ok:
            found.setdefault(k, {}).update({u.outvars[0]: None for u in uses})
            found[k][e.outvars[0]] = "slice"
        else:
            bad.add(k)
    return {k: v for k, v in found.items() if k not in bad}


def _eval(jaxpr: Any, consts: Sequence, args: Sequence, rows: dict) -> list:
    """Evaluates ``jaxpr``, with each variable of ``rows`` (``{var: value}``) given, and the
    equations that made only those variables skipped."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    env.update(rows)

    def read(a):
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for e in jaxpr.eqns:
        if e.outvars and all(v in rows for v in e.outvars):
            continue
        for v, x in zip(e.outvars, Runner.bind(e, [read(a) for a in e.invars])):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _scan(eqn: Any, nest: Any, ins: list) -> Any | None:
    """The scan ``eqn`` (``nest``: its body) with its counter-sliced consts as ``xs`` (one new
    ``scan`` equation), or None when it has none or the rewrite does not apply."""
    nc, ncar = nest.roles.count("c"), nest.roles.count("r")
    found = _slices(eqn, nest.jaxpr, nc, ncar, ins)
    if not found or any(getattr(a.aval, "vma", None) for a in eqn.invars):
        return None
    params, body = eqn.params, nest.program
    moved = sorted(found)
    n_xs = len(eqn.invars) - nc - ncar

    def fun(*ins):
        consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]

        def step(carry, x):
            rows = {}
            for k, row in zip(moved, x[n_xs:]):
                rows.update({v: None if how == "slice" else row for v, how in found[k].items()})
            outs = _eval(body.jaxpr, body.consts, [*consts, *carry, *x[:n_xs]], rows)
            return outs[:ncar], outs[ncar:]

        xs = [*xs, *(consts[k] for k in moved)]
        carry, ys = lax.scan(step, list(init), xs, length=params["length"], unroll=params["unroll"])
        return [*carry, *ys]

    avals = [a.aval for a in eqn.invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    traced = jax.make_jaxpr(fun)(*specs)
    new = traced.jaxpr
    if traced.consts or len(new.eqns) != 1 or not any(n.kind == "scan" for n in nested(new.eqns[0])):
        return None
    outer = dict(zip(new.invars, eqn.invars))
    scan = new.eqns[0]
    if any(not isinstance(a, jcore.Literal) and a not in outer for a in scan.invars):
        return None
    if list(scan.outvars) != list(new.outvars) or len(scan.outvars) != len(eqn.outvars):
        return None
    return scan.replace(
        invars=[a if isinstance(a, jcore.Literal) else outer[a] for a in scan.invars],
        outvars=list(eqn.outvars),
    )
