"""Trace-time state: the hook configuration, layer names and what JAX may reuse.

Contract:

* ``Config`` is the immutable hook configuration of one transformed function (``vk.grad(...,
  hooks=..., capture=...)`` makes one when it is called, not per call). Its ``token`` is the
  same for configurations of equal content (globs, transform, and hooks and capture specs that
  behave the same: ``canonical``, so hooks made anew in a loop share it), and unique
  otherwise, for the life of the process.
* A *scope* is active only while a vjpkit transform traces the user's function. Two kinds:
  ``LAYERS`` (the reverse-mode transforms: every layer call becomes one ``vjpkit_layer``
  equation, whatever the hooks, so the trace does not depend on the configuration) and a
  ``TangentScope`` (forward-mode hooks of ``vk.jvp``, which route hooked layers directly).
  Outside a scope ``current()`` is ``None`` and layers are plain functions.
* Layer names come from ``name_scope``, which combinators push around their children; the full
  name joins the stack with ``/``.
* Model libraries register what must be entered while a scope is active (Flax linen's method
  interceptor) with ``register_interceptor``, push/pop style; this module imports none of them.
* Trace identity: JAX caches the traces of inner ``jax.jit`` / ``jax.checkpoint`` / ``lax.cond``
  functions by function and argument types, plus a user context value set here: the active
  scope's token and the current name path. A trace made under one scope (or one name prefix)
  is never replayed under another or under none, and the same scope and path reuse theirs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from ._errors import ConfigError
from ._hook_base import at_iteration, before, inner, is_deferred, is_factory
from ._names import call_keys, iterations, matches, split_key

_local = threading.local()
_tokens = itertools.count(1)


def _stack(attr: str) -> list:
    if not hasattr(_local, attr):
        setattr(_local, attr, [])
    return getattr(_local, attr)


def new_token() -> int:
    """A number never handed out before in this process (``id()`` values can be reused)."""
    return next(_tokens)


_interned: collections.OrderedDict = collections.OrderedDict()
_INTERNED_MAX = 256


class _Same:
    """Equal only to itself: an object compared by identity, kept alive so that its id is not reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_VALUES = (bool, int, str, bytes, type(None), type(Ellipsis))


def canonical(obj: Any, depth: int = 0) -> Any:
    """A hashable key equal for hooks that behave the same, so that their traces can be shared.

    A hook made anew for each transform (``vk.scale(0.5)``, ``lambda rec: ...`` written in a
    loop) is a new object of the same code: functions are keyed by their code, globals, defaults
    and closure contents (eight functions deep), methods by function and object, tuples and
    NamedTuples (``vk.HookTransform``, capture specs) by their items, ``vk.before`` by its hook,
    ``vk.on_host(fn)`` by ``fn``, numbers and strings by type and value (floats by ``repr``:
    ``-0.0`` is not ``0.0``). Anything else (arrays, lists, an ``on_host(fn, every=N > 1)``,
    which counts its calls) is compared by identity.
    """
    kind = type(obj)
    if kind in _VALUES:
        return (kind, obj)
    if kind in (float, complex):
        return (kind, repr(obj))
    if isinstance(obj, tuple) and (kind is tuple or hasattr(obj, "_fields")):
        return (kind, tuple(canonical(x, depth) for x in obj))
    if kind is frozenset:
        return (kind, frozenset(canonical(x, depth) for x in obj))
    if isinstance(obj, types.FunctionType):
        if depth >= 8:  # functions nested this deep (or a closure that holds itself)
            return _Same(obj)
        depth += 1
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(canonical(cell.cell_contents, depth))
            except ValueError:  # an empty cell
                cells.append(_Same(cell))
        extra = {**(obj.__kwdefaults__ or {}), **{f"__dict__.{k}": v for k, v in vars(obj).items()}}
        return (
            "function",
            obj.__code__,
            _Same(obj.__globals__),
            canonical(obj.__defaults__, depth),
            tuple(sorted((k, canonical(v, depth)) for k, v in extra.items())),
            tuple(cells),
        )
    if isinstance(obj, types.MethodType):
        return ("method", canonical(obj.__func__, depth), _Same(obj.__self__))
    if isinstance(obj, types.BuiltinMethodType) and not isinstance(obj.__self__, types.ModuleType):
        return ("builtin method", obj.__name__, _Same(obj.__self__))  # records.append: new each time
    if isinstance(obj, functools.partial):
        keywords = tuple(sorted((k, canonical(v, depth)) for k, v in obj.keywords.items()))
        return ("partial", canonical(obj.func, depth), canonical(obj.args, depth), keywords)
    if kind is before:
        return ("before", canonical(obj.hook, depth))
    if is_deferred(obj) and getattr(obj, "every", None) == 1:  # vk.on_host(fn): counts nothing
        return ("on_host", canonical(obj.fn, depth))
    return _Same(obj)


