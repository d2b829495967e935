"""Rules per primitive: how the plan walks an equation and how the runner evaluates it, side by side.

Contract: ``RULES`` maps a primitive name to a ``Rule(plan, eval, nest)``; ``rule_for(eqn)``
gives the rule of an equation (``SITE`` for an equation a site source recognises, ``CALL`` for
any call-like primitive not in the table, ``DEFAULT`` for any other primitive). Adding a
primitive is one entry here. The one place that says which primitives hold programs and how:
every walker of the engine and of the tools (planning, running, plain-JAX matching, the
``fori_loop`` rewrite, per-example uses and dependence, curvature's example axis) descends into
an equation's programs through ``nested(eqn)`` (or ``call_program`` / ``sub_programs``, built
on it), never by its own list of primitives or its own reading of their params.

* ``plan(planner, eqn, ins, at) -> out flags``: the forward dataflow "may carry a gradient"
  over the equation's outputs, given its inputs' flags ``ins``; ``at`` is the ``At`` of the
  equation (path, enclosing scans, inside a cond, whether to register sites). It walks nested
  programs with ``planner.walk`` and registers layer calls with ``planner.site``.
* ``eval(runner, eqn, invals, p, probes, states) -> (outs, states)``: evaluates an equation that
  holds active layer calls (at path ``p``), threading the probes and hook states of the calls
  inside it (``runner.mine``); equations that hold none are bound as they are.
* ``nest(eqn) -> (Nested, ...)``: the programs the equation holds, each with the operands it
  receives and their role (as they are, a scan's const / carry / slice, a shard's part) and its
  kind (``"call"``, ``"scan"``, ``"branch"``, ``"loop"``, ``"opaque"``); ``None``: the generic
  finder, every program in the params as ``"opaque"``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import _compat
from ._site import registered


class At(NamedTuple):
    """Where the planner is: the equation's path, enclosing scans and shard_maps, inside a cond,
    registering."""

    path: tuple
    # ((path, size, is a shard_map), ...): every enclosing scan (size: its length) and shard_map
    # (size: its shards), outermost first; a call's probes and records are stacked over them
    stack: tuple = ()
    in_cond: bool = False
    register: bool = True

    @property
    def scans(self) -> tuple:
        """``((path, length), ...)`` of the enclosing ``lax.scan`` s, outermost first."""
        return tuple((q, n) for q, n, sharded in self.stack if not sharded)

    def to(self, path: tuple, **changes: Any) -> At:
        return self._replace(path=path, **changes)


class Rule(NamedTuple):
    """How one primitive is planned, evaluated and descended into (see the module contract)."""

    plan: Callable
    eval: Callable
    nest: Callable | None = None


class Nested(NamedTuple):
    """One program an equation holds, and how the equation's operands enter it.

    ``kind``: ``"call"`` runs once on the operands as they are, its outputs the equation's (an
    inner ``jax.jit``, ``jax.checkpoint``, ``shard_map``, a call primitive of another library);
    ``"scan"`` runs once per iteration, its outputs the carry then the stacked ``ys``;
    ``"branch"`` is one of a ``cond``'s programs (``index``: which), its outputs the equation's;
    ``"loop"`` a ``while``'s condition or body (run an unknown number of times); ``"opaque"`` a
    program the engine does not rewrite (a custom_jvp/custom_vjp function's, and those of
    primitives it does not know).

    ``ins``: per program input, the index of the equation operand it receives (``None``: not
    known). ``roles``: one letter per input, ``"="`` the operand as it is, ``"c"`` a loop's
    const (the same array every iteration), ``"r"`` a loop's carry (changes between
    iterations), ``"s"`` a scan's ``xs`` (one slice per iteration), ``"p"`` a ``shard_map``
    operand split over the shards (each shard sees its part)."""

    key: str
    index: int | None
    program: Any
    kind: str
    ins: tuple | None
    roles: str

    @property
    def jaxpr(self) -> Any:
        """The open program."""
        return _open(self.program)

    def operands(self, values: list, keep: str = "=cp") -> list:
        """``values`` (one per equation operand) as this program's inputs; an input whose role
        is not in ``keep`` (or when ``ins`` is not known) gets ``None``."""
        if self.ins is None:
            return [None] * len(self.jaxpr.invars)
        return [values[i] if r in keep else None for i, r in zip(self.ins, self.roles)]


# --- default: any other primitive ---------------------------------------------------------------


class Scanned(NamedTuple):
    """A program input as a layer call under ``lax.scan`` sees it: ``leaf`` (its index) given to
    each enclosing scan, outermost first, as ``xs`` (``"s"``: one slice per iteration) or as a
    const (``"c"``: the same array every iteration)."""

    leaf: int
    how: str


def scanned(origin: Any, how: str) -> Any:
    """``origin`` given to one more scan ``how`` (``"s"`` or ``"c"``); None stays None."""
    if isinstance(origin, Scanned):
        return Scanned(origin.leaf, origin.how + how)
    return Scanned(origin, how) if isinstance(origin, int) else None


def _found(eqn: Any) -> list[tuple[str, int | None, Any]]:
    """``(param, position in a tuple or None, value)`` of every program in ``eqn``'s params."""
    found = []
    for key, value in eqn.params.items():
        if isinstance(value, (tuple, list)):
            found += [(key, k, v) for k, v in enumerate(value) if _open(v) is not None]
        elif _open(value) is not None:
            found.append((key, None, value))
    return found


