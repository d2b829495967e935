"""The custom_vjp rule that turns one active layer call into a ``Cotangents`` record.

Contract: ``hooked(site, handler, run_inner, ops, probe, state, nested_probes, nested_states)``
evaluates one site (a span with a layout, ``_site``) through a private ``jax.custom_vjp``:

* fwd runs ``jax.vjp`` over the *perturbed* operands only (``symbolic_zeros=True``) and keeps
  the vjp function, the forward values and the perturbation mask as residuals (the mask as
  pytree metadata), so nothing is recomputed and nothing is kept on the side;
* bwd, when the call's output cotangent is not zero (the loss depends on it): hands the
  record without ``grad_input`` / ``grad_params`` to ``handler.before`` (pre-hooks may replace
  ``grad_output``), runs the layer's VJP on the resulting ``grad_output``, builds the full
  record (``grad_input`` / ``grad_params`` leaves follow the plan's static flags: ``None``
  where no gradient can flow, zeros where JAX proved one is zero) and hands it to
  ``handler.after``, which may replace ``grad_input`` / ``grad_params``, advances the state and
  fills the probe's parts. It returns the (possibly replaced) cotangents upstream, the parts as
  the probe's cotangent and the new state as the cotangent of the state operand. A call whose
  output cotangent is zero makes no record and runs no handler.

The policy (hooks, capture, host delivery, the explain log) lives in the handler
(``_handlers``); this module imports none of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .. import _context
from .._records import Cotangents
from .._trees import Static, merge, select, unvary, unwrap, vary, varying_axes
from . import _site


def _zeros(aval: Any) -> Any:
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jnp.zeros(aval.shape, aval.dtype)
    return jnp.zeros(aval.shape, jax.dtypes.float0)


def _instantiate(cts: Sequence, avals: Sequence) -> list:
    return [_zeros(a) if isinstance(c, SymbolicZero) or c is None else c for c, a in zip(cts, avals)]


def _replace_grads(layout: _site.Layout, shown: Sequence, rec: Cotangents) -> list:
    """Operand cotangents with the record's (possibly replaced) grad_params and grad_input."""
    hoisted, (g_params, g_inputs, g_kw) = layout.split(shown)
    if rec.grad_params is not None:
        g_params = rec.grad_params
    if rec.grad_input is not None:
        g_inputs = (rec.grad_input,) if len(g_inputs) == 1 else tuple(rec.grad_input)
    return layout.join(hoisted, g_params, g_inputs, g_kw)


def hooked(
    site: Any,
    handler: Any,
    run_inner: Callable,
    ops: Sequence,
    probe: Any,
    state: Any,
    nested_probes: dict,
    nested_states: dict,
    iteration: tuple = (),
) -> tuple[list, Any, dict]:
    """Evaluates ``site`` through its rule; returns ``(outputs, new state, nested states)``.

    ``iteration``: the indices of the enclosing scans (traced), for hooks that run on some
    iterations only; the handlers run under ``_context.iteration(iteration)``."""
    in_avals = [v.aval for v in site.eqn.invars]
    out_avals = [v.aval for v in site.eqn.outvars]
    layout = site.layout
    static_flags = site.flags
    pre = handler.before is not None

    def primal(ops, probe, state, npr, nst, it):
        del probe, it
        outs, nst = run_inner(list(ops), npr, nst)
        return outs, state, nst

    rule = jax.custom_vjp(primal)

    def fwd(ops, probe, state, npr, nst, it):
        ops_v, mask = unwrap(ops)
        state_v, _ = unwrap(state)
        npr_v, _ = unwrap(npr)
        nst_v, _ = unwrap(nst)

        def part(diff, npr, nst):
            return run_inner(merge(ops_v, mask, diff), npr, nst)

        (outs, nst_out), vjp_fn = jax.vjp(part, select(ops_v, mask), npr_v, nst_v)
        probe_v, _ = unwrap(probe)
        axes = Static(tuple(varying_axes(p) for p in jax.tree.leaves(probe_v)))  # inside shard_map
        it_v, _ = unwrap(it)
        return (outs, state_v, nst_out), (vjp_fn, ops_v, outs, Static(tuple(mask)), axes, it_v)

    def bwd(res, cts):
        with _context.iteration(res[-1]):
            return _bwd(res[:-1], cts)

    def _bwd(res, cts):
        vjp_fn, ops_v, outs, mask, probe_axes = res
        mask = mask.value
        g_outs, (g_state, g_live), g_nst = cts
        live = any(not isinstance(g, SymbolicZero) for g in g_outs)
        g_outs = _instantiate(g_outs, out_avals)
        g_live = None if g_live is None else _instantiate([g_live], [g_live.aval])[0]
        new_state = g_state
        if live and pre:  # the record before the VJP: pre-hooks may replace grad_output
            none = [None] * len(ops_v)
            rec = _site.record(layout, site.name, site.call, ops_v, outs, g_outs, none)
            rec, new_state = handler.before(site, rec, new_state)
            g_outs = [g if g is not None else o for g, o in zip(_out_leaves(layout, rec), g_outs)]
        g_nst = jax.tree.map(
            lambda g, s: jnp.zeros(s.shape, s.dtype) if isinstance(g, SymbolicZero) else g,
            g_nst,
            nested_states,
            is_leaf=lambda x: isinstance(x, SymbolicZero),
        )
        g_diff, g_npr, g_nst_in = vjp_fn((g_outs, g_nst))
        it = iter(g_diff)
        grads = [next(it) if m else None for m in mask]
        # The record follows the plan's flags: a gradient JAX proved zero is zeros, not None.
        shown = [
            (g if g is not None else _zeros(a)) if f and jnp.issubdtype(a.dtype, jnp.inexact) else None
            for g, a, f in zip(grads, in_avals, static_flags)
        ]
        probe_ct = None
        parts: dict = {}
        if live:
            rec = _site.record(layout, site.name, site.call, ops_v, outs, g_outs, shown)
            if handler.after is not None:
                rec, new_state = handler.after(site, rec, new_state, parts)
            shown = _replace_grads(layout, shown, rec)
        elif g_live is not None and handler.unreached is not None:  # forward values, zero cotangents
            rec = _site.record(layout, site.name, site.call, ops_v, outs, g_outs, shown)
            handler.unreached(site, rec, parts)
        if parts and site.slot is not None:  # typed like the probe (a per-shard probe varies in shard_map)
            leaves, tree = jax.tree.flatten(parts)
            probe_ct = jax.tree.unflatten(tree, [vary(c, a) for c, a in zip(leaves, probe_axes.value)])
        # a per-shard rewrite (a hook with per-shard state) of a replicated operand's gradient
        out_grads = [unvary(s, a) if m and s is not None else None for s, m, a in zip(shown, mask, in_avals)]
        return out_grads, probe_ct, (new_state, g_live), g_npr, g_nst_in, None

    rule.defvjp(fwd, bwd, symbolic_zeros=True)
    return rule(list(ops), probe, state, nested_probes, nested_states, tuple(iteration))


def _out_leaves(layout: _site.Layout, rec: Cotangents) -> list:
    """``rec.grad_output`` as flat output leaves (``None`` for integer outputs)."""
    return layout.out_tree.flatten_up_to(rec.grad_output)
