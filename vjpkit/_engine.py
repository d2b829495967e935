"""The engine: one traced program, evaluated with every hooked layer call given its rule.

Contract: ``trace`` runs the user's function once under ``jax.make_jaxpr`` with the ``LAYERS``
scope active, so every layer call is one ``vjpkit_layer`` equation (``_primitive``); the
program does not depend on the hook configuration. ``_plan.Plan`` names its layer calls and
decides which are active. ``Runner`` evaluates the program equation by equation:

* an active call goes through the custom_vjp rule of ``_rule``; an inactive one is inlined
  (inside another vjpkit transform's trace, calls stay marked for it);
* ``lax.scan`` bodies holding active calls are re-scanned with their calls' probes stacked on
  a leading axis (passed as ``xs``: one record per iteration) and their hook states in the
  carry (advanced once per iteration, in backward order);
* ``lax.cond`` / ``switch`` branches get the probes and states as operands, so only the
  branch taken writes them;
* ``jax.checkpoint`` bodies are re-checkpointed; inner ``jax.jit`` bodies are inlined, or, in
  an eager call, kept as one compiled call cached per configuration;
* anything else is bound as it is.

A hook state rides the backward pass as the cotangent of a pass-through value: ``vjp`` seeds
the program's final states with the user's states and reads the new ones off as the
cotangents of the initial ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from . import _context, _hooks, _host, _rule, _slots
from ._plan import Plan, Site
from ._primitive import layer_p

# --- evaluation ------------------------------------------------------------------------------

_JIT_CACHE: dict = {}
_JIT_CACHE_SIZE = 64


def _traced(tree: Any) -> bool:
    """Whether any leaf is traced by something other than autodiff (so not an eager call)."""
    return any(isinstance(leaf, jax.core.Tracer) and not _ad_only(leaf) for leaf in jax.tree.leaves(tree))


def _ad_only(t: Any) -> bool:
    while isinstance(t, jax.core.Tracer):
        name = type(t).__name__
        if name not in ("JVPTracer", "LinearizeTracer"):
            return False
        t = getattr(t, "primal", None)
    return True


def _bind(eqn: Any, invals: Sequence) -> list:
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


class Runner:
    """Evaluates a planned program; see the module contract."""

    def __init__(self, plan: Plan, log: list | None = None):
        self.plan = plan
        self.log = log
        # Inside another vjpkit transform's trace (a hooked gradient inside a hooked loss), layer
        # calls stay marked, so that the outer transform sees the forward calls of this one.
        self.mark = _context.current() is _context.LAYERS

    def eval(self, jaxpr, consts, args, path, probes: dict, states: dict) -> tuple[list, dict]:
        env: dict[Any, Any] = {}

        def read(a):
            return a.val if isinstance(a, jcore.Literal) else env[a]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for i, eqn in enumerate(jaxpr.eqns):
            p = (*path, i)
            invals = [read(a) for a in eqn.invars]
            if p in self.plan.busy or (eqn.primitive is layer_p and p in self.plan.sites):
                outs, states = self._special(eqn, invals, p, probes, states)
            else:
                outs = _bind(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars], states

    def _mine(self, p, probes, states) -> tuple[dict, dict]:
        keys = [s.key for s in self.plan.under(p)]
        return (
            {k: probes[k] for k in keys if k in probes},
            {k: states[k] for k in keys if k in states},
        )

    def _special(self, eqn, invals, p, probes, states) -> tuple[list, dict]:
        name = eqn.primitive.name
        params = eqn.params
        if eqn.primitive is layer_p:
            return self._layer(eqn, invals, p, probes, states)
        if name == "scan":
            return self._scan(eqn, invals, p, probes, states)
        if name == "cond":
            return self._cond(eqn, invals, p, probes, states)
        if name in ("jit", "pjit") and self.log is None and not _traced((invals, probes, states)):
            return self._jit(eqn, invals, p, probes, states)
        if name in ("jit", "pjit", "closed_call", "core_call"):
            inner = params["jaxpr"]
            return self.eval(inner.jaxpr, inner.consts, invals, p, probes, states)
        if name in ("remat2", "checkpoint"):
            pr, st = self._mine(p, probes, states)

            def body(invals, pr, st):
                return self.eval(params["jaxpr"], (), invals, p, pr, st)

            remat = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
            outs, st = remat(invals, pr, st)
            return outs, {**states, **st}
        return _bind(eqn, invals), states

    def _jit(self, eqn, invals, p, probes, states) -> tuple[list, dict]:
        """An inner ``jax.jit`` called eagerly stays one compiled call, cached per configuration."""
        inner = eqn.params["jaxpr"]
        sites = tuple((q[len(p) :], s.key) for q, s in self.plan.sites.items() if q[: len(p)] == p)
        key = (self.plan.config.token, id(inner), sites, self.mark)
        entry = _JIT_CACHE.get(key)
        if entry is None:
            runner = Runner(self.plan)  # an equivalent plan for this program and configuration

            def body(invals, pr, st):
                return runner.eval(inner.jaxpr, inner.consts, invals, p, pr, st)

            entry = (inner, jax.jit(body))  # holding ``inner`` keeps its id from being reused
            if len(_JIT_CACHE) >= _JIT_CACHE_SIZE:
                _JIT_CACHE.pop(next(iter(_JIT_CACHE)))
            _JIT_CACHE[key] = entry
        pr, st = self._mine(p, probes, states)
        outs, st = entry[1](invals, pr, st)
        return outs, {**states, **st}

    def _layer(self, eqn, invals, p, probes, states) -> tuple[list, dict]:
        site = self.plan.sites[p]
        inner = eqn.params["jaxpr"]

        def run_inner(ops, pr, st):
            return self.eval(inner.jaxpr, inner.consts, ops, p, pr, st)

        if not site.active:
            if self.mark and not self.plan.under(p):
                return _bind(eqn, invals), states
            return run_inner(invals, probes, states)
        if self.mark and not self.plan.under(p):

            def run_inner(ops, pr, st):
                return _bind(eqn, ops), st

        pr, st = self._mine(p, probes, states)
        outs, state, st = _rule.hooked(
            site, run_inner, invals, probes.get(site.key), states.get(site.key), pr, st, self.log
        )
        states = {**states, **st}
        if site.state is not None:
            states[site.key] = state
        return outs, states

    def _scan(self, eqn, invals, p, probes, states) -> tuple[list, dict]:
        params = eqn.params
        nc, ncar = params["num_consts"], params["num_carry"]
        body = params["jaxpr"]
        consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
        pr, st = self._mine(p, probes, states)

        def step(carry, x):
            c, s = carry
            xx, prx = x
            outs, s = self.eval(body.jaxpr, body.consts, [*consts, *c, *xx], p, prx, s)
            return (outs[:ncar], s), outs[ncar:]

        (c_out, st), ys = lax.scan(
            step,
            (list(init), st),
            (list(xs), pr),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*c_out, *ys], {**states, **st}

    def _cond(self, eqn, invals, p, probes, states) -> tuple[list, dict]:
        index, ops = invals[0], invals[1:]
        pr, st = self._mine(p, probes, states)

        def branch(k, jaxpr, ops, pr, st):
            outs, new = self.eval(jaxpr.jaxpr, jaxpr.consts, ops, (*p, "b", k), pr, st)
            return outs, {key: new[key] for key in st}

        fns = [functools.partial(branch, k, br) for k, br in enumerate(eqn.params["branches"])]
        outs, st = lax.switch(index, fns, list(ops), pr, st)
        return outs, {**states, **st}


# --- the transforms' shared core ----------------------------------------------------------------


@dataclasses.dataclass
class Traced:
    """A traced program and its plan: ``out_tree`` is the user output's treedef."""

    closed: Any
    plan: Plan
    out_tree: Any
    n_out: int


