"""Shared by the foreign-model tests: linen interception wired into vjpkit transforms.

The core enters ``vjpkit._foreign.interception()`` while a transform traces. Until the core
does so itself, ``wire_linen`` wraps ``_context.activate`` for the duration of a test.
"""

from __future__ import annotations

import contextlib
import inspect

from vjpkit import _context, _foreign


def core_wires_linen() -> bool:
    return "interception" in inspect.getsource(_context)


def wire_linen(monkeypatch) -> None:
    if core_wires_linen():
        return
    original = _context.activate

    @contextlib.contextmanager
    def activate(scope):
        with original(scope) as s, _foreign.interception():
            yield s

    monkeypatch.setattr(_context, "activate", activate)
