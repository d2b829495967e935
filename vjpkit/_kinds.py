"""The one kind registry: what kind of layer a call is, stored on the call's site.

Contract: every layer source says what its calls compute through this module, and the kind
travels on the call's ``vjpkit_layer`` equation (parameter ``kind``), so the engine's site
holds it (``Site.kind``) and the per-example fast paths (and later curvature) read it there.
Two ways to give a kind:

* a layer source that knows it before the call passes ``kind=`` to ``_primitive.call``
  (the Flax and Equinox adapters);
* a layer function calls ``note(kind)`` while it is traced (``vjpkit.nn``'s norms): the
  innermost layer call being traced takes it.

Kinds are static descriptions, never arrays. This module imports no framework and no engine.

* ``LayerKind("dense")``: ``y = x @ W + b`` over the trailing ``in_ndim`` axes of ``x`` (``W``
  flattened to ``(in, out)``; ``transpose`` when the layer stores ``W`` as ``(out, in)``, as
  Equinox does). ``roles`` maps param paths to ``"weight"`` / ``"bias"``. ``axes``, when given,
  says which axes of the weight *leaf* the input's trailing axes meet, in order, and which
  become the output's trailing axes, in order (``((1,), (0,))`` for ``x @ W.T``, a tied head
  ``h @ embed.T``); ``()`` is the layout above.
* ``LayerKind("lookup")``: ``table[ids]``, rows of axis 0 of the weight (``roles``) gathered at
  integer indices (the call's input, with a trailing index axis of 1); ``padding`` holds the
  gather's out-of-range mode: ``"clip"`` (clamped) or ``"fill"`` (zero rows).
* ``LayerKind("conv")``: a channels-last convolution (1-D NWC with a WIO kernel, 2-D NHWC
  with an HWIO kernel) with the layer's own ``strides``, ``padding`` (``"SAME"``, ``"VALID"`` or
  ``((lo, hi), ...)``) and kernel ``dilation`` (``()``: none), never inferred from shapes.
* ``LayerKind("local")``: any layer whose per-example parameter gradient is ``vjp`` of
  ``fn(params, x_i)`` at ``grad_output_i``; ``batched`` says whether ``fn`` expects the
  example with a leading batch axis of 1 (Flax) or without (Equinox). ``vk.inspect`` takes
  that vjp of the call's own computation as traced on one example (which also holds any
  ``vmap`` s inside the model), so ``fn`` describes the layer but is not needed there. A
  plain-JAX ``dot_general`` / ``conv_general_dilated`` layer that is not the canonical dense or
  conv is local with a ``note``: the equation in words (``"conv_general_dilated with
  feature_group_count=2"``), which messages quote.
* ``LayerKind("batch")``: a layer whose output for one example depends on the other examples
  of its input (batch statistics: batch norm in training mode); per-example gradients are not
  defined through it.
* ``AffineNorm(normalize)``: ``y = normalize(params, x) * scale + bias`` over the last axis
  (``vjpkit.nn``'s layer and RMS norms, batch norm in eval mode), every other parameter
  receiving no gradient; ``normalize(params, x)`` takes the layer's params keyed by their path
  inside the layer and treats each row of axis 0 independently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

_local = threading.local()


@dataclasses.dataclass(frozen=True, eq=False)
class LayerKind:
    """A layer call's kind (see the module docstring)."""

    kind: str  # "dense" | "conv" | "lookup" | "local" | "batch"
    roles: dict[str, str] = dataclasses.field(default_factory=dict)  # param path -> "weight" | "bias"
    transpose: bool = False
    in_ndim: int = 1
    strides: tuple[int, ...] = (1, 1)
    padding: Any = "SAME"
    dilation: tuple[int, ...] = ()  # conv kernel dilation per spatial axis; () means none
    fn: Callable | None = None
    batched: bool = True
    axes: tuple = ()  # dense: (leaf axes met by the input's trailing axes, leaf axes of the output)
    note: str = ""  # a matched layer with no dense/conv fast path: its equation, for messages


class AffineNorm(NamedTuple):
    """``y = normalize(params, x) * scale + bias`` (see the module docstring)."""

    normalize: Callable[[dict, Any], Any]


@contextlib.contextmanager
def noting(kind: Any = None) -> Iterator[list]:
    """Opens the kind slot of one layer call while its function is traced; yields ``[kind]``."""
    stack = _local.__dict__.setdefault("stack", [])
    slot = [kind]
    stack.append(slot)
    try:
        yield slot
    finally:
        stack.pop()


def note(kind: Any) -> None:
    """Gives the innermost layer call being traced the kind ``kind`` (outside one: nothing)."""
    stack = _local.__dict__.get("stack")
    if stack:
        stack[-1][0] = kind