def trace(config: _context.Config, flat_fun: Callable, leaves: Sequence, extra: Any = ()) -> Traced:
    """Traces ``flat_fun(*leaves) -> (out, aux)`` once with every layer call marked.

    ``extra`` holds the values ``flat_fun`` closes over (the other arguments), to tell an eager
    call from a traced one.
    """

    # Called eagerly (no argument is traced), what does not depend on the differentiated
    # arguments is computed as it is written, as eager jax.grad does: a loss may read concrete
    # values of its other arguments (int(y.max())).
    eager = not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((leaves, extra)))

    def marked(*leaves):
        with _context.activate(_context.LAYERS):
            if eager:
                with jax.ensure_compile_time_eval():
                    return flat_fun(*leaves)
            return flat_fun(*leaves)

    closed, shape = jax.make_jaxpr(marked, return_shape=True)(*leaves)
    out_tree = jax.tree.structure(shape)
    n_out = len(jax.tree.leaves(shape[0]))
    plan = Plan(config, closed.jaxpr, [True] * len(leaves))
    return Traced(closed, plan, out_tree, n_out)


def linearize(traced: Traced, leaves: Sequence, hook_state: Any, log: list | None = None):
    """``(out, aux, pull)`` of the traced program.

    ``pull(seed_leaves)`` returns ``(leaf cotangents, captured, new hook state)``; it is a
    ``jax.tree_util.Partial`` (a pytree, so ``jit`` can take it). ``log``, when given, receives
    the key of every call whose backward pass runs, in backward order, at trace time.
    """
    plan = traced.plan
    runner = Runner(plan, log)
    probes0 = _slots.probes(plan)
    states0 = _slots.layer_states(plan, hook_state)

    def program(leaves, probes, states):
        outs, states = runner.eval(traced.closed.jaxpr, traced.closed.consts, leaves, (), probes, states)
        return (outs[: traced.n_out], states), outs[traced.n_out :]

    (outs, _), pullback, aux_leaves = jax.vjp(program, list(leaves), probes0, states0, has_aux=True)
    out_shape, aux_shape = jax.tree.unflatten(traced.out_tree, [0] * traced.out_tree.num_leaves)
    out = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    aux = jax.tree.unflatten(jax.tree.structure(aux_shape), aux_leaves)
    pull = jax.tree_util.Partial(functools.partial(_pull, plan), pullback, states0, hook_state)
    return out, aux, pull


