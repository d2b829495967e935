"""``make_step(..., curvature_every=N)``: K-FAC statistics on every N-th step only.

The reference is a hand loop, never ``make_step``: on step ``t`` with ``t % N == 0`` a jitted
``vk.value_and_grad`` with the statistics capture (the key ``make_step`` draws from the state's
rng) and ``opt.update(..., curvature=captured)``, on the others ``jax.value_and_grad`` and
``opt.update(..., curvature=None)`` (K-FAC keeps its EMA and cached inverses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose


def _problem():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "fc1": {"weight": jax.random.normal(k[0], (6, 8)) * 0.4, "bias": jnp.zeros(8)},
        "fc2": {"weight": jax.random.normal(k[1], (8, 3)) * 0.4, "bias": jnp.zeros(3)},
    }
    x = jax.random.normal(k[2], (16, 6))
    y = jax.random.randint(k[3], (16,), 0, 3)

    def loss_fn(p, batch):
        xb, yb = batch
        h = jnp.tanh(xb @ p["fc1"]["weight"] + p["fc1"]["bias"])
        return vk.curvature.softmax_cross_entropy(h @ p["fc2"]["weight"] + p["fc2"]["bias"], yb)

    return loss_fn, params, (x, y)


@pytest.mark.parametrize("every", [1, 3])
def test_statistics_every_n_steps_equal_the_hand_loop(every):
    loss_fn, params, batch = _problem()
    spec = vk.curvature.stats("*", ["kfac"])
    grad_fn = jax.jit(vk.value_and_grad(loss_fn, capture=spec))
    like = jax.eval_shape(lambda p: grad_fn(p, batch, key=jax.random.key(0))[1], params)
    opt = vk.curvature.kfac(0.1, like=like, damping=0.1, update_every=2)
    step = vk.train.make_step(loss_fn, opt, capture=spec, curvature_every=every)
    state = vk.train.TrainState.create(params, opt, seed=5)
    got = []
    for _ in range(7):
        state, metrics = step(state, batch)
        got.append(metrics)

    p, s, rng = params, opt.init(params), jax.random.PRNGKey(5)
    update = jax.jit(lambda g, s, p, c: opt.update(g, s, p, curvature=c))
    plain = jax.jit(lambda g, s, p: opt.update(g, s, p, curvature=None))
    for t in range(7):
        rng, key = jax.random.split(rng)
        if t % every == 0:
            (loss, g), cap = grad_fn(p, batch, key=key)
            u, s = update(g, s, p, cap)
            tree_allclose(got[t]["captured"], cap, rtol=1e-5, atol=1e-7)
        else:
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            u, s = plain(g, s, p)
            assert all(np.isnan(a).all() for a in jax.tree.leaves(got[t]["captured"]))  # no statistics
        np.testing.assert_allclose(got[t]["loss"], loss, rtol=1e-5)
        p = optax.apply_updates(p, u)
    tree_allclose(state.params, p, rtol=1e-4, atol=1e-6)


def test_jitted_step_runs_the_branch_the_cond_would_take():
    """``make_step(jit=True)`` with ``curvature_every`` runs one of two programs, chosen on the
    host by K-FAC's count (XLA:CPU compiles convolutions in a ``lax.cond`` slowly); it equals the
    traceable step's ``lax.cond`` under ``jax.jit`` step for step, NaN records included."""
    loss_fn, params, batch = _problem()
    spec = vk.curvature.stats("*", ["kfac"])
    grad_fn = vk.value_and_grad(loss_fn, capture=spec)
    like = jax.eval_shape(lambda p: grad_fn(p, batch, key=jax.random.key(0))[1], params)
    opt = vk.curvature.kfac(0.1, like=like, damping=0.1, update_every=2)
    hosted = vk.train.make_step(loss_fn, opt, capture=spec, curvature_every=3)
    in_cond = jax.jit(vk.train.make_step(loss_fn, opt, capture=spec, curvature_every=3, jit=False))
    a = vk.train.TrainState.create(params, opt, seed=5)
    b = vk.train.TrainState.create(params, opt, seed=5)
    for t in range(7):
        a, got = hosted(a, batch)
        b, want = in_cond(b, batch)
        assert np.isnan(jax.tree.leaves(got["captured"])[0]).all() == (t % 3 != 0)
        tree_allclose(got, want, rtol=1e-5, atol=1e-7)  # NaN where both are NaN
    tree_allclose(a.params, b.params, rtol=1e-5, atol=1e-7)


def test_curvature_every_needs_statistics_only_and_a_taker():
    loss_fn, params, batch = _problem()
    spec = vk.curvature.stats("*", ["kfac"])
    with pytest.raises(vk.ConfigError, match="curvature_every must be an int >= 1"):
        vk.train.make_step(loss_fn, optax.sgd(0.1), capture=spec, curvature_every=0)
    with pytest.raises(vk.ConfigError, match=r"vk\.curvature\.stats specs only"):
        vk.train.make_step(loss_fn, optax.sgd(0.1), capture=[spec, vk.capture("*")], curvature_every=2)
    step = vk.train.make_step(loss_fn, optax.sgd(0.1), capture=spec, curvature_every=2)
    with pytest.raises(vk.ConfigError, match=r"holds no vk\.curvature\.kfac"):
        jax.eval_shape(step, vk.train.TrainState.create(params, optax.sgd(0.1)), batch)


