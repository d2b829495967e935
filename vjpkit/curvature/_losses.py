"""Registered losses: plain mean losses that also mark the model output for curvature.

Contract. ``softmax_cross_entropy(logits, labels)``, ``mse(pred, target)`` and
``sigmoid_binary_cross_entropy(logits, labels)`` return the loss value, a mean over the batch
(axis 0 of the output, ``N`` examples): cross-entropy over ``logits (N, ..., C)`` with integer
labels ``(N, ...)`` or label distributions ``(N, ..., C)``, averaged over the ``N * P``
positions (``P`` = the product of the middle axes: a sequence model's ``(B, T, C)`` logits are
``B`` examples of ``T`` positions each, so its per-example statistics are per sequence); the
squared error and the binary cross-entropy averaged over every element, as
``torch.nn.MSELoss`` / ``BCEWithLogitsLoss`` do. Outside a
curvature transform they are nothing more. Inside one (``collecting``) each call also appends a
``Mark`` (kind, output, target), and the transform makes the output an extra output of the
traced program, so that backward passes can be seeded there.

For a mark, ``sqrt_hessian`` gives the seeds ``S`` (one per column, stacked on axis 0) with
``sum_k S_k S_k^T`` = the Hessian of the loss with respect to the output (block-diagonal over
the examples, and over the positions of a cross-entropy: each position's block is its term's
Hessian over ``N * P``, so the exact seeds are ``P * C``), and ``sampled`` gives
``M`` Monte-Carlo seeds whose outer products equal it in expectation, from targets sampled from
the model's predictive distribution with ``jax.random.split(key, M)[m]`` (the key itself when
``M = 1``, as kfac-jax does) (``jax.random.categorical`` of the logits, a Bernoulli, a
unit Gaussian for the squared error).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._errors import ConfigError
from .._format import spec as _spec

_local = threading.local()


class Mark(NamedTuple):
    """One registered loss call: its kind, the model output it reads and the target."""

    kind: str
    output: jax.Array
    target: jax.Array
    value: Any = None  # the loss value the registered call returned (the transform checks it)
    axes: tuple = ()  # the named axes (pmap, shard_map) the registered call ran under


@contextlib.contextmanager
def collecting() -> Iterator[list[Mark]]:
    """Registered losses called inside append their ``Mark`` to the yielded list."""
    stack = _local.__dict__.setdefault("stack", [])
    marks: list[Mark] = []
    stack.append(marks)
    try:
        yield marks
    finally:
        stack.pop()


def _mark(kind: str, output: Any, target: Any, value: Any) -> Any:
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].append(Mark(kind, output, target, value, tuple(_compat.axis_names())))
    return value


def _integer_target(labels: jax.Array, c: int, dtype: Any) -> jax.Array:
    """One-hot rows of integer ``labels``; a label outside ``[0, c)`` is an error when the labels
    are concrete, and makes its row NaN when traced (so that the loss, its gradient and every
    statistic are NaN rather than silently leaving the example out, as ``one_hot`` would)."""
    try:
        concrete = np.asarray(labels)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        concrete = None
    if concrete is not None and concrete.size and (concrete.min() < 0 or concrete.max() >= c):
        flat = concrete.reshape(-1)
        bad = np.flatnonzero((flat < 0) | (flat >= c))
        at = [tuple(int(i) for i in np.unravel_index(b, concrete.shape)) for b in bad[:5]]
        at = [a[0] if len(a) == 1 else a for a in at]
        raise ConfigError(
            f"vk.curvature.softmax_cross_entropy: integer labels must be classes in [0, {c}) for "
            f"logits with {c} columns, got {flat[bad[:5]].tolist()} at rows {at}"
            f"{' ...' if bad.size > 5 else ''}. Fix the labels or the number of classes (under "
            "jax.jit such a label makes the loss, the gradient and the statistics NaN)."
        )
    valid = (labels >= 0) & (labels < c)
    return jnp.where(valid[..., None], jax.nn.one_hot(labels, c, dtype=dtype), jnp.asarray(jnp.nan, dtype))


def _float_output(x: Any, who: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
        raise ConfigError(
            f"vk.curvature.{who}: the model output must be a float array with the examples on "
            f"axis 0, got {_spec(x)}."
        )
    return x


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over the batch (and positions), registered for curvature.

    Args:
        logits: ``(N, C)`` float logits, or ``(N, ..., C)`` (a sequence model's ``(B, T, C)``:
            the examples are the ``B`` sequences, the loss a mean over every position).
        labels: ``(N, ...)`` integer classes, or ``(N, ..., C)`` label distributions (one-hot).

    Returns:
        ``mean_{n,t} -log softmax(logits_nt)[labels_nt]`` (a float scalar).

    Examples:
        >>> def loss_fn(params, x, y):
        ...     return vk.curvature.softmax_cross_entropy(model(params, x), y)
    """
    logits = _float_output(logits, "softmax_cross_entropy")
    labels = jnp.asarray(labels)
    if logits.ndim < 2:
        raise ConfigError(
            f"vk.curvature.softmax_cross_entropy: logits must be (N, C) or (N, ..., C) (the "
            f"examples on axis 0, the classes last), got {_spec(logits)}."
        )
    lead, c = tuple(logits.shape[:-1]), logits.shape[-1]
    if jnp.issubdtype(labels.dtype, jnp.integer) and labels.shape == lead:
        target = _integer_target(labels, c, logits.dtype)
    elif labels.shape == logits.shape and jnp.issubdtype(labels.dtype, jnp.floating):
        target = labels.astype(logits.dtype)
    else:
        raise ConfigError(
            f"vk.curvature.softmax_cross_entropy: labels must be integer classes {lead} or a "
            f"float distribution {tuple(logits.shape)} for logits {_spec(logits)}, got {_spec(labels)}."
        )
    return _mark("softmax_cross_entropy", logits, target, _ce_value(logits, target))


def mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over every element (``torch.nn.MSELoss()``), registered for curvature.

    Examples:
        >>> loss = vk.curvature.mse(model(params, x), y)
    """
    pred = _float_output(pred, "mse")
    target = jnp.asarray(target)
    if target.shape != pred.shape:
        raise ConfigError(
            f"vk.curvature.mse: target {_spec(target)} must have the shape of pred {_spec(pred)}."
        )
    target = target.astype(pred.dtype)
    return _mark("mse", pred, target, _mse_value(pred, target))


def sigmoid_binary_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean sigmoid binary cross-entropy over every element, registered for curvature.

    Args:
        logits: float logits, examples on axis 0.
        labels: targets in ``[0, 1]`` of the same shape.

    Examples:
        >>> loss = vk.curvature.sigmoid_binary_cross_entropy(model(params, x), y)
    """
    logits = _float_output(logits, "sigmoid_binary_cross_entropy")
    labels = jnp.asarray(labels)
    if labels.shape != logits.shape:
        raise ConfigError(
            f"vk.curvature.sigmoid_binary_cross_entropy: labels {_spec(labels)} must have the "
            f"shape of logits {_spec(logits)}."
        )
    labels = labels.astype(logits.dtype)
    return _mark("sigmoid_binary_cross_entropy", logits, labels, _bce_value(logits, labels))


def _ce_value(logits: jax.Array, target: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.sum(target * jax.nn.log_softmax(logits, axis=-1), axis=-1))


def _mse_value(pred: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(pred - target))


def _bce_value(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jax.nn.softplus(logits) - labels * logits)


_VALUES = {"softmax_cross_entropy": _ce_value, "mse": _mse_value, "sigmoid_binary_cross_entropy": _bce_value}


def output_grad(mark: Mark) -> jax.Array:
    """``dL/d output`` of the registered loss (each example's row carrying the ``1/N`` of the
    mean): the gradient's seed at the model output."""
    return jax.grad(_VALUES[mark.kind])(mark.output, mark.target)


