"""Per-example gradient norms of layers called under ``lax.scan`` (issue 31), against
``jax.vmap(jax.grad)`` of the plain per-example loss.

A stacked leaf ``W (L, ...)`` given to the scan as ``xs`` has per-example gradients whose slice
``i`` is iteration ``i``'s, so ``||g_b||^2 = sum_i ||g_{b,i}||^2``: the scanned layers take the
fast paths with the iteration axis leading, and no longer warn "no fast path: the leaf is passed
into a 'scan'". A leaf closed over by the scan body (the same weight every iteration) gets the
sum over iterations before the norm. The reference never uses vjpkit.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.test_per_example import per_example_grads
from tests.test_per_example_layouts import fast
from vjpkit.inspect import _per_example as pe

# The default tier runs this test's eager twin (conftest.py): the first one's is slow.
DEFAULT_TIER_EAGER = "test_mlp_under_scan"

SCAN_FALLBACK = "passed into a 'scan'"


def reference_norms(loss_fn, params, *batch):
    """``{leaf path: (B,) norms}`` and the total, float64, from vmap(grad)."""
    grads = per_example_grads(loss_fn, params, *batch)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    sq = {
        jax.tree_util.keystr(p, simple=True, separator="/"): np.sum(
            np.asarray(g, np.float64).reshape(g.shape[0], -1) ** 2, axis=1
        )
        for p, g in flat
    }
    return np.sqrt(sum(sq.values())), {k: np.sqrt(v) for k, v in sq.items()}


def assert_matches(norms, loss_fn, params, *batch, rtol=1e-5, atol=1e-6):
    total, leaves = reference_norms(loss_fn, params, *batch)
    got = {
        jax.tree_util.keystr(p, simple=True, separator="/"): v
        for p, v in jax.tree_util.tree_flatten_with_path(norms.params)[0]
    }
    assert sorted(got) == sorted(leaves)
    for k in leaves:
        np.testing.assert_allclose(got[k], leaves[k], rtol=rtol, atol=atol, err_msg=k)
    np.testing.assert_allclose(norms.total, total, rtol=rtol, atol=atol)


# ----------------------------------------------------------------- a transformer in plain JAX


def tf_init(key, vocab=13, dim=8, depth=3, length=6):
    keys = iter(jax.random.split(key, 32))

    def normal(shape, scale):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    def norm(*lead):
        return {"scale": 1.0 + normal((*lead, dim), 0.1), "bias": normal((*lead, dim), 0.1)}

    return {
        "embed": normal((vocab, dim), 1.0),
        "pos": normal((length, dim), 0.1),
        "blocks": {
            "ln1": norm(depth),
            "attn": {n: normal((depth, dim, dim), dim**-0.5) for n in ("q", "k", "v")},
            "o": {"w": normal((depth, dim, dim), dim**-0.5), "b": normal((depth, dim), 0.1)},
            "ln2": norm(depth),
            "fc": {"w": normal((depth, dim, 2 * dim), dim**-0.5), "b": normal((depth, 2 * dim), 0.1)},
            "proj": {"w": normal((depth, 2 * dim, dim), (2 * dim) ** -0.5), "b": normal((depth, dim), 0.1)},
        },
        "ln_f": norm(),
        "head": normal((dim, vocab), dim**-0.5),
    }


def layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(x, p):
    h = layer_norm(x, p["ln1"])
    q, k, v = (h @ p["attn"][n] for n in "qkv")
    t = x.shape[1]
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    a = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), v)
    x = x + a @ p["o"]["w"] + p["o"]["b"]  # x + h @ W + b: the bias after the residual add
    h = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["fc"]["w"] + p["fc"]["b"])
    return x + h @ p["proj"]["w"] + p["proj"]["b"]


def tf_loss(params, tokens):
    inp, target = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inp] + params["pos"][: inp.shape[1]]
    x, _ = jax.lax.scan(lambda h, p: (block(h, p), None), x, params["blocks"])
    logits = layer_norm(x, params["ln_f"]) @ params["head"]
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], -1))


def test_transformer_blocks_under_scan(maybe_jit):
    params = tf_init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (5, 7), 0, 13)
    loss, grads, norms = fast(maybe_jit(pe.per_example_grad_norms(tf_loss)), params, tokens)
    assert_matches(norms, tf_loss, params, tokens)
    tree_allclose(grads, jax.grad(tf_loss)(params, tokens), rtol=1e-5, atol=1e-6)
    assert {"blocks/fc", "blocks/proj/w", "blocks/o/w", "blocks/attn/q", "blocks/ln1"} <= set(norms.layers)


# ----------------------------------------------------------------------- an MLP under scan


def mlp_init(key, depth=4, dim=5, out=3):
    k = jax.random.split(key, 3)
    return {
        "w": jax.random.normal(k[0], (depth, dim, dim)) * dim**-0.5,
        "b": jax.random.normal(k[1], (depth, dim)) * 0.1,
        "head": jax.random.normal(k[2], (dim, out)),
    }


def scan_mlp_loss(params, x, y, reverse=False):
    def body(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(body, x, {"w": params["w"], "b": params["b"]}, reverse=reverse)
    return jnp.mean(jnp.sum(jnp.square(h @ params["head"] - y), -1))


@pytest.mark.parametrize("reverse", [False, True])
def test_mlp_under_scan(maybe_jit, reverse):
    params = mlp_init(jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (7, 5))
    y = jax.random.normal(jax.random.key(4), (7, 3))

    def loss(p, x, y):
        return scan_mlp_loss(p, x, y, reverse)

    _, _, norms = fast(maybe_jit(pe.per_example_grad_norms(loss)), params, x, y)
    assert_matches(norms, loss, params, x, y)
    assert sorted(norms.layers) == ["head", "w"]


@pytest.mark.parametrize("t", [2, 9])  # T^2 <= in*out: Gram ghost norm; else per-example X^T D
def test_sequence_mlp_under_scan(t):
    params = mlp_init(jax.random.key(5), depth=3, dim=4)
    x = jax.random.normal(jax.random.key(6), (6, t, 4))
    y = jax.random.normal(jax.random.key(7), (6, t, 3))
    _, _, norms = fast(jax.jit(pe.per_example_grad_norms(scan_mlp_loss)), params, x, y)
    assert_matches(norms, scan_mlp_loss, params, x, y)


def test_nested_scans_over_a_doubly_stacked_weight():
    k = jax.random.split(jax.random.key(8), 3)
    params = {"w": jax.random.normal(k[0], (2, 3, 4, 4)) * 0.5, "b": jax.random.normal(k[1], (2, 3, 4)) * 0.1}
    x = jax.random.normal(k[2], (5, 4))

    def loss(p, x):
        def inner(h, q):
            return jnp.tanh(h @ q["w"] + q["b"]), None

        def outer(h, q):
            return jax.lax.scan(inner, h, q)[0], None

        h, _ = jax.lax.scan(outer, x, p)
        return jnp.mean(jnp.sum(jnp.square(h), -1))

    _, _, norms = fast(jax.jit(pe.per_example_grad_norms(loss)), params, x)
    assert_matches(norms, loss, params, x)


def test_weight_closed_over_by_the_scan_body():
    """An RNN: ``U``, ``W`` and ``b`` are the same every step, so g_b sums over the steps."""
    k = jax.random.split(jax.random.key(9), 5)
    params = {
        "u": {"w": jax.random.normal(k[0], (4, 4)) * 0.5},
        "inp": {"w": jax.random.normal(k[1], (3, 4)) * 0.5, "b": jax.random.normal(k[2], (4,)) * 0.1},
        "head": jax.random.normal(k[3], (4, 2)),
    }
    xs = jax.random.normal(k[4], (6, 5, 3))  # (batch, time, features)

    def loss(p, xs):
        def cell(h, x_t):
            return jnp.tanh(h @ p["u"]["w"] + x_t @ p["inp"]["w"] + p["inp"]["b"]), None

        h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[0], 4)), jnp.swapaxes(xs, 0, 1))
        return jnp.mean(jnp.sum(h @ p["head"], -1) ** 2)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, _, norms = jax.jit(pe.per_example_grad_norms(loss))(params, xs)
    assert not [w for w in seen if SCAN_FALLBACK in str(w.message)], [str(w.message) for w in seen]
    assert_matches(norms, loss, params, xs)


# --------------------------------------------------------------- what still falls back, exactly


def test_stacked_leaf_also_used_outside_the_scan_still_falls_back():
    params = mlp_init(jax.random.key(10))
    x = jax.random.normal(jax.random.key(11), (6, 5))
    y = jax.random.normal(jax.random.key(12), (6, 3))

    def loss(p, x, y):  # a penalty on the stacked weight: a use outside any layer
        return scan_mlp_loss(p, x, y) + 1e-2 * jnp.sum(jnp.square(p["w"]))

    with pytest.warns(UserWarning, match="'w'"):
        _, _, norms = jax.jit(pe.per_example_grad_norms(loss))(params, x, y)
    assert_matches(norms, loss, params, x, y)


# ------------------------------------------------------------------ DP clipping and variance


def test_dp_clip_and_gradient_stats_under_scan():
    params = mlp_init(jax.random.key(15))
    x = jax.random.normal(jax.random.key(16), (8, 5))
    y = jax.random.normal(jax.random.key(17), (8, 3))
    grads = per_example_grads(scan_mlp_loss, params, x, y)
    total, _ = reference_norms(scan_mlp_loss, params, x, y)
    clip, sigma, key = float(np.median(total)), 0.0, jax.random.key(18)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, dp, _ = jax.jit(pe.dp_clip(clip, sigma, key)(scan_mlp_loss))(params, x, y, step=0)
    factor = np.minimum(1.0, clip / total)
    expected = jax.tree.map(lambda g: np.tensordot(factor, np.asarray(g, np.float64), axes=1) / 8, grads)
    tree_allclose(jax.tree.map(lambda a: np.asarray(a, np.float64), dp), expected, rtol=1e-5, atol=1e-6)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, stats = jax.jit(vk.inspect.gradient_stats(scan_mlp_loss, "w"))(params, x, y)
    variance = stats["w"].variance  # the layer 'w' takes the leaves w and b, keyed as records key them
    for leaf in ("w", "b"):
        expected = np.var(np.asarray(grads[leaf], np.float64), axis=0)
        np.testing.assert_allclose(variance[leaf], expected, rtol=1e-4, atol=1e-6, err_msg=leaf)
