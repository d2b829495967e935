"""How a layer's hooks run: plain hooks, stateful ``HookTransform`` s, pre-hooks, and their checks.

Contract: a layer's hook list may mix plain hooks (``rec -> None | Cotangents``),
``HookTransform`` s (``init(params) -> state``, ``update(rec, state) -> (rec, state)``) and
either wrapped in ``vk.before`` (types: ``_hook_base``). ``init_state`` gives the layer's
state: the single transform's state, or a tuple when several transforms apply (in list order,
``before`` ones included). ``run`` applies the hooks of one phase in order (``"before"`` the
layer's own VJP, or ``"after"`` it) and checks, at trace time, every replacement record and
every new state against what it replaces; it never casts.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _context, _format
from ._check import check_like
from ._errors import ConfigError, HookError
from ._hook_base import HookTransform, at_iteration, factory, inner, is_before, is_deferred
from ._records import Cotangents, Tangents


@factory
def hook_chain(*transforms: HookTransform | Callable) -> HookTransform:
    """Composes hooks left to right into one ``HookTransform``, like ``optax.chain``.

    Plain hooks may appear in the chain; they keep no state. The state is a tuple with one
    entry per element.

    Examples:
        >>> moderate = vk.hook_chain(vk.ema_normalize(0.9), vk.clip_by_norm(1.0))
    """
    if any(is_before(t) for t in transforms):
        raise ConfigError(
            "vk.hook_chain: a vk.before(...) hook cannot be chained with hooks that run after the "
            "layer's VJP. Give them side by side in a list instead: hooks={'fc*': [vk.before(f), g]}."
        )
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
    return [inner(h) for h in hooks if isinstance(inner(h), HookTransform)]


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


_EXACT = "A replacement must match the original cotangent exactly; cast it yourself if you mean to."
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
            where = _format.where(path)
            raise ConfigError(
                f"hook state of layer {key!r}, path {where}: leaves must be floating-point arrays, got "
                f"{getattr(dtype, 'name', type(leaf).__name__)}. State travels through the backward pass "
                "as a cotangent, and integer cotangents carry no value: keep counters as float32 "
                "(jnp.zeros(()) and count + 1) and PRNG keys as a float step to fold in."
            )


def hook_name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


# What a hook may replace, per record type and phase; every other field is read-only.
_WRITABLE = {
    "before": ("grad_output",),
    "after": ("grad_input", "grad_params"),
    "tangent": ("tangent_output",),
}
_READ_ONLY = {
    "before": ("params", "input", "output"),
    "after": ("params", "input", "output", "grad_output"),
    "tangent": ("params", "input", "output", "tangent_input", "tangent_params"),
}
_ONLY = {
    "before": "grad_output can be replaced before the layer's VJP.",
    "after": "grad_input and grad_params can be replaced; they are what the layers below receive.",
    "tangent": "tangent_output can be replaced: it is what the layers above receive.",
}


def validate(rec: Any, new: Any, hook: Callable, phase: str = "after") -> Any:
    """Checks that ``new`` may replace ``rec`` (returned by ``hook`` in ``phase``) and returns it.

    ``phase``: ``"before"`` / ``"after"`` a layer's VJP (``Cotangents``), or ``"tangent"``
    (forward mode, ``Tangents``). A replacement keeps the record's layer and call, leaves its
    read-only fields as they are, and matches each replaced field's structure, shapes and dtypes.
    """
    pre, fwd = phase == "before", phase == "tangent"
    kind = "pre-hook" if pre else "tangent hook" if fwd else "hook"
    who = f"{kind} {hook_name(hook)} on layer {rec.name!r} (call {rec.call})"
    if new is None:
        return rec
    if not isinstance(new, type(rec)):
        how = (
            "rec.replace(tangent_output=...) to rewrite the output tangent."
            if fwd
            else "rec.replace(grad_input=..., grad_params=...) to rewrite cotangents."
        )
        raise HookError(
            f"{who} returned {type(new).__name__}, not a {'Tangents ' if fwd else ''}record. A "
            f"{kind} returns None to observe, or {how}"
        )
    if (new.name, new.call) != (rec.name, rec.call):
        raise HookError(
            f"{who} returned the record of layer {new.name!r} (call {new.call}). "
            "Return the record you were given, changed with rec.replace(...)."
        )
    for field in _READ_ONLY[phase]:
        if getattr(new, field) is getattr(rec, field):
            continue
        if field == "grad_output":
            raise HookError(
                f"{who} changed field 'grad_output', which is read-only after the layer's own VJP "
                "has run: grad_input and grad_params were computed from it. To rewrite grad_output "
                "before the layer's VJP (PyTorch's register_full_backward_pre_hook), wrap the hook "
                "in vk.before: hooks={" + repr(rec.name) + ": vk.before(hook)}; grad_input and "
                "grad_params are then computed from the new value."
            )
        raise HookError(f"{who} changed field {field!r}, which is read-only. Only " + _ONLY[phase])
    if pre:
        for field in ("grad_input", "grad_params"):
            if getattr(new, field) is not None:
                raise HookError(
                    f"{who} set field {field!r}, which is not computed yet before the layer's VJP. "
                    "A vk.before hook may only replace grad_output; rewrite grad_input or grad_params "
                    "with a hook that runs after the VJP (without vk.before)."
                )
    for field in _WRITABLE[phase]:
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
        hint = _EXACT.replace("cotangent", "tangent") if fwd else _EXACT
        check_like(expected, got, what=f"{who}, field {field!r}", error=HookError, hint=hint)
    return new


def run_tangent(rec: Tangents, hooks: Sequence[Callable]) -> Tangents:
    """Applies forward-mode (tangent) hooks in order and returns the final record.

    A tangent hook is ``rec -> None | Tangents`` (or ``vk.on_host(fn)``); only
    ``tangent_output`` can be replaced, checked by ``validate`` as reverse-mode replacements are.
    """
    for hook in hooks:
        if not callable(hook):  # a vk.HookTransform: reverse mode only
            raise ConfigError(
                f"layer {rec.name!r} (call {rec.call}): {type(hook).__name__} is not a tangent hook. "
                "Tangent hooks are functions rec -> None | Tangents, or vk.on_host(fn)."
            )
        with _context.activate(None):  # hooks may call layers; those are plain calls
            out = hook(rec)
        rec = validate(rec, out, hook, "tangent")
    return rec


def run(
    rec: Cotangents, hooks: Sequence[Callable], state: Any, sink: list | None = None, phase: str = "after"
):
    """Applies the hooks of ``phase`` in order; returns the final record and the layer's new state.

    ``phase`` is ``"before"`` (the ``vk.before`` hooks, before the layer's own VJP) or
    ``"after"`` (every other hook). The state covers every ``HookTransform`` of ``hooks``; the
    other phase's entries pass through unchanged. With ``sink``, a hook marked ``deferred``
    (``vk.on_host``) is not called: the record it would see is appended to ``sink``, for the
    transform to deliver after the backward pass.
    """
    transforms = _transforms(hooks)
    stateless = state is None
    if stateless:
        state = init_state(hooks, rec.params)
    states = list((state,) if len(transforms) == 1 else state) if transforms else []
    k = 0  # index of the next HookTransform in the list
    for wrapped in hooks:
        hook = inner(wrapped)
        mine = is_before(wrapped) == (phase == "before")
        if isinstance(hook, HookTransform):
            k += 1
        if not mine:
            continue
        if sink is not None and is_deferred(hook):
            sink.append(rec)
            continue
        before_ids = _snapshot(rec)
        fn = hook.update if isinstance(hook, HookTransform) else hook
        chosen = _chosen(wrapped, rec)  # None: every iteration, else a traced bool
        with _context.activate(None):  # hooks may call layers: those are plain calls
            if isinstance(hook, HookTransform):
                old = states[k - 1]
                out, new = _update(hook, rec, old)
                check_like(
                    old,
                    new,
                    what=f"hook state of layer {rec.name!r} (call {rec.call}), from {hook_name(hook.update)}",
                    error=HookError,
                    hint="update(rec, state) must return a state of the same structure, shapes and dtypes.",
                )
                states[k - 1] = new if chosen is None else _where(chosen, new, old)
            else:
                out = hook(rec)
                if out is None:
                    _watch_kept(rec, hook)
        _check_untouched(rec, before_ids, fn)
        new_rec = validate(rec, out, fn, phase)
        rec = new_rec if chosen is None or new_rec is rec else _where(chosen, new_rec, rec)
    if stateless:
        return rec, None
    if not transforms:
        return rec, ()
    return rec, states[0] if len(states) == 1 else tuple(states)


def _chosen(hook: Any, rec: Cotangents) -> Any:
    """For a hook on some scan iterations only (``at_iteration``), whether the iteration whose
    backward pass is traced is one of them (a traced bool); ``None`` for any other hook."""
    if not isinstance(hook, at_iteration):
        return None
    index = _context.current_iteration()
    if len(index) != len(hook.wanted):
        raise ConfigError(
            f"the hook {hook!r} on layer {rec.name!r} (call {rec.call}) chooses scan iterations, "
            "but this backward pass is not traced per iteration (a transform that does not run "
            "iteration globs, such as forward mode): use a glob without [i]."
        )
    return jnp.all(jnp.asarray([i == w for w, i in zip(hook.wanted, index) if w is not None]))


def _where(chosen: Any, new: Any, old: Any) -> Any:
    """``new`` where ``chosen``, else ``old``, leaf by leaf (``None`` leaves stay ``None``)."""
    return jax.tree.map(lambda a, b: jnp.where(chosen, a, b), new, old)


_watch = threading.local()
_warned: set = set()


def _watch_kept(rec: Cotangents, hook: Callable) -> None:
    """Remembers (weakly) a traced record a plain hook returned ``None`` for; see ``warn_kept``."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(rec)):
        _watch.__dict__.setdefault("records", []).append((weakref.ref(rec), hook, rec.name))


def warn_kept() -> None:
    """Warns once per hook and layer for each watched record that is still alive.

    Called by the driver once the backward pass has been traced. Under ``jit``, ``lax.scan``
    or ``vmap`` a hook runs once, while the step is traced, on tracers: a record it stored (in a
    list, a dict, an attribute) holds tracers, not values, and using it later raises
    ``UnexpectedTracerError``. vjpkit keeps no record once the pass is traced, so a record
    still alive then was kept by the hook.
    """
    records = _watch.__dict__.pop("records", [])
    for ref, hook, name in records:
        key = (id(hook), name)
        if ref() is None or key in _warned:
            continue
        _warned.add(key)
        warnings.warn(
            f"vjpkit: hook {hook_name(hook)} on layer {name!r} kept the record it was given, but the "
            "step is being traced (jax.jit, lax.scan or vmap), so the record holds tracers, not "
            "values: the hook runs once at trace time, and using what it kept later raises "
            "UnexpectedTracerError. To get values every step on the host, wrap the function in "
            f"vk.on_host: hooks={{{name!r}: vk.on_host(fn)}} (fn gets numpy arrays), or use "
            "capture= to return records from the step.",
            stacklevel=3,
        )


def _update(hook: HookTransform, rec: Cotangents, state: Any) -> tuple[Cotangents, Any]:
    """``hook.update(rec, state)``, with a clear error when it does not return a pair."""
    result = hook.update(rec, state)
    if not (isinstance(result, tuple) and not isinstance(result, Cotangents) and len(result) == 2):
        raise HookError(
            f"the update of vk.HookTransform {hook_name(hook.update)} on layer {rec.name!r} (call "
            f"{rec.call}) returned {type(result).__name__}, not a pair (rec, state). Return "
            "(rec, new_state): rec unchanged to observe, or rec.replace(...) to rewrite."
        )
    return result
