"""Slots and hook state: how captured records and new states leave the backward pass.

Contract: an active layer call that a handler wants owns a *slot*: a zero "probe" operand whose
cotangent the rule sets to the handlers' named parts (``{"captured": record, "host": (...),
"ran": 1, "seen": 1}``; ``_handlers``). Slot shapes come from the plan
(the program's types), never from a second trace. A call inside ``lax.scan`` or
``jax.shard_map`` has its probe stacked on a leading axis per enclosing scan (its length) or
shard_map (its shards), outermost first, so its records come back one per iteration and shard.
Integer and boolean leaves travel exactly, as 16-bit chunks in float32; a record of a
``lax.cond`` branch not taken comes back as NaN (integers: 0), never as plausible zeros.

The hook state threaded by ``hook_state=`` is a ``HookState`` (``_hook_base``): ``layers`` maps
call keys to the states of their stateful hooks, ``host`` holds the step counters of host
deliveries with ``every > 1``. This module checks it, threads it and advances the counters.
Inside ``jax.shard_map`` each shard keeps its own state: a call's state is stacked on a leading
axis per enclosing shard_map (``Site.shards``), each shard starting from the same ``init``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .. import _context, _hooks, _host
from .._check import check_like
from .._errors import ConfigError
from .._hook_base import HookState
from ._carry import read

THREADING = (
    "Create the state once with `state = vk.init_hook_state(g, *args)`, pass it as "
    "`g(*args, hook_state=state)`, and pass the state that call returns to the next step."
)


# --- slots --------------------------------------------------------------------------------------


def _stacked(site: Any) -> Any:
    carried = {name: p.carried for name, p in site.slot.items()}
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((*site.stack, *a.shape), a.dtype), carried)


def probes(plan: Any) -> dict:
    """Zero probes for every call of ``plan`` that has probe parts (captured, host hooks, ...)."""
    return {
        s.key: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), _stacked(s))
        for s in plan.active()
        if s.slot is not None
    }


def send_host(plan: Any, probe_grads: dict, hook_state: Any) -> tuple[dict, jax.Array | None]:
    """Sends every record the ``vk.on_host`` hooks saw in this backward pass in ONE transfer.

    On the host each hook gets its records in backward order: calls in reverse forward order,
    and the calls inside one ``lax.scan`` body iteration by iteration, last iteration first.
    Calls whose backward pass did not run (a branch not taken) deliver nothing. Hooks with
    ``every > 1`` are gated by their counters in ``hook_state.host`` when it is threaded.

    Returns:
        ``(advanced host counters, token)``; the token is ``None`` when nothing is sent.
    """
    groups: dict[tuple, list] = {}  # calls grouped by their enclosing loops, in backward order
    for key in reversed(plan.order):
        site = plan.by_key[key]
        if site.host and key in probe_grads:
            groups.setdefault(site.loops, []).append(site)
    state = None if hook_state is None else _as_hook_state(hook_state, plan.config.transform)
    host = dict(state.host) if state is not None else {}
    if not groups:
        return host, None
    payload, order = [], []
    sent = read(plan, probe_grads, "host", mask=False)
    for sites in groups.values():
        entries = []
        for site in sites:
            payload.append((list(sent[site.key]), probe_grads[site.key]["ran"]))
            entries.append(site.host)
        order.append((sites[0].stack, sites[0].sharded, entries))
    due = {}
    if state is not None:
        for key, hook in gated_hooks(plan.config).items():
            if key not in host:
                raise ConfigError(
                    f"{plan.config.transform}: hook_state has no step counter for {hook!r} "
                    f"(hook_state.host[{key!r}]); it was made for other hooks. {THREADING}"
                )
            count = host[key]["count"]
            due[hook] = jnp.mod(count, hook.every) == 0
            host[key] = {"count": count + 1}
    return host, _host.send_records(payload, order, due)


# --- hook state ---------------------------------------------------------------------------------


def _as_hook_state(value: Any, transform: str) -> HookState:
    if isinstance(value, HookState):
        return value
    if isinstance(value, Mapping):  # a plain {call key: state} dict
        return HookState(value)
    raise ConfigError(
        f"{transform}: hook_state must be the state returned last by the previous call (or by "
        f"vk.init_hook_state), got {type(value).__name__}. {THREADING}"
    )


def layer_states(plan: Any, hook_state: Any) -> dict:
    """The user's state for every stateful call of ``plan``, checked against ``init``'s shapes."""
    transform = plan.config.transform
    stateful = [s for s in plan.active() if s.state is not None]
    if not stateful:
        given = None if hook_state is None else _as_hook_state(hook_state, transform)
        if given is not None and not given.host:
            entries = f" (it has entries {sorted(given.layers)})" if given.layers else ""
            raise ConfigError(
                f"{transform}: hook_state= was given{entries}, but no hook on the layers called keeps "
                "state (no vk.HookTransform with array state). Drop hook_state=."
            )
        return {}
    if hook_state is None:
        raise ConfigError(
            f"{transform}: the hooks on layer {stateful[0].key!r} keep state across steps, so the "
            f"function needs hook_state=. {THREADING}"
        )
    state = _as_hook_state(hook_state, transform)
    keys = {s.key for s in stateful}
    extra = sorted(set(state.layers) - keys)
    if extra:
        raise ConfigError(
            f"{transform}: hook_state has entries {extra} for layer calls that keep no state in "
            f"this forward pass (stateful calls: {sorted(keys)}). {THREADING}"
        )
    out = {}
    for s in stateful:
        if s.key not in state.layers:
            raise ConfigError(
                f"{transform}: hook_state has no entry for layer call {s.key!r} (it has "
                f"{sorted(state.layers)}). Was it made for another model or other hooks? {THREADING}"
            )
        check_like(
            s.state,
            state.layers[s.key],
            what=f"{transform}: hook_state[{s.key!r}]",
            error=ConfigError,
            hint=THREADING,
        )
        out[s.key] = state.layers[s.key]
    return out


def new_state(plan: Any, hook_state: Any, g_states: dict, host: dict) -> HookState | None:
    """The advanced hook state: new layer states and host counters (capture ones: ``deliver``)."""
    if hook_state is None:
        return None
    state = _as_hook_state(hook_state, plan.config.transform)
    return HookState({k: g_states.get(k, v) for k, v in state.layers.items()}, host)


def gated_hooks(config: _context.Config) -> dict:
    """``{counter key: hook}``: the distinct ``vk.on_host`` hooks with ``every > 1``."""
    hooks = {h: None for _, hs in config.hooks for h in hs if getattr(h, "deferred", False) and h.every > 1}
    return {f"on_host[{j}]": h for j, h in enumerate(hooks)}


def host_counters(config: _context.Config) -> dict:
    """Initial step counters of the host deliveries that skip steps (``every > 1``)."""
    keys = [
        f"capture[{i}]"
        for i, spec in enumerate(config.capture)
        if spec.host is not None and spec.host.every > 1
    ]
    keys += list(gated_hooks(config))
    return {key: {"count": jnp.zeros((), jnp.float32)} for key in keys}


def deliver(
    config: _context.Config, captured: dict, state: HookState | None, after: jax.Array | None = None
) -> tuple[HookState | None, jax.Array | None]:
    """Sends each capture spec's records to its host function, after ``after``.

    Returns:
        ``(state with advanced capture counters, token of the last transfer or after)``.
    """
    counted = [i for i, spec in enumerate(config.capture) if spec.host is not None and spec.host.every > 1]
    host = dict(state.host) if state is not None else {}
    if counted and (state is None or any(f"capture[{i}]" not in host for i in counted)):
        raise ConfigError(
            f"{config.transform}: a capture host delivery with every > 1 keeps a step counter in the "
            f"hook state, so the function needs hook_state=. {THREADING}"
        )
    token = after
    for i, spec in enumerate(config.capture):
        if spec.host is None:
            continue
        mine = {k: v for k, v in captured.items() if spec.matches(v.name, v.call)}
        if i in counted:
            count = host[f"capture[{i}]"]["count"]
            token = spec.host.send(mine, jnp.mod(count, spec.host.every) == 0, token)
            host[f"capture[{i}]"] = {"count": count + 1}
        else:
            token = spec.host.send(mine, None, token)
    return (None if state is None else HookState(state.layers, host)), token


def init_states(plan: Any, collect: Callable[[Any], Any]) -> HookState:
    """Initial states of every stateful call of ``plan``; ``collect(site)`` gives its params."""
    layers = {}
    for s in plan.active():
        if s.state is None:
            continue
        state = _hooks.init_state(s.hooks, collect(s))
        _hooks.check_float_state(state, s.key)
        layers[s.key] = jax.tree.map(lambda a, s=s: jnp.broadcast_to(a, (*s.shards, *jnp.shape(a))), state)
    return HookState(layers, host_counters(plan.config))