def _label_mass(mark: Mark) -> jax.Array:
    """``sqrt(s_n)`` per position, ``s_n`` the sum of its label row: the Hessian of
    ``-sum_c t_c log softmax(z)_c`` over ``z`` is ``s_n (diag p - p p^T)``, so the seeds of a
    label distribution that does not sum to 1 carry ``sqrt(s_n)`` (1 for one-hot rows; NaN for
    a negative sum, whose Hessian has no real square root, and for an out-of-range label)."""
    return jnp.sqrt(jnp.sum(mark.target, axis=-1))


def _per_element(out: jax.Array) -> tuple[int, int]:
    n = out.shape[0]
    return n, out.size // n


def sqrt_hessian(mark: Mark) -> jax.Array:
    """The exact seeds: ``(K, *out.shape)``, ``sum_k S_k S_k^T`` = the loss's output Hessian."""
    out = mark.output
    n, d = _per_element(out)
    if mark.kind == "softmax_cross_entropy":
        c = out.shape[-1]
        p = jax.nn.softmax(out, axis=-1).reshape(n, -1, c)  # (N, P, C): P positions per example
        positions = p.shape[1]
        eye = jnp.eye(c, dtype=out.dtype)
        # column k of each position's diag(sqrt p) - p sqrt(p)^T, every example at once: (C, N, P, C)
        cols = jnp.moveaxis(jnp.sqrt(p), -1, 0)[..., None] * (eye[:, None, None, :] - p[None])
        mass = _label_mass(mark).reshape(1, n, positions, 1)
        scale = mass / jnp.sqrt(jnp.asarray(n * positions, out.dtype))
        cols = cols * scale
        if positions == 1:
            return cols.reshape(c, *out.shape)
        # one seed per (position, class): position t's columns, zero at the other positions
        # (the Hessian is block-diagonal over the positions; a seed spanning them would add
        # cross terms between positions that share parameters)
        at = jnp.eye(positions, dtype=out.dtype)[:, None, None, :, None]  # (P, 1, 1, P, 1)
        return (at * cols[None]).reshape(positions * c, *out.shape)
    if mark.kind == "mse":
        scale = jnp.sqrt(jnp.asarray(2.0 / (n * d), out.dtype))
        eye = jnp.eye(d, dtype=out.dtype).reshape(d, 1, *out.shape[1:])
        return jnp.broadcast_to(eye * scale, (d, *out.shape))
    s = jax.nn.sigmoid(out)  # binary cross-entropy: diagonal, s (1 - s) / (N d)
    root = jnp.sqrt(s * (1 - s) / (n * d))
    eye = jnp.eye(d, dtype=out.dtype).reshape(d, *out.shape[1:])
    return eye[:, None] * root[None]


def sampled(mark: Mark, key: jax.Array, samples: int) -> jax.Array:
    """``samples`` Monte-Carlo seeds ``(M, *out.shape)``: ``E[sum_m s_m s_m^T]`` = the Hessian."""
    out = mark.output
    n, d = _per_element(out)
    # sample m draws with split(key, M)[m]; one sample with the key itself (both as kfac-jax does)
    keys = key[None] if samples == 1 else jax.random.split(key, samples)
    m = jnp.asarray(samples, out.dtype)
    if mark.kind == "softmax_cross_entropy":
        p = jax.nn.softmax(out, axis=-1)
        positions = n * (out.size // (n * out.shape[-1]))  # the loss averages over them

        def one(k):  # a label per position, drawn independently: E[s s^T] is block-diagonal
            y = jax.random.categorical(k, out, axis=-1)
            return (p - jax.nn.one_hot(y, out.shape[-1], dtype=out.dtype)) / jnp.sqrt(positions * m)

        return jax.vmap(one)(keys) * _label_mass(mark)[None, ..., None]
    if mark.kind == "mse":
        z = jax.vmap(lambda k: jax.random.normal(k, out.shape, out.dtype))(keys)
        return z * jnp.sqrt(2.0 / (n * d * m))
    s = jax.nn.sigmoid(out)

    def one(k):
        y = jax.random.bernoulli(k, s).astype(out.dtype)
        return (s - y) / jnp.sqrt(n * d * m)

    return jax.vmap(one)(keys)
