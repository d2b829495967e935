"""The custom_jvp rule that turns one layer call into a ``Tangents`` record.

Contract: ``hooked_call`` is what ``vjpkit._rule.call`` runs for a hooked layer when the
active scope has ``mode == "jvp"`` (inside ``vk.jvp``, ``vk.linearize`` and
``vk.jacobian(mode="fwd")``). It routes the call through a private ``jax.custom_jvp`` whose rule

* runs ``jax.jvp`` over the leaves whose tangent is not a symbolic zero
  (``symbolic_zeros=True``), so nothing is pushed forward for inputs that carry no tangent;
  their ``tangent_input`` / ``tangent_params`` leaves are ``None`` (the whole field is ``None``
  when no leaf has a tangent), as ``grad_input`` is ``None`` in a ``Cotangents``;
* builds the record, runs the hooks in order, and returns ``tangent_output`` (possibly replaced)
  as the call's output tangent. Only ``tangent_output`` can be replaced, with exactly its
  structure, shapes and dtypes; anything else raises ``HookError`` at trace time.

A layer call that no tangent reaches (all tangents zero) is a plain call and fires no hook.
Keyword arguments that are arrays (a dropout key) are passed through the rule with a zero
tangent; all other keyword arguments are static.

This module also owns ``forward_mode_error``, which turns JAX's bare message for
forward-mode autodiff of a hooked (custom_vjp) layer into a ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero

from . import _context
from ._check import check_like
from ._errors import ConfigError, HookError
from ._hooks import hook_name
from ._records import Tangents
from ._trees import merge, scatter, select, split_kwargs

_FORWARD_MODE_MESSAGES = (
    "can't apply forward-mode autodiff (jvp) to a custom_vjp function",
    "Differentiation rule for 'custom_lin' not implemented",
)


def forward_mode_error(err: BaseException, transform: str, layer: str | None = None) -> ConfigError | None:
    """The vjpkit error for JAX's forward-mode-of-custom_vjp failure, or ``None`` for others.

    ``jax.jvp``, ``jax.jacfwd`` or ``jax.linearize`` applied *inside* a function traced by a
    hooked reverse-mode transform reach a layer that is a custom_vjp rule, which JAX can only
    differentiate in reverse mode (forward over reverse, as in ``jax.hessian``, works).

    Args:
        err: the exception JAX raised.
        transform: the public name of the hooked transform (``"vk.grad"``, ``"vk.vjp"``, ...).
        layer: the key of the layer call that failed, when known.

    Examples:
        >>> try:
        ...     out = vk.grad(loss_with_inner_jvp, hooks={"fc*": hook})(params)
        ... except Exception as err:
        ...     new = forward_mode_error(err, "vk.grad")
    """
    if not any(message in str(err) for message in _FORWARD_MODE_MESSAGES):
        return None
    where = f"layer {layer!r}" if layer else "a hooked layer"
    return ConfigError(
        f"{transform} with hooks: forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize or vk.jvp) "
        f"reached {where} inside the function {transform} differentiates. "
        f"Inside {transform}'s hooks scope a hooked layer is a reverse-mode rule (custom_vjp), so "
        "it has no forward mode. Use one of: reverse mode inside (jax.jacrev, jax.grad or vk.vjp "
        f"in place of jax.jacfwd or jax.jvp); forward mode outside ({transform} first, then "
        f"jax.jvp or jax.jacfwd of the result: forward-over-reverse, as vk.hvp does); or hook "
        "globs that do not match the layers inside the forward-mode transform."
    )


def _is_zero(t: Any) -> bool:
    return isinstance(t, SymbolicZero)


def _replacement(rec: Tangents, new: Any, hook: Callable) -> Tangents:
    who = f"tangent hook {hook_name(hook)} on layer {rec.name!r} (call {rec.call})"
    if not isinstance(new, Tangents):
        raise HookError(
            f"{who} returned {type(new).__name__}, not a Tangents record. A tangent hook returns "
            "None to observe, or rec.replace(tangent_output=...) to rewrite the output tangent."
        )
    if (new.name, new.call) != (rec.name, rec.call):
        raise HookError(
            f"{who} returned the record of layer {new.name!r} (call {new.call}). "
            "Return the record you were given, changed with rec.replace(tangent_output=...)."
        )
    for field in ("params", "input", "output", "tangent_input", "tangent_params"):
        if getattr(new, field) is not getattr(rec, field):
            raise HookError(
                f"{who} changed field {field!r}, which is read-only. Only tangent_output can be "
                "replaced: it is what the layers above receive."
            )
    if new.tangent_output is not rec.tangent_output:
        check_like(
            rec.tangent_output,
            new.tangent_output,
            what=f"{who}, field 'tangent_output'",
            error=HookError,
            hint="A replacement must match the original tangent exactly; cast it yourself if you mean to.",
        )
    return new


def _apply_hooks(rec: Tangents, hooks: Sequence[Callable]) -> Tangents:
    for hook in hooks:
        if not callable(hook):  # a vk.HookTransform: reverse mode only
            raise ConfigError(
                f"layer {rec.name!r} (call {rec.call}): {type(hook).__name__} is not a tangent hook. Tangent "
                "hooks are functions rec -> None | Tangents, or vk.on_host(fn)."
            )
        with _context.activate(None):  # hooks may call layers; those are plain calls
            out = hook(rec)
        if out is not None:
            rec = _replacement(rec, out, hook)
    return rec


def hooked_call(
    fn: Callable,
    name: str,
    index: int,
    hooks: Sequence[Callable],
    params: Any,
    inputs: tuple,
    kwargs: dict,
) -> Any:
    """Applies ``fn(params, *inputs, **kwargs)`` as hooked layer call ``name`` (call ``index``).

    Examples:
        >>> out = hooked_call(dense_fn, "fc1", 0, (vk.on_host(print),), params, (x,), {})
    """
    dynamic_kw, static_kw = split_kwargs(kwargs)
    single = len(inputs) == 1

    def plain(p, xs, kw):
        return fn(p, *xs, **kw, **static_kw)

    rule = jax.custom_jvp(plain)

    def jvp(primals, tangents):
        p, xs, kw = primals
        tp, txs, _ = tangents
        p_leaves, p_def = jax.tree.flatten(p)
        x_leaves, x_def = jax.tree.flatten(xs)
        tp_leaves = jax.tree.leaves(tp, is_leaf=_is_zero)
        tx_leaves = jax.tree.leaves(txs, is_leaf=_is_zero)
        p_mask = [not _is_zero(t) for t in tp_leaves]
        x_mask = [not _is_zero(t) for t in tx_leaves]

        def diff_part(p_diff, x_diff):
            p_full = jax.tree.unflatten(p_def, merge(p_leaves, p_mask, p_diff))
            x_full = jax.tree.unflatten(x_def, merge(x_leaves, x_mask, x_diff))
            return plain(p_full, x_full, kw)

        y, ty = jax.jvp(
            diff_part,
            (select(p_leaves, p_mask), select(x_leaves, x_mask)),
            (select(tp_leaves, p_mask), select(tx_leaves, x_mask)),
        )
        tangent_xs = scatter(x_def, x_mask, select(tx_leaves, x_mask), collapse=True)
        rec = Tangents(
            name=name,
            call=index,
            params=p,
            input=xs[0] if single else xs,
            output=y,
            tangent_input=(tangent_xs[0] if single else tangent_xs) if tangent_xs is not None else None,
            tangent_params=scatter(p_def, p_mask, select(tp_leaves, p_mask), collapse=True),
            tangent_output=ty,
        )
        rec = _apply_hooks(rec, hooks)
        return y, rec.tangent_output

    rule.defjvp(jvp, symbolic_zeros=True)
    return rule(params, tuple(inputs), dynamic_kw)