@pytest.mark.slow
def test_fit_takes_curvature_every():
    loss_fn, params, batch = _problem()
    spec = vk.curvature.stats("*", ["kfac"])
    grad_fn = vk.value_and_grad(loss_fn, capture=spec)
    like = jax.eval_shape(lambda p: grad_fn(p, batch, key=jax.random.key(0))[1], params)
    opt = vk.curvature.kfac(0.1, like=like, damping=0.1)
    step = vk.train.make_step(loss_fn, opt, capture=spec, curvature_every=4)
    state = vk.train.TrainState.create(params, opt, seed=0)
    for _ in range(6):
        state, _ = step(state, batch)
    fitted, history = vk.train.fit(
        loss_fn, opt, params, [batch] * 6, capture=spec, curvature_every=4, progress=False
    )
    tree_allclose(fitted.params, state.params, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_fit_dispatches_two_programs_on_the_host(monkeypatch):
    """``fit(curvature_every=3)``, one step per dispatch, runs make_step's two programs (each
    traced once) chosen on the host, and equals ``fit`` with the ``lax.cond`` inside a scanned
    program (``scan_steps=2``); the records are NaN exactly on the steps without statistics."""
    from vjpkit.train import _fit

    loss_fn, params, batch = _problem()
    spec = vk.curvature.stats("*", ["kfac"])
    grad_fn = vk.value_and_grad(loss_fn, capture=spec)
    like = jax.eval_shape(lambda p: grad_fn(p, batch, key=jax.random.key(0))[1], params)
    opt = vk.curvature.kfac(0.1, like=like, damping=0.1, update_every=3)
    traced, real = [], _fit.build_step

    def spy(*args, **kwargs):
        fn = real(*args, **kwargs)

        def step(state, b):
            traced.append(kwargs.get("phase"))
            return fn(state, b)

        return step

    monkeypatch.setattr(_fit, "build_step", spy)
    seen = {}
    hosted, _ = vk.train.fit(
        loss_fn, opt, params, [batch] * 6, capture=spec, curvature_every=3, progress=False,
        on_records=lambda t, rec: seen.setdefault(t, rec),
    )  # fmt: skip
    assert traced.count("stats") == 1 and traced.count("plain") == 1, traced
    assert sorted(seen) == list(range(6))
    for t, rec in seen.items():
        assert np.isnan(jax.tree.leaves(rec)[0]).all() == (t % 3 != 0), t
    before = len(traced)
    scanned, _ = vk.train.fit(
        loss_fn, opt, params, [batch] * 6, capture=spec, curvature_every=3, scan_steps=2, progress=False
    )
    assert set(traced[before:]) == {None}  # the scanned program runs the cond
    tree_allclose(hosted.params, scanned.params, rtol=1e-5, atol=1e-7)
    tree_allclose(hosted.opt_state, scanned.opt_state, rtol=1e-5, atol=1e-7)


def test_multisteps_kfac_gets_the_statistics():
    """``optax.MultiSteps(kfac, 2)`` in ``make_step`` equals a hand loop of
    ``MultiSteps.update(..., curvature=)`` (its ``gradient_transformation()`` drops extra
    arguments: K-FAC got no statistics and every step was NaN)."""
    loss_fn, params, batch = _problem()
    spec = vk.curvature.stats("*", ["kfac"])
    grad_fn = jax.jit(vk.value_and_grad(loss_fn, capture=spec))
    like = jax.eval_shape(lambda p: grad_fn(p, batch, key=jax.random.key(0))[1], params)
    opt = optax.MultiSteps(vk.curvature.kfac(0.1, like=like, damping=0.1, update_every=2), 2)
    step = vk.train.make_step(loss_fn, opt, capture=spec)
    state = vk.train.TrainState.create(params, opt, seed=5)
    p, s, rng = params, opt.init(params), jax.random.PRNGKey(5)
    update = jax.jit(lambda g, s, p, c: opt.update(g, s, p, curvature=c))
    with jax.numpy_dtype_promotion("standard"):  # optax's MultiSteps arithmetic is not strict-clean
        for _ in range(4):
            state, _ = step(state, batch)
            rng, key = jax.random.split(rng)
            (_, g), cap = grad_fn(p, batch, key=key)
            u, s = update(g, s, p, cap)
            p = optax.apply_updates(p, u)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state.params))
    tree_allclose(state.params, p, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # the steps moved the params
        tree_allclose(p, params, rtol=1e-3, atol=1e-5)


def test_kfac_inside_a_transformation_without_extra_arguments_is_an_error():
    loss_fn, params, batch = _problem()
    spec = vk.curvature.stats("*", ["kfac"])
    like = jax.eval_shape(
        lambda p: vk.value_and_grad(loss_fn, capture=spec)(p, batch, key=jax.random.key(0))[1], params
    )
    kfac = vk.curvature.kfac(0.1, like=like, damping=0.1)
    opt = optax.GradientTransformation(kfac.init, lambda u, s, p=None: kfac.update(u, s, p))
    step = vk.train.make_step(loss_fn, opt, capture=spec)
    with pytest.raises(vk.ConfigError, match="extra arguments"):
        step(vk.train.TrainState.create(params, opt, seed=0), batch)
