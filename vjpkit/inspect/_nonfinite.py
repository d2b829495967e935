"""Where a NaN or Inf came from: the first layer call whose cotangent (or value) went non-finite.

Contract: ``find_nonfinite`` runs ``loss_fn(*args, **kwargs)`` and its gradient with
respect to ``args[0]`` once, jit-compiled (``kwargs`` are closed over), with an in-graph
capture of ``nonfinite_count`` (the number of NaN and Inf elements) of every field of every
layer call; only those counts leave the graph. It reports

* the backward origin: the first call, **in backward order** (the order records are made),
  whose ``grad_output``, ``grad_input`` or ``grad_params`` has a non-finite element, and that
  field (checked in this order within a call);
* the forward origin: the first call, **in forward order**, whose ``input``, ``params`` or
  ``output`` has one, and that field. ``output`` means the call itself made the NaN/Inf from
  finite values (a ``log`` of a negative number); ``input`` means it arrived from outside any
  layer (the data, or an operation between layers); ``params`` means the parameters are bad.

The two differ in general: a NaN made in the forward pass of layer k reaches the backward pass
first through the layers after k (the loss's gradient at a NaN output, or a parameter gradient
``input.T @ grad_output`` of a NaN input), so the backward origin names a later layer and the
forward origin names k.

It returns a ``NonFiniteReport`` (also when everything is finite: then ``layer`` and
``forward_layer`` are ``None``, ``loss_finite`` is True and the report is falsy) and prints its
one-line ``message``. A loss that is non-finite while every layer call is finite is reported
as made by the loss itself, after the last layer.
``first_nonfinite`` is the quiet form used by ``vk.train.fit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _engine
from .._capture import FIELDS, capture
from .._errors import ConfigError

BACKWARD_FIELDS = ("grad_output", "grad_input", "grad_params")
FORWARD_FIELDS = ("input", "params", "output")

NO_LAYER = (
    "vk.inspect.find_nonfinite: {fname} calls no vjpkit layer, so no layer can be named. Build the "
    "model from vjpkit layers (nn.dense, nn.conv2d, ... composed with nn.serial), or make any pure "
    "function a named layer with nn.layer(fn, init)."
)


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """What ``find_nonfinite`` found. Falsy exactly when everything was finite.

    Attributes:
        layer: the call key (``"fc2"``, ``"fc#1"``) of the first call in backward order with a
            non-finite ``grad_output``, ``grad_input`` or ``grad_params``; ``None`` if none.
        call: that call's index (0 for ``"fc"``, 1 for ``"fc#1"``); ``None`` if none.
        field: its first non-finite field, in the order ``grad_output``, ``grad_input``,
            ``grad_params``; ``None`` if none.
        counts: the number of non-finite elements of that call, per field (all six fields);
            ``{}`` if none.
        forward_layer: the call key of the first call in forward order whose ``input``,
            ``params`` or ``output`` is non-finite; ``None`` if none.
        forward_field: that field: ``"output"`` (the call made the NaN/Inf), ``"input"``
            (it arrived from outside any layer) or ``"params"``; ``None`` if none.
        loss_finite: whether the loss value itself is finite.
        per_layer: ``{call key: {field: count}}`` for every call, in backward order (calls the
            backward pass never reaches are left out).
        forward_order: every call key, in forward order.
        message: the one-line summary that was printed.
    """

    layer: str | None
    call: int | None
    field: str | None
    counts: dict[str, int]
    forward_layer: str | None
    forward_field: str | None
    loss_finite: bool
    per_layer: dict[str, dict[str, int]]
    forward_order: list[str]
    message: str

    @property
    def found(self) -> bool:
        """Whether anything was non-finite: a layer's value or cotangent, or the loss."""
        return self.layer is not None or self.forward_layer is not None or not self.loss_finite

    def __bool__(self) -> bool:
        return self.found


def _counts(loss_fn: Callable, args: tuple, kwargs: dict) -> tuple[float, dict, list[str]] | None:
    """``(loss, {call key: {field: count}} in backward order, forward order)``; ``None`` when
    ``loss_fn`` calls no vjpkit layer."""
    if not args:
        raise ConfigError(
            "vk.inspect.find_nonfinite needs loss_fn's arguments, "
            "e.g. find_nonfinite(loss_fn, params, batch)."
        )
    spec = capture("*", fields=FIELDS, reduce="nonfinite_count")
    config = _engine.configure(None, (spec,), "vk.inspect.find_nonfinite")
    forward: list[str] = []
    backward: list[str] = []

    def run(*a):  # one trace: the forward order from its plan, the backward order from its pullback
        traced = _engine.trace(config, loss_fn, a, kwargs, argnums=(0,), check=False)
        forward[:] = traced.plan.order
        if not forward:
            return None
        loss, _, pull = _engine.linearize(traced)
        if getattr(loss, "shape", None) != ():
            raise ConfigError(
                f"vk.inspect.find_nonfinite: loss_fn must return a scalar loss, got shape "
                f"{getattr(loss, 'shape', type(loss).__name__)}."
            )
        _, captured, _, _ = pull([jnp.ones((), loss.dtype)])
        backward[:] = captured  # at trace time the dict is in backward order; jit returns it sorted
        return loss, captured

    result = jax.device_get(jax.jit(run)(*args))  # one compile beats op-by-op dispatch
    if result is None:  # the forward pass ran and called no layer
        return None
    loss, captured = result
    per_layer = {}
    for key in backward:
        rec = captured[key]
        per_layer[key] = {f: int(sum(float(c) for c in jax.tree.leaves(getattr(rec, f)))) for f in FIELDS}
    return float(loss), per_layer, list(forward or [])