def _nest_generic(eqn: Any, call: bool) -> tuple[Nested, ...]:
    """Every program in the params; one run on the operands as they are (found by arity) is
    ``"opaque"`` with its operands known, or the ``"call"`` when ``call`` (the first such)."""
    out: list[Nested] = []
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    for key, index, value in _found(eqn):
        j = _open(value)
        # only a program held as a param of its own is guessed by arity (a tuple's programs,
        # custom_linear_solve's matvec / solve / ..., run on operands they do not list as such)
        if index is None and len(j.invars) == n_in and len(j.outvars) == n_out:
            kind = "call" if call and not any(m.kind == "call" for m in out) else "opaque"
            out.append(Nested(key, index, value, kind, tuple(range(n_in)), "=" * n_in))
        else:
            out.append(Nested(key, index, value, "opaque", None, ""))
    return tuple(out)


def _nest_opaque(eqn: Any) -> tuple[Nested, ...]:
    return _nest_generic(eqn, call=False)


def _nest_call(eqn: Any) -> tuple[Nested, ...]:
    return _nest_generic(eqn, call=True)


def _plan_default(planner, eqn, ins, at):
    if eqn.primitive.name == "stop_gradient":
        return [False] * len(eqn.outvars)
    if at.register:  # a program inside that the engine does not rewrite: its layer calls warn
        planner.unreachable(eqn)
    return [any(ins)] * len(eqn.outvars)


def _eval_default(runner, eqn, invals, p, probes, states):
    return runner.bind(eqn, invals), states


DEFAULT = Rule(_plan_default, _eval_default)


# --- a site: an equation a site source recognises (a vjpkit_layer equation) ---------------------


def _plan_site(planner, eqn, ins, at):
    return planner.site(eqn, ins, at)


def _eval_site(runner, eqn, invals, p, probes, states):
    return runner.layer(eqn, invals, p, probes, states)


SITE = Rule(_plan_site, _eval_site)


# --- lax.scan -------------------------------------------------------------------------------------


def _plan_scan(planner, eqn, ins, at):
    orig = planner.origins_of(eqn)  # before the walks below move on to the body's equations
    nc, ncar = _compat.scan_split(eqn.params)
    body = eqn.params["jaxpr"].jaxpr
    consts, carry, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
    while True:  # the carry's flags to a fixed point, registering nothing
        outs = planner.walk(body, consts + carry + xs, at._replace(register=False))
        new = [a or b for a, b in zip(carry, outs[:ncar])]
        if new == carry:
            break
        carry = new
    n = eqn.params["length"]
    inner = at._replace(stack=(*at.stack, (at.path, n, False)))
    # the leaves given as consts or xs, tagged so (Scanned)
    tagged = [scanned(o, "c") for o in orig[:nc]] + [None] * ncar
    tagged += [scanned(o, "s") for o in orig[nc + ncar :]]
    return planner.walk(body, consts + carry + xs, inner, tagged)


