"""Trace-time state: layer names, call counters and the active hook scope.

Contract: a ``Scope`` exists only while a vjpkit transform (``vk.grad``, ...) traces the
function it was given. Outside one, ``current`` is ``None`` and layers are plain functions.
Layer names come from ``name_scope``, which combinators push around their children; the
full name joins the stack with ``/``. Hook configuration lives in the scope, which belongs to
one transformed function: nothing here is global configuration, only a thread-local stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from ._errors import ConfigError
from ._records import call_key

_local = threading.local()


def _stack(attr: str) -> list:
    if not hasattr(_local, attr):
        setattr(_local, attr, [])
    return getattr(_local, attr)


@dataclasses.dataclass
class Scope:
    """Hooks of one vjpkit transform, and what its trace has seen so far.

    Attributes:
        hooks: ``(glob, (hook, ...))`` pairs, in the user's order.
        transform: the public name of the transform, for error messages.
        mode: ``"vjp"`` (reverse-mode hooks get ``Cotangents``), ``"jvp"`` (forward-mode
            hooks get ``Tangents``), ``"discover"`` (a shape-only trace that fills
            ``slots`` and ``states``) or ``"init"`` (a forward pass that fills ``states``).
        capture: capture specs (``vjpkit._capture.CaptureSpec``).
        hook_state: the user's hook state, ``{call key: state}``, or ``None``.
        probes: ``{call key: probe}``: the zero arrays whose cotangents carry captured records
            and new hook states out of the backward pass.
        slots: filled by discovery: ``{call key: shape tree of the probe}``.
        states: filled by discovery and init: ``{call key: initial hook state}``.
        dtypes: filled by discovery: the dtypes of each captured record, to undo ``carry``.
        calls: the number of calls seen per layer name in this forward pass.
        keys: call keys (``name`` or ``name#k``) in forward order.
        matched: the globs that matched at least one layer.
    """

    hooks: Sequence[tuple[str, tuple[Callable, ...]]]
    transform: str = "vk.grad"
    mode: str = "vjp"
    capture: Sequence[Any] = ()
    hook_state: dict[str, Any] | None = None
    probes: dict[str, Any] = dataclasses.field(default_factory=dict)
    slots: dict[str, Any] = dataclasses.field(default_factory=dict)
    states: dict[str, Any] = dataclasses.field(default_factory=dict)
    dtypes: dict[str, Any] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    keys: list[str] = dataclasses.field(default_factory=list)
    matched: set[str] = dataclasses.field(default_factory=set)

    def register(self, name: str) -> int:
        """Counts one call of layer ``name`` and returns its call index."""
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        self.keys.append(call_key(name, call))
        return call

    def capture_for(self, name: str) -> Any:
        """The first capture spec whose globs match ``name``, or ``None``."""
        for spec in self.capture:
            if spec.matches(name):
                self.matched.update(g for g in spec.layers if fnmatch.fnmatchcase(name, g))
                return spec
        return None

    def hooks_for(self, name: str) -> tuple[Callable, ...]:
        """All hooks whose glob matches ``name``, in the order they were given."""
        found: list[Callable] = []
        for glob, hooks in self.hooks:
            if fnmatch.fnmatchcase(name, glob):
                self.matched.add(glob)
                found.extend(hooks)
        return tuple(found)

    def check_matched(self) -> None:
        """Raises if a glob matched no layer call of the traced function."""
        missing = [glob for glob, _ in self.hooks if glob not in self.matched]
        missing += [g for spec in self.capture for g in spec.layers if g not in self.matched]
        if not missing:
            return
        names = sorted(set(self.calls))
        available = ", ".join(repr(n) for n in names) if names else "none: no vjpkit layer ran"
        raise ConfigError(
            f"{self.transform}: the hook or capture glob(s) {', '.join(map(repr, missing))} "
            "matched no layer. "
            f"Layers called in this forward pass: {available}. Globs use fnmatch syntax on the full "
            "layer path (for example 'fc*', 'block1/*' or '*/conv1'); fix or remove the glob."
        )


def current() -> Scope | None:
    """The innermost active scope, or ``None`` outside vjpkit transforms."""
    scopes = _stack("scopes")
    return scopes[-1] if scopes else None


# JAX caches the traces of inner ``jax.jit``/``jax.checkpoint``/``lax.cond`` functions by function
# and argument types. Hooks are decided at trace time, so each scope gets its own token in JAX's
# trace-cache key: a trace made under one scope is never replayed under another, or without one.
_cache_token = jax.make_user_context(default_value=None)
_scope_ids = itertools.count(1)


@contextlib.contextmanager
def activate(scope: Scope | None) -> Iterator[Scope | None]:
    """Makes ``scope`` current for the duration (``None`` suspends every scope)."""
    scopes = _stack("scopes")
    scopes.append(scope)
    try:
        with _cache_token(None if scope is None else next(_scope_ids)):
            yield scope
    finally:
        scopes.pop()


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[None]:
    """Pushes one component of the layer path (``serial`` does this around each child)."""
    path = _stack("path")
    path.append(name)
    try:
        yield
    finally:
        path.pop()


def layer_path(default: str) -> str:
    """The current layer's full name; ``default`` when no combinator has named it."""
    path = _stack("path")
    return "/".join(path) if path else default


def normalize_hooks(hooks: Any, transform: str) -> tuple[tuple[str, tuple[Callable, ...]], ...]:
    """Checks a ``{glob: hook | [hooks]}`` mapping and returns it as pairs."""
    if hooks is None:
        return ()
    if not isinstance(hooks, dict):
        raise ConfigError(
            f"{transform}: hooks must be a dict {{glob: hook or [hooks]}}, got {type(hooks).__name__}. "
            "Example: hooks={'fc*': vk.on_host(print)}."
        )
    pairs = []
    for glob, value in hooks.items():
        if not isinstance(glob, str) or not glob:
            raise ConfigError(f"{transform}: hook keys must be non-empty glob strings, got {glob!r}.")
        many = isinstance(value, list) or (isinstance(value, tuple) and not hasattr(value, "_fields"))
        fns = tuple(value) if many else (value,)
        for fn in fns:
            stateful = hasattr(fn, "init") and hasattr(fn, "update")  # a vk.HookTransform
            if not (callable(fn) or stateful):
                raise ConfigError(
                    f"{transform}: the hook for glob {glob!r} is {type(fn).__name__}, not a callable. "
                    "A hook is a function rec -> None | Cotangents, vk.on_host(fn), or a vk.HookTransform."
                )
        pairs.append((glob, fns))
    return tuple(pairs)
