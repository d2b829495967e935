"""Ready-made hook transforms, in optax's style: each returns a ``HookTransform``.

Contract: stateless transforms (``scale``, ``zero``, ``clip_by_norm``) have state ``()`` and
need no threading. Stateful ones (``ema_normalize``, ``add_noise``, ``accumulate_stats``) keep
float32 state as NamedTuples, threaded with ``hook_state=`` (see ``vk.init_hook_state``).
``field`` selects ``"grad_params"`` (default), ``"grad_input"``, or both as a tuple; a field
that is ``None`` for a call (its input needs no gradient) is left alone. Outputs keep the
cotangent's dtype.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._errors import ConfigError, HookError
from ._hook_base import HookTransform, factory
from ._records import Cotangents

_FIELDS = ("grad_params", "grad_input")


def _fields(field: str | tuple[str, ...], who: str) -> tuple[str, ...]:
    fields = (field,) if isinstance(field, str) else tuple(field)
    bad = [f for f in fields if f not in _FIELDS]
    if bad or not fields:
        raise ConfigError(f"vk.{who}: field must be 'grad_params', 'grad_input' or both, got {field!r}.")
    return fields


def _map_fields(rec: Cotangents, fields: tuple[str, ...], fn: Callable[[Any], Any]) -> Cotangents:
    changes = {f: fn(getattr(rec, f)) for f in fields if getattr(rec, f) is not None}
    return rec.replace(**changes) if changes else rec


def _no_state(params: Any) -> tuple:
    del params
    return ()


def _stateless(fields: tuple[str, ...], fn: Callable[[Any], Any]) -> HookTransform:
    def update(rec, state):
        return _map_fields(rec, fields, fn), state

    return HookTransform(_no_state, update)


@factory
def scale(factor: float, field: str | tuple[str, ...] = "grad_params") -> HookTransform:
    """Multiplies the chosen cotangent(s) by ``factor``.

    Examples:
        >>> hooks = {"fc1": vk.scale(0.1)}                      # a 10x smaller step for fc1
        >>> hooks = {"block1/*": vk.scale(0.0, "grad_input")}   # stop gradients below block1
    """
    fields = _fields(field, "scale")
    return _stateless(fields, lambda tree: jax.tree.map(lambda g: g * jnp.asarray(factor, g.dtype), tree))


@factory
def zero(field: str | tuple[str, ...] = "grad_params") -> HookTransform:
    """Replaces the chosen cotangent(s) with zeros: ``zero()`` freezes a layer's parameters.

    Examples:
        >>> hooks = {"fc1": vk.zero()}   # fc1 is frozen; layers below still learn
    """
    fields = _fields(field, "zero")
    return _stateless(fields, lambda tree: jax.tree.map(jnp.zeros_like, tree))


def _global_norm(tree: Any) -> jax.Array:
    """The l2 norm over all leaves, in float32 (complex leaves by their modulus)."""
    return optax.tree_utils.tree_norm(jax.tree.map(_as_f32, tree)).astype(jnp.float32)


def _as_f32(g: jax.Array) -> jax.Array:
    return g.astype(jnp.complex64 if jnp.iscomplexobj(g) else jnp.float32)


def _real_only(rec: Cotangents, what: str) -> None:
    """Raises for complex ``grad_params``: a mean and a variance of them are not defined here."""
    for path, g in jax.tree_util.tree_flatten_with_path(rec.grad_params)[0]:
        if jnp.iscomplexobj(g):
            raise HookError(
                f"vk.{what} on layer {rec.name!r} (call {rec.call}), grad_params path "
                f"{jax.tree_util.keystr(path)}: the gradient is complex ({g.dtype}), and {what} keeps "
                "real running means and variances. Use it on real layers only (a glob that leaves "
                "this layer out), or write a HookTransform for complex gradients."
            )


@factory
def clip_by_norm(max_norm: float, field: str | tuple[str, ...] = "grad_params") -> HookTransform:
    """Rescales a layer's cotangent so that its norm (over all its leaves) is at most ``max_norm``.

    Examples:
        >>> hooks = {"conv*": vk.clip_by_norm(1.0), "fc*": vk.clip_by_norm(0.5, "grad_input")}
    """
    if not max_norm > 0:
        raise ConfigError(f"vk.clip_by_norm: max_norm must be positive, got {max_norm!r}.")
    fields = _fields(field, "clip_by_norm")

    def clip(tree):
        factor = jnp.minimum(1.0, max_norm / jnp.maximum(_global_norm(tree), 1e-30))
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), tree)  # complex: a real factor

    return _stateless(fields, clip)


class EmaNormalizeState(NamedTuple):
    """State of ``ema_normalize``: step count and EMAs of each gradient's mean and variance.

    ``mean`` and ``var`` are keyed like the layer's params, one float32 scalar per leaf.
    """

    count: jax.Array
    mean: Any
    var: Any


@factory
def ema_normalize(decay: float = 0.9, eps: float = 1e-8, center: bool = True) -> HookTransform:
    """Standardises a layer's parameter gradients with EMAs of their mean and variance.

    Per parameter leaf ``g`` (e.g. a conv kernel's gradient), each step:
    ``mean <- decay * mean + (1 - decay) * g.mean()``, ``var <- decay * var + (1 - decay) * g.var()``,
    bias-corrected by ``1 - decay**count`` as in Adam, then
    ``g <- (g - mean_hat) / (sqrt(var_hat) + eps)`` (without ``- mean_hat`` if not ``center``).
    This is the gradient moderation of the forum thread "What do the grad_in and grad_out of
    nn.Conv2d consist of?": new kernel gradients from the history of past ones.

    Examples:
        >>> g = vk.value_and_grad(loss_fn, hooks={"conv*": vk.ema_normalize(0.9)})
        >>> state = vk.init_hook_state(g, params, x, y)
        >>> (loss, grads), state = jax.jit(g)(params, x, y, hook_state=state)
        >>> state["conv1"].var["weight"]
    """
    if not 0.0 <= decay < 1.0:
        raise ConfigError(f"vk.ema_normalize: decay must be in [0, 1), got {decay!r}.")

    def init(params):
        def zeros():
            return jax.tree.map(lambda _: jnp.zeros((), jnp.float32), params)

        return EmaNormalizeState(jnp.zeros((), jnp.float32), zeros(), zeros())

    def update(rec, state):
        if rec.grad_params is None:
            return rec, state
        _real_only(rec, "ema_normalize")
        count = state.count + 1.0
        d = jnp.float32(decay)
        mean = jax.tree.map(
            lambda m, g: d * m + (1 - d) * jnp.mean(g.astype(jnp.float32)), state.mean, rec.grad_params
        )
        var = jax.tree.map(
            lambda v, g: d * v + (1 - d) * jnp.var(g.astype(jnp.float32)), state.var, rec.grad_params
        )
        correction = 1 - d**count

        def normalize(g, m, v):
            m_hat, v_hat = m / correction, v / correction
            centred = g.astype(jnp.float32) - (m_hat if center else 0.0)
            return (centred / (jnp.sqrt(v_hat) + eps)).astype(g.dtype)

        grads = jax.tree.map(normalize, rec.grad_params, mean, var)
        return rec.replace(grad_params=grads), EmaNormalizeState(count, mean, var)

    return HookTransform(init, update)


class AddNoiseState(NamedTuple):
    """State of ``add_noise``: the step count (float32), folded into the key each step."""

    count: jax.Array


@factory
def add_noise(key: jax.Array, stddev: float, field: str | tuple[str, ...] = "grad_params") -> HookTransform:
    """Adds Gaussian noise ``N(0, stddev^2)`` to the chosen cotangent(s), fresh each step.

    The noise of step ``t`` is drawn from ``key`` folded with ``t``, the call index and a hash of
    the layer name, so layers and steps get independent noise; ``t`` lives in the hook state.

    Examples:
        >>> hooks = {"fc*": vk.add_noise(jax.random.key(0), 1e-3)}
    """
    fields = _fields(field, "add_noise")

    def init(params):
        del params
        return AddNoiseState(jnp.zeros((), jnp.float32))

    def update(rec, state):
        step_key = jax.random.fold_in(key, state.count.astype(jnp.uint32))
        step_key = jax.random.fold_in(step_key, rec.call)
        step_key = jax.random.fold_in(step_key, zlib.crc32(rec.name.encode()) & 0x7FFFFFFF)

        def noisy(tree):
            leaves, treedef = jax.tree.flatten(tree)
            keys = jax.random.split(step_key, max(len(leaves), 1))
            out = [
                g + (stddev * jax.random.normal(k, g.shape, _as_f32(g).dtype)).astype(g.dtype)
                for g, k in zip(leaves, keys)
            ]
            return jax.tree.unflatten(treedef, out)

        return _map_fields(rec, fields, noisy), AddNoiseState(state.count + 1.0)

    return HookTransform(init, update)


class AccumulateState(NamedTuple):
    """State of ``accumulate_stats``: Welford running moments of each parameter gradient.

    ``mean`` and ``m2`` are keyed like params, elementwise; the variance over steps is
    ``m2 / count``.
    """

    count: jax.Array
    mean: Any
    m2: Any


@factory
def accumulate_stats() -> HookTransform:
    """Observes a layer's parameter gradients and keeps their running mean and variance over steps.

    Examples:
        >>> g = vk.grad(loss_fn, hooks={"fc*": vk.accumulate_stats()})
        >>> state = vk.init_hook_state(g, params, x, y)
        >>> grads, state = g(params, x, y, hook_state=state)
        >>> variance = jax.tree.map(lambda m2: m2 / state["fc1"].count, state["fc1"].m2)
    """

    def init(params):
        def zeros():
            return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

        return AccumulateState(jnp.zeros((), jnp.float32), zeros(), zeros())

    def update(rec, state):
        if rec.grad_params is None:
            return rec, state
        _real_only(rec, "accumulate_stats")
        count = state.count + 1.0
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), rec.grad_params)
        delta = jax.tree.map(jnp.subtract, grads, state.mean)
        mean = jax.tree.map(lambda m, dl: m + dl / count, state.mean, delta)
        m2 = jax.tree.map(lambda s, dl, g, m: s + dl * (g - m), state.m2, delta, grads, mean)
        return rec, AccumulateState(count, mean, m2)

    return HookTransform(init, update)
