"""Multi-head dot-product attention as named child layers: ``q``, ``k``, ``v``, ``dot_product``, ``out``.

Contract: ``multi_head_attention`` is a combinator, like ``serial``: it makes no record of its
own, and each of its parts is a hookable call named under the attention's path
(``"attn/q"`` inside ``serial(attn=...)``; ``"multi_head_attention/q"``, or ``name/q``, when
it is used alone). ``q``, ``k``, ``v`` and ``out`` are ``nn.dense`` layers (so their records,
parameter layouts and per-example fast paths are dense's); ``dot_product`` is the
parameter-less ``softmax(q k^T / sqrt(head_dim) + mask) v`` on per-head arrays
``(batch, length, heads, head_dim)``, whose record has ``input = (q, k, v)``. Masks are
static (``causal=True``) or an array keyword (``mask=``), ``True`` where attention is allowed;
a query with every key masked attends uniformly (no NaN). Inputs are ``(batch, length,
features)``; bad shapes and dtypes raise ``ConfigError`` naming the layer and the argument.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _context
from .._errors import ConfigError
from . import _random
from ._layer import Layer, layer
from ._linear import dense
from ._linear import describe as _describe

_PARTS = ("q", "k", "v", "out")


def _dot_product(causal: bool):
    def fn(params, q, k, v, *, mask=None):
        del params
        scale = 1.0 / math.sqrt(q.shape[-1])
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        allowed = None
        if causal:
            allowed = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        if mask is not None:
            allowed = mask if allowed is None else jnp.logical_and(allowed, mask)
        if allowed is not None:
            logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)

    return fn


def multi_head_attention(
    num_heads: int,
    features: int | None = None,
    out_features: int | None = None,
    *,
    causal: bool = False,
    use_bias: bool = True,
    dtype=None,
    name: str | None = None,
) -> Layer:
    """Multi-head attention: ``apply(params, x)`` (self) or ``apply(params, x, context)`` (cross).

    ``q = x @ Wq``, ``k = context @ Wk``, ``v = context @ Wv`` (``context`` defaults to ``x``),
    split into ``num_heads`` heads of ``features // num_heads``; each head computes
    ``softmax(q k^T / sqrt(head_dim)) v``, and the heads, concatenated, go through ``out``.
    ``params`` is ``{"q", "k", "v", "out"}``, each a dense layer's ``{"weight", "bias"}``.

    Args:
        num_heads: number of heads; it must divide ``features``.
        features: the q/k/v width; default: ``x``'s last axis.
        out_features: the output width; default: ``x``'s last axis.
        causal: query ``i`` attends only to keys ``j <= i``.
        use_bias: the projections have biases.
        dtype: parameter dtype; default: the input's float dtype.
        name: the prefix of the parts' names when no combinator names the layer
            (default ``"multi_head_attention"``).

    ``apply(params, x, context=None, *, mask=None)``: ``x`` is ``(batch, q_len, d)``,
    ``context`` ``(batch, kv_len, d_kv)``; ``mask`` is boolean, ``True`` where attention is
    allowed: ``(batch, kv_len)`` (padding) or broadcastable to ``(batch, num_heads, q_len,
    kv_len)``; it combines with ``causal``. Other keyword arguments are ignored.

    Examples:
        >>> attn = nn.multi_head_attention(4, causal=True)
        >>> x = jnp.ones((2, 6, 16))
        >>> params = attn.init(jax.random.key(0), x)
        >>> sorted(params), params["q"]["weight"].shape
        (['k', 'out', 'q', 'v'], (16, 16))
        >>> attn.apply(params, x, mask=jnp.ones((2, 6), bool)).shape
        (2, 6, 16)
    """
    what = "nn.multi_head_attention" + (f" {name!r}" if name else "")
    if not (isinstance(num_heads, (int, np.integer)) and not isinstance(num_heads, bool) and num_heads > 0):
        raise ConfigError(f"{what}: num_heads must be a positive int, got {num_heads!r}.")
    for arg, v in (("features", features), ("out_features", out_features)):
        if v is not None and not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0):
            raise ConfigError(f"{what}: {arg} must be a positive int or None, got {v!r}.")
    if features is not None and features % num_heads:
        raise ConfigError(
            f"{what}: num_heads={num_heads} must divide features={features} (each head gets "
            "features // num_heads); change one of them."
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise ConfigError(f"{what}: causal must be a bool, got {causal!r}.")
    prefix = name or "multi_head_attention"
    if "/" in prefix:
        raise ConfigError(f"{what}: the name {prefix!r} contains '/', which separates nested names.")
    core = layer(_dot_product(bool(causal)), name="dot_product")

    def check_inputs(x, context):
        if not hasattr(x, "shape") or len(x.shape) != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ConfigError(
                f"{what}: x must be a float array (batch, q_len, features), got {_describe(x)}."
            )
        if context is not None:
            if (
                not hasattr(context, "shape")
                or len(context.shape) != 3
                or not jnp.issubdtype(context.dtype, jnp.floating)
            ):
                raise ConfigError(
                    f"{what}: context must be a float array (batch, kv_len, features), "
                    f"got {_describe(context)}."
                )
            if context.shape[0] != x.shape[0]:
                raise ConfigError(
                    f"{what}: context has batch {context.shape[0]} ({_describe(context)}) but x has "
                    f"batch {x.shape[0]} ({_describe(x)}); expected the same batch size."
                )
        width = features if features is not None else x.shape[-1]
        if width % num_heads:
            raise ConfigError(
                f"{what}: num_heads={num_heads} must divide features={width} (from x's last axis, "
                f"{_describe(x)}); pass features= or change num_heads."
            )
        return width

    def init(key, x, context=None):
        width = check_inputs(x, context)
        src = x if context is None else context
        dt = dtype if dtype is not None else (x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else None)
        mid = jax.ShapeDtypeStruct((*x.shape[:-1], width), dt or jnp.float32)
        n_out = out_features if out_features is not None else x.shape[-1]
        kq, kk, kv, ko = _random.split(key, 4)
        return {
            "q": dense(width, use_bias, dtype=dtype).init(kq, x),
            "k": dense(width, use_bias, dtype=dtype).init(kk, src),
            "v": dense(width, use_bias, dtype=dtype).init(kv, src),
            "out": dense(n_out, use_bias, dtype=dtype).init(ko, mid),
        }

    def check_params(params, x, src):
        for part, inp in (("q", x), ("k", src), ("v", src)):
            w = params[part].get("weight") if isinstance(params[part], dict) else None
            if w is None or len(w.shape) != 2 or w.shape[0] != inp.shape[-1] or w.shape[1] % num_heads:
                got = _describe(w) if w is not None else repr(params[part])
                raise ConfigError(
                    f"{what}: params[{part!r}]['weight'] must be (in, features) with in = "
                    f"{inp.shape[-1]} (the input's last axis) and features divisible by "
                    f"num_heads={num_heads}; got {got}. Were these params made by init on another input?"
                )

    def check_mask(mask, b, tq, tk):
        if mask is None:
            return None
        shape = tuple(mask.shape) if hasattr(mask, "shape") and hasattr(mask, "dtype") else None
        full = (b, num_heads, tq, tk)
        if shape is None or np.dtype(mask.dtype) != np.bool_:
            raise ConfigError(
                f"{what}: mask must be a boolean array, True where attention is allowed: (batch, "
                f"kv_len) = {(b, tk)} or broadcastable to (batch, heads, q_len, kv_len) = {full}; "
                f"got {_describe(mask)}."
            )
        mask = jnp.asarray(mask)
        if shape == (b, tk):
            return mask[:, None, None, :]
        if len(shape) == 4 and all(s in (1, f) for s, f in zip(shape, full)):
            return mask
        raise ConfigError(
            f"{what}: mask has {_describe(mask)}; expected (batch, kv_len) = {(b, tk)} or a shape "
            f"broadcastable to (batch, heads, q_len, kv_len) = {full}."
        )

    def apply(params, x, context=None, *, mask=None, **kwargs):
        del kwargs  # keyword arguments meant for other layers (key=, deterministic=, ...)
        width = check_inputs(x, context)
        if not isinstance(params, dict) or set(params) != set(_PARTS):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ConfigError(f"{what}: params must be {{'q', 'k', 'v', 'out'}} (made by init), got {got}.")
        src = x if context is None else context
        check_params(params, x, src)
        b, tq, tk = x.shape[0], x.shape[1], src.shape[1]
        mask = check_mask(mask, b, tq, tk)
        parts = {p: dense(width, use_bias) for p in ("q", "k", "v")}
        with contextlib.ExitStack() as stack:
            if not _context.layer_path(""):  # used alone: its own name prefixes the parts'
                stack.enter_context(_context.name_scope(prefix))
            heads = {}
            for part, inp in (("q", x), ("k", src), ("v", src)):
                with _context.name_scope(part):
                    h = parts[part].apply(params[part], inp)
                heads[part] = h.reshape(*h.shape[:2], num_heads, h.shape[-1] // num_heads)
            kw = {} if mask is None else {"mask": mask}
            with _context.name_scope("dot_product"):
                o = core.apply({}, heads["q"], heads["k"], heads["v"], **kw)
            o = o.reshape(b, tq, -1)
            with _context.name_scope("out"):
                n_out = params["out"]["weight"].shape[-1]
                return dense(n_out, use_bias).apply(params["out"], o)

    return Layer(init, apply)
