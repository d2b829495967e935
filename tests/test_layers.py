"""Every layer of vjpkit.nn: forward values, records, gradients, weight sharing, naming.

References are independent of vjpkit's rule: numpy re-implementations of each layer's forward,
``jax.vjp`` of the plain ``layer.apply`` (plain JAX outside vjpkit transforms), hand-chained
vjps, ``jax.test_util.check_grads`` and ``jax.grad``. Records are collected on the host with
``vk.on_host``; every test runs with and without ``jit`` through the ``maybe_jit`` fixture.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

RTOL, ATOL = 1e-5, 1e-6
EPS = 1e-2  # check_grads' finite-difference step: float32 round-off swamps the default 1e-4


# ----------------------------------------------------------------------------- helpers


def _normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    # numpy's generator: jax.random compiles a program per new shape, which dominates eager runtime
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jnp.asarray(data).astype(dtype)


def _spaced(seed: int, shape) -> jax.Array:
    """Shuffled values 0.2 apart and at least 0.1 from 0: no ties in a max, no input at a relu kink,
    even after check_grads' finite-difference steps."""
    n = math.prod(shape)
    values = (np.random.default_rng(seed).permutation(n) - n // 2) * 0.2 + 0.1
    return jnp.asarray(values.reshape(shape).astype(np.float32))


def _rand_like(tree: Any, seed: int = 7) -> Any:
    """Random normal values with the structure, shapes and dtypes of ``tree``."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [_normal(seed + i, leaf.shape, leaf.dtype) for i, leaf in enumerate(leaves)]
    )


def _params(layer: nn.Layer, *example_inputs, seed: int = 7) -> Any:
    """Generic params for ``layer`` (init's structure, random values: layer_norm is not 1 and 0)."""
    return _rand_like(jax.eval_shape(layer.init, jax.random.key(0), *example_inputs), seed)


def _hooked_grad(loss: Callable, args: tuple, argnums, maybe_jit, glob: str = "*"):
    """Runs vk.grad with an on_host hook on ``glob``; returns (grads, records in delivery order)."""
    records: list[vk.Cotangents] = []
    grads = maybe_jit(vk.grad(loss, argnums=argnums, hooks={glob: vk.on_host(records.append)}))(*args)
    jax.block_until_ready(grads)
    return grads, records


def _by_key(records) -> dict[str, vk.Cotangents]:
    out = {rec.key: rec for rec in records}
    assert len(out) == len(records), f"duplicate record keys: {[r.key for r in records]}"
    return out


def _check_record(rec, *, params, inp, output, grad_output, grad_input, grad_params, rtol=RTOL, atol=ATOL):
    tree_allclose(rec.params, params, rtol=0, atol=0)
    # a computed input (a layer after another) is the compiled program's value: equal to the
    # eagerly chained reference up to rounding (fused or not, FMA or not), not bit for bit
    tree_allclose(rec.input, inp, rtol=1e-6, atol=1e-7)
    tree_allclose(rec.output, output, rtol=rtol, atol=atol)
    tree_allclose(rec.grad_output, grad_output, rtol=rtol, atol=atol)
    if grad_input is None:
        assert rec.grad_input is None, f"{rec.key}: grad_input should be None, got {rec.grad_input!r}"
    else:
        tree_allclose(rec.grad_input, grad_input, rtol=rtol, atol=atol)
    tree_allclose(rec.grad_params, grad_params, rtol=rtol, atol=atol)


# ------------------------------------------------------------------- numpy references


def _same_pads(size: int, k: int, s: int) -> tuple[int, int]:
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def _pads(x_shape, window, stride, padding):
    if padding == "SAME":
        return [_same_pads(x_shape[1], window[0], stride[0]), _same_pads(x_shape[2], window[1], stride[1])]
    if padding == "VALID":
        return [(0, 0), (0, 0)]
    return [tuple(p) for p in padding]


def _np_conv(x, w, b, stride, padding):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kh, kw = w.shape[:2]
    sh, sw = stride
    (pt, pb), (pl, pr) = _pads(x.shape, (kh, kw), stride, padding)
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    oh, ow = (xp.shape[1] - kh) // sh + 1, (xp.shape[2] - kw) // sw + 1
    out = np.zeros((x.shape[0], oh, ow, w.shape[3]))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, i * sh : i * sh + kh, j * sw : j * sw + kw, :]
            out[:, i, j, :] = np.einsum("nhwc,hwco->no", patch, w)
    return out + (0.0 if b is None else np.asarray(b, np.float64))


def _np_pool(x, window, stride, padding, kind):
    x = np.asarray(x, np.float64)
    (pt, pb), (pl, pr) = _pads(x.shape, window, stride, padding)
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=fill)
    (wh, ww), (sh, sw) = window, stride
    oh, ow = (xp.shape[1] - wh) // sh + 1, (xp.shape[2] - ww) // sw + 1
    out = np.zeros((x.shape[0], oh, ow, x.shape[3]))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, i * sh : i * sh + wh, j * sw : j * sw + ww, :]
            out[:, i, j, :] = patch.max(axis=(1, 2)) if kind == "max" else patch.sum(axis=(1, 2)) / (wh * ww)
    return out


_erf = np.vectorize(math.erf)


def _np_gelu(x, approximate):
    x = np.asarray(x, np.float64)
    if approximate:
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _np_layer_norm(p, x, eps=1e-5):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(p["bias"])


def _np_dense(p, x):
    y = np.asarray(x, np.float64) @ np.asarray(p["weight"], np.float64)
    return y + np.asarray(p["bias"], np.float64) if "bias" in p else y


def _custom_fn(params, x):
    return params["w"] * jnp.sin(x) + params["b"]