def content_token(content: Any) -> int:
    """One token per configuration content: hooks that behave the same share it (``canonical``).

    So a transform built anew on every call (``vk.grad(loss, hooks={"fc*": vk.scale(0.5)})(...)``
    in a loop) reuses the traces and compiled inner calls of the previous ones, and a different
    configuration never does. The table keeps the last 256 contents (their objects stay alive
    that long); an evicted content gets a fresh token when it comes back.
    """
    content = canonical(content)
    token = _interned.pop(content, None)
    if token is None:
        token = new_token()
        if len(_interned) >= _INTERNED_MAX:
            _interned.popitem(last=False)
    _interned[content] = token
    return token


@dataclasses.dataclass(frozen=True, eq=False)
class Config:
    """The hook configuration of one transformed function (immutable).

    Attributes:
        hooks: ``(glob, (hook, ...))`` pairs, in the user's order.
        capture: capture specs (``vjpkit._capture.CaptureSpec``).
        transform: the public name of the transform, for error messages.
        match: find the layers of plain JAX code in the traced program (``docs/plain-jax.md``).
        token: one per configuration content (``content_token``), for JAX's trace caches.
    """

    hooks: tuple[tuple[str, tuple[Callable, ...]], ...] = ()
    capture: tuple[Any, ...] = ()
    transform: str = "vk.grad"
    match: bool = True
    token: int = dataclasses.field(default=0, compare=False)

    def __post_init__(self):
        if not self.token:
            content = (self.hooks, self.capture, self.transform, self.match)
            object.__setattr__(self, "token", content_token(content))

    def hooks_for(self, name: str, call: int = 0) -> tuple[Callable, ...]:
        """All hooks whose glob matches call ``call`` of ``name`` (``_names.matches``), in order;
        a glob ending in ``[i]`` gives its hooks wrapped in ``at_iteration``."""
        out = []
        for glob, hooks in self.hooks:
            base, wanted = iterations(glob)
            if matches(name, call, base):
                gated = any(w is not None for w in wanted)
                out += [at_iteration(h, wanted) if gated else h for h in hooks]
        return tuple(out)

    def capture_for(self, name: str, call: int = 0) -> Any:
        """The first capture spec whose globs match call ``call`` of ``name``, or ``None``."""
        return next((spec for spec in self.capture if spec.matches(name, call)), None)

    def check_matched(self, names: Sequence[str]) -> None:
        """Raises if a glob matched none of the layer calls of ``names`` (forward order, a name
        once per call) made in the traced function."""
        globs = [glob for glob, _ in self.hooks] + [g for spec in self.capture for g in spec.layers]
        keys = call_keys(names)
        missing = [g for g in globs if not any(matches(*split_key(k), iterations(g)[0]) for k in keys)]
        if not missing:
            return
        available = _listed(keys) if keys else "none: no vjpkit layer ran"
        raise ConfigError(
            f"{self.transform}: the hook or capture glob(s) {', '.join(map(repr, dict.fromkeys(missing)))} "
            "matched no layer. "
            f"Layers called in this forward pass: {available}. Globs use fnmatch syntax on the full "
            "layer path (for example 'fc*', 'block1/*' or '*/conv1') and match every call of a "
            "layer; 'name#k' matches its k-th later call only ('emb#1'). Fix or remove the glob."
        )


