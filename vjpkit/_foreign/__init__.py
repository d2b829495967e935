"""Foreign models: Flax linen, Flax NNX and Equinox modules as vjpkit layer calls.

Contract: nothing here imports flax or equinox at ``import vjpkit``; each submodule imports
its framework lazily. ``interception()`` is registered with the scope
(``_context.register_interceptor``) when this package is imported, so ``_context.activate``
enters it whenever a vjpkit transform traces (a no-op unless ``flax.linen`` has been imported;
installed once when scopes nest); ``vjpkit._hookable.hookable`` makes NNX and Equinox models
hookable. Each adapter gives its layer calls their kind (``vjpkit._kinds``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

from .. import _context

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


_context.register_interceptor(interception)