def _custom_init(key, x):
    d = x.shape[-1]
    return {"w": jax.random.normal(key, (d,), jnp.float32), "b": jnp.zeros((d,), jnp.float32)}


def _conv_ref(stride, padding, bias=True):
    def ref(p, x):
        return _np_conv(x, p["weight"], p.get("bias") if bias else None, stride, padding)

    return ref


# --------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[], nn.Layer]
    name: str  # the record name of a standalone call
    shape: tuple
    ref: Callable[[Any, np.ndarray], np.ndarray]  # numpy forward reference
    order: int = 2  # check_grads order; 1 marks a piecewise layer (kinks, ties): spaced inputs
    kwargs: Callable[[], dict] = dict


CASES = [
    Case("dense", lambda: nn.dense(5), "dense", (3, 4), _np_dense),
    Case("dense_nobias", lambda: nn.dense(5, use_bias=False), "dense", (3, 4), _np_dense),
    Case("dense_3d", lambda: nn.dense(2), "dense", (2, 3, 4), _np_dense),
    Case("conv_same_s1", lambda: nn.conv2d(3, 3), "conv2d", (2, 5, 5, 2), _conv_ref((1, 1), "SAME")),
    Case(
        "conv_valid_s1",
        lambda: nn.conv2d(3, (3, 2), padding="VALID"),
        "conv2d",
        (2, 5, 6, 2),
        _conv_ref((1, 1), "VALID"),
    ),
    Case(
        "conv_same_s2",
        lambda: nn.conv2d(3, 3, stride=2),
        "conv2d",
        (2, 7, 6, 2),
        _conv_ref((2, 2), "SAME"),
    ),
    Case(
        "conv_valid_s2",
        lambda: nn.conv2d(4, 3, stride=2, padding="VALID"),
        "conv2d",
        (1, 7, 7, 3),
        _conv_ref((2, 2), "VALID"),
    ),
    Case(
        "conv_nobias",
        lambda: nn.conv2d(2, 2, stride=(1, 2), use_bias=False),
        "conv2d",
        (1, 4, 5, 2),
        _conv_ref((1, 2), "SAME", bias=False),
    ),
    Case(
        "max_pool",
        lambda: nn.max_pool(2),
        "max_pool",
        (2, 4, 6, 3),
        lambda p, x: _np_pool(x, (2, 2), (2, 2), "VALID", "max"),
        order=1,
    ),
    Case(
        "max_pool_overlap_same",
        lambda: nn.max_pool(3, stride=2, padding="SAME"),
        "max_pool",
        (1, 5, 6, 2),
        lambda p, x: _np_pool(x, (3, 3), (2, 2), "SAME", "max"),
        order=1,
    ),
    Case(
        "max_pool_uneven_same",
        lambda: nn.max_pool((2, 3), padding="SAME"),
        "max_pool",
        (2, 5, 7, 3),
        lambda p, x: _np_pool(x, (2, 3), (2, 3), "SAME", "max"),
        order=1,
    ),
    Case(
        "max_pool_uneven_valid",
        lambda: nn.max_pool(2),
        "max_pool",
        (1, 5, 7, 2),
        lambda p, x: _np_pool(x, (2, 2), (2, 2), "VALID", "max"),
        order=1,
    ),
    Case(
        "max_pool_explicit_overlap",
        lambda: nn.max_pool(2, stride=1, padding=[(1, 0), (0, 1)]),
        "max_pool",
        (1, 4, 3, 2),
        lambda p, x: _np_pool(x, (2, 2), (1, 1), [(1, 0), (0, 1)], "max"),
        order=1,
    ),
    Case(
        "avg_pool_explicit",
        lambda: nn.avg_pool(2, padding=[(1, 1), (0, 1)]),
        "avg_pool",
        (2, 4, 5, 3),
        lambda p, x: _np_pool(x, (2, 2), (2, 2), [(1, 1), (0, 1)], "avg"),
    ),
    Case(
        "avg_pool",
        lambda: nn.avg_pool(2),
        "avg_pool",
        (2, 4, 6, 3),
        lambda p, x: _np_pool(x, (2, 2), (2, 2), "VALID", "avg"),
    ),
    Case(
        "avg_pool_overlap_same",
        lambda: nn.avg_pool((3, 2), stride=(2, 1), padding="SAME"),
        "avg_pool",
        (1, 5, 4, 2),
        lambda p, x: _np_pool(x, (3, 2), (2, 1), "SAME", "avg"),
    ),
    Case(
        "flatten",
        lambda: nn.flatten(),
        "flatten",
        (2, 3, 2, 2),
        lambda p, x: np.asarray(x).reshape(2, -1),
    ),
    Case("relu", lambda: nn.relu(), "relu", (3, 5), lambda p, x: np.maximum(np.asarray(x), 0), order=1),
    Case("tanh", lambda: nn.tanh(), "tanh", (3, 5), lambda p, x: np.tanh(np.asarray(x, np.float64))),
    Case("gelu_exact", lambda: nn.gelu(), "gelu", (3, 5), lambda p, x: _np_gelu(x, False)),
    Case("gelu_approx", lambda: nn.gelu(approximate=True), "gelu", (3, 5), lambda p, x: _np_gelu(x, True)),
    Case(
        "sigmoid",
        lambda: nn.sigmoid(),
        "sigmoid",
        (3, 5),
        lambda p, x: 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64))),
    ),
    Case("layer_norm", lambda: nn.layer_norm(), "layer_norm", (3, 6), _np_layer_norm),
    Case(
        "dropout",
        lambda: nn.dropout(0.4),
        "dropout",
        (4, 6),
        None,  # random: its forward is checked by test_dropout_forward
        order=1,
        kwargs=lambda: {"key": jax.random.key(11)},
    ),
    Case(
        "custom",
        lambda: nn.layer(_custom_fn, _custom_init, name="custom"),
        "custom",
        (3, 4),
        lambda p, x: np.asarray(p["w"]) * np.sin(np.asarray(x, np.float64)) + np.asarray(p["b"]),
    ),
]
CASE_IDS = [c.id for c in CASES]
PARAM_CASES = [c for c in CASES if c.id.startswith(("dense", "conv", "layer_norm", "custom"))]
# one case per layer kind for the (slower) chained test; the other cases differ only in shapes/options
_CHAIN_IDS = ("dense", "conv_same_s2", "max_pool_overlap_same", "avg_pool", "flatten", "relu", "tanh")
_CHAIN_IDS += ("gelu_exact", "sigmoid", "layer_norm", "dropout", "custom")
CHAIN_CASES = [c for c in CASES if c.id in _CHAIN_IDS]
assert len(CHAIN_CASES) == len(_CHAIN_IDS)


