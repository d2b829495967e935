"""Reverse-mode transforms with named layer hooks: ``grad`` and ``value_and_grad``.

Contract: without ``hooks`` these return exactly what ``jax.grad`` / ``jax.value_and_grad``
return (only error messages are rewritten to be clearer). With ``hooks`` or ``capture``, the
returned function traces ``fun`` once through the engine's driver (``_engine.trace`` /
``linearize``), which routes every layer call whose path matches a glob through the custom_vjp
rule. The hook configuration (``_engine.configure``) belongs to the returned function:
``jax.jit`` of it compiles the hooks in.

An eager call with capture, no hooks and no host delivery (nothing user-written runs) is
compiled once per configuration and function, as ``jax.jit`` would do, instead of being traced
again on every call; a loss that cannot be jitted (it reads concrete values, takes a non-array
keyword) runs op by op as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _capture, _engine
from ._check import require_inexact
from ._errors import ConfigError, SeedError
from ._hook_base import HookState
from ._trees import is_traced


def _describe_value(x: Any) -> str:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None:
        return f"a {type(x).__name__}"
    return f"an array of shape {tuple(shape)} and dtype {np.dtype(dtype).name}"


def _scalar_loss(fun: Callable, has_aux: bool, transform: str) -> Callable:
    """``fun`` with its output checked to be a scalar (and ``(scalar, aux)`` with has_aux)."""
    fname = getattr(fun, "__name__", "fun")
    fname = "fun" if fname == "<lambda>" else fname

    @functools.wraps(fun)
    def checked(*args, **kwargs):
        out = fun(*args, **kwargs)
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


def _argnums(argnums: Any, nargs: int, transform: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(i, int) and -nargs <= i < nargs for i in nums):
        raise ConfigError(
            f"{transform}: argnums={argnums!r} does not name positional arguments of a call with "
            f"{nargs} of them."
        )
    return tuple(i % nargs for i in nums)


def _program_capture(capture: Any) -> Callable | None:
    """The program of a capture spec that brings its own (``vk.curvature.stats``: its
    ``program`` field), a transform ``(name, fun, argnums, has_aux, hooks, capture, match,
    with_value) -> function``; ``None`` when no spec does. Nothing is registered at import."""
    found = (getattr(c, "program", None) for c in _capture.items(capture))
    return next((p for p in found if callable(p)), None)


def _transform(
    jax_transform: Callable, name: str, fun: Callable, argnums, has_aux: bool, hooks, capture, match
) -> Callable:
    if not callable(fun):
        raise ConfigError(f"{name}: fun must be callable, got {type(fun).__name__}.")
    special = _program_capture(capture)
    if special is not None:
        with_value = jax_transform is jax.value_and_grad
        hooked = special(name, fun, argnums, has_aux, hooks, capture, match, with_value)
        config = getattr(hooked, "hook_config", None)  # its hooks' configuration, if any
        hooked = functools.wraps(fun)(hooked)
        hooked.__vjpkit__ = dict(fun=fun, config=config, argnums=argnums, has_aux=has_aux)
        return hooked
    config = _engine.configure(hooks, capture, name, match)
    if not config.hooks and not config.capture:
        return jax_transform(_scalar_loss(fun, has_aux, name), argnums=argnums, has_aux=has_aux)
    with_value = jax_transform is jax.value_and_grad
    checked = _scalar_loss(fun, has_aux, name)

    # nothing user-written runs in the backward pass, and nothing is delivered to the host
    pure = not config.hooks and not any(spec.host is not None for spec in config.capture)

    def hooked(*args, hook_state=None, **kwargs):
        if not pure or hook_state is not None or is_traced((args, kwargs)):
            return run(*args, hook_state=hook_state, **kwargs)
        key = (config.token, fun, argnums, has_aux, with_value)
        compiled = _EAGER.get(key)
        if compiled is None:
            order: list = []  # the captured calls in backward order, as the trace makes them
            compiled = (jax.jit(functools.partial(run, _vk_order=order)), order)
        if compiled is not False:
            try:
                result, captured = compiled[0](*args, **kwargs)
            except Exception:  # not jittable (or a user error, which the eager run raises again)
                compiled = False
            else:
                _remember(key, compiled)
                # jit returns dicts with sorted keys: give them back in backward order, as eagerly
                return result, {k: captured[k] for k in compiled[1] if k in captured}
            _remember(key, compiled)
        return run(*args, hook_state=hook_state, **kwargs)

    def run(*args, hook_state=None, _vk_order=None, **kwargs):
        nums = _argnums(argnums, len(args), name)
        _require_differentiable([args[i] for i in nums], nums, name)
        traced = _engine.trace(config, checked, args, kwargs, argnums=nums, has_aux=has_aux)
        value, aux, pullback = _engine.linearize(traced, hook_state)
        grads, captured, new_state, _ = pullback(
            [jnp.ones_like(value)]
        )  # ones_like keeps a shard_map varying type
        user_grads = grads[0] if isinstance(argnums, int) else tuple(grads)
        if with_value:
            result = ((value, aux), user_grads) if has_aux else (value, user_grads)
        else:
            result = (user_grads, aux) if has_aux else user_grads
        if _vk_order is not None:
            _vk_order[:] = list(captured)
        extras = ((captured,) if config.capture else ()) + ((new_state,) if hook_state is not None else ())
        return (result, *extras) if extras else result

    hooked = functools.wraps(fun)(hooked)
    hooked.__vjpkit__ = dict(fun=fun, config=config, argnums=argnums, has_aux=has_aux)
    return hooked


_EAGER: dict = {}  # (config token, fun, argnums, has_aux, value) -> jitted transform, or False
_EAGER_SIZE = 64


def _remember(key: tuple, compiled: Any) -> None:
    if key not in _EAGER and len(_EAGER) >= _EAGER_SIZE:
        _EAGER.pop(next(iter(_EAGER)))
    _EAGER[key] = compiled


def _require_differentiable(diff: Sequence, nums: Sequence[int], transform: str) -> None:
    for i, value in zip(nums, diff):
        require_inexact(
            value,
            f"{transform}: args[{i}]",
            error=ConfigError,
            hint="Cast it (x.astype(jnp.float32)) or leave it out of argnums.",
        )


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    hooks: dict | None = None,
    capture: Any = None,
    match: bool | None = None,
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
        match: find the layers of plain JAX code (``x @ params["fc1"]["w"]``) in the traced
            program, named by parameter path (``docs/plain-jax.md``). Default on; the
            environment variable ``VJPKIT_MATCH=0`` turns the default off.

    Returns:
        A function with ``fun``'s signature returning what ``jax.grad`` returns; with
        ``capture``, ``(result, captured)``. When hooks keep state (``vk.HookTransform``), it
        takes ``hook_state=`` and returns the new state last: ``(result[, captured], state)``.

    Examples:
        >>> def halve_fc1(rec):
        ...     return rec.replace(grad_params=jax.tree.map(lambda g: g / 2, rec.grad_params))
        >>> grads = jax.jit(vk.grad(loss, hooks={"fc1": halve_fc1}))(params, x, y)
    """
    return _transform(jax.grad, "vk.grad", fun, argnums, has_aux, hooks, capture, match)


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    hooks: dict | None = None,
    capture: Any = None,
    match: bool | None = None,
) -> Callable:
    """``jax.value_and_grad`` with named, hookable layer cotangents; see ``grad``.

    Examples:
        >>> (loss_value, grads) = vk.value_and_grad(loss, hooks={"fc*": vk.on_host(print)})(params, x, y)
    """
    return _transform(jax.value_and_grad, "vk.value_and_grad", fun, argnums, has_aux, hooks, capture, match)


