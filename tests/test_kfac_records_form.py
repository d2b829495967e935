"""K-FAC's records form: ``(a A^-1)^T (d G^-1)`` from the gradient's rows (``grad_rows``).

The model has wide layers and a small batch (the records form's case): a dense layer with a
bias, dense layers stacked under ``lax.scan`` (one block per iteration), a weight a scan closes
over (its rows joined over the iterations) and a narrow head. Oracles (float64): the same
optimizer without the rows (the Kronecker form ``A^-1 M G^-1``); a NumPy solve for the block.
Where the updates are not the rows' gradient (weight decay added before K-FAC in a chain) the
result is still the Kronecker form's.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit.curvature import Factors, Layout, _blocks, _kfac, kronecker_block

# The default tier runs this test's eager twin (conftest.py): the first one's is slow.
DEFAULT_TIER_EAGER = "test_grad_rows_give_each_dense_gradient"

N, IN, H, C = 8, 48, 64, 10


pytestmark = pytest.mark.usefixtures("x64")  # float64 (conftest)


def problem(seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *s: rng.standard_normal(s) / np.sqrt(s[-2])
    params = {
        "inp": {"w": w(IN, H), "b": 0.1 * rng.standard_normal(H)},
        "blocks": {"w": np.stack([w(H, H), w(H, H)]), "b": 0.1 * rng.standard_normal((2, H))},
        "shared": w(H, H),
        "out": {"w": w(H, C), "b": 0.1 * rng.standard_normal(C)},
    }
    return params, rng.standard_normal((N, IN)), rng.integers(0, C, N)


def model(p, x):
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
    h, _ = lax.scan(lambda h, q: (jnp.tanh(h @ q["w"] + q["b"]), None), h, p["blocks"])
    h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ p["shared"]), None), h, None, length=2)
    return h @ p["out"]["w"] + p["out"]["b"]


def loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(model(p, x), y)


def run(which, steps=3, chain=None, jit=False, rows_only_every=0):
    """``steps`` K-FAC updates; every ``rows_only_every``-th one (after the first) with the
    rows-only capture (no statistics) when given. Returns the params."""
    params, x, y = problem()
    g = vk.value_and_grad(loss, capture=vk.curvature.stats("*", which))
    g_rows = vk.value_and_grad(loss, capture=vk.curvature.stats("*", ["grad_rows"]))
    like = jax.eval_shape(g, params, x, y, key=jax.random.key(0))[1]
    opt = vk.curvature.kfac(0.1, like=like, damping=1e-2, momentum=0.5, update_every=2)
    if chain is not None:
        opt = optax.chain(chain, opt)
    state = opt.init(params)

    def step(params, state, k, i):
        if rows_only_every and i and i % rows_only_every == 0:
            (_, grads), cur = g_rows(params, x, y)
        else:
            (_, grads), cur = g(params, x, y, key=k)
        updates, state = opt.update(grads, state, params, curvature=cur)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, static_argnums=3) if jit else step
    for i, k in enumerate(jax.random.split(jax.random.key(3), steps)):
        params, state = step(params, state, k, i)
    return params


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_records_form_equals_the_kronecker_form(jit):
    want = run(["kfac"], jit=jit)
    got = run(["kfac", "grad_rows"], jit=jit)
    tree_allclose(got, want, rtol=1e-9, atol=1e-12)
    moved = run(["kfac"], steps=0)
    with pytest.raises(AssertionError):  # the steps did something
        tree_allclose(want, moved, rtol=1e-3, atol=1e-6)


def test_rows_only_steps_equal_steps_without_statistics():
    params, x, y = problem()
    g = vk.value_and_grad(loss, capture=vk.curvature.stats("*", ["kfac"]))
    g_rows = vk.value_and_grad(loss, capture=vk.curvature.stats("*", ["grad_rows"]))
    (_, grads), cur = g(params, x, y, key=jax.random.key(0))
    opt = vk.curvature.kfac(0.1, like=cur, damping=1e-2)
    _, state = opt.update(grads, opt.init(params), params, curvature=cur)
    (_, grads), rows = g_rows(params, x, y)
    assert all(rows[k].grad_rows is not None for k in ("inp", "blocks", "shared", "out"))
    want, state_want = opt.update(grads, state, params)
    got, state_got = opt.update(grads, state, params, curvature=rows)
    # the records form's one decision per block (a lax.cond), only with the rows
    assert "cond" not in str(jax.make_jaxpr(lambda g: opt.update(g, state, params))(grads))
    assert "cond" in str(jax.make_jaxpr(lambda g, r: opt.update(g, state, params, curvature=r))(grads, rows))
    tree_allclose(got, want, rtol=1e-9, atol=1e-12)
    tree_allclose(state_got, state_want, rtol=0, atol=0)  # no statistics taken


def test_updates_that_are_not_the_rows_gradient_take_the_kronecker_form():
    decay = optax.add_decayed_weights(1e-3)
    want = run(["kfac"], chain=decay)
    got = run(["kfac", "grad_rows"], chain=decay)
    tree_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_make_step_takes_the_rows_between_statistics(monkeypatch):
    params, x, y = problem()
    seen = {}
    block_rows = _kfac._block_rows
    monkeypatch.setattr(
        _kfac, "_block_rows", lambda *a: seen[len(results)].append(sorted(out := block_rows(*a))) or out
    )
    results = []
    for which in (["kfac"], ["kfac", "grad_rows"]):
        seen[len(results)] = []
        spec = vk.curvature.stats("*", which)
        like = jax.eval_shape(vk.value_and_grad(loss, capture=spec), params, x, y, key=jax.random.key(0))[1]
        opt = vk.curvature.kfac(0.1, like=like, damping=1e-2, update_every=2)
        step = vk.train.make_step(lambda p, b, key: loss(p, *b), opt, capture=spec, curvature_every=2)
        state = vk.train.TrainState.create(params, opt, seed=0)
        for _ in range(4):
            state, _ = step(state, (x, y))
        results.append(state.params)
    tree_allclose(results[1], results[0], rtol=1e-9, atol=1e-12)
    # each trace of an update: without the rows none; with them every Kronecker block's, in both
    # programs (the statistics' and the plain one)
    assert seen[0] and all(got == [] for got in seen[0]), seen
    assert len(seen[1]) >= 2 and all(got == ["blocks", "inp", "out", "shared"] for got in seen[1]), seen


def _block(lead=(), diag_g=False, d_a=7, d_g=9):
    rng = np.random.default_rng(1)

    def spd(d):
        m = rng.standard_normal((*lead, d, d))
        return m @ np.swapaxes(m, -1, -2) / d + np.eye(d)

    layout = Layout("dense", "w", "b")
    block = kronecker_block(layout, d_a, d_g, dtype=jnp.float64, lead=lead, diag_g=diag_g)
    g_side = np.abs(rng.standard_normal((*lead, d_g))) + 0.5 if diag_g else spd(d_g)
    state = block.refresh(block.update(block.init(), Factors(spd(d_a), g_side), 0.0), 0.01)
    a = rng.standard_normal((*lead, 3, d_a))
    a[..., -1] = 1.0  # the bias's input
    d = rng.standard_normal((*lead, 3, d_g))
    m = np.einsum("...ra,...rg->...ag", a, d)
    return block, state, (a, d), (m[..., :-1, :], m[..., -1, :])


@pytest.mark.parametrize("lead", [(), (2,)], ids=["one", "per-slice"])
@pytest.mark.parametrize("diag_g", [False, True], ids=["dense", "diagonal-G"])
def test_block_records_form_equals_numpy(lead, diag_g):
    block, state, rows, grads = _block(lead, diag_g)
    got = block.precondition(state, grads, rows)
    want = block.precondition(state, grads)
    tree_allclose(got, want, rtol=1e-10, atol=1e-12)
    a_inv, g_inv = np.asarray(state.cache.A), np.asarray(state.cache.G)
    m = np.concatenate([grads[0], grads[1][..., None, :]], axis=-2)
    ref = a_inv @ m @ (np.vectorize(np.diag, signature="(n)->(n,n)")(g_inv) if diag_g else g_inv)
    np.testing.assert_allclose(np.concatenate([got[0], got[1][..., None, :]], axis=-2), ref, rtol=1e-10)
    assert "cond" in str(jax.make_jaxpr(lambda g, r: block.precondition(state, g, r))(grads, rows))


def test_block_takes_the_kronecker_form_when_it_is_cheaper():
    block, state, (a, d), grads = _block(d_a=3, d_g=2)  # 3 rows over a 3 x 2 matrix: no gain
    text = str(jax.make_jaxpr(lambda g, r: block.precondition(state, g, r))(grads, (a, d)))
    assert "cond" not in text


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_rows_give_each_dense_gradient(jit):
    """``a^T d`` is the call's gradient of ``[W; b]`` (``jax.grad``): per iteration of the stacked
    blocks, summed over the iterations of the closed-over weight."""
    params, x, y = problem()
    g = vk.grad(loss, capture=vk.curvature.stats("*", ["grad_rows"]))
    grads, cap = (jax.jit(g) if jit else g)(params, x, y)
    want = jax.grad(loss)(params, x, y)

    def m(r):
        return np.einsum("...ra,...rg->...ag", r.a, r.d)

    got = m(cap["inp"].grad_rows)
    np.testing.assert_allclose(got, np.concatenate([want["inp"]["w"], want["inp"]["b"][None]]), rtol=1e-10)
    got = m(cap["blocks"].grad_rows)  # (2, H + 1, H): one per block
    np.testing.assert_allclose(
        got, np.concatenate([want["blocks"]["w"], want["blocks"]["b"][:, None]], 1), rtol=1e-10
    )
    np.testing.assert_allclose(m(cap["shared"].grad_rows).sum(0), want["shared"], rtol=1e-10)
    tree_allclose(grads, want, rtol=1e-12, atol=1e-14)


def test_rows_with_another_estimators_statistics_are_an_error():
    """A curvature dict with rows and ``kflr`` given to ``kfac(estimator="kfac")`` is not a
    rows-only step: the missing ``kfac`` field is an error, as without the rows."""
    params, x, y = problem()
    (_, grads), cur = vk.value_and_grad(loss, capture=vk.curvature.stats("*", ["kfac"]))(
        params, x, y, key=jax.random.key(0)
    )
    (_, grads), other = vk.value_and_grad(loss, capture=vk.curvature.stats("*", ["kflr", "grad_rows"]))(
        params, x, y
    )
    opt = vk.curvature.kfac(0.1, like=cur, damping=1e-2)
    _, state = opt.update(grads, opt.init(params), params, curvature=cur)
    with pytest.raises(vk.ConfigError, match="kfac"):
        opt.update(grads, state, params, curvature=other)


@pytest.mark.parametrize("pre", ["identity", "decay", "clip"])
def test_float32_check_catches_a_small_change_before_kfac(pre):
    """In float32 the check tells a gradient changed by weight decay 1e-4, or by a clip that
    barely acts (0.999 of its norm), from rounding: the update equals the Kronecker form's to
    float32 rounding (a looser check took the records form there, 1e-2 off); unchanged, the
    records form is taken (a spy on the block's cond)."""
    with jax.enable_x64(False):
        rng = np.random.default_rng(0)
        params = {
            "inp": {
                "w": (rng.standard_normal((256, 512)) / 16).astype(np.float32),
                "b": np.zeros(512, np.float32),
            },
            "out": {"w": (rng.standard_normal((512, 10)) / 22).astype(np.float32)},
        }
        x, y = rng.standard_normal((64, 256)).astype(np.float32), rng.integers(0, 10, 64)

        def loss32(p, x, y):
            h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
            return vk.curvature.softmax_cross_entropy(h @ p["out"]["w"], y)

        (_, grads), cur = vk.value_and_grad(loss32, capture=vk.curvature.stats("*", ["kfac"]))(
            params, x, y, key=jax.random.key(0)
        )
        rows = vk.value_and_grad(loss32, capture=vk.curvature.stats("*", ["kfac", "grad_rows"]))
        cur_rows = rows(params, x, y, key=jax.random.key(0))[1]
        norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))))
        before = {
            "identity": optax.identity(),
            "decay": optax.add_decayed_weights(1e-4),
            "clip": optax.clip_by_global_norm(0.999 * norm),
        }[pre]
        taken = []
        cond = _blocks.lax.cond

        def spy(pred, *branches):
            taken.append(bool(pred))
            return cond(pred, *branches)

        def update(curvature):
            opt = optax.chain(before, vk.curvature.kfac(1.0, like=cur, damping=1e-3))
            return opt.update(grads, opt.init(params), params, curvature=curvature)[0]

        want = update(cur)
        _blocks.lax = types.SimpleNamespace(cond=spy)
        try:
            got = update(cur_rows)
        finally:
            _blocks.lax = lax
        assert taken == [pre == "identity"], taken
        tree_allclose(got, want, rtol=2e-4, atol=2e-5)  # entries ~1; decay dropped: 1e-2 off
