"""Layers with parameters: ``dense``, ``conv1d``, ``conv2d``, ``embedding``, ``layer_norm``.

Contract: each returns an ``Layer`` built with ``layer``, so
every call is hookable. Parameter names and layouts are part of the API contract: ``dense`` has
``weight (in, out)`` and ``bias (out,)`` with ``y = x @ weight + bias``; ``conv2d`` is NHWC
with ``weight (kh, kw, in, out)``; ``conv1d`` is NWC with ``weight (k, in, out)``.
Parameters take ``dtype``, else the input's float dtype. The convolutions give their kind
(``_kinds.LayerKind("conv")`` with their strides and padding) while traced.
Initialisation follows PyTorch's defaults (uniform in +-1/sqrt(fan_in)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _context, _kinds
from .._errors import ConfigError
from .._format import spec
from . import _random
from ._layer import Layer, layer, positive_pair, require_param


def _param_dtype(x, dtype):
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.dtype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(jnp.float32)


def describe(x) -> str:
    """``float32[2,3]`` for error messages (arrays, tracers, ``ShapeDtypeStruct``)."""
    return spec(x) if hasattr(x, "shape") and hasattr(x, "dtype") else f"a {type(x).__name__}"


def _uniform(key, shape, fan_in, dtype):
    bound = 1.0 / float(max(fan_in, 1)) ** 0.5
    return _random.uniform(key, shape, -bound, bound, dtype)


def dense(features: int, use_bias: bool = True, *, dtype=None, name: str | None = None) -> Layer:
    """Fully connected layer ``y = x @ weight + bias`` over the last axis.

    Args:
        features: output size.
        use_bias: add ``bias`` (shape ``(features,)``).
        dtype: parameter dtype; default: the input's float dtype.
        name: the name when no combinator names it.

    Examples:
        >>> p = nn.dense(4).init(jax.random.key(0), jnp.ones((2, 3)))
        >>> jax.tree.map(jnp.shape, p)
        {'bias': (4,), 'weight': (3, 4)}
    """

    def init(key, x):
        n_in, dt = x.shape[-1], _param_dtype(x, dtype)
        kw, kb = _random.split(key)
        params = {"weight": _uniform(kw, (n_in, features), n_in, dt)}
        if use_bias:
            params["bias"] = _uniform(kb, (features,), n_in, dt)
        return params

    def fn(params, x):
        who = f"nn.dense layer {_context.current_layer(name or 'dense')!r}"
        w = require_param(params, "weight", who, "(in, out)")
        b = require_param(params, "bias", who, "(out,)") if use_bias else None
        if not hasattr(x, "shape") or jnp.ndim(x) < 1 or x.shape[-1] != w.shape[0]:
            raise ConfigError(
                f"{who}: the input {describe(x)} has {x.shape[-1] if jnp.ndim(x) else 'no'} features on "
                f"its last axis, but weight is {describe(w)}: it expects {w.shape[0]}. Feed this layer "
                f"inputs of shape (..., {w.shape[0]}), or re-initialise its params with model.init on "
                "an input of the right width."
            )
        y = x @ w
        return y + b if use_bias else y

    return layer(fn, init, name=name or "dense")


def _static_padding(padding):
    """``padding`` as a hashable static value (a string, or ``((lo, hi), ...)``); as given if neither."""
    if isinstance(padding, str):
        return padding
    try:
        return tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        return padding  # not a padding lax accepts: the convolution itself raises on the first call


def conv2d(
    features: int,
    kernel_size,
    stride=1,
    padding="SAME",
    use_bias: bool = True,
    *,
    dtype=None,
    name: str | None = None,
) -> Layer:
    """2-D convolution on NHWC inputs, ``weight (kh, kw, in, out)``, ``bias (out,)``.

    Args:
        features: output channels.
        kernel_size: ``k`` or ``(kh, kw)``.
        stride: ``s`` or ``(sh, sw)``.
        padding: ``"SAME"``, ``"VALID"`` or explicit ``[(lo, hi), (lo, hi)]``.
        use_bias: add ``bias``.
        dtype: parameter dtype; default: the input's float dtype.
        name: the name when no combinator names it.

    Examples:
        >>> conv = nn.conv2d(32, 3)
        >>> p = conv.init(jax.random.key(0), jnp.ones((64, 16, 16, 16)))
        >>> p["weight"].shape
        (3, 3, 16, 32)
    """
    kh, kw_ = positive_pair("nn.conv2d", "kernel_size", kernel_size)
    strides = positive_pair("nn.conv2d", "stride", stride)

    def init(key, x):
        n_in, dt = x.shape[-1], _param_dtype(x, dtype)
        fan_in = kh * kw_ * n_in
        k1, k2 = _random.split(key)
        params = {"weight": _uniform(k1, (kh, kw_, n_in, features), fan_in, dt)}
        if use_bias:
            params["bias"] = _uniform(k2, (features,), fan_in, dt)
        return params

    pads2 = _static_padding(padding)
    kind2 = _kinds.LayerKind("conv", {"weight": "weight", "bias": "bias"}, strides=strides, padding=pads2)

    def fn(params, x):
        _kinds.note(kind2)  # the per-example fast path reads strides and padding here, not from shapes
        y = jax.lax.conv_general_dilated(
            x, params["weight"], strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return y + params["bias"] if use_bias else y

    return layer(fn, init, name=name or "conv2d")


def conv1d(
    features: int,
    kernel_size: int,
    stride: int = 1,
    padding="SAME",
    use_bias: bool = True,
    *,
    dtype=None,
    name: str | None = None,
) -> Layer:
    """1-D convolution on NWC inputs ``(batch, length, channels)``, ``weight (k, in, out)``, ``bias (out,)``.

    Args:
        features: output channels.
        kernel_size: the kernel length ``k``, a positive int.
        stride: a positive int.
        padding: ``"SAME"``, ``"VALID"`` or explicit ``[(lo, hi)]``.
        use_bias: add ``bias``.
        dtype: parameter dtype; default: the input's float dtype.
        name: the name when no combinator names it.

    Examples:
        >>> conv = nn.conv1d(8, 3)
        >>> p = conv.init(jax.random.key(0), jnp.ones((4, 10, 2)))
        >>> p["weight"].shape, conv.apply(p, jnp.ones((4, 10, 2))).shape
        ((3, 2, 8), (4, 10, 8))
    """
    what = "nn.conv1d" + (f" {name!r}" if name else "")
    for arg, v in (("kernel_size", kernel_size), ("stride", stride), ("features", features)):
        if not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0):
            raise ConfigError(f"{what}: {arg} must be a positive int, got {v!r}.")
    explicit = (
        isinstance(padding, (tuple, list))
        and len(padding) == 1
        and isinstance(padding[0], (tuple, list))
        and len(padding[0]) == 2
        and all(isinstance(k, (int, np.integer)) for k in padding[0])
    )
    if not (padding in ("SAME", "VALID") or explicit):
        raise ConfigError(f"{what}: padding must be 'SAME', 'VALID' or [(lo, hi)] ints, got {padding!r}.")
    pads = padding if isinstance(padding, str) else [tuple(padding[0])]
    kind1 = _kinds.LayerKind(
        "conv", {"weight": "weight", "bias": "bias"}, strides=(int(stride),), padding=_static_padding(pads)
    )

    def check(x):
        if not hasattr(x, "shape") or len(x.shape) != 3:
            raise ConfigError(f"{what}: expects NWC input (batch, length, channels), got {describe(x)}.")

    def init(key, x):
        check(x)
        n_in, dt = x.shape[-1], _param_dtype(x, dtype)
        fan_in = kernel_size * n_in
        k1, k2 = _random.split(key)
        params = {"weight": _uniform(k1, (kernel_size, n_in, features), fan_in, dt)}
        if use_bias:
            params["bias"] = _uniform(k2, (features,), fan_in, dt)
        return params

    def fn(params, x):
        check(x)
        w = params["weight"]
        if x.shape[-1] != w.shape[1]:
            raise ConfigError(
                f"{what}: the input has {x.shape[-1]} channels (shape {tuple(x.shape)}) but weight "
                f"{tuple(w.shape)} expects {w.shape[1]}."
            )
        _kinds.note(kind1)  # the per-example fast path reads stride and padding here, not from shapes
        y = jax.lax.conv_general_dilated(x, w, (stride,), pads, dimension_numbers=("NWC", "WIO", "NWC"))
        return y + params["bias"] if use_bias else y

    return layer(fn, init, name=name or "conv1d")


def embedding(num_embeddings: int, features: int, *, dtype=jnp.float32, name: str | None = None) -> Layer:
    """Lookup table ``weight[ids]``, ``weight (num_embeddings, features)``, N(0, 1) init.

    Integer ids need no gradient, so a hook sees ``grad_input=None``.

    Examples:
        >>> emb = nn.embedding(10, 4)
        >>> emb.apply(emb.init(jax.random.key(0)), jnp.array([1, 2])).shape
        (2, 4)
    """

    def init(key, *inputs):
        del inputs
        return {"weight": _random.normal(key, (num_embeddings, features), dtype)}

    def fn(params, ids):
        return jnp.take(params["weight"], ids, axis=0)

    return layer(fn, init, name=name or "embedding")


def layer_norm(
    eps: float = 1e-5, use_scale: bool = True, use_bias: bool = True, *, name: str | None = None
) -> Layer:
    """Normalises the last axis to zero mean and unit variance, then ``* scale + bias``.

    Examples:
        >>> ln = nn.layer_norm()
        >>> jax.tree.map(jnp.shape, ln.init(jax.random.key(0), jnp.ones((2, 5))))
        {'bias': (5,), 'scale': (5,)}
    """

    def init(key, x):
        del key
        d, dt = x.shape[-1], _param_dtype(x, None)
        params = {}
        if use_scale:
            params["scale"] = jnp.ones((d,), dt)
        if use_bias:
            params["bias"] = jnp.zeros((d,), dt)
        return params

    def normalize(params, x):
        del params
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + eps)

    def fn(params, x):
        _kinds.note(_kinds.AffineNorm(normalize))  # y = normalize(x) * scale + bias
        y = normalize(params, x)
        if use_scale:
            y = y * params["scale"]
        if use_bias:
            y = y + params["bias"]
        return y

    return layer(fn, init, name=name or "layer_norm")
