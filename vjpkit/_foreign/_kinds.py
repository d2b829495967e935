"""What kind of layer a foreign layer call is, for the per-example fast paths.

Contract: while ``collect()`` is active (``vk.inspect``'s shape-only analysis trace), the
foreign integrations ``note`` each layer call's kind under its full layer name, and mark calls
that contain other layer calls (a Flax parent module, an Equinox block) as containers. Outside
``collect()``, ``note`` and ``container`` do nothing. This module imports no framework.

Kinds:

* ``"dense"``: ``y = x @ W + b`` over the trailing ``in_ndim`` axes of ``x`` (``W`` flattened to
  ``(in, out)``; ``transpose`` when the layer stores ``W`` as ``(out, in)``, as Equinox does).
* ``"conv"``: a 2-D NHWC convolution with an HWIO kernel, known ``strides`` and ``padding``.
* ``"local"``: any layer whose per-example parameter gradient is ``vjp`` of ``fn(params, x_i)``
  at ``grad_output_i`` (layer norms, embeddings): computed with a ``vmap`` over the examples of
  *that layer's* vjp only, never of the whole loss. ``batched`` says whether ``fn`` expects
  the example with a leading batch axis of 1 (Flax) or without (Equinox).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """A foreign layer call's kind (see the module docstring)."""

    kind: str  # "dense" | "conv" | "local"
    roles: dict[str, str] = dataclasses.field(default_factory=dict)  # param path -> "weight" | "bias"
    transpose: bool = False
    in_ndim: int = 1
    strides: tuple[int, int] = (1, 1)
    padding: Any = "SAME"
    fn: Callable | None = None
    batched: bool = True


@dataclasses.dataclass
class Registry:
    kinds: dict[str, LayerKind] = dataclasses.field(default_factory=dict)
    containers: set[str] = dataclasses.field(default_factory=set)


@contextlib.contextmanager
def collect() -> Iterator[Registry]:
    """Collects the kinds noted while the block runs."""
    registry = Registry()
    previous = getattr(_local, "registry", None)
    _local.registry = registry
    try:
        yield registry
    finally:
        _local.registry = previous


def active() -> bool:
    return getattr(_local, "registry", None) is not None


def note(name: str, kind: LayerKind | None) -> None:
    registry = getattr(_local, "registry", None)
    if registry is not None and kind is not None:
        registry.kinds.setdefault(name, kind)


def container(name: str) -> None:
    registry = getattr(_local, "registry", None)
    if registry is not None:
        registry.containers.add(name)