def _listed(keys: Sequence[str]) -> str:
    """The call keys, sorted, each layer's calls after its second as ``...`` and the last one."""
    calls: dict[str, list[str]] = {}
    for k in keys:
        calls.setdefault(split_key(k)[0], []).append(k)
    shown = []
    for name in sorted(calls):
        ks = calls[name]
        shown += [repr(k) for k in ks] if len(ks) <= 3 else [repr(ks[0]), repr(ks[1]), "...", repr(ks[-1])]
    return ", ".join(shown)


class _Layers:
    """The scope of a reverse-mode trace: every layer call becomes a ``vjpkit_layer`` equation.

    Other scopes (``_jvp_rule.TangentScope``) route a layer call through their own
    ``call(fn, name, params, inputs, kwargs)`` method.
    """

    mode = "layers"
    token = "layers"


LAYERS = _Layers()


def current() -> Any:
    """The innermost active scope (``LAYERS`` or a ``TangentScope``), or ``None``."""
    scopes = _stack("scopes")
    return scopes[-1] if scopes else None


_cache_token = jax.make_user_context(default_value=None)
_interceptors: list[Callable[[], contextlib.AbstractContextManager]] = []


def register_interceptor(enter: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
    """Registers ``enter()``, a context manager entered whenever a scope becomes active.

    Model adapters use it (Flax linen enters its method interceptor); returns a function that
    unregisters it.
    """
    _interceptors.append(enter)
    return lambda: _interceptors.remove(enter)


def _identity() -> Any:
    scope = current()
    return None if scope is None else (scope.token, tuple(_stack("path")))


@contextlib.contextmanager
def activate(scope: Any) -> Iterator[Any]:
    """Makes ``scope`` current for the duration (``None`` suspends every scope).

    While a scope is active, the registered interceptors are entered (``register_interceptor``:
    Flax linen module calls become layer calls).
    """
    scopes = _stack("scopes")
    scopes.append(scope)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_cache_token(_identity()))
            if scope is not None:
                for enter in list(_interceptors):
                    stack.enter_context(enter())
            yield scope
    finally:
        scopes.pop()


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[None]:
    """Pushes one component of the layer path (``serial`` does this around each child)."""
    path = _stack("path")
    path.append(name)
    try:
        with _cache_token(_identity()):
            yield
    finally:
        path.pop()


@contextlib.contextmanager
def iteration(index: tuple) -> Iterator[None]:
    """Marks that a layer call's backward pass is traced at scan iteration ``index`` (traced
    ints, one per enclosing scan), for hooks that run on some iterations only."""
    stack = _stack("iteration")
    stack.append(tuple(index))
    try:
        yield
    finally:
        stack.pop()


def current_iteration() -> tuple:
    """The scan iteration whose backward pass is being traced (``iteration``), else ``()``."""
    stack = _stack("iteration")
    return stack[-1] if stack else ()


@contextlib.contextmanager
def tracing(name: str) -> Iterator[None]:
    """Marks that the function of layer call ``name`` is being traced (``_primitive.bind``)."""
    layers = _stack("layers")
    layers.append(name)
    try:
        yield
    finally:
        layers.pop()


def current_layer(default: str) -> str:
    """The name of the layer whose function runs now (for messages); ``default`` when unnamed."""
    layers = _stack("layers")
    return layers[-1] if layers else layer_path(default)


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
            hook = inner(fn)  # vk.before(hook) wraps a hook
            if is_factory(hook):
                what = getattr(hook, "__name__", repr(hook))
                raise ConfigError(
                    f"{transform}: the hook for glob {glob!r} is vk.{what} itself, which makes hooks: "
                    f"call it to make one, for example hooks={{{glob!r}: vk.{what}(...)}} "
                    + (
                        "(vk.on_host(fn) with fn(rec) run on the host)."
                        if isinstance(hook, type)
                        else "(see its docstring for the arguments)."
                    )
                )
            stateful = hasattr(hook, "init") and hasattr(hook, "update")  # a vk.HookTransform
            if not (callable(hook) or stateful):
                raise ConfigError(
                    f"{transform}: the hook for glob {glob!r} is {type(fn).__name__}, not a callable. "
                    "A hook is a function rec -> None | Cotangents, vk.on_host(fn), or a vk.HookTransform."
                )
        pairs.append((glob, fns))
    return tuple(pairs)
