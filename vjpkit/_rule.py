"""The custom_vjp rule that turns one layer call into a :class:`Cotangents` record.

Contract: :func:`call` is what every layer's ``apply`` runs. Outside a vjpkit transform, or
when no hook matches the layer, it is exactly ``fn(params, *inputs, **kwargs)``. Otherwise it
routes the call through a private ``jax.custom_vjp`` whose

* fwd runs ``jax.vjp`` over the *perturbed* leaves only (``symbolic_zeros=True``), keeping
  the vjp function as the residual, so nothing is recomputed and cotangents of inputs that
  need no gradient are never computed;
* bwd builds the record, runs the hooks in order, checks every replacement at trace time,
  and returns the (possibly replaced) ``grad_params`` and ``grad_input`` upstream.

Keyword arguments that are arrays (a dropout key) are passed through the rule as
non-differentiable operands; all other keyword arguments are static.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _context
from ._check import check_like
from ._errors import HookError
from ._records import Cotangents
from ._trees import merge, scatter, select, split_kwargs, unwrap


def call(fn: Callable, params: Any, inputs: tuple, kwargs: dict, default_name: str) -> Any:
    """Applies ``fn(params, *inputs, **kwargs)`` as the layer call ``default_name``."""
    scope = _context.current()
    if scope is None:
        return fn(params, *inputs, **kwargs)
    name = _context.layer_path(default_name)
    index = scope.register(name)
    hooks = scope.hooks_for(name)
    if not hooks:
        return fn(params, *inputs, **kwargs)
    if scope.mode == "jvp":
        from ._jvp_rule import hooked_call as jvp_hooked_call

        return jvp_hooked_call(fn, name, index, hooks, params, inputs, kwargs)
    return _hooked_call(fn, name, index, hooks, params, inputs, kwargs)


def _instantiate(g: Any) -> Any:
    return jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, SymbolicZero) else x,
        g,
        is_leaf=lambda x: isinstance(x, SymbolicZero),
    )


def _apply_hooks(rec: Cotangents, hooks: Sequence[Callable]) -> Cotangents:
    for hook in hooks:
        with _context.activate(None):  # hooks may call layers; those are plain calls
            out = hook(rec)
        if out is not None:
            rec = _replacement(rec, out, hook)
    return rec


def _hook_name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _replacement(rec: Cotangents, new: Any, hook: Callable) -> Cotangents:
    who = f"hook {_hook_name(hook)} on layer {rec.name!r} (call {rec.call})"
    if not isinstance(new, Cotangents):
        raise HookError(
            f"{who} returned {type(new).__name__}, not a record. A hook returns None to observe, "
            "or rec.replace(grad_input=..., grad_params=...) to rewrite cotangents."
        )
    if (new.name, new.call) != (rec.name, rec.call):
        raise HookError(
            f"{who} returned the record of layer {new.name!r} (call {new.call}). "
            "Return the record you were given, changed with rec.replace(...)."
        )
    for field in ("params", "input", "output", "grad_output"):
        if getattr(new, field) is not getattr(rec, field):
            raise HookError(
                f"{who} changed field {field!r}, which is read-only. Only grad_input and "
                "grad_params can be replaced; they are what the layers below receive."
            )
    for field in ("grad_input", "grad_params"):
        expected, got = getattr(rec, field), getattr(new, field)
        if got is expected:
            continue
        if expected is None:
            raise HookError(
                f"{who} set field {field!r}, which is None because that input needs no gradient "
                "(nothing upstream uses it). Leave it None."
            )
        check_like(
            expected,
            got,
            what=f"{who}, field {field!r}",
            error=HookError,
            hint="A replacement must match the original cotangent exactly; cast it yourself if you mean to.",
        )
    return new


def _hooked_call(
    fn: Callable,
    name: str,
    index: int,
    hooks: Sequence[Callable],
    params: Any,
    inputs: tuple,
    kwargs: dict,
) -> Any:
    dynamic_kw, static_kw = split_kwargs(kwargs)
    single = len(inputs) == 1
    masks: dict[str, Any] = {}  # static facts from fwd, read by bwd of the same call

    def plain(p, xs, kw):
        return fn(p, *xs, **kw, **static_kw)

    rule = jax.custom_vjp(plain)

    def fwd(p, xs, kw):
        p_val, p_mask = unwrap(p)
        x_val, x_mask = unwrap(xs)
        kw_val, _ = unwrap(kw)
        p_leaves, p_def = jax.tree.flatten(p_val)
        x_leaves, x_def = jax.tree.flatten(x_val)

        def diff_part(p_diff, x_diff):
            p_full = merge(p_leaves, p_mask, p_diff)
            x_full = merge(x_leaves, x_mask, x_diff)
            return plain(jax.tree.unflatten(p_def, p_full), jax.tree.unflatten(x_def, x_full), kw_val)

        y, vjp_fn = jax.vjp(diff_part, select(p_leaves, p_mask), select(x_leaves, x_mask))
        masks.update(p=(p_def, p_mask), x=(x_def, x_mask))
        return y, (vjp_fn, p_val, x_val, y)

    def bwd(res, g):
        vjp_fn, p_val, x_val, y = res
        g = _instantiate(g)
        gp, gx = vjp_fn(g)
        (p_def, p_mask), (x_def, x_mask) = masks["p"], masks["x"]
        grad_params = scatter(p_def, p_mask, gp, collapse=True)
        grad_xs = scatter(x_def, x_mask, gx, collapse=True)
        rec = Cotangents(
            name=name,
            call=index,
            params=p_val,
            input=x_val[0] if single else x_val,
            output=y,
            grad_output=g,
            grad_input=(grad_xs[0] if single else grad_xs) if grad_xs is not None else None,
            grad_params=grad_params,
        )
        rec = _apply_hooks(rec, hooks)
        gi = rec.grad_input
        gx_out = tuple(None for _ in x_val) if gi is None else (gi,) if single else gi
        gp_out = rec.grad_params if rec.grad_params is not None else jax.tree.map(lambda _: None, p_val)
        return gp_out, gx_out, jax.tree.map(lambda _: None, dynamic_kw)

    rule.defvjp(fwd, bwd, symbolic_zeros=True)
    return rule(params, tuple(inputs), dynamic_kw)
