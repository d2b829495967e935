"""Normalisation layers: ``rms_norm`` and ``batch_norm`` (running statistics as explicit state).

Contract: both normalise and then apply a per-feature affine map over the *last* axis
(``scale``, ``bias`` of shape ``(features,)``). ``rms_norm`` divides by the root mean square of
the last axis. ``batch_norm`` normalises each feature over every other axis (batch, and time or
height/width), and carries its running statistics in ``params["batch_stats"]`` =
``{"mean", "var"}``: they are never differentiated (their gradient is zero, through
``stop_gradient``), and ``apply(params, x, train=True)`` returns ``(y, new_batch_stats)``,
which the training step writes back into ``params``; ``train=False`` (the default) uses them
and returns ``y`` alone. Each layer is one hookable call whose record is ``x -> y``.
Both note themselves as affine norms (``_kinds.AffineNorm``, batch_norm in eval mode only),
which gives ``vk.inspect`` its per-example fast path for their parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _kinds
from .._errors import ConfigError
from ._layer import Layer, layer
from ._linear import _param_dtype
from ._linear import describe as _describe


def _check_input(what: str, x, min_ndim: int, expected: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) < min_ndim or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ConfigError(f"{what}: expects {expected}, got {_describe(x)}.")


def _check_features(what: str, params: dict, x, names) -> None:
    for k in names:
        if k in params and tuple(params[k].shape) != (x.shape[-1],):
            raise ConfigError(
                f"{what}: params[{k!r}] has shape {tuple(params[k].shape)} but the input has "
                f"{x.shape[-1]} features on its last axis ({_describe(x)}); expected ({x.shape[-1]},). "
                "Were these params made by init on another input?"
            )


def _check_eps(what: str, eps) -> None:
    if not (isinstance(eps, (int, float, np.floating)) and eps > 0):
        raise ConfigError(f"{what}: eps must be a positive number, got {eps!r}.")


def _affine(params, x_hat, use_scale, use_bias):
    if use_scale:
        x_hat = x_hat * params["scale"]
    if use_bias:
        x_hat = x_hat + params["bias"]
    return x_hat


def _rms_normalize(eps: float):
    def normalize(params, x):
        del params
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)

    return normalize


def rms_norm(eps: float = 1e-6, use_scale: bool = True, *, dtype=None, name: str | None = None) -> Layer:
    """Root-mean-square normalisation over the last axis: ``x / sqrt(mean(x**2) + eps) * scale``.

    Args:
        eps: added to the mean square, > 0.
        use_scale: multiply by ``scale`` (shape ``(features,)``, initialised to ones).
        dtype: parameter dtype; default: the input's float dtype.
        name: the name when no combinator names it.

    Examples:
        >>> rms = nn.rms_norm()
        >>> p = rms.init(jax.random.key(0), jnp.ones((2, 5)))
        >>> jax.tree.map(jnp.shape, p)
        {'scale': (5,)}
        >>> float(rms.apply(p, 3.0 * jnp.ones((2, 5)))[0, 0])
        0.9999999...
    """
    what = "nn.rms_norm" + (f" {name!r}" if name else "")
    _check_eps(what, eps)
    normalize = _rms_normalize(eps)

    def init(key, x):
        del key
        _check_input(what, x, 1, "a float input with features on the last axis")
        return {"scale": jnp.ones((x.shape[-1],), _param_dtype(x, dtype))} if use_scale else {}

    def fn(params, x):
        _check_input(what, x, 1, "a float input with features on the last axis")
        _check_features(what, params, x, ("scale",))
        _kinds.note(_kinds.AffineNorm(normalize))
        return _affine(params, normalize(params, x), use_scale, False)

    return layer(fn, init, name=name or "rms_norm")


def _bn_normalize(eps: float):
    def normalize(params, x):
        mean = jax.lax.stop_gradient(params["batch_stats/mean"])
        var = jax.lax.stop_gradient(params["batch_stats/var"])
        return (x - mean) * jax.lax.rsqrt(var + eps)

    return normalize


def batch_norm(
    momentum: float = 0.9,
    eps: float = 1e-5,
    use_scale: bool = True,
    use_bias: bool = True,
    *,
    dtype=None,
    name: str | None = None,
) -> Layer:
    """Batch normalisation over every axis but the last, with running statistics as state.

    ``params`` is ``{"scale", "bias", "batch_stats": {"mean", "var"}}``, all of shape
    ``(features,)`` (``mean`` starts at 0 and ``var`` at 1). The running statistics are never
    differentiated: their gradient is zero (``stop_gradient``), so leave them out of weight
    decay or simply overwrite them after each optimizer step.

    * ``apply(params, x, train=True) -> (y, new_batch_stats)``: normalises with the batch's
      mean and (biased) variance over all axes but the last, and returns the running statistics
      updated as ``momentum * old + (1 - momentum) * batch`` (Flax's convention; PyTorch's
      ``momentum=0.1`` is ``momentum=0.9`` here, and PyTorch keeps the unbiased variance).
      Write them back: ``params = {**params, "bn": {**params["bn"], "batch_stats": new}}``.
    * ``apply(params, x)`` (``train=False``, evaluation): normalises with the running
      statistics and returns ``y`` alone. It is a per-example affine map, so
      ``vk.inspect.per_example_grad_norms`` has a fast path for it.

    ``train`` must be a Python bool: it changes what ``apply`` returns. Because train mode
    returns a pair, use the layer in your own composition rather than inside ``nn.serial``
    when training (in eval mode it composes like any layer). The hookable record is the
    normalisation ``x -> y`` in both modes; the running-statistics update is outside it.

    Args:
        momentum: in ``[0, 1)``: the weight of the old running statistics.
        eps: added to the variance, > 0.
        use_scale: multiply by ``scale`` (ones at init).
        use_bias: add ``bias`` (zeros at init).
        dtype: parameter dtype; default: the input's float dtype.
        name: the name when no combinator names it.

    Examples:
        >>> bn = nn.batch_norm()
        >>> params = bn.init(jax.random.key(0), jnp.ones((8, 4)))
        >>> y, stats = bn.apply(params, jnp.ones((8, 4)), train=True)
        >>> params = {**params, "batch_stats": stats}
        >>> bn.apply(params, jnp.ones((8, 4))).shape
        (8, 4)
    """
    what = "nn.batch_norm" + (f" {name!r}" if name else "")
    _check_eps(what, eps)
    if not (isinstance(momentum, (int, float, np.floating)) and 0.0 <= momentum < 1.0):
        raise ConfigError(f"{what}: momentum must be in [0, 1), got {momentum!r}.")
    normalize = _bn_normalize(eps)
    expected = "a float input (batch, ..., features) with at least 2 axes"

    def init(key, x):
        del key
        _check_input(what, x, 2, expected)
        d, dt = x.shape[-1], _param_dtype(x, dtype)
        params = {}
        if use_scale:
            params["scale"] = jnp.ones((d,), dt)
        if use_bias:
            params["bias"] = jnp.zeros((d,), dt)
        params["batch_stats"] = {"mean": jnp.zeros((d,), dt), "var": jnp.ones((d,), dt)}
        return params

    def check(params, x, train):
        if not isinstance(train, (bool, np.bool_)):
            raise ConfigError(
                f"{what}: train must be a Python bool, got {type(train).__name__}. It decides what "
                "apply returns, so under jax.jit make it static (static_argnames='train' or "
                "functools.partial(apply, train=True))."
            )
        _check_input(what, x, 2, expected)
        stats = params.get("batch_stats") if isinstance(params, dict) else None
        if not isinstance(stats, dict) or set(stats) != {"mean", "var"}:
            got = sorted(stats) if isinstance(stats, dict) else type(stats).__name__
            raise ConfigError(
                f"{what}: params must hold batch_stats={{'mean', 'var'}} (made by init), got {got}."
            )
        _check_features(what, params, x, ("scale", "bias"))
        _check_features(what, stats, x, ("mean", "var"))

    def fn(params, x, *, train=False):
        axes = tuple(range(x.ndim - 1))
        if train:
            mean = jnp.mean(x, axis=axes)
            var = jnp.mean(jnp.square(x - mean), axis=axes)
            x_hat = (x - mean) * jax.lax.rsqrt(var + eps)
        else:
            flat = {
                "batch_stats/mean": params["batch_stats"]["mean"],
                "batch_stats/var": params["batch_stats"]["var"],
            }
            _kinds.note(_kinds.AffineNorm(normalize))
            x_hat = normalize(flat, x).astype(x.dtype)
        return _affine(params, x_hat, use_scale, use_bias)

    hookable = layer(fn, init, name=name or "batch_norm")

    def apply(params, x, *, train: bool = False, **kwargs):
        del kwargs  # keyword arguments meant for other layers (key=, mask=, ...)
        check(params, x, train)
        y = hookable.apply(params, x, train=train)
        if not train:
            return y
        old = params["batch_stats"]
        xs = jax.lax.stop_gradient(x)
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(xs, axis=axes)
        var = jnp.mean(jnp.square(xs - mean), axis=axes)
        new = {
            "mean": momentum * old["mean"] + (1.0 - momentum) * mean.astype(old["mean"].dtype),
            "var": momentum * old["var"] + (1.0 - momentum) * var.astype(old["var"].dtype),
        }
        return y, jax.lax.stop_gradient(new)

    return Layer(init, apply)
