"""Sites: the spans of a traced program that are layer calls, and the one record builder.

Contract: a *site* is a span of the program with a ``Layout``: which flat operands are values
the span closed over (``n_hoisted``, they get gradients but are not in the record), how the
rest unflatten into ``(params, inputs, array_kwargs)`` (``tree``), how the outputs unflatten
(``out_tree``), and the call's ``kind`` (``vjpkit._kinds``). A ``Span`` is what a *site
source* finds at one equation: the span's name, its computation (a closed jaxpr over the flat
operands) and its layout. ``SOURCES`` maps a primitive to its site source; a ``vjpkit_layer``
equation is one source (``layer_span``), and a new source is one entry, with no change to the
custom_vjp rule. ``record`` builds a ``Cotangents`` from flat values for any layout, from
arrays (the rule) or from shapes (the plan).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._primitive import layer_p
from .._records import Cotangents


class Layout(NamedTuple):
    """Which flat operands and outputs of a span are what (see the module contract)."""

    n_hoisted: int
    tree: Any  # treedef of (params, inputs, array_kwargs)
    out_tree: Any  # treedef of the output
    kind: Any = None  # the call's kind (vjpkit._kinds), or None

    def split(self, ops: Sequence) -> tuple[list, Any]:
        """``(hoisted, (params, inputs, kwargs))`` from flat operands."""
        n = self.n_hoisted
        return list(ops[:n]), jax.tree.unflatten(self.tree, list(ops[n:]))

    def join(self, hoisted: Sequence, params: Any, inputs: tuple, kwargs: Any) -> list:
        """Flat operands from their parts (the inverse of ``split``)."""
        return [*hoisted, *self.tree.flatten_up_to((params, tuple(inputs), kwargs))]


class Span(NamedTuple):
    """One layer call found in a program: its name, computation and layout."""

    name: str
    jaxpr: Any  # a ClosedJaxpr over the flat operands (*hoisted, *leaves)
    layout: Layout


def layer_span(eqn: Any) -> Span:
    """The span of a ``vjpkit_layer`` equation (the layer sources' explicit calls)."""
    p = eqn.params
    return Span(p["name"], p["jaxpr"], Layout(p["n_hoisted"], p["tree"], p["out_tree"], p["kind"].value))


# primitive -> site source: ``source(eqn) -> Span | None``
SOURCES: dict[Any, Callable[[Any], Span | None]] = {layer_p: layer_span}


def span_of(eqn: Any) -> Span | None:
    """The span a site source finds at ``eqn``, or ``None``."""
    source = SOURCES.get(eqn.primitive)
    return None if source is None else source(eqn)


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _collapse(tree: Any) -> Any:
    """``None`` for a tree that has leaf positions but no leaves; ``tree`` otherwise."""
    positions = jax.tree.leaves(tree, is_leaf=lambda x: x is None)
    if positions and all(p is None for p in positions):
        return None
    return tree


def record(
    layout: Layout, name: str, call: int, ops: Sequence, outs: Sequence, g_outs: Sequence, grads: Sequence
) -> Cotangents:
    """The record of one call from flat forward values and flat cotangents (arrays or shapes).

    ``grads`` holds one entry per operand, ``None`` where no gradient flows; ``grad_input`` /
    ``grad_params`` are ``None`` when every entry of theirs is. ``g_outs`` entries of integer
    outputs become ``None``.
    """
    _, (params, inputs, _) = layout.split(ops)
    _, (g_params, g_inputs, _) = layout.split(grads)
    single = len(inputs) == 1
    g_out = [g if _inexact(o) else None for g, o in zip(g_outs, outs)]
    return Cotangents(
        name=name,
        call=call,
        params=params,
        input=inputs[0] if single else inputs,
        output=jax.tree.unflatten(layout.out_tree, list(outs)),
        grad_output=jax.tree.unflatten(layout.out_tree, g_out),
        grad_input=_collapse(g_inputs[0] if single else g_inputs),
        grad_params=_collapse(g_params),
    )


@contextlib.contextmanager
def registered(table: dict, key: Any, value: Any) -> Iterator[None]:
    """``table[key] = value`` for the duration (push/pop: the previous entry comes back)."""
    missing = object()
    previous = table.get(key, missing)
    table[key] = value
    try:
        yield
    finally:
        if previous is missing:
            del table[key]
        else:
            table[key] = previous


def registered_source(
    primitive: Any, source: Callable[[Any], Span | None]
) -> contextlib.AbstractContextManager:
    """``SOURCES[primitive] = source`` for the duration (push/pop: the previous one comes back)."""
    return registered(SOURCES, primitive, source)
