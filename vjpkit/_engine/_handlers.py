"""Handlers: the policy the custom_vjp rule hands each record to (hooks, capture, host, explain log).

Contract: a ``Handler`` is a NamedTuple of pure functions, any of them ``None``; ``chain``
composes handlers left to right into one, as ``optax.chain`` does. The plan asks the handler
for a call's hook-state shapes (``state``) and the probe parts it owns (``slot``: by name, or
``None`` when it does not want the call); the rule (``_rule``) calls ``before`` with the record
before the layer's own VJP (``grad_output`` and the forward fields only) and ``after`` with the
full record. ``after`` fills the handler's own parts of ``parts``, the probe cotangent that
carries values out of the backward pass (``_slots``), and after the pass ``result`` reads them
back. The rule imports none of the modules used here; a new consumer of records is one more
handler in ``chain``.

* ``hooks()``: runs the hooks matching the call (``vk.before`` ones in ``before``), threads
  their state, and puts the records the ``vk.on_host`` hooks saw into its ``"host"`` part;
* ``capture()``: the captured record (``vk.capture``) in its ``"captured"`` part;
* ``records(name, specs)``: the records another consumer chooses, in its own part ``name``
  (curvature statistics read theirs so, beside the user's capture);
* ``log(keys)``: appends each call's key when its backward pass runs (``vk.explain``);
* ``tangent_hooks()``: forward mode (``vjpkit._jvp_rule``): runs the call's tangent hooks on
  its ``Tangents`` record (``after`` only; no state, no probe parts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _hooks
from .._capture import reduce_record
from .._hook_base import is_before
from .._records import Cotangents
from ._carry import FLAGS, encode, part, select, zeros


class Handler(NamedTuple):
    """What consumes a layer call's record in the backward pass (see the module contract).

    Attributes:
        state: ``state(hooks, record_avals, key) -> avals | None``: the call's hook state.
        slot: ``slot(name, call, record_avals, spec, host_hooks) -> {part: Part} | None``: the
            probe parts this handler owns for the call (``_carry.part``), by name; ``None``
            when it does not want the call.
        before: ``before(site, rec, state) -> (rec, state)``, before the layer's own VJP.
        after: ``after(site, rec, state, parts) -> (rec, state)``; fills its own ``parts``.
        unreached: ``unreached(site, rec, parts)``: a call with a probe whose output the loss
            does not depend on; ``rec`` has its forward values and zero cotangents. Fills its own
            ``parts`` (no hook runs).
        result: ``result(plan, read) -> dict``: what the handler gives back after a backward
            pass, from ``read(part) -> {call key: decoded value}`` (``_carry.read``).
    """

    state: Callable | None = None
    slot: Callable | None = None
    before: Callable | None = None
    after: Callable | None = None
    unreached: Callable | None = None
    result: Callable | None = None


def chain(*handlers: Handler) -> Handler:
    """One handler that runs ``handlers`` in order, as ``optax.chain`` does.

    The first ``state`` answer is the call's. The probe is the union of the handlers' parts
    (a part name owned twice is an error) and the flags ``"ran"`` (the call's backward pass
    ran; 0 for a call the loss does not reach) and ``"seen"`` (1 either way); a part its handler
    left empty travels as zeros. The results are merged.
    """

    def of(field):
        return [getattr(h, field) for h in handlers if getattr(h, field) is not None]

    states, slots, results = of("state"), of("slot"), of("result")

    def state(*a):
        return next((r for f in states if (r := f(*a)) is not None), None)

    def slot(*a):
        parts: dict = {}
        for f in slots:
            for name, p in (f(*a) or {}).items():
                if name in parts:
                    raise ValueError(f"two handlers own the probe part {name!r}")
                if name not in FLAGS:  # a chain's own (a chain of chains)
                    parts[name] = p
        return (
            {**parts, **dict.fromkeys(FLAGS, part(jax.ShapeDtypeStruct((), jnp.float32), unreached=False))}
            if parts
            else None
        )

    def filled(site, parts, ran):
        for name, p in site.slot.items():
            if name not in parts:
                parts[name] = zeros(p)
        parts.update(ran=jnp.asarray(1.0 if ran else 0.0, jnp.float32), seen=jnp.ones((), jnp.float32))

    def threaded(field):
        fns = of(field)
        if not fns and field == "before":
            return None

        def run(site, rec, state, *parts):
            for f in fns:
                rec, state = f(site, rec, state, *parts)
            if parts and getattr(site, "slot", None) is not None:
                filled(site, parts[0], True)
            return rec, state

        return run

    unreached = of("unreached")

    def run_unreached(site, rec, parts):
        for f in unreached:
            f(site, rec, parts)
        if site.slot is not None:
            filled(site, parts, False)

    def result(plan, read):
        return {k: v for f in results for k, v in f(plan, read).items()}

    return Handler(
        state if states else None,
        slot if slots else None,
        threaded("before"),
        threaded("after"),
        run_unreached,
        result if results else None,
    )


def hooks() -> Handler:
    """The matching hooks: ``vk.before`` ones first, the others after the VJP. The records the
    ``vk.on_host`` hooks saw travel in the ``"host"`` part (sent by ``_slots.send_host``)."""

    def state(hooks, record, key):
        avals = _hooks.state_avals(hooks, record.params)
        if avals is not None:
            _hooks.check_float_state(avals, key)
        return avals

    def slot(name, call, record, spec, host):
        return {"host": part(tuple(record for _ in host), unreached=False)} if host else None

    def before(site, rec, state):
        if not any(is_before(h) for h in site.hooks):
            return rec, state
        return _hooks.run(rec, site.hooks, state, phase="before")

    def after(site, rec, state, parts):
        sink: list[Cotangents] = []  # what the vk.on_host hooks saw: sent in the step's one transfer
        rec, state = _hooks.run(rec, site.hooks, state, sink)
        if site.host:
            parts["host"] = tuple(jax.tree.map(encode, r) for r in sink)
        return rec, state

    def unreached(site, rec, parts):  # no hook runs; the host part travels as zeros ("ran" is 0)
        if site.host:
            parts["host"] = tuple(jax.tree.map(encode, rec) for _ in site.host)

    return Handler(state=state, slot=slot, before=before, after=after, unreached=unreached)


def _carrying(name: str, spec_of: Callable, result: Callable) -> Handler:
    """Each chosen call's record, reduced by its spec (``spec_of(layer, call, config_spec)``,
    ``None``: not chosen), in the part ``name``; ``result(plan, read)``."""

    def slot(layer, call, record, spec, host):
        mine = spec_of(layer, call, spec)
        return None if mine is None else {name: part(reduce_record(record, mine, shapes=True))}

    def put(site, rec, parts):
        if site.slot is not None and name in site.slot:
            parts[name] = jax.tree.map(encode, reduce_record(rec, spec_of(site.name, site.call, site.spec)))

    def after(site, rec, state, parts):
        put(site, rec, parts)
        return rec, state

    return Handler(slot=slot, after=after, unreached=put, result=result)


def records(name: str, specs: Callable) -> Handler:
    """Each call ``specs(layer, call) -> CaptureSpec | None`` chooses, its record reduced as that
    spec says, in the part ``name``; the result is ``{name: {call key: record}}`` (a call of a
    ``lax.cond`` branch not taken gives NaN, integers 0). A consumer of records beside the
    user's capture (curvature statistics): the same call can be in both.

    >>> from vjpkit._capture import CaptureSpec
    >>> h = records("mine", lambda layer, call: CaptureSpec(("fc*",), ("input",), None))
    """
    return _carrying(
        name, lambda layer, call, spec: specs(layer, call), lambda plan, read: {name: read(name)}
    )


def capture() -> Handler:
    """The captured record (``vk.capture``: the configuration's first spec that chooses the
    call) in the ``"captured"`` part; the result's ``"captured"`` keeps the iterations the
    globs ask for (``blocks[2]``, ``_slots.select``)."""
    return _carrying(
        "captured",
        lambda layer, call, spec: spec,
        lambda plan, read: {"captured": select(plan, read("captured"))},
    )


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