def _setup(case: Case):
    layer = case.make()
    x = _spaced(1, case.shape) if case.order == 1 else _normal(1, case.shape)
    params = _params(layer, x)
    kw = case.kwargs()
    y = layer.apply(params, x, **kw)
    w_out = _normal(2, y.shape)
    return layer, params, x, kw, w_out


def _scale_layer() -> nn.Layer:
    """A learnable elementwise scale, put before a layer so that its input needs a gradient."""

    def init(key, x):
        return {"s": 1.0 + 0.5 * jax.random.normal(key, x.shape[1:], jnp.float32)}

    return nn.layer(lambda p, x: x * p["s"], init, name="pre")


# ------------------------------------------------------------------------------- tests


def test_every_layer_is_covered():
    """A new layer in vjpkit.nn must get a case here (or a dedicated test below)."""
    from_cases = {c.name for c in CASES}
    dedicated = {"embedding", "serial", "residual", "layer"}  # tests below
    # tested in test_transformer_layers.py
    dedicated |= {"multi_head_attention", "rms_norm", "batch_norm", "conv1d", "gru", "rnn"}
    public = {n for n in nn.__all__ if n != "Layer"}
    missing = public - (from_cases | dedicated)
    assert not missing, f"layers without a test case: {sorted(missing)}"


