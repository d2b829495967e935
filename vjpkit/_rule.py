"""The custom_vjp rule that turns one active layer call into a ``Cotangents`` record.

Contract: ``call`` is what every layer's ``apply`` runs. Outside a vjpkit transform it is
exactly ``fn(params, *inputs, **kwargs)``; inside a reverse-mode one it binds the call as one
``vjpkit_layer`` equation (``_primitive``); inside ``vk.jvp`` with hooks it goes through the
custom_jvp rule of ``_jvp_rule``.

``hooked`` is what the engine runs for an active call. Its private ``jax.custom_vjp``

* fwd runs ``jax.vjp`` over the *perturbed* operands only (``symbolic_zeros=True``) and keeps
  the vjp function, the forward values and the perturbation mask as residuals (the mask as
  pytree metadata), so nothing is recomputed and nothing is kept on the side;
* bwd builds the record (``grad_input`` / ``grad_params`` leaves follow the plan's static
  flags: ``None`` where no gradient can flow, zeros where JAX proved one is zero), runs the
  hooks (``_hooks.run``: checked replacements, the new state), and returns the (possibly
  replaced) cotangents upstream, the captured record as the probe's cotangent, and the new
  hook state as the cotangent of the state operand. A call whose output cotangent is zero
  (the loss does not depend on it) makes no record and runs no hook.

Array keyword arguments and values the layer's function closed over are operands that get
gradients; they are not part of the record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _context, _hooks, _primitive
from ._carry import slot_value
from ._records import Cotangents
from ._trees import Static, merge, select, unwrap


def call(fn: Callable, params: Any, inputs: tuple, kwargs: dict, default_name: str) -> Any:
    """Applies ``fn(params, *inputs, **kwargs)`` as the layer call ``default_name``."""
    scope = _context.current()
    if scope is None:
        return fn(params, *inputs, **kwargs)
    name = _context.layer_path(default_name)
    if scope.mode == "jvp":
        from ._jvp_rule import hooked_call as jvp_hooked_call

        return jvp_hooked_call(scope, fn, name, params, inputs, kwargs)
    return _primitive.bind(fn, name, params, inputs, kwargs)


def _zeros(aval: Any) -> Any:
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jnp.zeros(aval.shape, aval.dtype)
    return jnp.zeros(aval.shape, jax.dtypes.float0)


def _instantiate(cts: Sequence, avals: Sequence) -> list:
    return [_zeros(a) if isinstance(c, SymbolicZero) or c is None else c for c, a in zip(cts, avals)]


def _record(site: Any, ops: Sequence, outs: Sequence, g_outs: Sequence, grads: Sequence) -> Cotangents:
    """The record of ``site`` from flat forward values and flat operand cotangents."""
    _, (params, inputs, _) = site.split(ops)
    _, (g_params, g_inputs, _) = site.split(grads)
    out_tree = site.eqn.params["out_tree"]
    single = len(inputs) == 1
    g_out = [g if jnp.issubdtype(o.dtype, jnp.inexact) else None for g, o in zip(g_outs, outs)]
    shape = site.record
    return Cotangents(
        name=site.name,
        call=site.call,
        params=params,
        input=inputs[0] if single else inputs,
        output=jax.tree.unflatten(out_tree, list(outs)),
        grad_output=jax.tree.unflatten(out_tree, g_out),
        grad_input=None if shape.grad_input is None else g_inputs[0] if single else g_inputs,
        grad_params=None if shape.grad_params is None else g_params,
    )


def _replace_grads(site: Any, shown: Sequence, rec: Cotangents) -> list:
    """Operand cotangents with the record's (possibly replaced) grad_params and grad_input."""
    n = site.eqn.params["n_hoisted"]
    tree = site.eqn.params["tree"]
    g_params, g_inputs, g_kw = jax.tree.unflatten(tree, list(shown[n:]))
    if rec.grad_params is not None:
        g_params = rec.grad_params
    if rec.grad_input is not None:
        g_inputs = (rec.grad_input,) if len(g_inputs) == 1 else tuple(rec.grad_input)
    return [*shown[:n], *tree.flatten_up_to((g_params, g_inputs, g_kw))]


def hooked(
    site: Any,
    run_inner: Callable,
    ops: Sequence,
    probe: Any,
    state: Any,
    nested_probes: dict,
    nested_states: dict,
    log: list | None = None,
) -> tuple[list, Any, dict]:
    """Evaluates ``site`` through its rule; returns ``(outputs, new state, nested states)``."""
    in_avals = [v.aval for v in site.eqn.invars]
    out_avals = [v.aval for v in site.eqn.outvars]
    static_flags = site.flags

    def primal(ops, probe, state, npr, nst):
        del probe
        outs, nst = run_inner(list(ops), npr, nst)
        return outs, state, nst

    rule = jax.custom_vjp(primal)

    def fwd(ops, probe, state, npr, nst):
        del probe
        ops_v, mask = unwrap(ops)
        state_v, _ = unwrap(state)
        npr_v, _ = unwrap(npr)
        nst_v, _ = unwrap(nst)

        def part(diff, npr, nst):
            return run_inner(merge(ops_v, mask, diff), npr, nst)

        (outs, nst_out), vjp_fn = jax.vjp(part, select(ops_v, mask), npr_v, nst_v)
        return (outs, state_v, nst_out), (vjp_fn, ops_v, outs, Static(tuple(mask)))

    def bwd(res, cts):
        vjp_fn, ops_v, outs, mask = res
        mask = mask.value
        g_outs, g_state, g_nst = cts
        live = any(not isinstance(g, SymbolicZero) for g in g_outs)
        g_outs = _instantiate(g_outs, out_avals)
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
        probe_ct, new_state = None, g_state
        if live:
            if log is not None:
                log.append(site.key)
            rec = _record(site, ops_v, outs, g_outs, shown)
            sink: list = []  # what the vk.on_host hooks saw: sent in the step's one transfer
            rec, new_state = _hooks.run(rec, site.hooks, g_state, sink)
            shown = _replace_grads(site, shown, rec)
            if site.slot is not None:
                probe_ct = slot_value(site.spec, rec, sink)
        out_grads = [s if m else None for s, m in zip(shown, mask)]
        return out_grads, probe_ct, new_state, g_npr, g_nst_in

    rule.defvjp(fwd, bwd, symbolic_zeros=True)
    return rule(list(ops), probe, state, nested_probes, nested_states)
