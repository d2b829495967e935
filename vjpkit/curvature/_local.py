"""Per-example parameter gradients of a layer with no K-FAC rule (a "local" layer), as its
diagonal block and first-order statistics read them.

Contract. ``per_example_for(site)`` gives ``linearize(params, x, axis) -> PerExample`` for a
call whose own program takes nothing but its params and inputs and has one output (else
``None``): the call's program is linearized once at its record's ``params`` and ``input``, and
``PerExample.sum_sq(g, dtype)`` / ``sq_norms(g, dtype)`` give, for output cotangents ``g`` with
the examples on ``axis``, ``sum_i g_i**2`` and ``||g_i||^2`` per leaf (keyed like ``params``),
``g_i`` the vjp of the call at ``g`` masked to example ``i``. Exact for any layer; the first
path that applies computes them:

* **lookup** (``LayerKind("lookup")``: ``table[ids]``, the program's output the gather's): the
  rows of ``vjpkit.stats`` (``Rows.lookup``; an out-of-range index per the gather's mode),
  never ``N x`` the table;
* **shared** (a norm's affine ``x_hat * scale + bias``, a positional table ``x + pos``, a scalar
  temperature: every param reaches the output only through elementwise operations, from values
  the same for every example): the program split where the params' values meet the input's;
  one vjp of the elementwise part gives each example's cotangent of those values, and a vmap
  over the examples of the params-only part's vjp gives ``g_i`` (``N x`` the params' floats);
* **masked** (any other): ``N`` vjps of the call, each at ``g`` masked to one example
  (``N x`` the call's backward pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from .. import _compat, _format, stats
from .._kinds import LayerKind
from . import _examples


class PerExample(NamedTuple):
    """A local layer's per-example gradient statistics at one linearization (the contract)."""

    sum_sq: Callable[[jax.Array, Any], Any]  # (g, dtype) -> {leaf: sum_i g_i**2}, like params
    sq_norms: Callable[[jax.Array, Any], Any]  # (g, dtype) -> {leaf: (N,) ||g_i||^2}, like params


def _from_grads(per_example: Callable[[jax.Array], Any]) -> PerExample:
    """``PerExample`` of ``per_example(g) -> {leaf: (N, *leaf)}``, the gradients formed."""

    def sum_sq(g, dtype):
        return jax.tree.map(lambda p: jnp.sum(jnp.square(p.astype(dtype)), axis=0), per_example(g))

    def sq_norms(g, dtype):
        return jax.tree.map(
            lambda p: jnp.sum(jnp.square(p.astype(dtype)).reshape(p.shape[0], -1), axis=1), per_example(g)
        )

    return PerExample(sum_sq, sq_norms)


def per_example_for(site: Any) -> Callable | None:
    """``linearize(params, x, axis) -> PerExample`` for the call (the contract), or ``None``."""
    layout = site.layout
    kwargs_tree = layout.tree.children()[2]
    if layout.n_hoisted or kwargs_tree.num_leaves or len(site.eqn.outvars) != 1:
        return None
    single = len(layout.tree.children()[1].children()) == 1
    closed = site.span.jaxpr
    kwargs = jax.tree.unflatten(kwargs_tree, [])

    def flat(params, x):
        return layout.join([], params, (x,) if single else tuple(x), kwargs)

    masked = _masked(closed, flat)
    lookup = _lookup(site, closed, flat)
    if lookup is not None:
        return lookup
    shared = _shared(site, closed, flat)
    if shared is None:
        return masked

    def linearize(params, x, axis=0):
        return shared(params, x, axis) or masked(params, x, axis)

    return linearize


def masked(pull: Callable[[jax.Array], Any], axis: int = 0) -> PerExample:
    """``PerExample`` of ``pull(g) -> gradients`` (a vjp at output cotangents ``g``), taken
    once per example at ``g`` masked to that example on ``axis``: ``N`` pulls, vmapped."""

    def per_example(g):
        examples = jnp.arange(g.shape[axis])

        def one(i):
            mask = jnp.expand_dims(examples == i, [d for d in range(g.ndim) if d != axis])
            return pull(jnp.where(mask, g, 0).astype(g.dtype))

        return jax.vmap(one)(examples)

    return _from_grads(per_example)


def _masked(closed: Any, flat: Callable) -> Callable:
    fn = jcore.jaxpr_as_fun(closed)

    def linearize(params, x, axis=0):
        _, pull = jax.vjp(lambda p: fn(*flat(p, x))[0], params)
        return masked(lambda g: pull(g)[0], axis)

    return linearize