@pytest.mark.parametrize("case", [c for c in CASES if c.ref is not None], ids=lambda c: c.id)
def test_forward_matches_numpy(case, maybe_jit):
    layer, params, x, kw, _ = _setup(case)
    y = maybe_jit(layer.apply)(params, x, **kw)
    assert y.dtype == x.dtype
    expected = case.ref(params, x)
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_record_input_and_params_need_grad(case, maybe_jit):
    """grad w.r.t. (params, x): the record equals jax.vjp of the plain layer at grad_output = w_out."""
    layer, params, x, kw, w_out = _setup(case)

    def loss(p, x, kw):
        return jnp.sum(w_out * layer.apply(p, x, **kw))

    grads, records = _hooked_grad(loss, (params, x, kw), (0, 1), maybe_jit)
    assert [r.key for r in records] == [case.name]
    (rec,) = records
    assert (rec.name, rec.call) == (case.name, 0)

    y, vjp_fn = jax.vjp(lambda p, x: layer.apply(p, x, **kw), params, x)
    gp, gx = vjp_fn(w_out)
    _check_record(rec, params=params, inp=x, output=y, grad_output=w_out, grad_input=gx, grad_params=gp)
    tree_allclose(grads, (gp, gx), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", CHAIN_CASES, ids=lambda c: c.id)
def test_record_behind_another_layer(case, maybe_jit):
    """A layer below makes the input need a gradient; grad_input is what that layer receives."""
    layer, params, x, kw, w_out = _setup(case)
    pre = _scale_layer()
    pre_params = _params(pre, x, seed=3)
    all_params = {"pre": pre_params, "layer": params}

    def loss(ps, x, kw):
        h = pre.apply(ps["pre"], x)
        return jnp.sum(w_out * layer.apply(ps["layer"], h, **kw))

    grads, records = _hooked_grad(loss, (all_params, x, kw), 0, maybe_jit)
    assert [r.key for r in records] == [case.name, "pre"]  # backward order
    recs = _by_key(records)

    h, vjp_pre = jax.vjp(pre.apply, pre_params, x)
    y, vjp_layer = jax.vjp(lambda p, h: layer.apply(p, h, **kw), params, h)
    gp, gh = vjp_layer(w_out)
    gpre, _ = vjp_pre(gh)
    _check_record(
        recs[case.name], params=params, inp=h, output=y, grad_output=w_out, grad_input=gh, grad_params=gp
    )
    _check_record(
        recs["pre"], params=pre_params, inp=x, output=h, grad_output=gh, grad_input=None, grad_params=gpre
    )
    tree_allclose(grads, {"pre": gpre, "layer": gp}, rtol=RTOL, atol=ATOL)
    tree_allclose(grads, jax.grad(loss)(all_params, x, kw), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", PARAM_CASES, ids=lambda c: c.id)
def test_record_data_input_has_no_grad_input(case, maybe_jit):
    """The data batch entering the first layer needs no gradient: grad_input is None."""
    layer, params, x, kw, w_out = _setup(case)

    def loss(p, x):
        return jnp.sum(w_out * layer.apply(p, x, **kw))

    grads, records = _hooked_grad(loss, (params, x), 0, maybe_jit)
    (rec,) = records
    y, vjp_fn = jax.vjp(lambda p: layer.apply(p, x, **kw), params)
    (gp,) = vjp_fn(w_out)
    _check_record(rec, params=params, inp=x, output=y, grad_output=w_out, grad_input=None, grad_params=gp)
    tree_allclose(grads, gp, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_check_grads(case):
    layer, params, x, kw, _ = _setup(case)
    check_grads(lambda p, x: layer.apply(p, x, **kw), (params, x), order=case.order, modes=["rev"], eps=EPS)


def test_param_init():
    """Documented layouts; PyTorch-style uniform(+-1/sqrt(fan_in)); dtype follows the input."""
    key = jax.random.key(0)
    layers = {
        "dense": (nn.dense(4), (2, 5)),
        "dense_nobias": (nn.dense(4, use_bias=False), (2, 5)),
        "conv": (nn.conv2d(8, (3, 2)), (2, 6, 6, 3)),
        "ln": (nn.layer_norm(), (2, 5)),
        "ln_noscale": (nn.layer_norm(use_scale=False), (2, 5)),
        "emb": (nn.embedding(10, 3), (4,)),
    }

    def init_all(key, dtype):
        out = {}
        for name, (layer, shape) in layers.items():
            dt = jnp.int32 if name == "emb" else dtype
            out[name] = layer.init(key, jnp.zeros(shape, dt))
        return out

    expected_shapes = {
        "dense": {"weight": (5, 4), "bias": (4,)},
        "dense_nobias": {"weight": (5, 4)},
        "conv": {"weight": (3, 2, 3, 8), "bias": (8,)},
        "ln": {"scale": (5,), "bias": (5,)},
        "ln_noscale": {"bias": (5,)},
        "emb": {"weight": (10, 3)},
    }
    for dtype in (jnp.float32, jnp.bfloat16):
        specs = jax.eval_shape(functools.partial(init_all, dtype=dtype), key)
        assert jax.tree.map(lambda a: a.shape, specs) == expected_shapes
        for path, spec in jax.tree_util.tree_flatten_with_path(specs)[0]:
            want = jnp.float32 if path[0].key == "emb" else dtype  # embedding: float32 unless told
            assert spec.dtype == want, (path, spec.dtype)
    assert jax.eval_shape(nn.dense(2).init, key, jnp.zeros((2, 3), jnp.int32))["weight"].dtype == jnp.float32
    bf16_emb = jax.eval_shape(nn.embedding(4, 2, dtype=jnp.bfloat16).init, key)
    assert bf16_emb["weight"].dtype == jnp.bfloat16

    p = jax.jit(functools.partial(init_all, dtype=jnp.float32))(key)  # one compilation for all
    for name, fan_in in [("dense", 5), ("conv", 3 * 2 * 3)]:
        for leaf in jax.tree.leaves(p[name]):
            leaf = np.asarray(leaf, np.float64)
            bound = 1.0 / math.sqrt(fan_in)
            assert np.all(np.abs(leaf) <= bound) and leaf.std() > bound / 4, name
    tree_allclose(p["ln"], {"scale": jnp.ones((5,)), "bias": jnp.zeros((5,))}, rtol=0, atol=0)
    assert 0.3 < float(np.asarray(p["emb"]["weight"]).std()) < 3.0  # N(0, 1)


def test_dropout_forward(maybe_jit):
    rate = 0.3
    drop = nn.dropout(rate)
    x = _normal(1, (100, 100)) + 5.0  # no zeros in x
    k1, k2 = jax.random.key(1), jax.random.key(2)
    apply = maybe_jit(drop.apply)
    y1, y1_again, y2 = apply({}, x, key=k1), apply({}, x, key=k1), apply({}, x, key=k2)
    y1, x_np = np.asarray(y1), np.asarray(x)
    kept = y1 != 0
    np.testing.assert_allclose(y1[kept], x_np[kept] / (1 - rate), rtol=1e-6)
    assert abs((~kept).mean() - rate) < 0.03
    np.testing.assert_array_equal(y1, np.asarray(y1_again))
    assert (np.asarray(y2) != 0).tolist() != kept.tolist()
    tree_allclose(drop.apply({}, x, deterministic=True), x, rtol=0, atol=0)
    tree_allclose(nn.dropout(0.0).apply({}, x), x, rtol=0, atol=0)
    with pytest.raises(vk.ConfigError, match="key"):
        drop.apply({}, x)


def test_dropout_key_is_traced_argument(maybe_jit):
    """A key passed into the jitted step (not a constant) reaches the layer and the reference alike."""
    drop, fc = nn.dropout(0.5), nn.dense(3)
    x = _normal(1, (4, 5))
    p = _params(fc, x)
    w_out = _normal(2, (4, 3))

    def loss(p, x, key):
        return jnp.sum(w_out * fc.apply(p, drop.apply({}, x, key=key)))

    for seed in (0, 1):
        key = jax.random.key(seed)
        grads, records = _hooked_grad(loss, (p, x, key), (0, 1), maybe_jit)
        assert [r.key for r in records] == ["dense", "dropout"]
        recs = _by_key(records)
        h, vjp_d = jax.vjp(lambda x, key=key: drop.apply({}, x, key=key), x)
        y, vjp_fc = jax.vjp(fc.apply, p, h)
        gp, gh = vjp_fc(w_out)
        (gx,) = vjp_d(gh)
        _check_record(
            recs["dropout"], params={}, inp=x, output=h, grad_output=gh, grad_input=gx, grad_params={}
        )
        _check_record(
            recs["dense"], params=p, inp=h, output=y, grad_output=w_out, grad_input=gh, grad_params=gp
        )
        tree_allclose(grads, (gp, gx), rtol=RTOL, atol=ATOL)


def test_embedding_record_and_grads(maybe_jit):
    emb = nn.embedding(7, 4)
    ids = jnp.array([[1, 3, 3, 0, 6], [3, 1, 2, 2, 5]], jnp.int32)  # repeats: gradients accumulate
    params = _params(emb, ids)
    assert params["weight"].shape == (7, 4)
    w_out = _normal(2, (2, 5, 4))

    y = maybe_jit(emb.apply)(params, ids)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(params["weight"])[np.asarray(ids)])

    def loss(p, ids):
        return jnp.sum(w_out * emb.apply(p, ids))

    grads, records = _hooked_grad(loss, (params, ids), 0, maybe_jit)
    (rec,) = records
    assert rec.key == "embedding"
    y, vjp_fn = jax.vjp(lambda p: emb.apply(p, ids), params)
    (gp,) = vjp_fn(w_out)
    expected = np.zeros((7, 4), np.float64)
    np.add.at(expected, np.asarray(ids), np.asarray(w_out, np.float64))
    np.testing.assert_allclose(np.asarray(gp["weight"]), expected, rtol=1e-6, atol=1e-6)
    _check_record(rec, params=params, inp=ids, output=y, grad_output=w_out, grad_input=None, grad_params=gp)
    assert rec.input.dtype == np.int32
    tree_allclose(grads, gp, rtol=RTOL, atol=ATOL)
    check_grads(lambda p: emb.apply(p, ids), (params,), order=2, modes=["rev"], eps=EPS)


def test_embedding_then_dense(maybe_jit):
    """Integer ids into the first layer: the embedding's grad_input stays None behind a dense."""
    model = nn.serial(emb=nn.embedding(6, 3), fc=nn.dense(2))
    ids = jnp.array([0, 5, 5, 2], jnp.int32)
    params = _params(model, ids)
    w_out = _normal(2, (4, 2))

    def loss(p, ids):
        return jnp.sum(w_out * model.apply(p, ids))

    grads, records = _hooked_grad(loss, (params, ids), 0, maybe_jit)
    assert [r.key for r in records] == ["fc", "emb"]
    recs = _by_key(records)
    h, vjp_e = jax.vjp(lambda p: jnp.take(p["weight"], ids, axis=0), params["emb"])
    y, vjp_fc = jax.vjp(lambda p, h: h @ p["weight"] + p["bias"], params["fc"], h)
    gfc, gh = vjp_fc(w_out)
    (gemb,) = vjp_e(gh)
    _check_record(
        recs["fc"], params=params["fc"], inp=h, output=y, grad_output=w_out, grad_input=gh, grad_params=gfc
    )
    _check_record(
        recs["emb"],
        params=params["emb"],
        inp=ids,
        output=h,
        grad_output=gh,
        grad_input=None,
        grad_params=gemb,
    )
    tree_allclose(grads, {"emb": gemb, "fc": gfc}, rtol=RTOL, atol=ATOL)


def _bilinear() -> nn.Layer:
    def fn(p, a, b):
        return (a @ p["w"]) * b + jnp.sin(a).sum(-1, keepdims=True)

    def init(key, a, b):
        return {"w": jax.random.normal(key, (a.shape[-1], b.shape[-1]), jnp.float32)}

    return nn.layer(fn, init, name="bilinear")


@pytest.mark.parametrize("argnums", [(0, 1), (0, 1, 2), (0, 2)], ids=["a", "a_b", "b"])
def test_custom_layer_with_two_inputs(argnums, maybe_jit):
    """A tuple input: grad_input is a tuple with None for the inputs that need no gradient."""
    layer = _bilinear()
    a, b = _normal(1, (3, 4)), _normal(2, (3, 2))
    params = _params(layer, a, b)
    w_out = _normal(3, (3, 2))

    def loss(p, a, b):
        return jnp.sum(w_out * layer.apply(p, a, b))

    grads, records = _hooked_grad(loss, (params, a, b), argnums, maybe_jit)
    (rec,) = records
    assert rec.key == "bilinear"
    y, vjp_fn = jax.vjp(layer.apply, params, a, b)
    gp, ga, gb = vjp_fn(w_out)
    expected_gi = (ga if 1 in argnums else None, gb if 2 in argnums else None)
    _check_record(
        rec, params=params, inp=(a, b), output=y, grad_output=w_out, grad_input=expected_gi, grad_params=gp
    )
    tree_allclose(grads, tuple((gp, ga, gb)[i] for i in argnums), rtol=RTOL, atol=ATOL)
    check_grads(layer.apply, (params, a, b), order=2, modes=["rev"], eps=EPS)


def test_custom_layer_default_names():
    def my_layer(p, x):
        return x * p["s"]

    def init(key, x):
        return {"s": jnp.full((), 2.0, jnp.float32)}

    x = _normal(1, (2, 3))
    records = []
    for layer, expected in [
        (nn.layer(my_layer, init), "my_layer"),
        (nn.layer(lambda p, x: x * p["s"], init), "layer"),
        (nn.layer(my_layer, init, name="scaler"), "scaler"),
    ]:
        p = layer.init(jax.random.key(0), x)
        tree_allclose(layer.apply(p, x), 2.0 * x)
        g = vk.grad(
            lambda p, x, layer=layer: layer.apply(p, x).sum(), hooks={"*": vk.on_host(records.append)}
        )
        jax.block_until_ready(g(p, x))
        assert records[-1].name == expected
    assert nn.layer(my_layer).init(jax.random.key(0), x) == {}


# ----------------------------------------------------------------- whole models vs jax.grad


def _cnn():
    return nn.serial(
        conv1=nn.conv2d(4, 3),
        relu=nn.relu(),
        pool=nn.max_pool(2),
        conv2=nn.conv2d(6, 3, padding="VALID"),
        avg=nn.avg_pool(2),
        flat=nn.flatten(),
        fc=nn.dense(3),
    )


def _mlp():
    return nn.serial(
        fc1=nn.dense(8),
        ln=nn.layer_norm(),
        act=nn.gelu(),
        drop=nn.dropout(0.3),
        res=nn.residual(nn.serial(fc=nn.dense(8), act=nn.tanh())),
        out=nn.dense(3),
    )


@pytest.mark.parametrize(
    "make, shape, order",
    [
        (_cnn, (2, 12, 12, 1), ["fc", "flat", "avg", "conv2", "pool", "relu", "conv1"]),
        (_mlp, (5, 4), ["out", "res/act", "res/fc", "drop", "act", "ln", "fc1"]),
    ],
    ids=["cnn", "mlp"],
)
def test_model_hooked_grad_equals_jax_grad(make, shape, order, maybe_jit):
    model = make()
    x = _normal(1, shape)
    labels = _normal(2, (shape[0], 3))
    params = _params(model, x)
    key = jax.random.key(5)

    def loss(p, x, key):
        return jnp.mean((model.apply(p, x, key=key) - labels) ** 2)

    traced_seen = []

    def traced_observer(rec):
        traced_seen.append(rec.key)  # trace time: static metadata only
        return None

    records: list[vk.Cotangents] = []
    hooked = vk.grad(loss, hooks={"*": [traced_observer, vk.on_host(records.append)]})
    grads = maybe_jit(hooked)(params, x, key)
    jax.block_until_ready(grads)
    expected = jax.grad(loss)(params, x, key)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)

    assert traced_seen == order
    assert [r.key for r in records] == order
    recs = _by_key(records)
    for name, g in expected.items():
        # each layer is called once: its record's grad_params is the full gradient of its params
        leaves = {k: v for k, v in recs.items() if k == name or k.startswith(name + "/")}
        assert len(leaves) >= 1
        if name in recs:
            tree_allclose(recs[name].grad_params, g, rtol=1e-5, atol=1e-6)
        else:  # a residual block: its children carry the params
            for child, rec in leaves.items():
                expected_child = g.get(child.split("/", 1)[1], {})  # parameter-less: no entry
                tree_allclose(rec.grad_params, expected_child, rtol=1e-5, atol=1e-6)
    assert recs[order[-1]].grad_input is None  # the data batch


def test_residual_records_hand_chained(maybe_jit):
    """Inside a residual, the inner layer's grad_input is only its own branch's contribution."""
    model = nn.serial(pre=_scale_layer(), block=nn.residual(nn.serial(fc=nn.dense(4), act=nn.tanh())))
    x = _normal(1, (3, 4))
    params = _params(model, x)
    w_out = _normal(2, (3, 4))

    def loss(p, x):
        return jnp.sum(w_out * model.apply(p, x))

    grads, records = _hooked_grad(loss, (params, x), 0, maybe_jit)
    assert [r.key for r in records] == ["block/act", "block/fc", "pre"]
    recs = _by_key(records)
    pp, pf = params["pre"], params["block"]["fc"]
    h, vjp_pre = jax.vjp(lambda p, x: x * p["s"], pp, x)
    z, vjp_fc = jax.vjp(lambda p, h: h @ p["weight"] + p["bias"], pf, h)
    a, vjp_act = jax.vjp(jnp.tanh, z)
    tree_allclose(model.apply(params, x), h + a, rtol=RTOL, atol=ATOL)
    (gz,) = vjp_act(w_out)
    gfc, gh_branch = vjp_fc(gz)
    gh = w_out + gh_branch
    gpre, _ = vjp_pre(gh)
    _check_record(
        recs["block/act"], params={}, inp=z, output=a, grad_output=w_out, grad_input=gz, grad_params={}
    )
    _check_record(
        recs["block/fc"], params=pf, inp=h, output=z, grad_output=gz, grad_input=gh_branch, grad_params=gfc
    )
    _check_record(recs["pre"], params=pp, inp=x, output=h, grad_output=gh, grad_input=None, grad_params=gpre)
    tree_allclose(grads, {"pre": gpre, "block": {"fc": gfc}}, rtol=RTOL, atol=ATOL)


# -------------------------------------------------------------------------- weight sharing


def test_weight_sharing_two_calls(maybe_jit):
    model = nn.serial(fc=nn.dense(3), act=nn.tanh())
    x = _normal(1, (4, 3))
    params = _params(model, x)
    w_out = _normal(2, (4, 3))

    def loss(p, x):
        return jnp.sum(w_out * model.apply(p, model.apply(p, x)))

    grads, records = _hooked_grad(loss, (params, x), 0, maybe_jit)
    assert [r.key for r in records] == ["act#1", "fc#1", "act", "fc"]
    assert [(r.name, r.call) for r in records] == [("act", 1), ("fc", 1), ("act", 0), ("fc", 0)]
    recs = _by_key(records)

    pf = params["fc"]

    def fc(p, h):
        return h @ p["weight"] + p["bias"]

    z0, vjp_fc0 = jax.vjp(fc, pf, x)
    a0, vjp_act0 = jax.vjp(jnp.tanh, z0)
    z1, vjp_fc1 = jax.vjp(fc, pf, a0)
    a1, vjp_act1 = jax.vjp(jnp.tanh, z1)
    (gz1,) = vjp_act1(w_out)
    gp1, ga0 = vjp_fc1(gz1)
    (gz0,) = vjp_act0(ga0)
    gp0, _ = vjp_fc0(gz0)

    _check_record(
        recs["act#1"], params={}, inp=z1, output=a1, grad_output=w_out, grad_input=gz1, grad_params={}
    )
    _check_record(
        recs["fc#1"], params=pf, inp=a0, output=z1, grad_output=gz1, grad_input=ga0, grad_params=gp1
    )
    _check_record(recs["act"], params={}, inp=z0, output=a0, grad_output=ga0, grad_input=gz0, grad_params={})
    _check_record(recs["fc"], params=pf, inp=x, output=z0, grad_output=gz0, grad_input=None, grad_params=gp0)

    summed = jax.tree.map(lambda a, b: a + b, recs["fc"].grad_params, recs["fc#1"].grad_params)
    tree_allclose(grads["fc"], summed, rtol=RTOL, atol=ATOL)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=RTOL, atol=ATOL)
    tree_allclose(grads, {"fc": jax.tree.map(lambda a, b: a + b, gp0, gp1)}, rtol=RTOL, atol=ATOL)


