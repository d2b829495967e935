"""How a layer's hooks run: plain hooks, stateful ``HookTransform`` s, and their checks.

Contract: a layer's hook list may mix plain hooks (``rec -> None | Cotangents``) and
``HookTransform`` s (``init(params) -> state``, ``update(rec, state) -> (rec, state)``).
``init_state`` gives the layer's state: the single transform's state, or a tuple when
several transforms apply. ``run`` applies the hooks in order and checks, at trace time,
every replacement record and every new state against what it replaces; it never casts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from . import _context
from ._check import check_like
from ._errors import ConfigError, HookError
from ._records import Cotangents


class HookTransform(NamedTuple):
    """A stateful hook, in optax's shape.

    Attributes:
        init: ``init(params) -> state``, called once per matching layer call with its params.
            State leaves must be floating point (keep counters as ``float32``).
        update: ``update(rec, state) -> (rec, state)``: return ``rec`` unchanged to observe, or
            ``rec.replace(grad_input=..., grad_params=...)`` to rewrite, and the next state.

    Examples:
        >>> def init(params):
        ...     return {"count": jnp.zeros(())}
        >>> def update(rec, state):
        ...     return rec, {"count": state["count"] + 1}
        >>> counter = vk.HookTransform(init, update)
    """

    init: Callable[[Any], Any]
    update: Callable[[Cotangents, Any], tuple[Cotangents, Any]]


def hook_chain(*transforms: HookTransform | Callable) -> HookTransform:
    """Composes hooks left to right into one ``HookTransform``, like ``optax.chain``.

    Plain hooks may appear in the chain; they keep no state. The state is a tuple with one
    entry per element.

    Examples:
        >>> moderate = vk.hook_chain(vk.ema_normalize(0.9), vk.clip_by_norm(1.0))
    """
    parts = tuple(t if isinstance(t, HookTransform) else _stateless(t) for t in transforms)

    def init(params):
        return tuple(t.init(params) for t in parts)

    def update(rec, state):
        new_states = []
        for t, s in zip(parts, state):
            out, s = t.update(rec, s)
            rec = validate(rec, out, t.update)
            new_states.append(s)
        return rec, tuple(new_states)

    return HookTransform(init, update)


def _stateless(hook: Callable) -> HookTransform:
    if not callable(hook):
        raise ConfigError(f"vk.hook_chain: {hook!r} is neither a HookTransform nor a callable hook.")

    def update(rec, state):
        out = hook(rec)
        return (rec if out is None else out), state

    update.__qualname__ = getattr(hook, "__qualname__", type(hook).__name__)
    return HookTransform(lambda params: (), update)


def _transforms(hooks: Sequence[Callable]) -> list[HookTransform]:
    return [h for h in hooks if isinstance(h, HookTransform)]


def init_state(hooks: Sequence[Callable], params: Any) -> Any:
    """The initial state of one layer call's hooks (``()`` when none keeps state)."""
    states = tuple(t.init(params) for t in _transforms(hooks))
    return states[0] if len(states) == 1 else states


def is_stateful(state: Any) -> bool:
    return bool(jax.tree.leaves(state))


def state_avals(hooks: Sequence[Callable], params: Any) -> Any:
    """The shapes of one call's hook state from its params' shapes; ``None`` when stateless."""
    if not _transforms(hooks):
        return None
    avals = jax.eval_shape(lambda p: init_state(hooks, p), params)
    return avals if is_stateful(avals) else None


_FIELDS = ("params", "input", "output", "grad_output", "grad_input", "grad_params")


def _snapshot(rec: Cotangents) -> dict:
    def ids(tree):
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
        return treedef, [id(x) for x in leaves]

    return {field: ids(getattr(rec, field)) for field in _FIELDS}


def _check_untouched(rec: Cotangents, before: dict, hook: Callable) -> None:
    """Raises if ``hook`` changed ``rec`` in place (records are read-only)."""
    after = _snapshot(rec)
    changed = [field for field in _FIELDS if after[field] != before[field]]
    if not changed:
        return
    field = changed[0]
    raise HookError(
        f"hook {hook_name(hook)} on layer {rec.name!r} (call {rec.call}) changed field {field!r} of the "
        f"record in place (for example rec.{field}['weight'] = ...). Records are read-only: an in-place "
        "write would skip the checks on structure, shape and dtype. Return a changed copy instead: "
        f"return rec.replace({field}={{**rec.{field}, 'weight': new_value}})."
    )


def check_float_state(state: Any, key: str) -> None:
    """Raises unless every leaf of a layer's hook state is a floating-point array."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
            where = jax.tree_util.keystr(path) or "(root)"
            raise ConfigError(
                f"hook state of layer {key!r}, path {where}: leaves must be floating-point arrays, got "
                f"{getattr(dtype, 'name', type(leaf).__name__)}. State travels through the backward pass "
                "as a cotangent, and integer cotangents carry no value: keep counters as float32 "
                "(jnp.zeros(()) and count + 1) and PRNG keys as a float step to fold in."
            )


def hook_name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def validate(rec: Cotangents, new: Any, hook: Callable) -> Cotangents:
    """Checks that ``new`` may replace ``rec`` (returned by ``hook``) and returns it."""
    who = f"hook {hook_name(hook)} on layer {rec.name!r} (call {rec.call})"
    if new is None:
        return rec
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
            why = (
                "that input needs no gradient (nothing upstream uses it)"
                if field == "grad_input"
                else "the params are not being differentiated (see argnums)"
            )
            raise HookError(f"{who} set field {field!r}, which is None because {why}. Leave it None.")
        check_like(
            expected,
            got,
            what=f"{who}, field {field!r}",
            error=HookError,
            hint="A replacement must match the original cotangent exactly; cast it yourself if you mean to.",
        )
    return new


def run(rec: Cotangents, hooks: Sequence[Callable], state: Any, sink: list | None = None):
    """Applies ``hooks`` in order; returns the final record and the layer's new state.

    With ``sink``, a hook marked ``deferred`` (``vk.on_host``) is not called: the record it
    would see is appended to ``sink``, for the transform to deliver after the backward pass.
    """
    transforms = _transforms(hooks)
    stateless = state is None
    if stateless:
        state = init_state(hooks, rec.params)
    states = list((state,) if len(transforms) == 1 else state) if transforms else []
    new_states = []
    for hook in hooks:
        if sink is not None and getattr(hook, "deferred", False):
            sink.append(rec)
            continue
        before = _snapshot(rec)
        with _context.activate(None):  # hooks may call layers: those are plain calls
            if isinstance(hook, HookTransform):
                old = states[len(new_states)]
                out, new = hook.update(rec, old)
                check_like(
                    old,
                    new,
                    what=f"hook state of layer {rec.name!r} (call {rec.call}), from {hook_name(hook.update)}",
                    error=HookError,
                    hint="update(rec, state) must return a state of the same structure, shapes and dtypes.",
                )
                new_states.append(new)
            else:
                out = hook(rec)
        _check_untouched(rec, before, hook.update if isinstance(hook, HookTransform) else hook)
        rec = validate(rec, out, hook.update if isinstance(hook, HookTransform) else hook)
    if stateless:
        return rec, None
    if not transforms:
        return rec, ()
    return rec, new_states[0] if len(new_states) == 1 else tuple(new_states)
