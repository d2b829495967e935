"""Hookable classes for NNX and Equinox: ``__call__`` patched on the module classes.

Contract: ``patch(cls, framework)`` wraps ``cls.__call__`` once (idempotent, also for classes
that inherit a patched ``__call__``). Outside a vjpkit transform the wrapper calls the original
``__call__``; instances, their pytree structure and their serialisation are untouched. Inside
one, a call becomes a vjpkit layer call (``framework.layer`` does it), named by the attribute
path from the module whose ``__call__`` is running (found by identity among its submodules;
``"fc1"``, ``"layers/0"``, ``"blocks/2/attn"``), or by its class name when it is called from
outside any hookable module (the root of the model).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

from .. import _context

_local = threading.local()
_ATTR = "_vjpkit_original_call"


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def running(module: Any):
    """Marks ``module`` as the module whose ``__call__`` runs (its submodules name from it)."""
    stack = _stack()
    stack.append(module)
    try:
        yield
    finally:
        stack.pop()


def reenter(module: Any) -> None:
    """The next call of ``module`` is our own re-application: run the original ``__call__``."""
    _local.reentry = module


def _inherited_call(cls: type) -> Any:
    for base in cls.__mro__:
        if "__call__" in vars(base):
            return vars(base)["__call__"]
    return None


def is_patched(cls: type) -> bool:
    return hasattr(vars(cls).get("__call__") or _inherited_call(cls), _ATTR)


def patch(cls: type, framework: Any) -> None:
    """Wraps ``cls.__call__`` so that its calls are vjpkit layer calls inside transforms."""
    if is_patched(cls):  # its own __call__, or the inherited one, is already a wrapper
        return
    original = cls.__call__

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):  # noqa: N807
        if _context.current() is None:
            return original(self, *args, **kwargs)
        if getattr(_local, "reentry", None) is self:
            _local.reentry = None
            with running(self):
                return original(self, *args, **kwargs)
        stack = _stack()
        components = framework.path_in(stack[-1], self) if stack else None
        if not components:
            components = () if not stack else (type(self).__name__,)
        with contextlib.ExitStack() as names:
            for c in components:
                names.enter_context(_context.name_scope(c))
            return framework.layer(self, original, args, kwargs, type(self).__name__)

    setattr(__call__, _ATTR, original)
    cls.__call__ = __call__


def unpatched(cls: type) -> Callable:
    call = cls.__call__
    return getattr(call, _ATTR, call)