def test_call_counter_resets_per_forward_pass(maybe_jit):
    """call counts from 0 in every forward pass: a second step gives the same keys again."""
    fc = nn.dense(3)
    x = _normal(1, (2, 3))
    p = _params(fc, x)
    records = []
    g = maybe_jit(
        vk.grad(lambda p, x: fc.apply(p, fc.apply(p, x)).sum(), hooks={"dense": vk.on_host(records.append)})
    )
    jax.block_until_ready([g(p, x), g(p, 2.0 * x), g(p, x)])
    assert [r.key for r in records] == ["dense#1", "dense"] * 3


# --------------------------------------------------------------------------------- bf16


def test_bf16_dense_records(maybe_jit):
    bf16 = jnp.bfloat16
    model = nn.serial(fc1=nn.dense(6), act=nn.tanh(), fc2=nn.dense(3))
    x = _normal(1, (4, 5), bf16)
    assert all(
        leaf.dtype == bf16 for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0), x))
    )
    params = _params(model, x)
    w_out = _normal(2, (4, 3), bf16)

    def loss(p, x):
        return jnp.sum((w_out * model.apply(p, x)).astype(jnp.float32))

    grads, records = _hooked_grad(loss, (params, x), (0, 1), maybe_jit)
    recs = _by_key(records)
    for rec in records:
        for field in ("output", "grad_output", "grad_input", "grad_params"):
            for leaf in jax.tree.leaves(getattr(rec, field)):
                assert leaf.dtype == bf16, f"{rec.key}.{field} is {leaf.dtype}"

    def fc(p, h):
        return h @ p["weight"] + p["bias"]

    z1, vjp1 = jax.vjp(fc, params["fc1"], x)
    a, vjp_act = jax.vjp(jnp.tanh, z1)
    z2, vjp2 = jax.vjp(fc, params["fc2"], a)
    gp2, ga = vjp2(w_out)
    (gz1,) = vjp_act(ga)
    gp1, gx = vjp1(gz1)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    _check_record(
        recs["fc2"],
        params=params["fc2"],
        inp=a,
        output=z2,
        grad_output=w_out,
        grad_input=ga,
        grad_params=gp2,
        **tol,
    )
    _check_record(
        recs["act"], params={}, inp=z1, output=a, grad_output=ga, grad_input=gz1, grad_params={}, **tol
    )
    _check_record(
        recs["fc1"],
        params=params["fc1"],
        inp=x,
        output=z1,
        grad_output=gz1,
        grad_input=gx,
        grad_params=gp1,
        **tol,
    )
    tree_allclose(grads, jax.grad(loss, argnums=(0, 1))(params, x), **tol)
    assert all(leaf.dtype == bf16 for leaf in jax.tree.leaves(grads))


