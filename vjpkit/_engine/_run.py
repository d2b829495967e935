"""The runner: a planned program evaluated equation by equation, each by its primitive's rule.

Contract: ``Runner(plan, handler).eval(jaxpr, consts, args, path, probes, states)`` evaluates a
program traced by the driver. An equation that holds no active layer call is bound as it is;
one that does is evaluated by its rule (``_rules``): an active site goes through the custom_vjp
rule of ``_rule`` with the program's handler, an inactive one is inlined (inside another
vjpkit transform's trace, calls stay marked for it); scan, cond, checkpoint and call
primitives thread the probes and hook states of the calls inside them.

A hook state rides the backward pass as the cotangent of a pass-through value: the driver
seeds the program's final states with the user's states and reads the new ones off as the
cotangents of the initial ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from .. import _context
from . import _rule
from ._plan import Plan, _is_site
from ._rules import call_program, rule_for

_JIT_CACHE: dict = {}
_JIT_CACHE_SIZE = 64


def _ad_only(t: Any) -> bool:
    while isinstance(t, jax.core.Tracer):
        name = type(t).__name__
        if name not in ("JVPTracer", "LinearizeTracer"):
            return False
        t = getattr(t, "primal", None)
    return True


def _traced(tree: Any) -> bool:
    """Whether any leaf is traced by something other than autodiff (so not an eager call)."""
    return any(isinstance(leaf, jax.core.Tracer) and not _ad_only(leaf) for leaf in jax.tree.leaves(tree))


class Runner:
    """Evaluates a planned program; see the module contract."""

    def __init__(self, plan: Plan, handler: Any = None, compile_calls: bool = True):
        self.plan = plan
        self.handler = handler
        self.compile_calls = compile_calls
        # Inside another vjpkit transform's trace (a hooked gradient inside a hooked loss), layer
        # calls stay marked, so that the outer transform sees the forward calls of this one.
        self.mark = _context.current() is _context.LAYERS
        self.iteration: list = []  # the indices of the enclosing scans that hold gated hooks

    @contextlib.contextmanager
    def at_iteration(self, index: Any) -> Iterator[None]:
        """Evaluates a scan body at iteration ``index`` (traced), or outside any when ``None``."""
        if index is not None:
            self.iteration.append(index)
        try:
            yield
        finally:
            if index is not None:
                self.iteration.pop()

    @staticmethod
    def bind(eqn: Any, invals: Sequence) -> list:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*invals, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    def eval(self, jaxpr, consts, args, path, probes: dict, states: dict) -> tuple[list, dict]:
        env: dict[Any, Any] = {}

        def read(a):
            return a.val if isinstance(a, jcore.Literal) else env[a]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        busy, sites = self.plan.busy, self.plan.sites
        for i, eqn in enumerate(jaxpr.eqns):
            p = (*path, i)
            invals = [read(a) for a in eqn.invars]
            if p in busy or p in sites:
                outs, states = rule_for(eqn, _is_site).eval(self, eqn, invals, p, probes, states)
            else:
                outs = self.bind(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars], states

    def mine(self, p, probes, states) -> tuple[dict, dict]:
        """The probes and states of the active calls inside the equation at ``p``."""
        keys = [k for s in self.plan.under(p) for k in (s.key, s.carrier) if k is not None]
        return (
            {k: probes[k] for k in keys if k in probes},
            {k: states[k] for k in keys if k in states},
        )

    def can_compile(self, invals, probes, states) -> bool:
        """Whether an inner ``jax.jit`` may stay one compiled call (an eager, unlogged run)."""
        return self.compile_calls and not _traced((invals, probes, states))

    def compiled(self, eqn, invals, p, probes, states) -> tuple[list, dict]:
        """An inner ``jax.jit`` called eagerly stays one compiled call, cached per configuration."""
        inner = call_program(eqn)[1]
        sites = tuple((q[len(p) :], s.key) for q, s in self.plan.sites.items() if q[: len(p)] == p)
        key = (self.plan.config.token, id(inner), sites, self.mark)
        entry = _JIT_CACHE.get(key)
        if entry is None:
            runner = Runner(self.plan, self.handler)  # an equivalent plan for this program and configuration

            def body(invals, pr, st):
                return runner.eval(inner.jaxpr, inner.consts, invals, p, pr, st)

            entry = (inner, jax.jit(body))  # holding ``inner`` keeps its id from being reused
            if len(_JIT_CACHE) >= _JIT_CACHE_SIZE:
                _JIT_CACHE.pop(next(iter(_JIT_CACHE)))
            _JIT_CACHE[key] = entry
        pr, st = self.mine(p, probes, states)
        outs, st = entry[1](invals, pr, st)
        return outs, {**states, **st}

    def layer(self, eqn, invals, p, probes, states) -> tuple[list, dict]:
        site = self.plan.sites[p]
        inner = site.span.jaxpr

        def run_inner(ops, pr, st):
            return self.eval(inner.jaxpr, inner.consts, ops, p, pr, st)

        if not site.active:
            if self.mark and not self.plan.under(p):
                return self.bind(eqn, invals), states
            return run_inner(invals, probes, states)
        if self.mark and not self.plan.under(p):

            def run_inner(ops, pr, st):
                return self.bind(eqn, ops), st

        pr, st = self.mine(p, probes, states)
        state_in = (states.get(site.key), states.get(site.carrier))
        iteration = tuple(self.iteration) if site.gated else ()
        outs, (state, live), st = _rule.hooked(
            site, self.handler, run_inner, invals, probes.get(site.key), state_in, pr, st, iteration
        )
        states = {**states, **st}
        if site.state is not None:
            states[site.key] = state
        if site.carrier is not None:
            states[site.carrier] = live
        return outs, states