def _report(loss: float, per_layer: dict, forward: list[str], fname: str) -> NonFiniteReport:
    layer = field = None
    for key, counts in per_layer.items():
        field = next((f for f in BACKWARD_FIELDS if counts[f] > 0), None)
        if field is not None:
            layer = key
            break
    fwd_layer = fwd_field = None
    for key in forward:
        counts = per_layer.get(key)
        if counts is None:
            continue
        fwd_field = next((f for f in FORWARD_FIELDS if counts[f] > 0), None)
        if fwd_field is not None:
            fwd_layer = key
            break
    loss_finite = bool(np.isfinite(loss))
    parts = []
    if layer is not None:
        parts.append(
            f"the first non-finite cotangent in backward order is {layer!r} {field} "
            f"({per_layer[layer][field]} NaN/Inf)"
        )
    if fwd_layer is not None:
        how = {
            "output": "made its output non-finite from finite input and params",
            "input": "received a non-finite input from outside any layer (data or an op between layers)",
            "params": "has non-finite params",
        }[fwd_field]
        parts.append(f"in forward order, {fwd_layer!r} first {how}")
    if parts:
        message = f"find_nonfinite({fname}): " + "; ".join(parts) + f"; the loss is {loss}."
    elif loss_finite:
        message = (
            f"find_nonfinite({fname}): everything is finite: the loss ({loss:.6g}) and every layer "
            f"call's input, output, params and cotangents ({len(per_layer)} calls checked)."
        )
    else:
        message = (
            f"find_nonfinite({fname}): the loss is {loss}, but every layer call's values and cotangents "
            "are finite: the NaN/Inf is made after the last layer, in the loss itself."
        )
    call = None if layer is None else int(layer.partition("#")[2] or 0)
    return NonFiniteReport(
        layer=layer,
        call=call,
        field=field if layer is not None else None,
        counts=dict(per_layer[layer]) if layer is not None else {},
        forward_layer=fwd_layer,
        forward_field=fwd_field,
        loss_finite=loss_finite,
        per_layer=per_layer,
        forward_order=forward,
        message=message,
    )


def _name(fn: Callable) -> str:
    name = getattr(fn, "__name__", "loss_fn")
    return "loss_fn" if name == "<lambda>" else name


def find_nonfinite(loss_fn: Callable, *args: Any, **kwargs: Any) -> NonFiniteReport:
    """Names the layer call where a NaN or Inf first appears, backward and forward.

    Runs ``loss_fn(*args, **kwargs)`` and its gradient with respect to ``args[0]`` once, as a
    jitted ``vk.value_and_grad`` with a ``nonfinite_count`` capture of every layer (``args``
    are traced, ``kwargs`` closed over as constants), and prints a one-line message.

    Args:
        loss_fn: a scalar loss that calls vjpkit layers, e.g. ``loss_fn(params, batch)``.
        *args: its arguments, e.g. the params and the batch of the bad step.
        **kwargs: its arguments, e.g. the params and the batch of the bad step.

    Returns:
        A ``NonFiniteReport``. When everything is finite, its ``layer`` and
        ``forward_layer`` are ``None``, its message says so, and ``bool(report)`` is False.
        The report is truthy when anything, the loss included, is non-finite.

    Raises:
        ConfigError: ``loss_fn`` calls no vjpkit layer.

    Examples:
        >>> model = nn.serial(fc1=nn.dense(4), log=nn.layer(lambda p, h: jnp.log(h), name="log"),
        ...                   fc2=nn.dense(2))
        >>> report = vk.inspect.find_nonfinite(loss_fn, params, (x, y))  # cross-entropy of model
        find_nonfinite(loss_fn): the first non-finite cotangent in backward order is 'fc2' grad_output ...
        >>> report.layer, report.field, report.forward_layer, report.forward_field
        ('fc2', 'grad_output', 'log', 'output')
    """
    counted = _counts(loss_fn, args, kwargs)
    if counted is None:
        raise ConfigError(NO_LAYER.format(fname=_name(loss_fn)))
    report = _report(*counted, _name(loss_fn))
    print(report.message)
    return report


def first_nonfinite(loss_fn: Callable, params: Any, batch: Any, **kwargs: Any) -> tuple[str, str] | None:
    """``(call key, field)`` of the first non-finite cotangent in backward order, or ``None``.

    The quiet form of ``find_nonfinite`` for ``loss_fn(params, batch, **kwargs)``, used by
    ``vk.train.fit`` to name the layer in ``NonFiniteError``. ``None`` also when
    the loss calls no vjpkit layer.
    """
    counted = _counts(loss_fn, (params, batch), kwargs)
    if counted is None:
        return None
    report = _report(*counted, _name(loss_fn))
    return (report.layer, report.field) if report.layer is not None else None
