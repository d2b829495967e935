"""Trace-time notes a layer leaves about what it computes, for ``vjpkit.inspect``'s fast paths.

Contract: a layer function may call ``note(kind)`` while it runs; when a collector is open
(``collect()``, opened by the per-example analysis around its shape-only trace) and a vjpkit
scope is active, ``kind`` is stored under the name of the layer being traced (``_context.
tracing_layer``); the calls of one layer share their kind. Outside a collector ``note``
does nothing, so layers stay plain functions. A kind is a static description, never an array:

* ``AffineNorm(normalize)``: the layer is ``y = normalize(params, x) * scale + bias`` over the
  last axis, with ``scale``/``bias`` (either may be absent) and any other parameter receiving
  no gradient; ``normalize(params, x)`` takes the layer's params keyed by their path inside
  the layer (``"scale"``, ``"batch_stats/mean"``) and treats each row of axis 0 independently.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .. import _context

_local = threading.local()


class AffineNorm(NamedTuple):
    """``y = normalize(params, x) * scale + bias`` (see the module docstring)."""

    normalize: Callable[[dict, Any], Any]


def note(kind: Any) -> None:
    """Stores ``kind`` for the current layer call when a collector is open."""
    found = getattr(_local, "found", None)
    name = _context.tracing_layer()
    if found is None or name is None:
        return
    found[name] = kind


@contextlib.contextmanager
def collect() -> Iterator[dict[str, Any]]:
    """Collects ``{layer name: kind}`` of the layer calls traced inside the block."""
    previous = getattr(_local, "found", None)
    _local.found = found = {}
    try:
        yield found
    finally:
        _local.found = previous
