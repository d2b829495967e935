"""Curvature on a sequence model: ``vk.curvature.softmax_cross_entropy`` over ``(B, T, C)``
logits (issue 31). The examples are the ``B`` sequences, the loss a mean over the ``B * T``
positions; the exact statistics equal brute-force references (the GGN from the Jacobian and
each position's Hessian block, per-sequence gradients from ``jax.vmap(jax.grad)``), also with
the positions mixed inside the model (a causal running mean), and equal the same statistics of
the flattened ``(B * T, C)`` problem where that is the same function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.test_curvature import JIT

F64 = {"rtol": 1e-9, "atol": 1e-12}


@pytest.fixture
def f64():
    with jax.enable_x64(True):
        yield


B, T, DIN, H, C = 3, 4, 3, 5, 4


def params(seed=0):
    k = iter(jax.random.split(jax.random.key(seed), 4))
    normal = lambda *shape: jax.random.normal(next(k), shape, jnp.float64)
    return {
        "fc": {"w": normal(DIN, H), "b": 0.1 * normal(H)},
        "out": {"w": normal(H, C) / 2, "b": 0.1 * normal(C)},
    }


def model(p, x, mix=False):
    h = jnp.tanh(x @ p["fc"]["w"] + p["fc"]["b"])
    if mix:  # a causal running mean: every position reads the ones before it
        h = jnp.cumsum(h, axis=-2) / jnp.arange(1, h.shape[-2] + 1, dtype=h.dtype)[:, None]
    return h @ p["out"]["w"] + p["out"]["b"]


def data(kind, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, T, DIN)))
    labels = rng.integers(0, C, (B, T))
    if kind == "int":
        return x, jnp.asarray(labels, jnp.int32)
    if kind == "onehot":
        return x, jax.nn.one_hot(labels, C, dtype=jnp.float64)
    return x, jnp.asarray(rng.uniform(0.1, 0.6, (B, T, C)))  # soft rows not summing to 1


def ce(logits, target):  # the reference loss term of one position
    if target.ndim == 0:
        return -jax.nn.log_softmax(logits)[target]
    return -jnp.sum(target * jax.nn.log_softmax(logits))


def brute(p, x, y, mix):
    """diag GGN, per-sequence gradients of l_b / B (l_b the mean over its positions)."""
    flat, unravel = ravel_pytree(p)
    logits = model(p, x, mix)
    jac = jax.jacobian(lambda f: model(unravel(f), x, mix))(flat)  # (B, T, C, P)
    hess = jax.vmap(jax.vmap(jax.hessian(ce)))(logits, y) / (B * T)  # (B, T, C, C)
    ggn = jnp.einsum("ntap,ntab,ntbq->pq", jac, hess, jac)

    def seq_loss(q, xb, yb):
        return jnp.mean(jax.vmap(ce)(model(q, xb[None], mix)[0], yb)) / B

    per = jax.vmap(jax.grad(seq_loss), in_axes=(None, 0, 0))(p, x, y)
    return unravel(jnp.diag(ggn)), per


STATS = ["diag_ggn", "batch_l2", "sum_grad_squared", "backpack_variance"]


CASES = [
    pytest.param(mode, kind, mix, id=f"{mode}-{kind}-{'mix' if mix else 'positionwise'}",
                 marks=pytest.mark.slow if mode == "eager" and (kind, mix) != ("int", False) else ())
    for mode in ("jit", "eager")
    for kind in ("int", "onehot", "soft")
    for mix in (False, True)
]  # fmt: skip


@pytest.mark.parametrize("mode, kind, mix", CASES)
def test_sequence_statistics_equal_brute_force(mode, kind, mix, f64):
    p, (x, y) = params(), data(kind)

    def loss(q, x, y):
        return vk.curvature.softmax_cross_entropy(model(q, x, mix), y)

    spec = vk.curvature.stats("*", STATS)
    (value, grads), got = JIT[mode](vk.value_and_grad(loss, capture=spec))(p, x, y)
    ref_loss = jnp.mean(jax.vmap(jax.vmap(ce))(model(p, x, mix), y))
    tree_allclose(value, ref_loss, **F64)
    diag, per = brute(p, x, y, mix)
    tree_allclose(grads, jax.tree.map(lambda g: g.sum(0), per), **F64)
    for name in ("fc", "out"):
        g = per[name]
        tree_allclose(got[name].diag_ggn, diag[name], **F64)
        tree_allclose(got[name].sum_grad_squared, jax.tree.map(lambda a: jnp.sum(a**2, 0), g), **F64)
        l2 = sum(jnp.sum(a.reshape(B, -1) ** 2, 1) for a in jax.tree.leaves(g))
        tree_allclose(sum(jax.tree.leaves(got[name].batch_l2)), l2, **F64)
        var = jax.tree.map(lambda a: jnp.sum(a**2, 0) / B - (jnp.sum(a, 0) / B) ** 2, g)
        tree_allclose(got[name].backpack_variance, var, **F64)


def test_diag_ggn_equals_the_flattened_problem(f64):
    """Position-wise, ``(B, T, C)`` and ``(B * T, C)`` are one function with one GGN."""
    p, (x, y) = params(2), data("int", 3)
    spec = vk.curvature.stats("*", ["diag_ggn", "kflr"])
    seq = jax.jit(vk.grad(lambda q, x, y: vk.curvature.softmax_cross_entropy(model(q, x), y), capture=spec))
    ce_loss = vk.curvature.softmax_cross_entropy
    flat_loss = lambda q, x, y: ce_loss(model(q, x.reshape(-1, DIN)), y.reshape(-1))
    flat = jax.jit(vk.grad(flat_loss, capture=spec))
    (g1, s1), (g2, s2) = seq(p, x, y), flat(p, x, y)
    tree_allclose(g1, g2, **F64)
    for name in ("fc", "out"):
        tree_allclose(s1[name].diag_ggn, s2[name].diag_ggn, **F64)
        # G sums over the seeds and rows alike; A is normalised by the examples (B against B * T)
        tree_allclose(s1[name].kflr.G, s2[name].kflr.G, **F64)
        tree_allclose(s1[name].kflr.A, s2[name].kflr.A * T, **F64)


def test_monte_carlo_seeds_sample_each_position(f64):
    """kfac's G from sampled labels converges to the exact one (independent positions)."""
    p, (x, y) = params(4), data("int", 5)
    loss = lambda q, x, y: vk.curvature.softmax_cross_entropy(model(q, x), y)
    exact = jax.jit(vk.grad(loss, capture=vk.curvature.stats("out", ["kflr"])))(p, x, y)[1]["out"].kflr.G
    mc = vk.grad(loss, capture=vk.curvature.stats("out", ["kfac"], mc_samples=4000))
    got = jax.jit(mc)(p, x, y, key=jax.random.key(0))[1]["out"].kfac.G
    scale = float(jnp.max(jnp.abs(exact)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(exact), rtol=0.1, atol=0.05 * scale)


def test_label_shape_errors_name_both_shapes():
    logits = jnp.zeros((B, T, C))
    with pytest.raises(vk.ConfigError, match=r"integer classes \(3, 4\).*int32\[3\]"):
        vk.curvature.softmax_cross_entropy(logits, jnp.zeros((B,), jnp.int32))
    with pytest.raises(vk.ConfigError, match=r"at rows \[\(1, 2\)\]"):
        vk.curvature.softmax_cross_entropy(logits, jnp.zeros((B, T), jnp.int32).at[1, 2].set(C))
