"""A dense weight used by several calls (issue 32, item 4): its per-example curvature statistics
are the weight's, with the cross terms between its calls, the same in every call's entry.

Oracles (float64): the GGN of the whole weight by brute force (``jax.jacobian`` of the model
output with respect to the weight, the loss's Hessian with respect to the output), its diagonal;
``jax.vmap(jax.grad)`` of the per-example losses for ``sum_grad_squared`` and ``batch_l2``
(BackPACK's convention: of ``grad l_n / N``). The sum of the calls' own diagonals, what each entry
held before, differs from the oracle: the test can fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk

N, D, C = 6, 3, 4


pytestmark = pytest.mark.usefixtures("x64")  # float64 (conftest)


def problem():
    rng = np.random.default_rng(0)
    params = {
        "w": {"w": rng.standard_normal((D, D)) * 0.7, "b": rng.standard_normal(D) * 0.1},
        "head": {"w": rng.standard_normal((D, C)) * 0.7, "b": np.zeros(C)},
    }
    x = rng.standard_normal((N, D))
    y = rng.integers(0, C, N)
    return params, x, y


def model(p, x):
    h = jnp.tanh(x @ p["w"]["w"] + p["w"]["b"])
    h = jnp.tanh(h @ p["w"]["w"] + p["w"]["b"])  # the same weight and bias, called again
    return h @ p["head"]["w"] + p["head"]["b"]


def loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(model(p, x), y)


def plain_loss(p, x, y):
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(model(p, x)), y[:, None], 1))


def ggn_diagonal(params, x, leaf):
    """The diagonal of the GGN of ``params["w"][leaf]`` (all its uses), by brute force."""

    def out(v):
        return model({**params, "w": {**params["w"], leaf: v}}, x)

    jac = jax.jacobian(out)(params["w"][leaf]).reshape(N, C, -1)
    prob = jax.nn.softmax(out(params["w"][leaf]))
    hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob) / N
    ggn = jnp.einsum("ncp,ncd,ndq->pq", jac, hess, jac)
    return np.diag(ggn).reshape(params["w"][leaf].shape)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_diag_ggn_of_a_weight_used_twice_is_its_whole_diagonal(jit):
    params, x, y = problem()
    spec = vk.curvature.stats("*", ["diag_ggn", "kflr"])
    g = vk.grad(loss, capture=spec)
    _, cap = (jax.jit(g) if jit else g)(params, x, y)
    for leaf in ("w", "b"):
        want = ggn_diagonal(params, x, leaf)
        for key in ("w", "w#1"):  # the weight's, in each call's entry
            np.testing.assert_allclose(cap[key].diag_ggn[leaf], want, rtol=1e-10, atol=1e-14, err_msg=key)
    np.testing.assert_allclose(cap["head"].diag_ggn["w"], ggn_diagonal_head(params, x), rtol=1e-10)
    assert cap["w"].kflr is not None and cap["w#1"].kflr is not None  # factors stay per call
    assert not np.allclose(np.asarray(cap["w"].kflr.A), np.asarray(cap["w#1"].kflr.A))


def ggn_diagonal_head(params, x):
    def out(v):
        return model({**params, "head": {**params["head"], "w": v}}, x)

    jac = jax.jacobian(out)(params["head"]["w"]).reshape(N, C, -1)
    prob = jax.nn.softmax(out(params["head"]["w"]))
    hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob) / N
    return np.diag(jnp.einsum("ncp,ncd,ndq->pq", jac, hess, jac)).reshape(D, C)


def test_per_call_diagonals_summed_are_not_the_weights():
    """What the entries held before: each call's own diagonal; their sum misses the cross terms."""
    params, x, y = problem()
    single = vk.curvature.stats("w#0", ["diag_ggn"])
    other = vk.curvature.stats("w#1", ["diag_ggn"])
    _, a = vk.grad(loss, capture=single)(params, x, y)
    _, b = vk.grad(loss, capture=other)(params, x, y)  # one call chosen: its own diagonal
    summed = np.asarray(a["w"].diag_ggn["w"]) + np.asarray(b["w#1"].diag_ggn["w"])
    assert not np.allclose(summed, ggn_diagonal(params, x, "w"), rtol=1e-3)


