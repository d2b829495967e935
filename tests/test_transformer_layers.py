"""The layers a transformer needs: attention, rms_norm, batch_norm, conv1d, the GRU cell and rnn.

References never go through vjpkit: each layer has a plain ``jnp`` re-implementation written
here (explicit loops over heads, kernel taps and time steps), and a numpy forward where that is
cheap. Records come from ``vk.grad(..., capture="*")`` and ``vk.on_host`` hooks and are compared
with ``jax.vjp`` of the references, chained by hand; gradients also go through
``jax.test_util.check_grads``. Tests taking ``maybe_jit`` run jitted and eagerly.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.test_per_example import assert_norms_match
from vjpkit import nn
from vjpkit.inspect import dp_clip, per_example_grad_norms

RTOL, ATOL = 1e-5, 1e-5
EPS = 1e-2  # check_grads' finite-difference step (float32)


def _normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jnp.asarray(data).astype(dtype)


def _rand_like(tree, seed: int = 7):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_normal(seed + i, a.shape, a.dtype) for i, a in enumerate(leaves)])


def _params(layer, *inputs, seed: int = 7):
    """Random params with init's structure (so scale is not all ones, stats not 0 and 1)."""
    return _rand_like(jax.eval_shape(layer.init, jax.random.key(0), *inputs), seed)


def _check_grads64(f, args, order=2):
    """check_grads in float64 (default step): for layers whose second order float32 can't resolve."""
    with jax.enable_x64(True):
        up = lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a
        check_grads(f, jax.tree.map(up, args), order=order, modes=["rev"])


def _captured(loss, args, argnums, maybe_jit):
    grads, captured = maybe_jit(vk.grad(loss, argnums=argnums, capture="*"))(*args)
    return grads, captured


