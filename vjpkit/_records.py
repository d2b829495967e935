"""Records handed to hooks: one per layer call.

Contract: for one call ``y = layer(params, x)`` inside a scalar loss ``L``,

* ``grad_output`` is dL/dy: same structure, shape and dtype as ``output``.
* ``grad_input`` is dL/dx: same structure as ``input``. A leaf is ``None`` when that input
  needs no gradient (the data batch entering the first layer, integer ids, ...), and it is
  then never computed. ``grad_input`` is ``None`` as a whole when no input needs one.
* ``grad_params`` is dL/dparams of *this call*, keyed exactly like ``params``.

``name`` and ``call`` are static (pytree metadata); every other field is data, so a record
can be passed through ``jax.tree.map``, returned from ``jit`` or stacked by ``lax.scan``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ._format import describe


def call_key(name: str, call: int) -> str:
    """``name`` for a layer's first call in a forward pass, ``name#k`` for its k-th later call."""
    return name if call == 0 else f"{name}#{call}"


class _Record:
    """Behaviour shared by ``Cotangents`` and ``Tangents``."""

    name: str
    call: int

    def replace(self, **changes: Any):
        """Returns a copy with ``changes`` applied, like ``dataclasses.replace``.

        >>> rec2 = rec.replace(grad_params=jax.tree.map(lambda g: 0.5 * g, rec.grad_params))
        """
        return dataclasses.replace(self, **changes)

    @property
    def key(self) -> str:
        """The call key: ``name`` for call 0, ``f"{name}#{call}"`` for later calls."""
        return call_key(self.name, self.call)

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={describe(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if f.name not in ("name", "call")
        )
        return f"{type(self).__name__}(name={self.name!r}, call={self.call}, {fields})"


@dataclasses.dataclass(frozen=True, repr=False)
class Cotangents(_Record):
    """The backward record of one layer call ``output = layer(params, input)``.

    Attributes:
        name: the layer's path, e.g. ``"fc2"`` or ``"block1/fc1"`` (static).
        call: 0 for the first call of ``name`` in one forward pass, 1 for the second, ...
        params: the parameters this call used.
        input: the forward input (a tuple when the layer takes several inputs).
        output: the forward output.
        grad_output: dL/d(output), the cotangent arriving from the layers above.
        grad_input: dL/d(input), the cotangent sent to the layer below; ``None`` (per leaf)
            for inputs that need no gradient, which are then not computed at all.
        grad_params: dL/d(params) for this call only, keyed like ``params``.

    Examples:
        >>> def halve(rec):
        ...     return rec.replace(grad_params=jax.tree.map(lambda g: g / 2, rec.grad_params))
    """

    name: str
    call: int
    params: Any = None
    input: Any = None
    output: Any = None
    grad_output: Any = None
    grad_input: Any = None
    grad_params: Any = None


@dataclasses.dataclass(frozen=True, repr=False)
class Tangents(_Record):
    """The forward-mode record of one layer call, for ``vjpkit.jvp`` hooks.

    Attributes:
        name, call, params, input, output: as in ``Cotangents``.
        tangent_input: the tangent of ``input``.
        tangent_params: the tangent of ``params``.
        tangent_output: the tangent of ``output``, J @ (tangent_params, tangent_input).
    """

    name: str
    call: int
    params: Any = None
    input: Any = None
    output: Any = None
    tangent_input: Any = None
    tangent_params: Any = None
    tangent_output: Any = None


for _cls in (Cotangents, Tangents):
    _data = [f.name for f in dataclasses.fields(_cls) if f.name not in ("name", "call")]
    jax.tree_util.register_dataclass(_cls, data_fields=_data, meta_fields=["name", "call"])