def _nest_scan(eqn: Any) -> tuple[Nested, ...]:
    nc, ncar = _compat.scan_split(eqn.params)
    n = len(eqn.invars)
    roles = "c" * nc + "r" * ncar + "s" * (n - nc - ncar)
    return (Nested("jaxpr", None, eqn.params["jaxpr"], "scan", tuple(range(n)), roles),)


def _eval_scan(runner, eqn, invals, p, probes, states):
    """Re-scanned with the calls' probes stacked as ``xs`` and their states in the carry."""
    params = eqn.params
    nc, ncar = _compat.scan_split(params)
    body = params["jaxpr"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
    pr, st = runner.mine(p, probes, states)
    # a hook on some iterations only (a glob "blocks[2]") inside: the iteration index rides as xs
    n = params["length"]
    index = jnp.arange(n, dtype=jnp.int32) if any(s.gated for s in runner.plan.under(p)) else None

    def step(carry, x):
        c, s = carry
        xx, prx, i = x
        with runner.at_iteration(i):
            outs, s = runner.eval(body.jaxpr, body.consts, [*consts, *c, *xx], p, prx, s)
        return (outs[:ncar], s), outs[ncar:]

    (c_out, st), ys = lax.scan(
        step,
        (list(init), st),
        (list(xs), pr, index),
        length=n,
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*c_out, *ys], {**states, **st}


# --- lax.cond / switch ----------------------------------------------------------------------------


def _plan_cond(planner, eqn, ins, at):
    """Each branch restarts from the same call counts, so a layer in either branch has one key."""
    before = dict(planner.counts)
    after: list[dict] = []
    outs = None
    for k, branch in enumerate(eqn.params["branches"]):
        planner.counts = dict(before)
        o = planner.walk(branch.jaxpr, ins[1:], at.to((*at.path, "b", k), in_cond=True))
        outs = o if outs is None else [a or b for a, b in zip(outs, o)]
        after.append(planner.counts)
    names = set().union(*after)
    planner.counts = {n: max(c.get(n, 0) for c in after) for n in names}
    return outs


def _nest_cond(eqn: Any) -> tuple[Nested, ...]:
    """Each branch gets the operands after the index."""
    ops = tuple(range(1, len(eqn.invars)))
    branches = eqn.params["branches"]
    return tuple(Nested("branches", k, br, "branch", ops, "=" * len(ops)) for k, br in enumerate(branches))


def _nest_while(eqn: Any) -> tuple[Nested, ...]:
    """The condition gets its consts and the carry, the body its consts and the carry."""
    params = eqn.params
    cc, bc = params["cond_nconsts"], params["body_nconsts"]
    carry = tuple(range(cc + bc, len(eqn.invars)))
    r = "r" * len(carry)
    return (
        Nested("cond_jaxpr", None, params["cond_jaxpr"], "loop", (*range(cc), *carry), "c" * cc + r),
        Nested("body_jaxpr", None, params["body_jaxpr"], "loop", (*range(cc, cc + bc), *carry), "c" * bc + r),
    )


def _eval_cond(runner, eqn, invals, p, probes, states):
    """Probes and states are operands of the switch: only the branch taken writes them."""
    index, ops = invals[0], invals[1:]
    pr, st = runner.mine(p, probes, states)

    def branch(k, jaxpr, ops, pr, st):
        outs, new = runner.eval(jaxpr.jaxpr, jaxpr.consts, ops, (*p, "b", k), pr, st)
        return outs, {key: new[key] for key in st}

    fns = [functools.partial(branch, k, br) for k, br in enumerate(eqn.params["branches"])]
    outs, st = lax.switch(index, fns, list(ops), pr, st)
    return outs, {**states, **st}


# --- inner jax.jit and other call primitives: inlined (eager: one cached compiled call) ------------


def _plan_call(planner, eqn, ins, at):
    inner = call_program(eqn)[1]
    return planner.walk(getattr(inner, "jaxpr", inner), ins, at, planner.origins_of(eqn))


def _eval_call(runner, eqn, invals, p, probes, states):
    if eqn.primitive.name in ("jit", "pjit") and runner.can_compile(invals, probes, states):
        return runner.compiled(eqn, invals, p, probes, states)
    inner = call_program(eqn)[1]
    consts = getattr(inner, "consts", ())
    return runner.eval(getattr(inner, "jaxpr", inner), consts, invals, p, probes, states)


# --- jax.checkpoint: re-checkpointed ----------------------------------------------------------------


def _plan_remat(planner, eqn, ins, at):
    return planner.walk(eqn.params["jaxpr"], ins, at, planner.origins_of(eqn))


def _eval_remat(runner, eqn, invals, p, probes, states):
    params = eqn.params
    pr, st = runner.mine(p, probes, states)

    def body(invals, pr, st):
        return runner.eval(params["jaxpr"], (), invals, p, pr, st)

    remat = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
    outs, st = remat(invals, pr, st)
    return outs, {**states, **st}


# --- jax.shard_map: re-mapped, the calls' probes and states stacked over the shards ---------------


def shards(params: dict) -> tuple[tuple, int]:
    """``(manual axes, number of shards)`` of a ``shard_map`` equation's parameters."""
    axes = _compat.manual_axes(params)
    return axes, math.prod(params["mesh"].shape[a] for a in axes)


def _plan_shard_map(planner, eqn, ins, at):
    """Each shard runs the body on its part: a call inside has one record per shard (the
    program inputs it sees are per-shard views, so it has no origins)."""
    inner = at._replace(stack=(*at.stack, (at.path, shards(eqn.params)[1], True)))
    return planner.walk(eqn.params["jaxpr"], ins, inner)


def _nest_shard_map(eqn: Any) -> tuple[Nested, ...]:
    """A call whose operands split over the shards (``in_specs`` naming an axis) are parts."""
    roles = "".join("p" if any(spec) else "=" for spec in eqn.params["in_specs"])
    return (Nested("jaxpr", None, eqn.params["jaxpr"], "call", tuple(range(len(eqn.invars))), roles),)


def _eval_shard_map(runner, eqn, invals, p, probes, states):
    """Re-mapped with the calls' probes and states as extra operands split over the manual
    axes on their leading (shard) axis, so each shard writes its own records."""
    params = eqn.params
    axes, _ = shards(params)
    pr, st = runner.mine(p, probes, states)
    split = P(axes)

    def body(ops, pr, st):
        pr, st = jax.tree.map(lambda a: a[0], (pr, st))
        outs, st = runner.eval(params["jaxpr"], (), ops, p, pr, st)
        return outs, jax.tree.map(lambda a: a[None], st)

    mapped = jax.shard_map(
        body,
        mesh=params["mesh"],
        in_specs=(list(params["in_specs"]), *jax.tree.map(lambda _: split, (pr, st))),
        out_specs=(list(params["out_specs"]), jax.tree.map(lambda _: split, st)),
        axis_names=frozenset(axes),
        check_vma=params["check_vma"],
    )
    outs, st = mapped(list(invals), pr, st)
    return outs, {**states, **st}


# --- programs the engine does not rewrite: their layer calls run plain, with a warning ---------------


OPAQUE = Rule(_plan_default, _eval_default, _nest_opaque)  # programs not rewritten: calls inside warn
OPAQUE_LOOP = Rule(_plan_default, _eval_default, _nest_while)
# a function with its own derivative rule: not rewritten, but its program is what runs forward
OPAQUE_CALL = Rule(_plan_default, _eval_default, _nest_opaque)

CALL = Rule(_plan_call, _eval_call, _nest_call)  # any call-like primitive (``call_program``): inlined
RULES: dict[str, Rule] = {
    "scan": Rule(_plan_scan, _eval_scan, _nest_scan),
    "cond": Rule(_plan_cond, _eval_cond, _nest_cond),
    "checkpoint": Rule(_plan_remat, _eval_remat, _nest_call),
    "remat2": Rule(_plan_remat, _eval_remat, _nest_call),
    "custom_jvp_call": OPAQUE_CALL,
    "custom_vjp_call": OPAQUE_CALL,
    "custom_vjp_call_jaxpr": OPAQUE_CALL,
    "while": OPAQUE_LOOP,
    "shard_map": Rule(_plan_shard_map, _eval_shard_map, _nest_shard_map),
}


def rule_for(eqn: Any, is_site: Callable[[Any], bool]) -> Rule:
    """The rule of ``eqn``: ``SITE`` when a site source recognises it, else its primitive's in
    ``RULES``, else ``CALL`` for a call-like equation (``call_program``), else ``DEFAULT``."""
    if is_site(eqn):
        return SITE
    return _rule(eqn)


def _rule(eqn: Any) -> Rule:
    rule = RULES.get(eqn.primitive.name)
    if rule is not None:
        return rule
    return CALL if any(n.kind == "call" for n in _nest_call(eqn)) else DEFAULT


# --- sub-programs, found generically in equation params (as equinox's _finalise_jaxpr does) ------


def _open(value: Any) -> Any:
    """The open program of a ``Jaxpr`` or ``ClosedJaxpr`` parameter value, else ``None``."""
    j = getattr(value, "jaxpr", value)
    return j if hasattr(j, "eqns") and hasattr(j, "invars") else None


def nested(eqn: Any) -> tuple[Nested, ...]:
    """The programs ``eqn`` holds, each with how its operands enter it (``Nested``), by the
    equation's rule; empty for an equation with none. A site equation is not special here:
    walkers that leave sites to their sources check ``_site.span_of`` first.

    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda w, c: jax.lax.scan(lambda c, x: (c * w, x), c, c[None]))
    >>> eqn = jaxpr(2.0, jax.numpy.ones(1)).jaxpr.eqns[-1]
    >>> [(n.kind, n.roles) for n in nested(eqn)]
    [('scan', 'crs')]
    """
    nest = _rule(eqn).nest
    return (nest or _nest_opaque)(eqn)


def with_programs(eqn: Any, new: dict) -> Any:
    """``eqn`` with some of its programs replaced: ``new`` maps a ``Nested`` of ``nested(eqn)``
    to its new program; ``eqn`` itself when every new program is the old one."""
    new = {n: v for n, v in new.items() if v is not n.program}
    if not new:
        return eqn
    params = dict(eqn.params)
    for n, v in new.items():
        if n.index is None:
            params[n.key] = v
        else:
            items = list(params[n.key])
            items[n.index] = v
            kind = type(eqn.params[n.key])  # a namedtuple (custom_linear_solve's) by its _make
            params[n.key] = kind._make(items) if hasattr(kind, "_make") else kind(items)
    return eqn.replace(params=params)


def sub_programs(params: dict) -> list:
    """Every program (open ``Jaxpr``) held by an equation's ``params``, in tuples too."""
    found = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            j = _open(v)
            if j is not None:
                found.append(j)
    return found


def call_program(eqn: Any, forward: bool = False) -> tuple[str, Any] | None:
    """``(param name, program)`` of a call-like equation (``nested``'s ``"call"``: an inner
    ``jax.jit``, ``jax.checkpoint``, ``jax.shard_map``, any new call primitive, found in its
    params by arity); ``None`` for the other primitives with programs, whose rules treat them
    apart (``scan``, ``cond``, and those the engine does not rewrite: custom_jvp/custom_vjp,
    while). ``forward``: a custom_jvp/custom_vjp function's program too (an ``"opaque"``
    program run on the operands as they are: a forward dataflow may walk what runs forward;
    the engine does not rewrite it)."""
    for n in nested(eqn):
        if n.kind == "call" or (forward and n.kind == "opaque" and n.ins is not None):
            return n.key, n.program
    return None


def registered_rule(name: str, rule: Rule) -> contextlib.AbstractContextManager:
    """``RULES[name] = rule`` for the duration (push/pop: the previous rule comes back)."""
    return registered(RULES, name, rule)