# ------------------------------------------------------------------------- serial naming


def _record_names(model, params, x, maybe_jit, **kw):
    records = []
    g = maybe_jit(
        vk.grad(lambda p, x: jnp.sum(model.apply(p, x, **kw)), hooks={"*": vk.on_host(records.append)})
    )
    jax.block_until_ready(g(params, x))
    return [r.key for r in records]


def test_serial_nested_names_and_params(maybe_jit):
    model = nn.serial(
        block1=nn.serial(fc1=nn.dense(4), act=nn.relu()),
        block2=nn.serial(fc1=nn.dense(4), inner=nn.serial(fc=nn.dense(2))),
    )
    x = _normal(1, (3, 5))
    params = _params(model, x)
    assert jax.tree.map(jnp.shape, jax.eval_shape(model.init, jax.random.key(0), x)) == {
        "block1": {"fc1": {"weight": (5, 4), "bias": (4,)}},
        "block2": {
            "fc1": {"weight": (4, 4), "bias": (4,)},
            "inner": {"fc": {"weight": (4, 2), "bias": (2,)}},
        },
    }
    names = _record_names(model, params, x, maybe_jit)
    assert names == ["block2/inner/fc", "block2/fc1", "block1/act", "block1/fc1"]

    # a glob selects one block only
    records = []
    g = vk.grad(lambda p, x: jnp.sum(model.apply(p, x)), hooks={"block1/*": vk.on_host(records.append)})
    grads = maybe_jit(g)(params, x)
    jax.block_until_ready(grads)
    tree_allclose(grads, jax.grad(lambda p, x: jnp.sum(model.apply(p, x)))(params, x))
    assert [r.key for r in records] == ["block1/act", "block1/fc1"]


