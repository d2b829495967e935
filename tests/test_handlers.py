"""Handlers: forward-mode hooks go through the engine's handler type, and hooks run beside
curvature statistics in one call (each hook once; the statistics those of the loss)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax import lax

import vjpkit as vk
from vjpkit import _context, _engine
from vjpkit._jvp_rule import TangentScope

from . import test_curvature_blocks as cb
from .helpers import tree_allclose
from .models import dense_fn, mlp, mlp_setup

# --- forward mode ------------------------------------------------------------------------


def _chain_with_doubled_fc2(params, x, tp, tx):
    """``jax.jvp`` of the MLP by hand, with fc2's output tangent doubled."""
    h1, t1 = jax.jvp(dense_fn, (params["fc1"], x), (tp["fc1"], tx))
    a1, s1 = jax.jvp(jax.nn.relu, (h1,), (t1,))
    h2, t2 = jax.jvp(dense_fn, (params["fc2"], a1), (tp["fc2"], s1))
    a2, s2 = jax.jvp(jax.nn.relu, (h2,), (2 * t2,))
    return jax.jvp(dense_fn, (params["fc3"], a2), (tp["fc3"], s2))


def test_forward_mode_records_go_through_the_scope_handler(maybe_jit):
    """The custom_jvp rule hands each call's ``Tangents`` to the scope's handler (an engine
    ``Handler``), and the output tangent the handler returns is what the layers above get."""
    params, x, _ = mlp_setup()
    keys = jax.random.split(jax.random.key(3), 4)
    tp = jax.tree.map(lambda a: jax.random.normal(keys[0], a.shape), params)
    tx = jax.random.normal(keys[1], x.shape)
    seen = []

    def after(site, rec, state, parts):
        seen.append((site.name, site.call, rec.name, rec.call, tuple(rec.tangent_output.shape)))
        if site.name == "fc2":
            rec = rec.replace(tangent_output=2 * rec.tangent_output)
        return rec, state

    config = _engine.configure((("fc*", (lambda rec: None,)),), (), "test")

    def run(params, x, tp, tx):
        with _context.activate(TangentScope(config, _engine.Handler(after=after))):
            return jax.jvp(mlp.apply, (params, x), (tp, tx))

    got = maybe_jit(run)(params, x, tp, tx)
    tree_allclose(got, _chain_with_doubled_fc2(params, x, tp, tx))
    n = len(x)
    assert seen == [("fc1", 0, "fc1", 0, (n, 5)), ("fc2", 0, "fc2", 0, (n, 4)), ("fc3", 0, "fc3", 0, (n, 2))]


def test_vk_jvp_hooks_run_through_the_engine_handler(monkeypatch):
    """``vk.jvp``'s tangent hooks are run by ``_engine.tangent_hooks`` (the rule runs none)."""
    params, x, _ = mlp_setup()
    calls = []
    real = _engine.tangent_hooks

    def counted():
        handler = real()

        def after(site, rec, state, parts):
            calls.append(rec.name)
            return handler.after(site, rec, state, parts)

        return _engine.Handler(after=after)

    monkeypatch.setattr(_engine, "tangent_hooks", counted)
    double = lambda rec: rec.replace(tangent_output=2 * rec.tangent_output) if rec.name == "fc2" else None
    out, tangent = vk.jvp(mlp.apply, (params, x), (params, x), hooks={"fc*": double})
    assert calls == ["fc1", "fc2", "fc3"]
    tree_allclose((out, tangent), _chain_with_doubled_fc2(params, x, params, x))


# --- hooks beside curvature statistics -----------------------------------------------------

pytestmark = pytest.mark.usefixtures("x64")  # float64 throughout: the comparisons are to rounding


def _loss(inner_jit):
    block = jax.jit(cb.block) if inner_jit else cb.block

    def model(p, tok):
        h = p["embed"][tok]
        h, _ = lax.scan(lambda h, q: (block(h, q), None), h, p["blocks"])
        return cb.layer_norm(h, p["ln_f"]) @ p["embed"].T

    return lambda p, x, y: vk.curvature.softmax_cross_entropy(model(p, x), y)


def _halve(rec):
    """Halves the layer's parameter gradients and what it passes down."""
    return rec.replace(
        grad_params=jax.tree.map(lambda g: g / 2, rec.grad_params), grad_input=rec.grad_input / 2
    )