def _pull(plan: Plan, pullback: Callable, states0: dict, hook_state: Any, seed_leaves: Sequence) -> tuple:
    g_leaves, g_probes, g_states = pullback((list(seed_leaves), states0))
    captured = _slots.read_captured(plan, g_probes)
    host, token = _slots.send_host(plan, g_probes, hook_state)
    return _host.tie(token, (g_leaves, captured, _slots.new_state(plan, hook_state, g_states, host)))


def forward_values(traced: Traced, leaves: Sequence) -> Callable[[Site], Any]:
    """``params(site)``: the params a stateful call used, for its hooks' ``init``.

    An ``init`` that reads only shapes (all of vjpkit's) is evaluated on shapes. One that reads
    values gets them from one forward evaluation; inside ``lax.scan`` or ``lax.cond`` a call
    has no single params value, which is an error.
    """
    cache: dict[str, Any] = {}

    def params(site: Site) -> Any:
        def init(p):
            return _hooks.init_state(site.hooks, p)

        closed = jax.make_jaxpr(init)(site.record.params)
        if not _depends(closed.jaxpr):
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), site.record.params)
            return zeros
        if site.scans or site.in_cond:
            raise _context.ConfigError(
                f"{traced.plan.config.transform}: the init of the hooks on layer {site.key!r} reads its "
                "params' values, but the layer runs inside lax.scan or lax.cond, where its params "
                "differ per iteration or branch. Make init depend on shapes only (jnp.zeros_like)."
            )
        if not cache:
            _collect(traced, leaves, cache)
        return cache[site.key]

    return params


def _depends(jaxpr: Any) -> bool:
    """Whether any output of ``jaxpr`` depends on its inputs."""
    live = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(a, jcore.Literal) and a in live for a in eqn.invars):
            live.update(eqn.outvars)
    return any(not isinstance(v, jcore.Literal) and v in live for v in jaxpr.outvars)


def _collect(traced: Traced, leaves: Sequence, out: dict) -> None:
    plan = traced.plan

    class Collect(Runner):
        def _layer(self, eqn, invals, p, probes, states):
            site = plan.sites[p]
            out.setdefault(site.key, site.split(invals)[1][0])
            inner = eqn.params["jaxpr"]
            return self.eval(inner.jaxpr, inner.consts, invals, p, probes, states)

    Collect(plan).eval(traced.closed.jaxpr, traced.closed.consts, list(leaves), (), {}, {})