def test_first_order_statistics_of_a_shared_weight_equal_vmap_grad():
    params, x, y = problem()
    spec = vk.curvature.stats("*", ["sum_grad_squared", "batch_l2", "backpack_variance"])
    grads, cap = jax.jit(vk.grad(loss, capture=spec))(params, x, y)

    def one(p, xi, yi):
        return plain_loss(p, xi[None], yi[None])

    per = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)  # grad l_n
    for leaf in ("w", "b"):
        g = np.asarray(per["w"][leaf]) / N  # BackPACK's g_n = grad l_n / N
        sgs = np.sum(np.square(g), 0)
        l2 = np.sum(np.square(g).reshape(N, -1), 1)
        var = sgs / N - np.square(g.sum(0) / N)
        for key in ("w", "w#1"):
            np.testing.assert_allclose(cap[key].sum_grad_squared[leaf], sgs, rtol=1e-10, atol=1e-15)
            np.testing.assert_allclose(cap[key].batch_l2[leaf], l2, rtol=1e-10, atol=1e-15)
            np.testing.assert_allclose(cap[key].backpack_variance[leaf], var, rtol=1e-10, atol=1e-15)
        np.testing.assert_allclose(grads["w"][leaf], g.sum(0), rtol=1e-10)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_weight_closed_over_by_a_scan_has_its_whole_diagonal(jit):
    """An RNN's recurrent weight, the same in every step (a ``lax.scan`` closing over it): each
    iteration is one more call, and every iteration's entry holds the weight's whole diagonal."""
    rng = np.random.default_rng(1)
    steps = 3
    params = {"w": rng.standard_normal((D, D)) * 0.5, "head": {"w": rng.standard_normal((D, C)) * 0.5}}
    xs = rng.standard_normal((steps, N, D))
    y = rng.integers(0, C, N)

    def rnn(p, xs):
        h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ p["w"] + x), None), jnp.zeros((N, D)), xs)
        return h @ p["head"]["w"]

    def rnn_loss(p, xs, y):
        return vk.curvature.softmax_cross_entropy(rnn(p, xs), y)

    g = vk.grad(rnn_loss, capture=vk.curvature.stats("*", ["diag_ggn", "sum_grad_squared"]))
    _, cap = (jax.jit(g) if jit else g)(params, xs, y)
    (key,) = [k for k in cap if cap[k].layout.weight_leaf == (jax.tree_util.DictKey("w"),)]
    assert cap[key].layout.scans == "c"
    jac = jax.jacobian(lambda w: rnn({**params, "w": w}, xs))(params["w"]).reshape(N, C, -1)
    prob = jax.nn.softmax(rnn(params, xs))
    hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob) / N
    want = np.diag(jnp.einsum("ncp,ncd,ndq->pq", jac, hess, jac)).reshape(D, D)
    got = np.asarray(jax.tree.leaves(cap[key].diag_ggn)[0])
    assert got.shape == (steps, D, D)  # one entry per iteration, each the weight's
    for t in range(steps):
        np.testing.assert_allclose(got[t], want, rtol=1e-10, atol=1e-14)

    def one(p, xi, yi):
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(rnn(p, xi[:, None])), yi[None, None], 1))

    per = jax.vmap(jax.grad(one), in_axes=(None, 1, 0))(params, xs, y)["w"] / N
    sgs = np.asarray(jax.tree.leaves(cap[key].sum_grad_squared)[0])
    np.testing.assert_allclose(sgs[0], np.sum(np.square(np.asarray(per)), 0), rtol=1e-10, atol=1e-15)