def test_serial_positional_and_tuple_names(maybe_jit):
    x = _normal(1, (3, 5))
    model = nn.serial(nn.dense(4), nn.relu(), nn.dense(2))
    params = _params(model, x)
    assert sorted(params) == ["0", "2"]
    assert _record_names(model, params, x, maybe_jit) == ["2", "1", "0"]

    model = nn.serial(("inp", nn.dense(4)), nn.tanh(), ("head", nn.dense(2)), extra=nn.sigmoid())
    params = _params(model, x)
    assert sorted(params) == ["head", "inp"]
    assert _record_names(model, params, x, maybe_jit) == ["extra", "head", "1", "inp"]


def test_serial_apply_matches_composition(maybe_jit):
    model = nn.serial(fc1=nn.dense(4), act=nn.tanh(), fc2=nn.dense(2))
    x = _normal(1, (3, 5))
    params = _params(model, x)

    def by_hand(p, x):
        h = np.tanh(_np_dense(p["fc1"], x))
        return _np_dense(p["fc2"], h)

    y = maybe_jit(model.apply)(params, x)
    np.testing.assert_allclose(np.asarray(y, np.float64), by_hand(params, x), rtol=1e-5, atol=1e-6)


def test_serial_with_dropout_init_and_apply(maybe_jit):
    model = nn.serial(fc=nn.dense(4), drop=nn.dropout(0.5), out=nn.dense(2))
    x = _normal(1, (6, 3))
    assert sorted(jax.eval_shape(model.init, jax.random.key(0), x)) == ["fc", "out"]  # traces dropout
    params = _params(model, x)
    key = jax.random.key(3)
    apply = maybe_jit(model.apply)
    y = apply(params, x, key=key)
    assert y.shape == (6, 2)
    tree_allclose(apply(params, x, key=key), y, rtol=0, atol=0)
    # deterministic=True turns dropout into the identity
    h = x @ params["fc"]["weight"] + params["fc"]["bias"]
    expected = h @ params["out"]["weight"] + params["out"]["bias"]
    deterministic = maybe_jit(functools.partial(model.apply, deterministic=True))
    tree_allclose(deterministic(params, x), expected, rtol=RTOL, atol=ATOL)
    # serial hands dropout its own subkey: the result depends on the key
    y2 = apply(params, x, key=jax.random.key(4))
    assert not np.allclose(np.asarray(y), np.asarray(y2))
    names = _record_names(model, params, x, maybe_jit, key=key)
    assert names == ["out", "drop", "fc"]


