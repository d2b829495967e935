"""The custom_jvp rule that turns one layer call into a ``Tangents`` record.

Contract: ``hooked_call`` is what ``vjpkit._rule.call`` runs for a layer when the
active scope is a ``TangentScope`` (inside ``vk.jvp``, ``vk.linearize`` and
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


class TangentScope:
    """The scope of a forward-mode trace with hooks: hooked layers go through ``hooked_call``.

    Attributes:
        config: the hook configuration (``vjpkit._context.Config``).
        names: layer names called so far, in forward order (for ``check_matched``).
    """

    mode = "jvp"

    def __init__(self, config: Any):
        self.config = config
        self.token = config.token
        self.names: list[str] = []

    def call(self, fn: Callable, name: str, params: Any, inputs: tuple, kwargs: dict) -> Any:
        """One layer call of the forward-mode trace (``_primitive.call`` routes it here)."""
        return hooked_call(self, fn, name, params, inputs, kwargs)

    def register(self, name: str) -> int:
        """Counts one call of layer ``name`` and returns its call index."""
        self.names.append(name)
        return self.names.count(name) - 1


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
    scope: TangentScope, fn: Callable, name: str, params: Any, inputs: tuple, kwargs: dict
) -> Any:
    """Applies ``fn(params, *inputs, **kwargs)`` as layer call ``name`` of a forward-mode trace.

    Examples:
        >>> out = hooked_call(scope, dense_fn, "fc1", params, (x,), {})
    """
    index = scope.register(name)
    hooks = scope.config.hooks_for(name, index)
    if not hooks:
        return fn(params, *inputs, **kwargs)
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