def _lookup(site: Any, closed: Any, flat: Callable) -> Callable | None:
    kind = site.kind
    if not (isinstance(kind, LayerKind) and kind.kind == "lookup" and len(kind.roles) == 1):
        return None
    jaxpr = closed.jaxpr
    gathers = [e for e in jaxpr.eqns if e.primitive.name == "gather"]
    if len(gathers) != 1 or jaxpr.outvars[0] is not gathers[0].outvars[0]:
        return None  # the output is not the gather's own (a scale or a cast after it)
    (path,) = kind.roles
    index_of = stats.lookup_index(closed)

    def linearize(params, x, axis=0):
        table = _leaf(params, path)
        index = jnp.moveaxis(index_of(*flat(params, x)), axis, 0)
        if kind.padding == "clip":
            index, weight = jnp.clip(index, 0, table.shape[0] - 1), None
        else:  # out-of-range rows get no gradient
            weight = (index >= 0) & (index < table.shape[0])

        def rows(g, dtype):
            d = jnp.moveaxis(g, axis, 0).astype(dtype)
            w = None if weight is None else weight.astype(dtype)
            return [stats.Rows.lookup(index, d, table.shape, w)]

        return PerExample(
            lambda g, dtype: _keyed(params, path, stats.sum_sq(rows(g, dtype)), ()),
            lambda g, dtype: _keyed(params, path, stats.sq_norms(rows(g, dtype)), None),
        )

    return linearize


def _leaf(params: Any, path: str) -> Any:
    """The leaf of ``params`` a kind's role names (``_format.path``)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return next(v for kp, v in flat if _format.path(kp) == path)


def _keyed(params: Any, path: str, value: jax.Array, shape: tuple | None) -> Any:
    """``value`` at the leaf ``path`` of ``params``, zeros elsewhere: of the leaf's shape
    (``shape=()``, a leaf-shaped statistic) or of ``value``'s (``None``, per example)."""

    def one(kp, leaf):
        if _format.path(kp) == path:
            return value
        return jnp.zeros(leaf.shape if shape is not None else value.shape, value.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def _shared(site: Any, closed: Any, flat: Callable) -> Callable | None:
    """The shared path's ``linearize`` (the contract), or ``None`` where its structure is not
    there; the returned ``linearize`` gives ``None`` when the values the params reach the
    output through vary over the examples' axis."""
    jaxpr = closed.jaxpr
    _, (p_vars, _, _) = site.layout.split(list(jaxpr.invars))
    param_vars = set(jax.tree.leaves(p_vars))
    # P: computed from the params (and constants) alone; X: from no param; M: the rest
    reads_p, only_p = set(param_vars), set(param_vars) | set(jaxpr.constvars)
    pre, mixed = [], []
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not isinstance(v, jcore.Literal)]
        if all(v in only_p for v in ins):
            only_p.update(e.outvars)
            reads_p.update(e.outvars)
            pre.append(e)
        elif any(v in reads_p for v in ins):
            reads_p.update(e.outvars)
            mixed.append(e)
        else:
            pre.append(e)  # the input's own computation (a norm's normalization), not differentiated
    out = jaxpr.outvars[0]
    if isinstance(out, jcore.Literal) or out in only_p or out not in reads_p:
        return None
    rank = len(out.aval.shape)
    for e in mixed:  # elementwise, shapes aligned to the output's (size-1 axes broadcast)
        if not _examples.elementwise(e) or len(e.outvars) != 1 or len(e.outvars[0].aval.shape) != rank:
            return None
        if any(len(getattr(v.aval, "shape", ())) not in (0, rank) for v in e.invars):
            return None
    cuts = list(
        dict.fromkeys(v for e in mixed for v in e.invars if not isinstance(v, jcore.Literal) and v in only_p)
    )
    known = list(
        dict.fromkeys(
            v for e in mixed for v in e.invars if not isinstance(v, jcore.Literal) and v not in reads_p
        )
    )
    program = _compat.open_jaxpr(
        jaxpr.constvars, jaxpr.invars, [*cuts, *known], pre, jaxpr.effects, jaxpr.debug_info
    )
    before = jcore.jaxpr_as_fun(_compat.closed_jaxpr(program, closed.consts))
    shapes = [tuple(v.aval.shape) for v in cuts]

    def after(values: dict) -> jax.Array:
        env = dict(values)
        for e in mixed:
            got = e.primitive.bind(
                *(v.val if isinstance(v, jcore.Literal) else env[v] for v in e.invars), **e.params
            )
            env[e.outvars[0]] = got
        return env[out]

    def linearize(params, x, axis=0):
        aligned = [(1,) * (rank - len(s)) + s for s in shapes]
        if any(s[axis] != 1 for s in aligned):
            return None  # a param's value differs per example before it meets the input
        n = out.aval.shape[axis]

        def split(p):
            got = before(*flat(p, x))
            return got[: len(cuts)], got[len(cuts) :]

        cut_values, pull_cuts, known_values = jax.vjp(split, params, has_aux=True)
        fixed = dict(zip(known, known_values))

        def expand(c, s):  # the examples' axis of the value made explicit: (.., N at axis, ..)
            shape = list(s)
            shape[axis] = n
            return jnp.broadcast_to(c.reshape(s), shape)

        expanded = [expand(c, s) for c, s in zip(cut_values, aligned)]
        _, pull_after = jax.vjp(lambda cs: after({**fixed, **dict(zip(cuts, cs))}), expanded)

        def per_example(g):
            bars = pull_after(g.astype(out.aval.dtype))[0]
            each = [jnp.moveaxis(b, axis, 0).reshape(n, *s) for b, s in zip(bars, shapes)]
            return jax.vmap(lambda cs: pull_cuts(list(cs))[0])(each)

        return _from_grads(per_example)

    return linearize
