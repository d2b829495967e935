"""Reverse-mode transforms with named layer hooks: ``grad`` and ``value_and_grad``.

Contract: without ``hooks`` these return exactly what ``jax.grad`` / ``jax.value_and_grad``
return (only error messages are rewritten to be clearer). With ``hooks``, the returned
function opens a ``Scope`` while JAX traces ``fun``, so every layer
call whose path matches a glob is routed through the custom_vjp rule of ``_rule``. The hook
configuration belongs to the returned function: ``jax.jit`` of it compiles the hooks in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _context, _slots
from ._capture import as_specs
from ._errors import ConfigError, SeedError
from ._hooks import HookTransform


def _describe_value(x: Any) -> str:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None:
        return f"a {type(x).__name__}"
    return f"an array of shape {tuple(shape)} and dtype {np.dtype(dtype).name}"


def _scalar_loss(fun: Callable, has_aux: bool, transform: str, scope: _context.Scope | None) -> Callable:
    """``fun`` with its output checked to be a scalar (and ``(scalar, aux)`` with has_aux)."""
    fname = getattr(fun, "__name__", "fun")
    fname = "fun" if fname == "<lambda>" else fname

    @functools.wraps(fun)
    def checked(*args, **kwargs):
        out = fun(*args, **kwargs)
        if scope is not None:
            scope.check_matched()
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise SeedError(
                    f"{transform}(..., has_aux=True): {fname} must return a pair (loss, aux), "
                    f"got {_describe_value(out)}. Return (loss, aux), or drop has_aux=True."
                )
            value = out[0]
        else:
            value = out
        if getattr(value, "shape", None) is None or tuple(value.shape) != ():
            shape = tuple(getattr(value, "shape", ()))
            aux_note = (
                " If it returns (loss, aux), pass has_aux=True."
                if not has_aux and isinstance(out, (tuple, list))
                else ""
            )
            raise SeedError(
                f"{transform} needs a scalar loss, but {fname} returned {_describe_value(value)}."
                f"{aux_note} Reverse mode starts from a cotangent seed dL/dL: for a scalar loss the "
                "seed is 1.0 and is implied. A non-scalar output has no implied seed: reduce it to a "
                "scalar (for example out.sum() or out.mean()), or give the seed explicitly, one "
                "value per output element (the 'vector' of a vector-Jacobian product): "
                f"`out, pullback = vk.vjp({fname}, *args); grads = pullback(seed)[0]` with seed of "
                f"shape {shape} (jnp.ones({shape}) gives the gradient of out.sum())."
            )
        return out

    return checked


def _has_slots(pairs, specs) -> bool:
    return bool(specs) or any(isinstance(h, HookTransform) for _, hooks in pairs for h in hooks)


def _transform(
    jax_transform: Callable, name: str, fun: Callable, argnums, has_aux: bool, hooks, capture
) -> Callable:
    if not callable(fun):
        raise ConfigError(f"{name}: fun must be callable, got {type(fun).__name__}.")
    pairs = _context.normalize_hooks(hooks, name)
    specs = as_specs(capture, name)
    if not pairs and not specs:
        return jax_transform(_scalar_loss(fun, has_aux, name, None), argnums=argnums, has_aux=has_aux)
    with_value = jax_transform is jax.value_and_grad
    slotted = _has_slots(pairs, specs)

    @functools.wraps(fun)
    def hooked(*args, hook_state=None, **kwargs):
        if hook_state is not None and not slotted:
            raise ConfigError(
                f"{name}: hook_state= was given, but no hook keeps state (no vk.HookTransform in hooks). "
                "Drop hook_state=."
            )
        if not slotted:
            scope = _context.Scope(pairs, transform=name)
            inner = jax_transform(_scalar_loss(fun, has_aux, name, scope), argnums=argnums, has_aux=has_aux)
            with _context.activate(scope):
                return inner(*args, **kwargs)

        config = dict(hooks=pairs, transform=name, capture=specs, hook_state=hook_state)
        found = _context.Scope(mode="discover", **config)
        shaped = jax_transform(_scalar_loss(fun, has_aux, name, found), argnums=argnums, has_aux=has_aux)
        _slots.discover(found, lambda: shaped(*args, **kwargs))
        if hook_state is not None and not found.states:
            raise ConfigError(
                f"{name}: hook_state= was given, but no hook on the layers called keeps state "
                "(their vk.HookTransform states have no arrays). Drop hook_state=."
            )

        scope = _context.Scope(mode="vjp", **config)
        scope.slots, scope.dtypes, scope.states = found.slots, found.dtypes, found.states
        checked = _scalar_loss(fun, has_aux, name, scope)

        def with_probes(*args_and_probes, **kw):
            *user_args, scope.probes = args_and_probes
            return checked(*user_args, **kw)

        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        inner = jax_transform(with_probes, argnums=(*nums, len(args)), has_aux=has_aux)
        with _context.activate(scope):
            out = inner(*args, _slots.probes(found), **kwargs)
        if with_value:
            value, grads = out
        else:
            grads, value = out if has_aux else (out, None)
        user_grads = grads[0] if isinstance(argnums, int) else tuple(grads[:-1])
        captured, new_state = _slots.read_out(scope, grads[-1])
        result = (value, user_grads) if with_value else (user_grads, value) if has_aux else user_grads
        extras = ((captured,) if specs else ()) + ((new_state,) if hook_state is not None else ())
        return (result, *extras) if extras else result

    hooked.__vjpkit__ = dict(fun=fun, hooks=pairs, capture=specs, transform=name)
    return hooked


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    hooks: dict | None = None,
    capture: Any = None,
) -> Callable:
    """``jax.grad`` with named, hookable layer cotangents.

    Args:
        fun: a scalar loss ``fun(*args)``.
        argnums: which positional argument(s) to differentiate, as in ``jax.grad``.
        has_aux: ``fun`` returns ``(loss, aux)``; the result is then ``(grads, aux)``.
        hooks: ``{glob: hook or [hooks]}``. A hook is ``rec -> None | Cotangents`` and is
            traced into the backward pass of every layer call whose path matches the glob;
            ``vk.on_host(fn)`` runs ``fn`` on the host instead.
        capture: a glob, globs, or ``vk.capture(...)`` spec(s): the function then returns
            ``(result, captured)`` with ``captured = {call key: Cotangents}`` computed in-graph.

    Returns:
        A function with ``fun``'s signature returning what ``jax.grad`` returns; with
        ``capture``, ``(result, captured)``. When hooks keep state (``vk.HookTransform``), it
        takes ``hook_state=`` and returns the new state last: ``(result[, captured], state)``.

    Examples:
        >>> def halve_fc1(rec):
        ...     return rec.replace(grad_params=jax.tree.map(lambda g: g / 2, rec.grad_params))
        >>> grads = jax.jit(vk.grad(loss, hooks={"fc1": halve_fc1}))(params, x, y)
    """
    return _transform(jax.grad, "vk.grad", fun, argnums, has_aux, hooks, capture)


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    hooks: dict | None = None,
    capture: Any = None,
) -> Callable:
    """``jax.value_and_grad`` with named, hookable layer cotangents; see ``grad``.

    Examples:
        >>> (loss_value, grads) = vk.value_and_grad(loss, hooks={"fc*": vk.on_host(print)})(params, x, y)
    """
    return _transform(jax.value_and_grad, "vk.value_and_grad", fun, argnums, has_aux, hooks, capture)
