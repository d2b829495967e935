"""Handlers: the policy the custom_vjp rule hands each record to (hooks, capture, host, explain log).

Contract: a ``Handler`` is a NamedTuple of pure functions, any of them ``None``; ``chain``
composes handlers left to right into one, as ``optax.chain`` does. The plan asks the handler
for a call's hook-state shapes (``state``) and its probe parts' shapes (``slot``); the rule
(``_rule``) calls ``before`` with the record before the layer's own VJP (``grad_output`` and
the forward fields only) and ``after`` with the full record. ``after`` fills ``parts``, the
probe cotangent that carries values out of the backward pass (``_slots``). The rule imports
none of the modules used here; a new consumer of records is one more handler in ``chain``.

* ``hooks()``: runs the hooks matching the call (``vk.before`` ones in ``before``), threads
  their state, and puts the records the ``vk.on_host`` hooks saw into the ``"host"`` part;
* ``capture()``: puts the captured record (``vk.capture``) into the ``"captured"`` part and
  marks the call as run (``"ran"``);
* ``log(keys)``: appends each call's key when its backward pass runs (``vk.explain``);
* ``tangent_hooks()``: forward mode (``vjpkit._jvp_rule``): runs the call's tangent hooks on
  its ``Tangents`` record (``after`` only; no state, no probe parts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from .. import _hooks
from .._hook_base import is_before
from .._records import Cotangents
from ._carry import encode, slot_avals, slot_value


class Handler(NamedTuple):
    """What consumes a layer call's record in the backward pass (see the module contract).

    Attributes:
        state: ``state(hooks, record_avals, key) -> avals | None``: the call's hook state.
        slot: ``slot(record_avals, spec, host_hooks) -> dict | None``: the probe's parts.
        before: ``before(site, rec, state) -> (rec, state)``, before the layer's own VJP.
        after: ``after(site, rec, state, parts) -> (rec, state)``; fills ``parts``.
        unreached: ``unreached(site, rec, parts)``: a captured call whose output the loss does
            not depend on; ``rec`` has its forward values and zero cotangents. Fills ``parts``
            (no hook runs).
    """

    state: Callable | None = None
    slot: Callable | None = None
    before: Callable | None = None
    after: Callable | None = None
    unreached: Callable | None = None


def chain(*handlers: Handler) -> Handler:
    """One handler that runs ``handlers`` in order (their slots and states must not overlap)."""

    def first(field):
        fns = [getattr(h, field) for h in handlers if getattr(h, field) is not None]
        return (lambda *a: next((r for f in fns if (r := f(*a)) is not None), None)) if fns else None

    def threaded(field):
        fns = [getattr(h, field) for h in handlers if getattr(h, field) is not None]
        if not fns:
            return None

        def run(site, rec, state, *parts):
            for f in fns:
                rec, state = f(site, rec, state, *parts)
            return rec, state

        return run

    unreached = [h.unreached for h in handlers if h.unreached is not None]

    def run_unreached(site, rec, parts):
        for f in unreached:
            f(site, rec, parts)

    return Handler(
        first("state"),
        first("slot"),
        threaded("before"),
        threaded("after"),
        run_unreached if unreached else None,
    )


def hooks() -> Handler:
    """The matching hooks: ``vk.before`` ones first, the others after the VJP; host records out."""

    def state(hooks, record, key):
        avals = _hooks.state_avals(hooks, record.params)
        if avals is not None:
            _hooks.check_float_state(avals, key)
        return avals

    def before(site, rec, state):
        if not any(is_before(h) for h in site.hooks):
            return rec, state
        return _hooks.run(rec, site.hooks, state, phase="before")

    def after(site, rec, state, parts):
        sink: list[Cotangents] = []  # what the vk.on_host hooks saw: sent in the step's one transfer
        rec, state = _hooks.run(rec, site.hooks, state, sink)
        parts["host"] = tuple(jax.tree.map(encode, r) for r in sink)
        return rec, state

    def unreached(site, rec, parts):  # no hook runs; the host part travels as zeros ("ran" is 0)
        parts["host"] = tuple(jax.tree.map(encode, rec) for _ in site.host)

    return Handler(state=state, before=before, after=after, unreached=unreached)


def capture() -> Handler:
    """The captured record (reduced as its spec says) and the "ran" flag, as probe parts."""

    def slot(record, spec, host):
        return slot_avals(record, spec, len(host)) if spec is not None or host else None

    def after(site, rec, state, parts):
        value = slot_value(site.spec, rec)
        parts.update(captured=value["captured"], ran=value["ran"], seen=value["seen"])
        return rec, state

    def unreached(site, rec, parts):
        value = slot_value(site.spec, rec, ran=False)
        parts.update(captured=value["captured"], ran=value["ran"], seen=value["seen"])

    return Handler(slot=slot, after=after, unreached=unreached)


def log(keys: list) -> Handler:
    """Appends the key of every call whose backward pass runs, at trace time, in backward order."""

    def after(site, rec, state, parts):
        keys.append(site.key)
        return rec, state

    return Handler(after=after)


def tangent_hooks() -> Handler:
    """Forward mode: the call's tangent hooks, in order, on its ``Tangents`` record."""

    def after(site, rec, state, parts):
        return _hooks.run_tangent(rec, site.hooks), state

    return Handler(after=after)


def default() -> Handler:
    """The handlers of every vjpkit transform: hooks (and host hooks), then capture."""
    return chain(hooks(), capture())