@pytest.mark.parametrize("inner_jit", [False, True], ids=["plain", "inner-jit"])
def test_hooks_beside_curvature_stats_run_once_and_leave_the_stats_alone(maybe_jit, inner_jit):
    """One call with hooks and statistics: the gradient and the host deliveries equal the
    hooks-only transform's (each hook once per call, per scan iteration), the statistics equal
    the statistics-only transform's, and other capture specs give the hooked records."""
    params, x, y = cb.problem()
    loss = _loss(inner_jit)
    key = jax.random.key(0)
    spec = vk.curvature.stats("blocks/*", ["kfac", "diag_ggn", "sum_grad_squared"])

    def hooks(log):
        return {
            "blocks/fc": [
                _halve,
                vk.on_host(lambda rec: log.append((rec.key, np.asarray(rec.grad_params["w"])))),
            ]
        }

    seen, want_seen = [], []
    both = maybe_jit(vk.value_and_grad(loss, hooks=hooks(seen), capture=[spec, vk.capture("embed")]))
    (value, grads), captured = both(params, x, y, key=key)
    jax.effects_barrier()
    (want_value, want_grads), want_records = maybe_jit(
        vk.value_and_grad(loss, hooks=hooks(want_seen), capture=vk.capture("embed"))
    )(params, x, y)
    jax.effects_barrier()
    _, want_stats = maybe_jit(vk.value_and_grad(loss, capture=spec))(params, x, y, key=key)
    tree_allclose(value, want_value)
    tree_allclose(grads, want_grads)
    plain = jax.grad(loss)(params, x, y)
    assert not np.allclose(grads["embed"], plain["embed"])  # the hooks took effect
    assert [k for k, _ in seen] == [k for k, _ in want_seen] and len(seen) == cb.L
    for (_, a), (_, b) in zip(seen, want_seen):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    assert set(captured) == {*want_stats, *want_records}
    tree_allclose(captured["embed"], want_records["embed"])  # the hooked pass's record
    for k, stats in want_stats.items():  # the loss's statistics, not the hooked gradient's
        tree_allclose(captured[k], stats)


def test_stateful_hooks_beside_curvature_stats_thread_their_state(maybe_jit):
    """``hook_state=`` threads through the combined transform as through the hooks-only one;
    ``vk.init_hook_state`` takes the combined transform."""
    params, x, y = cb.problem()
    loss = _loss(False)
    hooks = {"blocks/fc": vk.ema_normalize(0.5)}
    both = vk.value_and_grad(loss, hooks=hooks, capture=vk.curvature.stats("*", ["kflr"]))
    only = vk.value_and_grad(loss, hooks=hooks)
    state = vk.init_hook_state(both, params, x, y)
    tree_allclose(state, vk.init_hook_state(only, params, x, y))
    want_state = state
    for seed in range(2):
        params, x, y = cb.problem(seed)
        (_, grads), _, state = maybe_jit(both)(params, x, y, hook_state=state)
        (_, want), want_state = maybe_jit(only)(params, x, y, hook_state=want_state)
        tree_allclose(grads, want)
        tree_allclose(state, want_state)
    with pytest.raises(vk.ConfigError, match=r"hook_state= was given, but the transform has no hooks="):
        vk.value_and_grad(loss, capture=vk.curvature.stats("*", ["kflr"]))(params, x, y, hook_state=state)


def test_make_step_with_hooks_and_kfac_equals_the_hand_composition():
    """``make_step`` with a hook and K-FAC: the update preconditions the hooked gradient with
    the loss's statistics, as ``kfac.update`` given each by hand."""
    params, x, y = cb.problem()
    loss = _loss(False)
    batch_loss = lambda p, batch: loss(p, *batch)
    spec = vk.curvature.stats("*", ["kflr"])
    like = jax.eval_shape(vk.value_and_grad(loss, capture=spec), params, x, y)[1]
    opt = vk.curvature.kfac(0.1, like=like, estimator="kflr", damping=1e-2)
    hooks = {"blocks/fc": _halve}
    step = vk.train.make_step(batch_loss, opt, hooks=hooks, capture=spec)
    state, metrics = step(vk.train.TrainState.create(params, opt), (x, y))
    (_, grads) = vk.value_and_grad(loss, hooks=hooks)(params, x, y)
    _, stats = vk.value_and_grad(loss, capture=spec)(params, x, y)
    updates, _ = opt.update(grads, opt.init(params), params, curvature=stats)
    tree_allclose(state.params, optax.apply_updates(params, updates))
    assert set(metrics["captured"]) == set(stats)
    assert np.isfinite(float(metrics["loss"]))
