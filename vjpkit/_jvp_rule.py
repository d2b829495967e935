"""The custom_jvp rule that turns one layer call into a ``Tangents`` record.

Contract: ``hooked_call`` is what ``vjpkit._rule.call`` runs for a layer when the
active scope is a ``TangentScope`` (inside ``vk.jvp``, ``vk.linearize`` and
``vk.jacobian(mode="fwd")``). It routes the call through a private ``jax.custom_jvp`` whose rule

* runs ``jax.jvp`` over the leaves whose tangent is not a symbolic zero
  (``symbolic_zeros=True``), so nothing is pushed forward for inputs that carry no tangent;
  their ``tangent_input`` / ``tangent_params`` leaves are ``None`` (the whole field is ``None``
  when no leaf has a tangent), as ``grad_input`` is ``None`` in a ``Cotangents``;
* builds the record and hands it to the scope's handler (``handler.after(site, rec, None,
  {})``, the engine's ``Handler`` type; ``_engine.tangent_hooks()`` runs the call's tangent
  hooks in order), and returns the handler's ``tangent_output`` (possibly replaced) as the
  call's output tangent. Only ``tangent_output`` can be replaced, with exactly its structure,
  shapes and dtypes (``_hooks.validate``); anything else raises ``HookError`` at trace time.

Like the reverse-mode rule (``_engine._rule``), this module imports no hook, capture or host
module: the policy lives in the handler.

A layer call that no tangent reaches (all tangents zero) is a plain call and fires no hook.
Keyword arguments that are arrays (a dropout key) are passed through the rule with a zero
tangent; all other keyword arguments are static.

"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.custom_derivatives import SymbolicZero

from ._records import Tangents
from ._trees import merge, scatter, select, split_kwargs


class TangentSite(NamedTuple):
    """The forward-mode counterpart of the engine's ``Site``, as handed to a handler.

    Attributes:
        name: the layer's name.
        call: its call index.
        hooks: the hooks matching this call.
    """

    name: str
    call: int
    hooks: tuple


class TangentScope:
    """The scope of a forward-mode trace with hooks: hooked layers go through ``hooked_call``.

    Attributes:
        config: the hook configuration (``vjpkit._context.Config``).
        handler: what each call's ``Tangents`` record is handed to (an engine ``Handler``
            with ``after``).
        names: layer names called so far, in forward order (for ``check_matched``).
    """

    mode = "jvp"

    def __init__(self, config: Any, handler: Any):
        self.config = config
        self.handler = handler
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
        rec, _ = scope.handler.after(TangentSite(name, index, tuple(hooks)), rec, None, {})
        return y, rec.tangent_output

    rule.defjvp(jvp, symbolic_zeros=True)
    return rule(params, tuple(inputs), dynamic_kw)