def _check_record(rec, *, inp, output, grad_output, grad_input, grad_params):
    tree_allclose(rec.input, inp, rtol=0, atol=0)
    tree_allclose(rec.output, output, rtol=RTOL, atol=ATOL)
    tree_allclose(rec.grad_output, grad_output, rtol=RTOL, atol=ATOL)
    if grad_input is None:
        assert rec.grad_input is None
    else:
        tree_allclose(rec.grad_input, grad_input, rtol=RTOL, atol=ATOL)
    tree_allclose(rec.grad_params, grad_params, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------ references


def ref_rms_norm(p, x, eps=1e-6):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * p["scale"]


def ref_batch_norm_train(p, x, eps=1e-5):
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean((x - mean) ** 2, axis=axes)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def ref_batch_norm_eval(p, x, eps=1e-5):
    stats = jax.lax.stop_gradient(p["batch_stats"])
    return (x - stats["mean"]) / jnp.sqrt(stats["var"] + eps) * p["scale"] + p["bias"]


def ref_conv1d(p, x, stride, padding):
    """Sum over kernel taps of shifted slices: no lax.conv."""
    k = p["weight"].shape[0]
    n = x.shape[1]
    if padding == "SAME":
        out = -(-n // stride)
        total = max((out - 1) * stride + k - n, 0)
        lo, hi = total // 2, total - total // 2
    elif padding == "VALID":
        lo, hi = 0, 0
    else:
        (lo, hi), *_ = padding
    xp = jnp.pad(x, ((0, 0), (lo, hi), (0, 0)))
    out = (xp.shape[1] - k) // stride + 1
    y = sum(xp[:, j : j + (out - 1) * stride + 1 : stride] @ p["weight"][j] for j in range(k))
    return y + p["bias"] if "bias" in p else y


def ref_attention(p, x, context=None, *, num_heads, causal=False, mask=None):
    """Head by head, with explicit softmax; ``mask`` as (batch, kv_len) or 4-D broadcastable."""
    src = x if context is None else context
    q = x @ p["q"]["weight"] + p["q"]["bias"]
    k = src @ p["k"]["weight"] + p["k"]["bias"]
    v = src @ p["v"]["weight"] + p["v"]["bias"]
    b, tq, tk = x.shape[0], x.shape[1], src.shape[1]
    dh = q.shape[-1] // num_heads
    allowed = jnp.ones((b, num_heads, tq, tk), bool)
    if causal:
        allowed = allowed & (jnp.arange(tk)[None, :] <= jnp.arange(tq)[:, None])
    if mask is not None:
        allowed = allowed & (mask[:, None, None, :] if mask.ndim == 2 else mask)
    heads = []
    for h in range(num_heads):
        qh, kh, vh = (a[..., h * dh : (h + 1) * dh] for a in (q, k, v))
        logits = jnp.einsum("bqd,bkd->bqk", qh, kh) / math.sqrt(dh)
        logits = jnp.where(allowed[:, h], logits, -1e30)
        e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        heads.append((e / jnp.sum(e, axis=-1, keepdims=True)) @ vh)
    return jnp.concatenate(heads, axis=-1) @ p["out"]["weight"] + p["out"]["bias"]


def ref_gru_cell(p, h, x):
    f = h.shape[-1]
    wi, wh, bi, bh = p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"]
    gate = lambda j, a, w, b: a @ w[:, j * f : (j + 1) * f] + b[j * f : (j + 1) * f]
    r = jax.nn.sigmoid(gate(0, x, wi, bi) + gate(0, h, wh, bh))
    z = jax.nn.sigmoid(gate(1, x, wi, bi) + gate(1, h, wh, bh))
    n = jnp.tanh(gate(2, x, wi, bi) + r * gate(2, h, wh, bh))
    return (1 - z) * n + z * h


def ref_rnn(p, xs, h0, reverse=False):
    """The GRU unrolled in a Python loop: every state, in time order."""
    h, hs = h0, [None] * xs.shape[1]
    steps = range(xs.shape[1] - 1, -1, -1) if reverse else range(xs.shape[1])
    for t in steps:
        h = ref_gru_cell(p, h, xs[:, t])
        hs[t] = h
    return jnp.stack(hs, axis=1)


# ---------------------------------------------------- single-input layers: norms, conv1d


def _apply(layer, **kw):
    return lambda p, x: layer.apply(p, x, **kw)


def _bn_train(layer):
    return lambda p, x: layer.apply(p, x, train=True)[0]


_conv = functools.partial(ref_conv1d, stride=1, padding="SAME")
_conv_s2 = functools.partial(ref_conv1d, stride=2, padding="SAME")
_conv_valid_s2 = functools.partial(ref_conv1d, stride=2, padding="VALID")
_conv_pads = functools.partial(ref_conv1d, stride=1, padding=[(2, 0)])
_rms_1e3 = functools.partial(ref_rms_norm, eps=1e-3)

SINGLE = [
    # (id, make, record name, input shape, call(layer) -> f(p, x), reference f(p, x))
    ("rms_norm_seq", lambda: nn.rms_norm(), "rms_norm", (3, 4, 6), _apply, ref_rms_norm),
    ("rms_norm_2d", lambda: nn.rms_norm(eps=1e-3), "rms_norm", (5, 7), _apply, _rms_1e3),
    ("batch_norm_eval", lambda: nn.batch_norm(), "batch_norm", (4, 3, 5), _apply, ref_batch_norm_eval),
    ("batch_norm_train", lambda: nn.batch_norm(), "batch_norm", (6, 5), _bn_train, ref_batch_norm_train),
    ("batch_norm_nhwc", lambda: nn.batch_norm(), "batch_norm", (2, 3, 3, 4), _bn_train, ref_batch_norm_train),
    ("conv1d_same", lambda: nn.conv1d(4, 3), "conv1d", (2, 7, 3), _apply, _conv),
    ("conv1d_same_s2", lambda: nn.conv1d(4, 4, stride=2), "conv1d", (2, 8, 3), _apply, _conv_s2),
    ("conv1d_valid_s2", lambda: nn.conv1d(5, 3, 2, "VALID"), "conv1d", (3, 9, 2), _apply, _conv_valid_s2),
    ("conv1d_pads", lambda: nn.conv1d(2, 3, 1, [(2, 0)], False), "conv1d", (2, 6, 3), _apply, _conv_pads),
]  # fmt: skip


def _setup(case):
    _, make, name, shape, call, ref = case
    layer = make()
    x = _normal(1, shape)
    params = _params(layer, x)
    if "batch_stats" in params:  # a valid variance
        params["batch_stats"]["var"] = jnp.abs(params["batch_stats"]["var"]) + 0.5
    f = call(layer)
    w_out = _normal(2, jax.eval_shape(f, params, x).shape)
    return f, name, params, x, ref, w_out


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c[0])
def test_single_forward_matches_reference(case, maybe_jit):
    f, _, params, x, ref, _ = _setup(case)
    y = maybe_jit(f)(params, x)
    assert y.dtype == x.dtype
    tree_allclose(y, ref(params, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c[0])
def test_single_record_against_reference_vjp(case, maybe_jit):
    f, name, params, x, ref, w_out = _setup(case)

    def loss(p, x):
        return jnp.sum(w_out * f(p, x))

    grads, captured = _captured(loss, (params, x), (0, 1), maybe_jit)
    assert sorted(captured) == [name]
    y, vjp_fn = jax.vjp(ref, params, x)
    gp, gx = vjp_fn(w_out)
    _check_record(captured[name], inp=x, output=y, grad_output=w_out, grad_input=gx, grad_params=gp)
    tree_allclose(grads, (gp, gx), rtol=RTOL, atol=ATOL)
    tree_allclose(grads, jax.grad(loss, argnums=(0, 1))(params, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c[0])
def test_single_record_behind_another_layer(case, maybe_jit):
    """Data input: no grad_input for the first layer; grad_input of the second is what the first gets."""
    f, name, params, x, ref, w_out = _setup(case)
    pre = nn.dense(x.shape[-1], name="pre")
    pre_params = _params(pre, x, seed=3)

    def loss(ps, x):
        return jnp.sum(w_out * f(ps["layer"], pre.apply(ps["pre"], x)))

    all_params = {"pre": pre_params, "layer": params}
    grads, captured = _captured(loss, (all_params, x), 0, maybe_jit)
    h, vjp_pre = jax.vjp(lambda p: x @ p["weight"] + p["bias"], pre_params)
    y, vjp_layer = jax.vjp(ref, params, h)
    gp, gh = vjp_layer(w_out)
    (gpre,) = vjp_pre(gh)
    _check_record(captured[name], inp=h, output=y, grad_output=w_out, grad_input=gh, grad_params=gp)
    _check_record(captured["pre"], inp=x, output=h, grad_output=gh, grad_input=None, grad_params=gpre)
    tree_allclose(grads, {"pre": gpre, "layer": gp}, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c[0])
def test_single_check_grads(case):
    f, _, params, x, _, _ = _setup(case)
    stats = params.pop("batch_stats", None)  # never differentiated: numerically they do matter
    full = (lambda p, x: f({**p, "batch_stats": stats}, x)) if stats is not None else f
    check_grads(full, (params, x), order=2, modes=["rev"], eps=EPS)


# ------------------------------------------------------------------------------ attention

B, T, D, H = 2, 5, 8, 2
PAD = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)  # example 0 has 2 padding positions


def _attn_setup(seed=0, **kw):
    attn = nn.multi_head_attention(H, **kw)
    x = _normal(seed + 1, (B, T, D))
    return attn, _small(_params(attn, x, seed=seed + 10)), x


def _small(params, factor=0.5):
    """Init-sized weights: check_grads' second-order finite differences stay accurate in float32."""
    return jax.tree.map(lambda a: a * factor, params)


ATTN_CASES = [
    ("self", {}, {}),
    ("causal", {"causal": True}, {}),
    ("padding", {}, {"mask": PAD}),
    ("causal_padding", {"causal": True}, {"mask": PAD}),
    ("mask_4d", {}, {"mask": np.tril(np.ones((T, T), bool))[None, None]}),
    ("mask_4d_per_head", {}, {"mask": np.random.default_rng(0).random((B, H, T, T)) < 0.7}),
    ("widths", {"features": 6, "out_features": 3}, {"mask": PAD}),
]


@pytest.mark.parametrize(("cid", "make_kw", "apply_kw"), ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_attention_forward_matches_reference(cid, make_kw, apply_kw, maybe_jit):
    attn, params, x = _attn_setup(**make_kw)
    kw = {k: jnp.asarray(v) for k, v in apply_kw.items()}
    y = maybe_jit(lambda p, x, kw: attn.apply(p, x, **kw))(params, x, kw)
    expected = ref_attention(params, x, num_heads=H, causal=make_kw.get("causal", False), **kw)
    tree_allclose(y, expected, rtol=RTOL, atol=ATOL)
    assert y.shape == (B, T, make_kw.get("out_features", D))


def test_cross_attention_forward_and_grads(maybe_jit):
    attn = nn.multi_head_attention(H, causal=False)
    x, ctx = _normal(1, (B, T, D)), _normal(2, (B, 3, 6))
    params = _small(_params(attn, x, ctx))
    assert params["k"]["weight"].shape == (6, D) and params["q"]["weight"].shape == (D, D)
    mask = jnp.asarray(np.array([[1, 1, 0], [1, 1, 1]], bool))
    y = maybe_jit(lambda p, x, c: attn.apply(p, x, c, mask=mask))(params, x, ctx)
    ref = functools.partial(ref_attention, num_heads=H, mask=mask)
    tree_allclose(y, ref(params, x, ctx), rtol=RTOL, atol=ATOL)
    w_out = _normal(3, y.shape)

    def loss(p, x, c):
        return jnp.sum(w_out * attn.apply(p, x, c, mask=mask))

    grads, captured = _captured(loss, (params, x, ctx), (0, 1, 2), maybe_jit)
    _, vjp_fn = jax.vjp(ref, params, x, ctx)
    tree_allclose(grads, vjp_fn(w_out), rtol=RTOL, atol=ATOL)
    tree_allclose(captured["multi_head_attention/k"].input, ctx, rtol=0, atol=0)


def test_cross_attention_check_grads():
    attn = nn.multi_head_attention(H)
    x, ctx = _normal(1, (B, T, D)), _normal(2, (B, 3, 6))
    params = _small(_params(attn, x, ctx))
    mask = jnp.asarray(np.array([[1, 1, 0], [1, 1, 1]], bool))
    _check_grads64(lambda p, x, c: attn.apply(p, x, c, mask=mask), (params, x, ctx))


def _ref_core(q, k, v, allowed):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    logits = jnp.where(allowed, logits, -1e30)
    e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return jnp.einsum("bhqk,bkhd->bqhd", e / jnp.sum(e, axis=-1, keepdims=True), v)


def test_attention_records_hand_chained(maybe_jit):
    """Every part's record (q, k, v, dot_product, out) against jax.vjp of plain pieces, chained."""
    attn, params, x = _attn_setup(causal=True)
    mask = jnp.asarray(PAD)
    w_out = _normal(5, (B, T, D))

    def loss(p, x):
        return jnp.sum(w_out * attn.apply(p, x, mask=mask))

    grads, cap = _captured(loss, (params, x), (0, 1), maybe_jit)
    prefix = "multi_head_attention/"
    assert sorted(cap) == [prefix + n for n in ("dot_product", "k", "out", "q", "v")]

    dense_ref = lambda p, a: a @ p["weight"] + p["bias"]
    split = lambda a: a.reshape(B, T, H, D // H)
    allowed = jnp.tril(jnp.ones((T, T), bool)) & mask[:, None, None, :]
    proj, vjps = {}, {}
    for n in ("q", "k", "v"):
        proj[n], vjps[n] = jax.vjp(dense_ref, params[n], x)
    heads, vjp_core = jax.vjp(lambda q, k, v: _ref_core(q, k, v, allowed), *(split(proj[n]) for n in "qkv"))
    merged = heads.reshape(B, T, D)
    y, vjp_out = jax.vjp(dense_ref, params["out"], merged)
    g_out_params, g_merged = vjp_out(w_out)
    g_heads = vjp_core(g_merged.reshape(B, T, H, D // H))
    _check_record(
        cap[prefix + "out"],
        inp=merged,
        output=y,
        grad_output=w_out,
        grad_input=g_merged,
        grad_params=g_out_params,
    )
    _check_record(
        cap[prefix + "dot_product"],
        inp=tuple(split(proj[n]) for n in "qkv"),
        output=heads,
        grad_output=g_merged.reshape(B, T, H, D // H),
        grad_input=g_heads,
        grad_params={},
    )
    gx = 0.0
    expected = {"out": g_out_params}
    for n, g in zip("qkv", g_heads):
        gp, gxn = vjps[n](g.reshape(B, T, D))
        _check_record(
            cap[prefix + n],
            inp=x,
            output=proj[n],
            grad_output=g.reshape(B, T, D),
            grad_input=gxn,
            grad_params=gp,
        )
        expected[n], gx = gp, gx + gxn
    tree_allclose(grads, (expected, gx), rtol=RTOL, atol=ATOL)


def test_attention_in_serial_names_and_hooks(maybe_jit):
    """A hook on "attn/q" sees the q projection; serial passes mask= to the attention only."""
    model = nn.serial(attn=nn.multi_head_attention(H, causal=True), norm=nn.rms_norm(), fc=nn.dense(3))
    x = _normal(1, (B, T, D))
    params = model.init(jax.random.key(0), x)
    assert sorted(params) == ["attn", "fc", "norm"] and sorted(params["attn"]) == ["k", "out", "q", "v"]
    mask = jnp.asarray(PAD)

    def loss(p, x):
        return jnp.sum(model.apply(p, x, mask=mask) ** 2)

    records = []
    grads = maybe_jit(vk.grad(loss, hooks={"attn/q": vk.on_host(records.append)}))(params, x)
    jax.block_until_ready(grads)
    assert [r.key for r in records] == ["attn/q"]
    (rec,) = records
    tree_allclose(rec.params, params["attn"]["q"], rtol=0, atol=0)
    tree_allclose(rec.grad_params, grads["attn"]["q"], rtol=RTOL, atol=ATOL)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=RTOL, atol=ATOL)
    _, cap = vk.grad(loss, capture="*")(params, x)
    assert sorted(cap) == ["attn/dot_product", "attn/k", "attn/out", "attn/q", "attn/v", "fc", "norm"]


def test_attention_check_grads():
    attn, params, x = _attn_setup(causal=True)
    mask = jnp.asarray(PAD)
    _check_grads64(lambda p, x: attn.apply(p, x, mask=mask), (params, x))


def test_attention_numpy_mask_equals_jax_mask(maybe_jit):
    attn, params, x = _attn_setup(causal=True)
    y_np = maybe_jit(lambda p, x: attn.apply(p, x, mask=PAD))(params, x)
    tree_allclose(y_np, attn.apply(params, x, mask=jnp.asarray(PAD)), rtol=0, atol=0)
    g = vk.grad(lambda p, x: jnp.sum(attn.apply(p, x, mask=PAD)), hooks={"*": lambda rec: None})(params, x)
    tree_allclose(
        g, jax.grad(lambda p, x: jnp.sum(attn.apply(p, x, mask=PAD)))(params, x), rtol=RTOL, atol=ATOL
    )


def test_attention_fully_masked_query_is_finite(maybe_jit):
    attn, params, x = _attn_setup()
    mask = jnp.asarray(np.array([[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], bool))
    loss = lambda p, x: jnp.sum(attn.apply(p, x, mask=mask) ** 2)
    value, grads = maybe_jit(vk.value_and_grad(loss, argnums=(0, 1)))(params, x)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves((value, grads)))


# ---------------------------------------------------------------------------- GRU and rnn

F = 4


def _gru_setup(t=4, n_in=3, seed=0):
    cell = nn.gru(F)
    xs = _normal(seed + 1, (B, t, n_in))
    h0 = _normal(seed + 2, (B, F))
    params = _small(_params(cell, h0, xs[:, 0], seed=seed + 20))
    return cell, params, xs, h0


def test_gru_cell_record_against_reference(maybe_jit):
    """One cell call outside scan: its record is jax.vjp of the reference cell, for (h, x) inputs."""
    cell, params, xs, h0 = _gru_setup()
    x = xs[:, 0]
    assert jax.tree.map(jnp.shape, params) == {
        "bias_hh": (3 * F,),
        "bias_ih": (3 * F,),
        "weight_hh": (F, 3 * F),
        "weight_ih": (3, 3 * F),
    }
    y = maybe_jit(cell.apply)(params, h0, x)
    tree_allclose(y, ref_gru_cell(params, h0, x), rtol=RTOL, atol=ATOL)
    w_out = _normal(5, (B, F))

    def loss(p, h, x):
        return jnp.sum(w_out * cell.apply(p, h, x))

    grads, cap = _captured(loss, (params, h0, x), (0, 1, 2), maybe_jit)
    y, vjp_fn = jax.vjp(ref_gru_cell, params, h0, x)
    gp, gh, gx = vjp_fn(w_out)
    _check_record(cap["gru"], inp=(h0, x), output=y, grad_output=w_out, grad_input=(gh, gx), grad_params=gp)
    tree_allclose(grads, (gp, gh, gx), rtol=RTOL, atol=ATOL)
    # data x needs no gradient, h does: grad_input is (gh, None)
    _, cap = _captured(loss, (params, h0, x), (0, 1), maybe_jit)
    tree_allclose(cap["gru"].grad_input, (gh, None), rtol=RTOL, atol=ATOL)


def test_gru_matches_torch_gru_cell_formula():
    """The gate layout is PyTorch's GRUCell: (r, z, n) thirds, r applied to h @ W_hn + b_hn."""
    cell, params, xs, h0 = _gru_setup()
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x, h = np.asarray(xs[:, 0], np.float64), np.asarray(h0, np.float64)
    sig = lambda a: 1 / (1 + np.exp(-a))
    gi, gh = x @ p["weight_ih"] + p["bias_ih"], h @ p["weight_hh"] + p["bias_hh"]
    r = sig(gi[:, :F] + gh[:, :F])
    z = sig(gi[:, F : 2 * F] + gh[:, F : 2 * F])
    n = np.tanh(gi[:, 2 * F :] + r * gh[:, 2 * F :])
    np.testing.assert_allclose(cell.apply(params, h0, xs[:, 0]), (1 - z) * n + z * h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "captured"])
def test_rnn_gradients_against_unrolled_reference(reverse, hooked, maybe_jit):
    """Gradients through lax.scan, with and without a vjpkit transform, equal the unrolled loop's."""
    cell, params, xs, h0 = _gru_setup()
    enc = nn.rnn(cell, F, reverse=reverse)
    assert jax.tree.structure(enc.init(jax.random.key(0), xs)) == jax.tree.structure(params)
    w_out = _normal(6, (B, xs.shape[1], F))

    def loss(p, xs, h0):
        return jnp.sum(w_out * enc.apply(p, xs, h0=h0))

    ref = functools.partial(ref_rnn, reverse=reverse)
    hs = maybe_jit(lambda p, xs, h0: enc.apply(p, xs, h0=h0))(params, xs, h0)
    tree_allclose(hs, ref(params, xs, h0), rtol=RTOL, atol=ATOL)
    _, vjp_fn = jax.vjp(ref, params, xs, h0)
    expected = vjp_fn(w_out)
    if hooked:
        grads, cap = _captured(loss, (params, xs, h0), (0, 1, 2), maybe_jit)
        assert sorted(cap) == ["gru"]  # (its fields under scan are the core's business)
    else:
        grads = maybe_jit(vk.grad(loss, argnums=(0, 1, 2)))(params, xs, h0)
    tree_allclose(grads, expected, rtol=RTOL, atol=ATOL)


def test_rnn_last_state_zero_h0_and_in_serial(maybe_jit):
    cell, params, xs, _ = _gru_setup()
    model = nn.serial(enc=nn.rnn(cell, F, return_sequences=False), head=nn.dense(2))
    mparams = model.init(jax.random.key(0), xs)
    mparams["enc"] = params
    zeros = jnp.zeros((B, F))

    def loss(p, xs):
        return jnp.sum(model.apply(p, xs) ** 2)

    def ref_loss(p, xs):
        last = ref_rnn(p["enc"], xs, zeros)[:, -1]
        return jnp.sum((last @ p["head"]["weight"] + p["head"]["bias"]) ** 2)

    grads, cap = _captured(loss, (mparams, xs), 0, maybe_jit)
    assert sorted(cap) == ["enc", "head"]
    tree_allclose(grads, jax.grad(ref_loss)(mparams, xs), rtol=RTOL, atol=ATOL)
    head_in = ref_rnn(params, xs, zeros)[:, -1]
    tree_allclose(cap["head"].input, head_in, rtol=RTOL, atol=ATOL)


def test_rnn_check_grads():
    cell, params, xs, h0 = _gru_setup(t=3)
    enc = nn.rnn(cell, F)
    _check_grads64(lambda p, xs, h0: enc.apply(p, xs, h0=h0), (params, xs, h0))


# ------------------------------------------------------------------ batch_norm's running stats


def test_batch_norm_running_stats(maybe_jit):
    bn = nn.batch_norm(momentum=0.8)
    x = _normal(1, (6, 3, 4)) * 2.0 + 1.0
    params = bn.init(jax.random.key(0), x)
    tree_allclose(params["batch_stats"], {"mean": jnp.zeros(4), "var": jnp.ones(4)}, rtol=0, atol=0)
    y, stats = maybe_jit(functools.partial(bn.apply, train=True))(params, x)
    xn = np.asarray(x, np.float64).reshape(-1, 4)
    expected = {"mean": 0.2 * xn.mean(0), "var": 0.8 + 0.2 * xn.var(0)}
    tree_allclose(jax.tree.map(lambda a: np.asarray(a, np.float64), stats), expected, rtol=1e-5, atol=1e-6)
    tree_allclose(y, ref_batch_norm_train(params, x), rtol=RTOL, atol=ATOL)
    # eval mode uses the running statistics and returns y alone
    params = {**params, "batch_stats": stats}
    y_eval = maybe_jit(bn.apply)(params, x)
    tree_allclose(y_eval, ref_batch_norm_eval(params, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("train", [False, True])
def test_batch_norm_stats_get_zero_gradient(train, maybe_jit):
    bn = nn.batch_norm()
    x = _normal(1, (5, 3))
    params = _params(bn, x)
    params["batch_stats"]["var"] = jnp.abs(params["batch_stats"]["var"]) + 0.5

    def loss(p, x):
        out = bn.apply(p, x, train=train)
        y, stats = out if train else (out, None)
        # the new stats are data, not a path for gradients, even when the loss uses them
        extra = 0.0 if stats is None else jnp.sum(stats["mean"] * stats["var"])
        return jnp.sum(jnp.sin(y)) + extra

    for grads in (jax.grad(loss)(params, x), maybe_jit(vk.grad(loss))(params, x)):
        tree_allclose(
            grads["batch_stats"], jax.tree.map(jnp.zeros_like, params["batch_stats"]), rtol=0, atol=0
        )
        assert float(jnp.abs(grads["scale"]).sum()) > 0


def test_batch_norm_train_step_writes_stats_back(maybe_jit):
    """A training step: grads for scale/bias, new stats written over the params' ones."""
    bn, fc = nn.batch_norm(), nn.dense(1)
    x = _normal(1, (8, 3))
    params = {"bn": bn.init(jax.random.key(0), x), "fc": fc.init(jax.random.key(1), x)}

    @maybe_jit
    def step(params, x):
        def loss(p):
            y, stats = bn.apply(p["bn"], x, train=True)
            return jnp.mean(fc.apply(p["fc"], y) ** 2), stats

        grads, stats = vk.grad(loss, has_aux=True)(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return {**params, "bn": {**params["bn"], "batch_stats": stats}}

    new = step(params, x)
    expected_mean = 0.1 * np.asarray(x, np.float64).mean(0)
    np.testing.assert_allclose(new["bn"]["batch_stats"]["mean"], expected_mean, rtol=1e-5, atol=1e-6)
    assert not np.allclose(new["bn"]["scale"], params["bn"]["scale"])


# --------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: nn.multi_head_attention(0),
            r"nn.multi_head_attention: num_heads must be a positive int, got 0",
        ),
        (lambda: nn.multi_head_attention(3, features=8), r"num_heads=3 must divide features=8"),
        (lambda: nn.multi_head_attention(2, causal="yes"), r"causal must be a bool"),
        (lambda: nn.multi_head_attention(2, name="a/b"), r"contains '/'"),
        (lambda: nn.rms_norm(eps=0.0), r"nn.rms_norm: eps must be a positive number, got 0.0"),
        (lambda: nn.batch_norm(momentum=1.0), r"nn.batch_norm: momentum must be in \[0, 1\), got 1.0"),
        (lambda: nn.conv1d(4, 0), r"nn.conv1d: kernel_size must be a positive int, got 0"),
        (lambda: nn.conv1d(4, 3, stride=(2,)), r"nn.conv1d: stride must be a positive int, got \(2,\)"),
        (
            lambda: nn.conv1d(4, 3, padding="FULL"),
            r"nn.conv1d: padding must be 'SAME', 'VALID' or \[\(lo, hi\)\]",
        ),
        (lambda: nn.gru(0), r"nn.gru: features must be a positive int, got 0"),
        (lambda: nn.rnn(lambda p, h, x: h, 4), r"nn.rnn needs a cell nn.Layer"),
    ],
)
def test_bad_construction_raises_config_error(make, match):
    with pytest.raises(vk.ConfigError, match=match):
        make()


def _attn_params():
    attn = nn.multi_head_attention(2)
    return attn, attn.init(jax.random.key(0), jnp.ones((2, 5, 8)))


def _mha(*args, **kwargs):
    attn, params = _attn_params()
    return attn.apply(params, *args, **kwargs)


def _bn_params():
    return nn.batch_norm().init(jax.random.key(0), jnp.ones((2, 5)))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: nn.multi_head_attention(3).init(jax.random.key(0), jnp.ones((2, 5, 8))),
            r"num_heads=3 must divide features=8 \(from x's last axis, float32\[2,5,8\]\)",
        ),
        (
            lambda: _mha(jnp.ones((5, 8))),
            r"multi_head_attention: x must be a float array \(batch, q_len, features\), got float32\[5,8\]",
        ),
        (
            lambda: _mha(jnp.ones((2, 5, 8)), mask=jnp.ones((2, 5))),
            r"mask must be a boolean array.*got float32\[2,5\]",
        ),
        (
            lambda: _attn_params()[0].apply(
                _attn_params()[1], jnp.ones((2, 5, 8)), mask=jnp.ones((2, 4), bool)
            ),
            r"mask has bool\[2,4\]; expected \(batch, kv_len\) = \(2, 5\) or a shape broadcastable "
            r"to \(batch, heads, q_len, kv_len\) = \(2, 2, 5, 5\)",
        ),
        (
            lambda: _mha(jnp.ones((2, 5, 8)), jnp.ones((3, 4, 8))),
            r"context has batch 3 \(float32\[3,4,8\]\) but x has batch 2",
        ),
        (
            lambda: _mha(jnp.ones((2, 5, 6))),
            r"params\['q'\]\['weight'\] must be \(in, features\) with in = 6 .* got float32\[8,8\]",
        ),
        (
            lambda: nn.rms_norm().apply({"scale": jnp.ones(4)}, jnp.ones((2, 5))),
            r"nn.rms_norm: params\['scale'\] has shape \(4,\) but the input has 5 features",
        ),
        (
            lambda: nn.rms_norm().apply({"scale": jnp.ones(5)}, jnp.ones((2, 5), jnp.int32)),
            r"nn.rms_norm: expects a float input .* got int32\[2,5\]",
        ),
        (
            lambda: nn.batch_norm().init(jax.random.key(0), jnp.ones((5,))),
            r"nn.batch_norm: expects a float input \(batch, ..., features\) with at least 2 axes, got "
            r"float32\[5\]",
        ),
        (
            lambda: nn.batch_norm().apply({"scale": jnp.ones(5)}, jnp.ones((2, 5))),
            r"nn.batch_norm: params must hold batch_stats",
        ),
        (
            lambda: nn.batch_norm().apply(
                nn.batch_norm().init(jax.random.key(0), jnp.ones((2, 5))),
                jnp.ones((2, 5)),
                train=jnp.array(True),
            ),
            r"nn.batch_norm: train must be a Python bool, got ArrayImpl",
        ),
        (
            lambda: nn.conv1d(4, 3).init(jax.random.key(0), jnp.ones((2, 8, 8, 3))),
            r"nn.conv1d: expects NWC input \(batch, length, channels\), got float32\[2,8,8,3\]",
        ),
        (
            lambda: nn.conv1d(4, 3).apply(
                nn.conv1d(4, 3).init(jax.random.key(0), jnp.ones((2, 8, 3))), jnp.ones((2, 8, 2))
            ),
            r"nn.conv1d: the input has 2 channels \(shape \(2, 8, 2\)\) but weight \(3, 3, 4\) expects 3",
        ),
        (
            lambda: nn.gru(4).init(jax.random.key(0), jnp.ones((2, 3)), jnp.ones((2, 5))),
            r"nn.gru: h must have shape \(batch, features\) = \(2, 4\), got float32\[2,3\]",
        ),
        (
            lambda: nn.rnn(nn.gru(4), 4).init(jax.random.key(0), jnp.ones((2, 5))),
            r"nn.rnn: xs must be a float array \(batch, time, in\), got float32\[2,5\]",
        ),
    ],
)
def test_bad_input_raises_config_error(call, match):
    with pytest.raises(vk.ConfigError, match=match):
        call()


def test_bad_input_under_jit_and_vk_grad_names_the_layer():
    attn, params = _attn_params()
    x = jnp.ones((2, 5, 8))
    loss = lambda p, x, m: jnp.sum(attn.apply(p, x, mask=m))
    with pytest.raises(vk.ConfigError, match=r"nn.multi_head_attention: mask must be a boolean array"):
        jax.jit(vk.grad(loss))(params, x, jnp.ones((2, 5), jnp.int32))


# ------------------------------------------------------------------- per-example fast paths


def _per_example_setup(model, x, seed=0):
    params = _small(_params(model, x, seed=seed + 30), 0.7)
    y = jnp.asarray(np.random.default_rng(seed).integers(0, 3, x.shape[0]), jnp.int32)

    def loss(p, x, y):
        logits = jnp.mean(model.apply(p, x), axis=1)  # pool over time
        return jnp.mean(jax.nn.logsumexp(logits, 1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])

    return params, y, loss


def _bn_eval_params(params):
    """Positive running variances: the eval-mode batch_norm needs var + eps > 0."""
    stats = params["bn"]["batch_stats"]
    return {**params, "bn": {**params["bn"], "batch_stats": {**stats, "var": jnp.abs(stats["var"]) + 0.5}}}


def test_per_example_fast_paths_match_vmap_grad(maybe_jit):
    """conv1d, rms_norm, attention (its projections) and eval batch_norm: no fallback, 1e-5."""
    model = nn.serial(
        conv=nn.conv1d(8, 3, stride=2),
        rms=nn.rms_norm(),
        attn=nn.multi_head_attention(2, causal=True),
        bn=nn.batch_norm(),
        head=nn.dense(3),
    )
    x = _normal(1, (6, 9, 4))
    params, y, loss = _per_example_setup(model, x)
    params = _bn_eval_params(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns: there must be none
        _, grads, norms = maybe_jit(per_example_grad_norms(loss))(params, x, y)
    owners = {"bn/batch_stats/mean": "bn", "bn/batch_stats/var": "bn"}  # layers own nested leaves
    assert_norms_match(norms, loss, params, x, y, owners=owners)
    assert sorted(norms.layers) == sorted(
        ["conv", "rms", "attn/q", "attn/k", "attn/v", "attn/out", "bn", "head"]
    )
    tree_allclose(grads, jax.jit(jax.grad(loss))(params, x, y), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_example_norm_layers_shared_and_summed(reduction):
    """One rms_norm applied twice (weight sharing), and conv1d with explicit padding that SAME
    would not pick ((1, 0), not (0, 1)): conv1d gives its own stride and padding, so the norms
    are exact with no ``conv=`` (which the layer's own kind overrides), for both reductions."""
    conv, rms = nn.conv1d(5, 2, 1, [(1, 0)], name="conv"), nn.rms_norm(name="rms")
    head = nn.dense(3, name="head")
    x = _normal(2, (5, 7, 5))

    def model_apply(p, x):
        h = rms.apply(p["rms"], conv.apply(p["conv"], rms.apply(p["rms"], x)))
        return head.apply(p["head"], h)

    model = nn.Layer(
        lambda key, x: {
            "conv": conv.init(key, x),
            "rms": rms.init(key, x),
            "head": head.init(key, x),
        },
        model_apply,
    )
    params, y, mean_loss = _per_example_setup(model, x, seed=3)
    loss = mean_loss if reduction == "mean" else (lambda p, x, y: mean_loss(p, x, y) * x.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no failed check
        _, _, norms = jax.jit(per_example_grad_norms(loss, reduction=reduction))(params, x, y)
        wrong = {"conv": (2, "SAME")}  # ignored: the layer says what it is
        configured_fn = per_example_grad_norms(loss, reduction=reduction, conv=wrong)
        _, _, configured = jax.jit(configured_fn)(params, x, y)
        jax.effects_barrier()
    assert_norms_match(norms, loss, params, x, y)
    assert_norms_match(configured, loss, params, x, y)
    assert sorted(norms.layers) == ["conv", "head", "rms"]


def test_per_example_dp_clip_with_norms_and_attention():
    """dp_clip's clipped sums use the same per-example gradients: equal to a naive vmap(grad) DP."""
    model = nn.serial(attn=nn.multi_head_attention(2), rms=nn.rms_norm(), head=nn.dense(3))
    x = _normal(4, (5, 4, 6))
    params, y, loss = _per_example_setup(model, x, seed=5)
    clip = 0.5
    key = jax.random.key(3)
    _, grads, _ = jax.jit(dp_clip(clip, 0.0, key)(loss))(params, x, y, step=0)
    g = jax.jit(jax.vmap(jax.grad(lambda p, x, y: loss(p, x[None], y[None])), in_axes=(None, 0, 0)))(
        params, x, y
    )
    norms = jnp.sqrt(sum(jnp.sum(a.reshape(a.shape[0], -1) ** 2, axis=1) for a in jax.tree.leaves(g)))
    factor = jnp.minimum(1.0, clip / norms)
    expected = jax.tree.map(lambda a: jnp.tensordot(factor, a, axes=1) / x.shape[0], g)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)


def test_per_example_recurrent_takes_its_own_vjp():
    """The GRU (a lax.scan inside the layer) has no dense fast path: its per-example gradients
    are a vmap of its own vjp over the examples, with a warning naming it, and exact."""
    model = nn.serial(enc=nn.rnn(nn.gru(4), 4), head=nn.dense(3))
    x = _normal(6, (4, 3, 2))
    params, y, loss = _per_example_setup(model, x, seed=7)
    with pytest.warns(UserWarning, match=r"'enc' \(a layer of no known kind") as record:
        _, _, norms = jax.jit(per_example_grad_norms(loss))(params, x, y)
    assert not any("fall back" in str(w.message) for w in record)
    assert_norms_match(norms, loss, params, x, y)


# ------------------------------------------------------------- plain transforms and dtypes


def _stack():
    return nn.serial(
        conv=nn.conv1d(8, 3),
        attn=nn.multi_head_attention(2, causal=True),
        rms=nn.rms_norm(),
        bn=nn.batch_norm(),
        enc=nn.rnn(nn.gru(4), 4),
        fc=nn.dense(3),
    )


@pytest.mark.slow
def test_plain_transforms_and_vk_jvp_on_a_stack(maybe_jit):
    """Outside vjpkit transforms the layers are plain JAX (jvp, vmap); vk.jvp and vk.hvp run too."""
    model = _stack()
    x = _normal(1, (B, T, D))
    mask = jnp.asarray(PAD)
    params = model.init(jax.random.key(0), x)
    f = lambda p, x: model.apply(p, x, mask=mask)
    t = _rand_like(params, seed=40)
    y, ty = maybe_jit(lambda p, t: jax.jvp(lambda p: f(p, x), (p,), (t,)))(params, t)
    y2, ty2 = maybe_jit(lambda p, t: vk.jvp(lambda p: f(p, x), (p,), (t,)))(params, t)
    tree_allclose((y2, ty2), (y, ty), rtol=RTOL, atol=ATOL)
    # batch norm in eval mode and attention with a padding mask are per-example: vmap agrees
    one = lambda xi, mi: model.apply(params, xi[None], mask=mi[None])[0]
    tree_allclose(maybe_jit(jax.vmap(one))(x, mask), y, rtol=RTOL, atol=ATOL)
    hvp = maybe_jit(lambda p, t: vk.hvp(lambda p: jnp.sum(f(p, x) ** 2), (p,), t))(params, t)
    expected = jax.jit(lambda p, t: jax.jvp(jax.grad(lambda p: jnp.sum(f(p, x) ** 2)), (p,), (t,))[1])(
        params, t
    )
    tree_allclose(hvp, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_bfloat16_stays_bfloat16(maybe_jit):
    model = _stack()
    x = _normal(1, (B, T, D), jnp.bfloat16)
    params = model.init(jax.random.key(0), x)
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    y = maybe_jit(model.apply)(params, x)
    assert y.dtype == jnp.bfloat16
    grads = maybe_jit(vk.grad(lambda p, x: jnp.sum(model.apply(p, x).astype(jnp.float32))))(params, x)
    assert jax.tree.map(lambda a: a.dtype, grads) == jax.tree.map(lambda a: a.dtype, params)
    _, y_train = nn.batch_norm().apply(nn.batch_norm().init(jax.random.key(0), x), x, train=True)
    assert {a.dtype for a in jax.tree.leaves(y_train)} == {jnp.dtype(jnp.bfloat16)}
