"""The custom_vjp rule that turns one layer call into a ``Cotangents`` record.

Contract: ``call`` is what every layer's ``apply`` runs. Outside a vjpkit transform, or
when no hook or capture spec matches the layer, it is exactly ``fn(params, *inputs, **kwargs)``.
Otherwise it routes the call through a private ``jax.custom_vjp`` whose

* fwd runs ``jax.vjp`` over the *perturbed* leaves only (``symbolic_zeros=True``), keeping
  the vjp function as the residual, so nothing is recomputed and cotangents of inputs that
  need no gradient are never computed;
* bwd builds the record, runs the hooks (``_hooks.run``: checked replacements, new states),
  and returns the (possibly replaced) ``grad_params`` and ``grad_input`` upstream. When the
  call has a *slot* (it is captured or its hooks keep state), bwd also returns, as the
  cotangent of a zero "probe" argument, ``{"captured": record, "state": new state, "ran": 1}``;
  the transform reads these out as the gradient with respect to the probes.

Keyword arguments that are arrays (a dropout key) are passed through the rule as
non-differentiable operands; all other keyword arguments are static.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _context, _hooks, _slots
from ._capture import reduce_record
from ._records import Cotangents, call_key
from ._trees import merge, scatter, select, split_kwargs, unwrap


def call(fn: Callable, params: Any, inputs: tuple, kwargs: dict, default_name: str) -> Any:
    """Applies ``fn(params, *inputs, **kwargs)`` as the layer call ``default_name``."""
    scope = _context.current()
    if scope is None:
        return fn(params, *inputs, **kwargs)
    name = _context.layer_path(default_name)
    index = scope.register(name)
    hooks = scope.hooks_for(name)
    spec = scope.capture_for(name)
    if not hooks and spec is None:
        return fn(params, *inputs, **kwargs)
    if scope.mode == "jvp":
        from ._jvp_rule import hooked_call as jvp_hooked_call

        return jvp_hooked_call(fn, name, index, hooks, params, inputs, kwargs)
    key = call_key(name, index)
    if scope.mode == "init":
        state = _hooks.init_state(hooks, params)
        if _hooks.is_stateful(state):
            scope.states[key] = state
        return fn(params, *inputs, **kwargs)
    state = _layer_state(scope, key, hooks, params)
    try:
        return _hooked_call(fn, scope, key, name, index, hooks, spec, state, params, inputs, kwargs)
    except (TypeError, NotImplementedError) as err:
        from ._jvp_rule import forward_mode_error

        clear = forward_mode_error(err, scope.transform, key)
        if clear is None:
            raise
        raise clear from err


def _layer_state(scope: _context.Scope, key: str, hooks: Sequence[Callable], params: Any) -> Any:
    """The hook state this call starts from: the user's, or ``init``'s when it has no leaves."""
    if not any(isinstance(h, _hooks.HookTransform) for h in hooks):
        return ()
    state = _hooks.init_state(hooks, params)
    if not _hooks.is_stateful(state):
        return state
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    if scope.mode == "discover":
        _hooks.check_float_state(spec, key)
        scope.states[key] = spec
    return _slots.check_user_state(scope, key, spec)


def _instantiate(g: Any) -> Any:
    return jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, SymbolicZero) else x,
        g,
        is_leaf=lambda x: isinstance(x, SymbolicZero),
    )


def carry(tree: Any) -> Any:
    """Non-float leaves as float32, so they can travel as cotangents (cast back afterwards)."""
    return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(jnp.float32), tree)


def _hooked_call(
    fn: Callable,
    scope: _context.Scope,
    key: str,
    name: str,
    index: int,
    hooks: Sequence[Callable],
    spec: Any,
    state: Any,
    params: Any,
    inputs: tuple,
    kwargs: dict,
) -> Any:
    dynamic_kw, static_kw = split_kwargs(kwargs)
    single = len(inputs) == 1
    stateful = _hooks.is_stateful(state)
    has_slot = spec is not None or stateful
    probe = scope.probes.get(key) if scope.mode == "vjp" else None
    facts: dict[str, Any] = {}  # static facts from fwd, read by bwd of the same call

    def plain(p, xs, kw, extra):
        del extra
        return fn(p, *xs, **kw, **static_kw)

    rule = jax.custom_vjp(plain)

    def fwd(p, xs, kw, extra):
        p_val, p_mask = unwrap(p)
        x_val, x_mask = unwrap(xs)
        kw_val, _ = unwrap(kw)
        extra_val, _ = unwrap(extra)
        _, probe_mask = unwrap(extra["probe"])
        p_leaves, p_def = jax.tree.flatten(p_val)
        x_leaves, x_def = jax.tree.flatten(x_val)

        def diff_part(p_diff, x_diff):
            p_full = jax.tree.unflatten(p_def, merge(p_leaves, p_mask, p_diff))
            x_full = jax.tree.unflatten(x_def, merge(x_leaves, x_mask, x_diff))
            return fn(p_full, *x_full, **kw_val, **static_kw)

        y, vjp_fn = jax.vjp(diff_part, select(p_leaves, p_mask), select(x_leaves, x_mask))
        facts.update(p=(p_def, p_mask), x=(x_def, x_mask), probe_live=any(probe_mask))
        return y, (vjp_fn, p_val, x_val, y, extra_val["state"])

    def bwd(res, g):
        vjp_fn, p_val, x_val, y, old_state = res
        g = _instantiate(g)
        gp, gx = vjp_fn(g)
        (p_def, p_mask), (x_def, x_mask) = facts["p"], facts["x"]
        grad_xs = scatter(x_def, x_mask, gx, collapse=True)
        rec = Cotangents(
            name=name,
            call=index,
            params=p_val,
            input=x_val[0] if single else x_val,
            output=y,
            grad_output=g,
            grad_input=(grad_xs[0] if single else grad_xs) if grad_xs is not None else None,
            grad_params=scatter(p_def, p_mask, gp, collapse=True),
        )
        rec, new_state = _hooks.run(rec, hooks, old_state)
        probe_ct = None
        if has_slot:
            slot = {
                "captured": carry(reduce_record(rec, spec)) if spec is not None else None,
                "state": new_state if stateful else None,
                "ran": jnp.ones((), jnp.float32),
            }
            if scope.mode == "discover":
                scope.slots[key] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), slot)
                if spec is not None:
                    scope.dtypes[key] = jax.tree.map(lambda a: a.dtype, reduce_record(rec, spec))
            elif facts["probe_live"]:
                probe_ct = slot
        gi = rec.grad_input
        gx_out = tuple(None for _ in x_val) if gi is None else (gi,) if single else gi
        gp_out = rec.grad_params if rec.grad_params is not None else jax.tree.map(lambda _: None, p_val)
        extra_out = {"state": jax.tree.map(lambda _: None, old_state), "probe": probe_ct}
        return gp_out, gx_out, jax.tree.map(lambda _: None, dynamic_kw), extra_out

    rule.defvjp(fwd, bwd, symbolic_zeros=True)
    return rule(params, tuple(inputs), dynamic_kw, {"state": state, "probe": probe})
