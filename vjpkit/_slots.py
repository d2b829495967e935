"""Slots: how captured records and new hook states leave the backward pass.

Contract: a layer call that is captured, or whose hooks keep state, owns a *slot*: a zero
"probe" argument whose cotangent the rule sets to ``{"captured", "state", "ran"}``. Running a
transform with slots takes two traces: ``discover`` traces the whole transform under
``jax.eval_shape`` to learn every slot's shapes (no computation), then the real trace
differentiates with respect to the probes too, and ``read_out`` turns the probe
gradients into ``captured`` (``{call key: Cotangents}``) and the new hook state. A slot
whose backward never ran has ``ran == 0``: its state is returned unchanged. Each call has its
own probe, so calls of a shared layer are never summed.

Capture host delivery (``vk.capture(..., host=vk.on_host(fn, every=N))``) sends each spec's
records in one callback per step; with ``every > 1`` a float step counter lives in the hook
state under ``"__host__/<i>"`` and gates the transfer inside the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _context, _hooks
from ._check import check_like
from ._errors import ConfigError

HOST_KEY = "__host__/"

THREADING = (
    "Create the state once with `state = vk.init_hook_state(g, *args)`, pass it as "
    "`g(*args, hook_state=state)`, and pass the state that call returns to the next step."
)


def host_counters(specs: Sequence[Any]) -> dict[str, Any]:
    """Initial step counters of the capture host deliveries that skip steps."""
    return {
        f"{HOST_KEY}{i}": {"count": jnp.zeros((), jnp.float32)}
        for i, spec in enumerate(specs)
        if spec.host is not None and spec.host.every > 1
    }


def _owner(key: str) -> str:
    if key.startswith(HOST_KEY):
        return "a capture host delivery with every > 1 (its step counter)"
    return f"the hooks on layer {key!r}"


def check_user_state(scope: _context.Scope, key: str, expected: Any) -> Any:
    """The user's state for ``key``, checked against the shapes ``init`` gives."""
    if scope.hook_state is not None and not isinstance(scope.hook_state, dict):
        raise ConfigError(
            f"{scope.transform}: hook_state must be the dict {{call key: state}} returned last by the "
            f"previous call (or by vk.init_hook_state), got {type(scope.hook_state).__name__}. {THREADING}"
        )
    if scope.hook_state is None:
        raise ConfigError(
            f"{scope.transform}: {_owner(key)} keeps state across steps, so the function needs "
            f"hook_state=. {THREADING}"
        )
    if key not in scope.hook_state:
        raise ConfigError(
            f"{scope.transform}: hook_state has no entry for layer call {key!r} (it has "
            f"{sorted(scope.hook_state)}). Was it made for another model or other hooks? {THREADING}"
        )
    state = scope.hook_state[key]
    check_like(
        expected, state, what=f"{scope.transform}: hook_state[{key!r}]", error=ConfigError, hint=THREADING
    )
    return state


def discover(scope: _context.Scope, trace: Callable[[], Any]) -> None:
    """Traces ``trace()`` shape-only under ``scope`` (mode ``"discover"``) to fill its slots."""
    with _context.activate(scope):
        jax.eval_shape(trace)
    counters = host_counters(scope.capture)
    for key, spec in counters.items():
        scope.states[key] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), spec)
        check_user_state(scope, key, scope.states[key])
    if scope.hook_state is not None:
        extra = sorted(set(scope.hook_state) - set(scope.states))
        if extra:
            raise ConfigError(
                f"{scope.transform}: hook_state has entries {extra} for layer calls that keep no state in "
                f"this forward pass (stateful calls: {sorted(scope.states)}). {THREADING}"
            )


def probes(scope: _context.Scope) -> dict[str, Any]:
    """Zero probes shaped like the discovered slots."""
    return {
        key: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), slot) for key, slot in scope.slots.items()
    }


def read_out(scope: _context.Scope, probe_grads: dict[str, Any]) -> tuple[dict, dict]:
    """``(captured, new_state)`` from the probes' gradients."""
    captured, new_state = {}, {}
    for key in scope.slots:  # backward order (outside jit; jit returns dicts sorted by key)
        g = probe_grads[key]
        if g["captured"] is not None:
            captured[key] = jax.tree.map(lambda a, dt: a.astype(dt), g["captured"], scope.dtypes[key])
        if g["state"] is not None:
            ran = g["ran"] > 0
            new_state[key] = jax.tree.map(
                lambda new, o, r=ran: jnp.where(r, new, o), g["state"], scope.hook_state[key]
            )
    for key in scope.states:  # stateful calls whose backward never ran keep their state
        if key not in new_state and not key.startswith(HOST_KEY):
            new_state[key] = scope.hook_state[key]
    for i, spec in enumerate(scope.capture):
        if spec.host is None:
            continue
        mine = {k: v for k, v in captured.items() if spec.matches(k.split("#")[0])}
        counter_key = f"{HOST_KEY}{i}"
        if counter_key in scope.states:
            count = scope.hook_state[counter_key]["count"]
            jax.lax.cond(
                jnp.mod(count, spec.host.every) == 0,
                spec.host.send,
                lambda m: None,
                mine,
            )
            new_state[counter_key] = {"count": count + 1}
        else:
            spec.host.send(mine)
    return captured, new_state


def init_hook_state(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The initial hook state of a vjpkit-transformed function, for ``hook_state=``.

    Runs ``fn``'s forward pass once and calls each stateful hook's ``init`` with the params
    of each layer call it matches.

    Args:
        fn: the function returned by ``vk.grad`` / ``vk.value_and_grad`` with stateful hooks.
        *args: example arguments, as ``fn`` will be called.
        **kwargs: example arguments, as ``fn`` will be called.

    Returns:
        ``{call key: state}`` (a pytree of float arrays).

    Examples:
        >>> g = vk.value_and_grad(loss_fn, hooks={"conv*": vk.ema_normalize(0.9)})
        >>> state = vk.init_hook_state(g, params, x, y)
        >>> (loss, grads), state = jax.jit(g)(params, x, y, hook_state=state)
    """
    config = getattr(fn, "__vjpkit__", None)
    if config is None:
        raise ConfigError(
            "vk.init_hook_state takes the function returned by vk.grad / vk.value_and_grad "
            f"(with hooks=...), got {getattr(fn, '__name__', type(fn).__name__)}."
        )
    scope = _context.Scope(
        config["hooks"], transform=config["transform"], mode="init", capture=config["capture"]
    )
    with _context.activate(scope):
        config["fun"](*args, **kwargs)
    states = dict(scope.states)
    states.update(host_counters(config["capture"]))
    for key, state in states.items():
        _hooks.check_float_state(state, key)
    return states
