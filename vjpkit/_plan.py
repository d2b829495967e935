"""The plan: every layer call of one traced program, named, with its hooks and slot shapes.

Contract: ``Plan(config, jaxpr, in_flags)`` walks a program made by ``_engine.trace`` once,
computing nothing. It names every ``vjpkit_layer`` equation in forward order (``name``,
``name#1``, ...) as if inner ``jax.jit`` and ``jax.checkpoint`` bodies were inlined; the calls of
one ``lax.cond`` restart from the same counts in each branch, so a layer in either branch has
one key. It decides which calls are *active* (a hook or capture spec matches), and derives
from the program's types, per call: the record's shapes (``grad_input`` / ``grad_params``
leaves are ``None`` where no gradient can flow: a forward dataflow over the program), the
hook state's shapes, and the probe's shapes. A layer called where the engine cannot rewrite
(inside a ``custom_jvp``/``custom_vjp`` function or a ``while`` loop) makes a warning.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from . import _context, _hooks
from ._carry import slot_avals
from ._primitive import layer_p
from ._records import Cotangents, call_key


def _inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """One layer call of the traced program (static facts only).

    Attributes:
        key: ``name`` or ``name#k``; name, call: as in the record.
        path: where the equation sits (indices into nested programs).
        hooks: the hooks matching ``name``; spec: the capture spec, or ``None``; host: the
            ``vk.on_host`` hooks among them, whose records leave in the step's one transfer.
        eqn: the ``vjpkit_layer`` equation.
        flags: per operand, whether it carries a gradient (``grad_input`` / ``grad_params``
            leaves are ``None`` where not).
        origins: per operand, the index of the program input it is (passed through calls
            unchanged), or ``None`` (computed, constant, or inside a loop or branch).
        scans: lengths of the enclosing ``lax.scan`` s, outermost first; loops: their paths.
        in_cond: inside a ``lax.cond`` branch.
        record: the record's fields as ``ShapeDtypeStruct`` trees (unstacked).
        state: the hook state's ``ShapeDtypeStruct`` tree, or ``None`` when stateless.
        slot: the probe's carried ``ShapeDtypeStruct`` tree (captured and host records), or ``None``.
    """

    key: str
    name: str
    call: int
    path: tuple
    hooks: tuple
    spec: Any
    host: tuple
    eqn: Any
    flags: tuple
    origins: tuple
    scans: tuple
    loops: tuple
    in_cond: bool
    record: Cotangents
    state: Any
    slot: Any

    @property
    def active(self) -> bool:
        return bool(self.hooks) or self.spec is not None

    def split(self, ops: Sequence) -> tuple[list, Any]:
        """``(hoisted, (params, inputs, kwargs))`` from flat operands."""
        n = self.eqn.params["n_hoisted"]
        return list(ops[:n]), jax.tree.unflatten(self.eqn.params["tree"], list(ops[n:]))


def _record_avals(eqn: Any, flags: Sequence[bool], name: str, call: int) -> Cotangents:
    n = eqn.params["n_hoisted"]
    tree = eqn.params["tree"]
    avals = [_sds(v.aval) for v in eqn.invars[n:]]
    grads = [a if f and _inexact(a) else None for a, f in zip(avals, flags[n:])]
    params, inputs, _ = jax.tree.unflatten(tree, avals)
    g_params, g_inputs, _ = jax.tree.unflatten(tree, grads)
    outs = jax.tree.unflatten(eqn.params["out_tree"], [_sds(v.aval) for v in eqn.outvars])
    g_outs = jax.tree.map(lambda a: a if _inexact(a) else None, outs)
    single = len(inputs) == 1
    return Cotangents(
        name=name,
        call=call,
        params=params,
        input=inputs[0] if single else inputs,
        output=outs,
        grad_output=g_outs,
        grad_input=_collapse(g_inputs[0] if single else g_inputs),
        grad_params=_collapse(g_params),
    )


def _collapse(tree: Any) -> Any:
    """``None`` for a tree that has leaf positions but no leaves; ``tree`` otherwise."""
    is_none = lambda x: x is None
    positions = jax.tree.leaves(tree, is_leaf=is_none)
    if positions and all(p is None for p in positions):
        return None
    return tree


class Plan:
    """Every layer call of a traced program, named, with its hooks and slot shapes."""

    def __init__(self, config: _context.Config, jaxpr: Any, in_flags: Sequence[bool]):
        self.config = config
        self.sites: dict[tuple, Site] = {}
        self.by_key: dict[str, Site] = {}
        self.order: list[str] = []  # keys of every layer call, forward order
        self.busy: set[tuple] = set()  # paths that hold a layer call
        self.unreached: list[str] = []  # layer names inside programs the engine cannot rewrite
        self._counts: dict[str, int] = {}
        self._walk(jaxpr, list(in_flags), (), (), False, True, list(range(len(in_flags))))

    # -- queries
    def active(self) -> list[Site]:
        return [s for s in self.by_key.values() if s.active]

    def under(self, path: tuple) -> list[Site]:
        """Active sites (one per key) strictly inside the equation at ``path``."""
        if getattr(self, "_under_size", None) != len(self.sites):  # index every proper prefix once
            index: dict[tuple, dict[str, Site]] = {}
            for p, s in self.sites.items():
                if s.active:
                    for k in range(len(p)):
                        index.setdefault(p[:k], {}).setdefault(s.key, s)
            self._under, self._under_size = index, len(self.sites)
        return list(self._under.get(tuple(path), {}).values())

    @property
    def names(self) -> list[str]:
        return [self.by_key[k].name for k in self.order] + self.unreached

    # -- the walk
    def _walk(self, jaxpr, flags, path, scans, in_cond, register, origins=None) -> list[bool]:
        env: dict[Any, bool] = dict(zip(jaxpr.invars, flags))
        origin = dict(zip(jaxpr.invars, origins or ()))

        def read(a):
            return False if isinstance(a, jcore.Literal) else env.get(a, False)

        for i, eqn in enumerate(jaxpr.eqns):
            p = (*path, i)
            ins = [read(a) for a in eqn.invars]
            self._origins = [None if isinstance(a, jcore.Literal) else origin.get(a) for a in eqn.invars]
            outs = self._eqn(eqn, ins, p, scans, in_cond, register)
            for v, f in zip(eqn.outvars, outs):
                env[v] = bool(f) and _inexact(v.aval)
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn, ins, p, scans, in_cond, register) -> list[bool]:
        prim, params = eqn.primitive, eqn.params
        orig = self._origins
        if prim is layer_p:
            return self._site(eqn, ins, p, scans, in_cond, register)
        name = prim.name
        if name == "scan":
            return self._scan(eqn, ins, p, scans, in_cond, register)
        if name == "cond":
            return self._cond(eqn, ins, p, scans, register)
        if name in ("jit", "pjit", "closed_call", "core_call") and "jaxpr" in params:
            inner = params["jaxpr"]
            return self._walk(getattr(inner, "jaxpr", inner), ins, p, scans, in_cond, register, orig)
        if name in ("remat2", "checkpoint"):
            return self._walk(params["jaxpr"], ins, p, scans, in_cond, register, orig)
        if name == "stop_gradient":
            return [False] * len(eqn.outvars)
        if register:
            self._unreachable(eqn, name)
        return [any(ins)] * len(eqn.outvars)

    def _unreachable(self, eqn, prim_name) -> None:
        names = _layer_names_in(eqn.params)
        if names:
            self.unreached += names
            warnings.warn(
                f"vjpkit: layer call(s) {sorted(set(names))} run inside a '{prim_name}' "
                "(a custom_jvp/custom_vjp function or a while loop), which vjpkit does not rewrite: "
                "they run as plain JAX and make no record. Call them outside it to hook them.",
                stacklevel=2,
            )

    def _site(self, eqn, ins, p, scans, in_cond, register) -> list[bool]:
        inner = eqn.params["jaxpr"].jaxpr
        orig = [None] * len(inner.invars) if scans or in_cond else list(self._origins)
        if not register:
            return self._walk(inner, ins, p, scans, in_cond, False)
        name = eqn.params["name"]
        call = self._counts.get(name, 0)
        self._counts[name] = call + 1
        key = call_key(name, call)
        config = self.config
        hooks = config.hooks_for(name)
        spec = config.capture_for(name)
        record = _record_avals(eqn, ins, name, call)
        host = tuple(h for h in hooks if getattr(h, "deferred", False))
        state = _hooks.state_avals(hooks, record.params)
        if state is not None:
            _hooks.check_float_state(state, key)
        slot = slot_avals(record, spec, len(host)) if spec is not None or host else None
        lengths, loops = tuple(n for _, n in scans), tuple(q for q, _ in scans)
        site = Site(
            key, name, call, p, hooks, spec, host, eqn, tuple(ins), tuple(orig), lengths, loops, in_cond,
            record, state, slot
        )  # fmt: skip
        if key in self.by_key:  # the same call in another branch of a lax.cond
            other = self.by_key[key]
            same = jax.tree.structure((other.slot, other.state)) == jax.tree.structure((slot, state))
            if not same or jax.tree.leaves((other.slot, other.state)) != jax.tree.leaves((slot, state)):
                raise _context.ConfigError(
                    f"{config.transform}: layer call {key!r} appears in two lax.cond branches with "
                    f"different record shapes ({other.record!r} and {record!r}). Give the layers "
                    "in the two branches different names."
                )
        else:
            self.by_key[key] = site
            self.order.append(key)
        self.sites[p] = site
        self.busy.update(p[:k] for k in range(len(p) + 1))  # every layer call is rewritten or inlined
        return self._walk(inner, ins, p, scans, in_cond, True, orig)

    def _scan(self, eqn, ins, p, scans, in_cond, register) -> list[bool]:
        nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
        body = eqn.params["jaxpr"].jaxpr
        consts, carry, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
        while True:
            outs = self._walk(body, consts + carry + xs, p, scans, in_cond, False)
            new = [a or b for a, b in zip(carry, outs[:ncar])]
            if new == carry:
                break
            carry = new
        return self._walk(
            body, consts + carry + xs, p, (*scans, (p, eqn.params["length"])), in_cond, register
        )

    def _cond(self, eqn, ins, p, scans, register) -> list[bool]:
        before = dict(self._counts)
        after: list[dict] = []
        outs = None
        for k, branch in enumerate(eqn.params["branches"]):
            self._counts = dict(before)
            o = self._walk(branch.jaxpr, ins[1:], (*p, "b", k), scans, True, register)
            outs = o if outs is None else [a or b for a, b in zip(outs, o)]
            after.append(self._counts)
        names = set().union(*after)
        self._counts = {n: max(c.get(n, 0) for c in after) for n in names}
        return outs


def _layer_names_in(params: dict) -> list[str]:
    """Names of the layer calls inside the programs held by an equation's ``params``."""
    names = []
    for v in params.values():
        for s in v if isinstance(v, (tuple, list)) else [v]:
            jaxpr = s.jaxpr if isinstance(s, jcore.ClosedJaxpr) else s if isinstance(s, jcore.Jaxpr) else None
            for eqn in jaxpr.eqns if jaxpr is not None else ():
                if eqn.primitive is layer_p:
                    names.append(eqn.params["name"])
                names += _layer_names_in(eqn.params)
    return names
