"""K-FAC on blocks under ``lax.scan`` (issue 32): a weight stacked as the scan's ``xs`` is one
K-FAC block per slice, and a weight the scan closes over is one shared block, so the optimizer's
update equals that of the same model unrolled into separate (or shared) weights, step after
step, and no layer falls back to SGD.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose

L, D, C, B = 3, 4, 3, 6


def params(seed=0):
    k = iter(jax.random.split(jax.random.key(seed), 6))
    n = lambda *s, scale=0.5: scale * jax.random.normal(next(k), s)
    return {"blocks": {"w": n(L, D, D), "b": n(L, D, scale=0.1)}, "shared": n(D, D), "out": {"w": n(D, C)}}


def scanned(p, x, y):
    def body(h, bp):
        h = jnp.tanh(h @ bp["w"] + bp["b"])  # stacked: one slice per iteration
        return jnp.tanh(h @ p["shared"]), None  # closed over: the same weight every iteration

    h, _ = jax.lax.scan(body, x, p["blocks"])
    return vk.curvature.softmax_cross_entropy(h @ p["out"]["w"], y)


def fori(p, x, y):  # the same model as a fori_loop indexing the stacked weights by its counter
    def body(i, h):
        h = jnp.tanh(h @ p["blocks"]["w"][i] + p["blocks"]["b"][i])
        return jnp.tanh(h @ p["shared"])

    return vk.curvature.softmax_cross_entropy(jax.lax.fori_loop(0, L, body, x) @ p["out"]["w"], y)


def unrolled_params(p):
    q = {f"block{i}": {"w": p["blocks"]["w"][i], "b": p["blocks"]["b"][i]} for i in range(L)}
    return {**q, "shared": p["shared"], "out": p["out"]}


def unrolled(q, x, y):
    h = x
    for i in range(L):
        h = jnp.tanh(jnp.tanh(h @ q[f"block{i}"]["w"] + q[f"block{i}"]["b"]) @ q["shared"])
    return vk.curvature.softmax_cross_entropy(h @ q["out"]["w"], y)


def restack(u):
    blocks = {k: jnp.stack([u[f"block{i}"][k] for i in range(L)]) for k in ("w", "b")}
    return {"blocks": blocks, "shared": u["shared"], "out": u["out"]}


def run(loss, p, steps, solver):
    spec = vk.curvature.stats("*", ["kflr"])
    grad = jax.jit(vk.grad(loss, capture=spec))
    x = jax.random.normal(jax.random.key(1), (B, D))
    y = jax.random.randint(jax.random.key(2), (B,), 0, C)
    like = jax.eval_shape(grad, p, x, y)[1]
    opt = vk.curvature.kfac(0.1, like=like, estimator="kflr", damping=1e-2, solver=solver, momentum=0.5)
    state = opt.init(p)
    update = jax.jit(lambda g, s, p, c: opt.update(g, s, p, curvature=c))
    out = []
    for _ in range(steps):
        g, curvature = grad(p, x, y)
        updates, state = update(g, state, p, curvature)
        p = optax.apply_updates(p, updates)
        out.append(updates)
    return out, state, like


@pytest.mark.parametrize("loop, solver", [("scan", "inverse"), ("scan", "eigh"), ("fori", "inverse")])
def test_scanned_blocks_equal_the_unrolled_model(loop, solver):
    p = params()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer falls back to SGD
        got, state, like = run(scanned if loop == "scan" else fori, p, 3, solver)
        want, _, _ = run(unrolled, unrolled_params(p), 3, solver)
    for g, w in zip(got, want):
        tree_allclose(g, restack(w), rtol=2e-4, atol=1e-6)
    assert like["blocks"].layout.scans == "s" and like["shared"].layout.scans == "c"
    assert state.factors["blocks"].A.shape == (L, D + 1, D + 1)  # one factor pair per slice
    assert state.factors["shared"].A.shape == (D, D)  # one shared block, summed over iterations


def test_a_stacked_leaf_of_the_wrong_length_is_an_error():
    p = params()
    x = jnp.ones((B, D))
    y = jnp.zeros((B,), jnp.int32)
    like = jax.eval_shape(vk.grad(scanned, capture=vk.curvature.stats("*", ["kflr"])), p, x, y)[1]
    opt = vk.curvature.kfac(0.1, like=like, estimator="kflr")
    bad = {**p, "blocks": jax.tree.map(lambda a: a[:2], p["blocks"])}
    with pytest.raises(vk.ConfigError, match=r"given to lax.scan as xs with \(3,\) iterations"):
        opt.init(bad)
    np.testing.assert_array_equal(opt.init(p).count, 0)


def test_kfac_without_statistics_is_an_error_not_sgd():
    """``like={}``, a first ``update()`` without ``curvature=``, and ``make_step`` / ``fit`` with a
    K-FAC optimizer but no ``vk.curvature.stats`` capture would each be momentum SGD."""
    with pytest.raises(vk.ConfigError, match="nothing to precondition"):
        vk.curvature.kfac(0.1, like={})
    p = params()
    x, y = jax.random.normal(jax.random.key(1), (B, D)), jnp.zeros((B,), jnp.int32)
    grad = vk.grad(scanned, capture=vk.curvature.stats("*", ["kflr"]))
    g, curvature = grad(p, x, y)
    opt = vk.curvature.kfac(0.1, like=curvature, estimator="kflr")
    with pytest.raises(vk.ConfigError, match="first update"):
        opt.update(g, opt.init(p), p)
    _, state = opt.update(g, opt.init(p), p, curvature=curvature)
    opt.update(g, state, p)  # later steps may reuse the cached inverses

    loss = lambda p, batch: scanned(p, *batch)
    state = vk.train.TrainState.create(p, opt)
    with pytest.raises(vk.ConfigError, match=r"capture= has none"):
        vk.train.make_step(loss, opt)(state, (x, y))
    with pytest.raises(vk.ConfigError, match=r"capture= has none"):
        vk.train.fit(loss, opt, p, (x, y), batch_size=B, steps=1, progress=False)
    step = vk.train.make_step(loss, opt, capture=vk.curvature.stats("*", ["kflr"]))
    new, _ = step(state, (x, y))
    assert int(new.step) == 1


def test_nested_scans_slice_outside_and_share_inside():
    """A weight sliced by an outer scan and closed over by an inner one (``scans == "sc"``): one
    block per outer slice, its factors summed over the inner iterations, as the unrolled model
    with each slice shared by its inner steps."""
    k = jax.random.split(jax.random.key(5), 2)
    p = {"w": 0.5 * jax.random.normal(k[0], (2, D, D)), "out": 0.5 * jax.random.normal(k[1], (D, C))}

    def nested(p, x, y):
        def outer(h, w):
            return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h, None, length=3)[0], None

        h, _ = jax.lax.scan(outer, x, p["w"])
        return vk.curvature.softmax_cross_entropy(h @ p["out"], y)

    def flat(q, x, y):
        h = x
        for i in range(2):
            for _ in range(3):
                h = jnp.tanh(h @ q[f"w{i}"])
        return vk.curvature.softmax_cross_entropy(h @ q["out"], y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, state, like = run(nested, p, 2, "inverse")
        want, _, _ = run(flat, {"w0": p["w"][0], "w1": p["w"][1], "out": p["out"]}, 2, "inverse")
    assert like["w"].layout.scans == "sc" and state.factors["w"].A.shape == (2, D, D)
    for g, w in zip(got, want):
        tree_allclose(g, {"w": jnp.stack([w["w0"], w["w1"]]), "out": w["out"]}, rtol=2e-4, atol=1e-6)