def init_hook_state(fn: Callable, *args: Any, **kwargs: Any) -> HookState:
    """The initial hook state of a vjpkit-transformed function, for ``hook_state=``.

    Traces ``fn``'s forward pass once (no gradient is computed), with the arguments ``fn``
    differentiates (its ``argnums``: plain-JAX layers are named by these leaves' paths, as in
    its records), and calls each stateful hook's ``init`` with the params of each layer call it
    matches. A layer inside ``lax.scan`` has one
    state, advanced once per iteration.

    Args:
        fn: the function returned by ``vk.grad`` / ``vk.value_and_grad`` with stateful hooks.
        *args: example arguments, as ``fn`` will be called.
        **kwargs: example arguments, as ``fn`` will be called.

    Returns:
        A ``vk.HookState``: ``state[call key]`` is that call's state (float arrays).

    Examples:
        >>> g = vk.value_and_grad(loss_fn, hooks={"conv*": vk.ema_normalize(0.9)})
        >>> state = vk.init_hook_state(g, params, x, y)
        >>> (loss, grads), state = jax.jit(g)(params, x, y, hook_state=state)
    """
    meta = getattr(fn, "__vjpkit__", None)
    if meta is None:
        raise ConfigError(
            "vk.init_hook_state takes the function returned by vk.grad / vk.value_and_grad "
            f"(with hooks=...), got {getattr(fn, '__name__', type(fn).__name__)}."
        )
    config, fun = meta["config"], meta["fun"]
    if config is None:  # a transform with its own program (vk.curvature.stats) and no hooks
        return HookState()
    # the same arguments differentiated as the transform's calls: plain-JAX matching names the
    # layers by the paths of these leaves, and takes the others (the batch) as data
    nums = meta.get("argnums")
    nums = None if nums is None else _argnums(nums, len(args), config.transform)
    traced = _engine.trace(
        config, fun, args, kwargs, argnums=nums, has_aux=meta.get("has_aux", False), check=False
    )
    return _engine.init_hook_state(traced)
