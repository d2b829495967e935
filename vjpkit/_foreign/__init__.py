"""Foreign models: Flax linen, Flax NNX and Equinox modules as vjpkit layer calls.

Contract: nothing here imports flax or equinox at ``import vjpkit``; each submodule imports
its framework lazily. ``interception()`` is what ``_context.activate`` enters whenever a scope
becomes active, i.e. while a vjpkit transform traces (a no-op unless ``flax.linen`` has been
imported; installed once when scopes nest); ``vjpkit._hookable.hookable`` makes NNX and
Equinox models hookable. ``_kinds`` tags foreign layer calls with the kind of layer they are,
for the per-example fast paths.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_local = threading.local()


@contextlib.contextmanager
def interception() -> Iterator[None]:
    """Routes Flax linen module calls through vjpkit's layer rule for the duration.

    A no-op when ``flax.linen`` was never imported (then no linen module can run).
    """
    if "flax.linen" not in sys.modules or getattr(_local, "active", False):  # nested: installed once
        yield
        return
    from ._linen import linen_interception

    _local.active = True
    try:
        with linen_interception():
            yield
    finally:
        _local.active = False