def test_serial_rejects_bad_children():
    with pytest.raises(vk.ConfigError):
        nn.serial()
    with pytest.raises(vk.ConfigError, match="fc"):
        nn.serial(("fc", nn.dense(2)), fc=nn.dense(3))
    with pytest.raises(vk.ConfigError):
        nn.serial(("a/b", nn.dense(2)))
    with pytest.raises(vk.ConfigError):
        nn.serial(fc=lambda p, x: x)
    model = nn.serial(fc=nn.dense(2))
    x = _normal(1, (2, 3))
    with pytest.raises(vk.ConfigError, match="other"):
        model.apply({"fc": _params(model, x)["fc"], "other": {}}, x)


def _np_max_pool_grad_shared_ties(x, g, k):
    """d/dx of sum(g * max_pool(x)) for non-overlapping k x k windows, ties sharing equally."""
    x, g = np.asarray(x, np.float64), np.asarray(g, np.float64)
    out = np.zeros_like(x)
    for i in range(g.shape[1]):
        for j in range(g.shape[2]):
            patch = x[:, i * k : (i + 1) * k, j * k : (j + 1) * k, :]
            top = patch == patch.max(axis=(1, 2), keepdims=True)
            share = g[:, i : i + 1, j : j + 1, :] / top.sum(axis=(1, 2), keepdims=True)
            out[:, i * k : (i + 1) * k, j * k : (j + 1) * k, :] = top * share
    return out


def test_max_pool_ties_share_the_gradient(maybe_jit):
    # relu then pool: windows of zeros and exact ties are where pooling gradients differ
    x = jnp.round(jax.random.normal(jax.random.key(3), (2, 4, 6, 3)))
    x = jax.nn.relu(x)
    pool = nn.max_pool(2)
    y, pullback = jax.vjp(lambda x: maybe_jit(pool.apply)({}, x), x)
    g = _normal(4, y.shape)
    (gx,) = pullback(g)
    np.testing.assert_allclose(np.asarray(gx), _np_max_pool_grad_shared_ties(x, g, 2), rtol=1e-6, atol=1e-7)
    assert np.any((np.asarray(x) == 0).reshape(2, 2, 2, 3, 2, 3).all(axis=(2, 4)))  # a window of ties


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: nn.max_pool(0), "window must be a positive int"),
        (lambda: nn.avg_pool((2, 2, 2)), r"window .* got \(2, 2, 2\)"),
        (lambda: nn.max_pool(2, stride=(1, -1)), "stride"),
        (lambda: nn.max_pool(2, padding="same"), "padding must be 'SAME', 'VALID'"),
        (lambda: nn.avg_pool(2, padding=[(1, 1)], name="p"), r"nn.avg_pool 'p': padding .* got \[\(1, 1\)\]"),
        (lambda: nn.conv2d(4, (3,)), r"nn.conv2d: kernel_size .* got \(3,\)"),
        (lambda: nn.conv2d(4, 3, stride=0), "nn.conv2d: stride must be a positive int"),
    ],
)
def test_pool_and_conv_reject_bad_arguments(make, match):
    with pytest.raises(vk.ConfigError, match=match):
        make()


def test_pool_rejects_non_nhwc_input(maybe_jit):
    with pytest.raises(vk.ConfigError, match=r"nn.max_pool: expects NHWC .* got shape \(4, 6\) float32"):
        maybe_jit(nn.max_pool(2).apply)({}, jnp.ones((4, 6)))
