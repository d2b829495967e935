"""Stateful hooks (vk.HookTransform) and the ready-made transforms, against references.

References are numpy re-implementations of each transform fed with plain ``jax.grad``
gradients, and hand-chained ``jax.vjp`` s where a transform changes ``grad_input``. Nothing is
compared with constants from a run. Behaviour tests run with and without ``jax.jit``
(``maybe_jit``); error tests check that each error is raised at trace time (eager, under
``jax.jit(...).lower`` and under ``jax.eval_shape``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.models import dense_fn, mlp_chain, mlp_loss, mlp_setup
from vjpkit import nn

DECAY = 0.9
LR = 0.1
LAYERS = ("fc1", "fc2", "fc3")


# ---------------------------------------------------------------- numpy references


def np_tree(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def np_ema_init(grads_like):
    return (0, {k: 0.0 for k in grads_like}, {k: 0.0 for k in grads_like})


def np_ema(state, raw, decay=DECAY, eps=1e-8, center=True):
    """One ema_normalize step in float64: ``(new_state, normalized gradients)``."""
    count, mean, var = state
    count += 1
    mean = {k: decay * mean[k] + (1 - decay) * np.mean(g) for k, g in raw.items()}
    var = {k: decay * var[k] + (1 - decay) * np.var(g) for k, g in raw.items()}
    c = 1 - decay**count
    out = {k: (g - (mean[k] / c if center else 0.0)) / (np.sqrt(var[k] / c) + eps) for k, g in raw.items()}
    return (count, mean, var), out


def as_ema_state(state):
    count, mean, var = state
    return vk.EmaNormalizeState(
        np.float32(count),
        {k: np.float32(v) for k, v in mean.items()},
        {k: np.float32(v) for k, v in var.items()},
    )


def f32(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


def np_norm(tree):
    return np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(tree)))


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def batches(steps, batch=6):
    """Different data each step: (xs, ys) stacked over steps."""
    data = [mlp_setup(batch, seed=100 + t)[1:] for t in range(steps)]
    return jnp.stack([d[0] for d in data]), jnp.stack([d[1] for d in data])


def ema_reference(params, xs, ys, layer="fc2", center=True):
    """Per step: (state of ``layer``, gradients used) of SGD with ema_normalize on ``layer``."""
    state, out = None, []
    for x, y in zip(xs, ys):
        raw = jax.grad(mlp_loss)(params, x, y)
        state = state or np_ema_init(raw[layer])
        state, normalized = np_ema(state, np_tree(raw[layer]), center=center)
        grads = dict(raw, **{layer: f32(normalized)})
        out.append((as_ema_state(state), f32(grads)))
        params = sgd(params, grads)
    return out


# ---------------------------------------------------------------- 1. ema_normalize


@pytest.mark.parametrize("center", [True, False], ids=["center", "no-center"])
def test_ema_normalize_over_sgd_steps_matches_numpy(maybe_jit, center):
    params, _, _ = mlp_setup()
    xs, ys = batches(4 if maybe_jit is jax.jit else 3)  # eager retraces every step: 3 steps suffice
    g = vk.grad(mlp_loss, hooks={"fc2": vk.ema_normalize(DECAY, center=center)})
    state = vk.init_hook_state(g, params, xs[0], ys[0])
    assert sorted(state) == ["fc2"]
    tree_allclose(state["fc2"], as_ema_state(np_ema_init(params["fc2"])), rtol=0, atol=0)

    @maybe_jit
    def step(params, state, x, y):
        grads, state = g(params, x, y, hook_state=state)
        return sgd(params, grads), state, grads

    reference = ema_reference(params, xs, ys, center=center)
    for t, (ref_state, ref_grads) in enumerate(reference):
        raw_here = jax.grad(mlp_loss)(params, xs[t], ys[t])
        params, state, grads = step(params, state, xs[t], ys[t])
        tree_allclose(state["fc2"], ref_state, rtol=1e-5, atol=1e-9)
        tree_allclose(grads, ref_grads, rtol=1e-4, atol=1e-5)
        for other in ("fc1", "fc3"):  # untouched layers: exactly what jax.grad gives
            tree_allclose(grads[other], raw_here[other], rtol=1e-5, atol=1e-7)


def test_ema_normalize_state_in_lax_scan_carry(maybe_jit):
    params, _, _ = mlp_setup()
    xs, ys = batches(5)
    g = vk.grad(mlp_loss, hooks={"fc2": vk.ema_normalize(DECAY)})
    state0 = vk.init_hook_state(g, params, xs[0], ys[0])

    @maybe_jit
    def train(params, state, xs, ys):
        def body(carry, batch):
            params, state = carry
            grads, state = g(params, *batch, hook_state=state)
            return (sgd(params, grads), state), (state, grads)

        return jax.lax.scan(body, (params, state), (xs, ys))

    (final_params, final_state), (states, grads) = train(params, state0, xs, ys)
    reference = ema_reference(params, xs, ys)
    for t, (ref_state, ref_grads) in enumerate(reference):
        tree_allclose(jax.tree.map(lambda a, t=t: a[t], states["fc2"]), ref_state, rtol=1e-5, atol=1e-9)
        tree_allclose(jax.tree.map(lambda a, t=t: a[t], grads), ref_grads, rtol=1e-4, atol=1e-5)
    tree_allclose(final_state["fc2"], reference[-1][0], rtol=1e-5, atol=1e-9)


def test_capture_sees_the_record_after_stateful_hooks(maybe_jit):
    params, x, y = mlp_setup()
    spec = vk.capture("fc2", fields=["grad_params"])
    g = vk.value_and_grad(mlp_loss, hooks={"fc2": vk.ema_normalize(DECAY)}, capture=spec)
    state = vk.init_hook_state(g, params, x, y)
    (value, grads), captured, new_state = maybe_jit(g)(params, x, y, hook_state=state)
    ref_state, ref_grads = ema_reference(params, x[None], y[None])[0]
    tree_allclose(value, jnp.asarray(mlp_loss(params, x, y)), rtol=1e-6, atol=0)
    tree_allclose(captured["fc2"].grad_params, ref_grads["fc2"], rtol=1e-4, atol=1e-5)
    tree_allclose(grads, ref_grads, rtol=1e-4, atol=1e-5)
    tree_allclose(new_state["fc2"], ref_state, rtol=1e-5, atol=1e-9)


def test_has_aux_with_state(maybe_jit):
    params, x, y = mlp_setup()
    aux_loss = lambda p, x, y: (mlp_loss(p, x, y), {"n": jnp.float32(x.shape[0])})
    g = vk.grad(aux_loss, has_aux=True, hooks={"fc2": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, x, y)
    (grads, aux), new_state = maybe_jit(g)(params, x, y, hook_state=state)
    ref_state, ref_grads = ema_reference(params, x[None], y[None])[0]
    assert float(aux["n"]) == x.shape[0]
    tree_allclose(grads, ref_grads, rtol=1e-4, atol=1e-5)
    tree_allclose(new_state["fc2"], ref_state, rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------- 2. hook_chain


def test_hook_chain_equals_transforms_in_sequence(maybe_jit):
    params, x, y = mlp_setup()
    raw = jax.grad(mlp_loss)(params, x, y)
    ref_state, normalized = np_ema(np_ema_init(raw["fc2"]), np_tree(raw["fc2"]))
    max_norm = 0.5 * np_norm(normalized)  # so that the clip is active
    expected = {k: 2.0 * v * max_norm / np_norm(normalized) for k, v in normalized.items()}

    parts = (vk.ema_normalize(DECAY), vk.clip_by_norm(float(max_norm)), vk.scale(2.0))
    for hooks in ({"fc2": vk.hook_chain(*parts)}, {"fc2": list(parts)}):
        g = vk.grad(mlp_loss, hooks=hooks)
        state = vk.init_hook_state(g, params, x, y)
        assert isinstance(state["fc2"], tuple) and len(state["fc2"]) == 3
        assert state["fc2"][1:] == ((), ())
        grads, new_state = maybe_jit(g)(params, x, y, hook_state=state)
        tree_allclose(grads["fc2"], f32(expected), rtol=1e-4, atol=1e-6)
        tree_allclose(grads["fc1"], raw["fc1"], rtol=1e-5, atol=1e-7)
        tree_allclose(new_state["fc2"][0], as_ema_state(ref_state), rtol=1e-5, atol=1e-9)

    # and the same as calling each update by hand on the reference record
    reference = mlp_chain(params, x, y)["fc2"]
    rec = vk.Cotangents(name="fc2", call=0, params=params["fc2"], **reference)
    by_hand = []
    for part in parts:
        rec, s = part.update(rec, part.init(params["fc2"]))
        by_hand.append(s)
    tree_allclose(grads["fc2"], rec.grad_params, rtol=1e-4, atol=1e-6)
    tree_allclose(new_state["fc2"], tuple(by_hand), rtol=1e-5, atol=1e-9)


def test_hook_chain_order_matters_for_state(maybe_jit):
    params, x, y = mlp_setup()
    raw = np_tree(jax.grad(mlp_loss)(params, x, y)["fc2"])
    plain_tripler = lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: 3.0 * g, rec.grad_params))
    first = vk.hook_chain(plain_tripler, vk.ema_normalize(DECAY))  # EMA of 3 * g
    last = vk.hook_chain(vk.ema_normalize(DECAY), plain_tripler)  # 3 * normalized g
    for chain, scaled_in, scaled_out in ((first, 3.0, 1.0), (last, 1.0, 3.0)):
        g = vk.grad(mlp_loss, hooks={"fc2": chain})
        state = vk.init_hook_state(g, params, x, y)
        grads, new_state = maybe_jit(g)(params, x, y, hook_state=state)
        ref_state, normalized = np_ema(np_ema_init(raw), {k: scaled_in * v for k, v in raw.items()})
        ema_state = new_state["fc2"][1] if chain is first else new_state["fc2"][0]
        tree_allclose(ema_state, as_ema_state(ref_state), rtol=1e-5, atol=1e-9)
        expected = {k: scaled_out * v for k, v in normalized.items()}
        tree_allclose(grads["fc2"], f32(expected), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- 3. ready-made transforms


def stateless(hooks):
    """``vk.grad(mlp_loss, hooks=hooks)`` for hooks that keep no state: no hook_state needed."""
    return vk.grad(mlp_loss, hooks=hooks)


def test_stateless_transforms_return_what_jax_grad_returns(maybe_jit):
    params, x, y = mlp_setup()
    for hooks in ({"fc2": vk.scale(1.0)}, {"fc2": vk.hook_chain(vk.zero(), vk.clip_by_norm(1.0))}):
        grads = maybe_jit(vk.grad(mlp_loss, hooks=hooks))(params, x, y)
        assert jax.tree.structure(grads) == jax.tree.structure(params)
        value, grads = maybe_jit(vk.value_and_grad(mlp_loss, hooks=hooks))(params, x, y)
        assert jax.tree.structure(grads) == jax.tree.structure(params)


def hand_chained_fc1(params, x, y, grad_input_fc2):
    """fc1's parameter gradient when fc2 sends ``grad_input_fc2`` down instead of the true one."""
    h1 = dense_fn(params["fc1"], x)
    g1 = jax.vjp(jax.nn.relu, h1)[1](grad_input_fc2)[0]
    return jax.vjp(dense_fn, params["fc1"], x)[1](g1)[0]


def test_clip_by_norm_grad_params(maybe_jit):
    params, x, y = mlp_setup()
    raw = jax.grad(mlp_loss)(params, x, y)
    norm2 = np_norm(raw["fc2"])
    max_norm = float(norm2 / 3)
    hooks = {"fc2": vk.clip_by_norm(max_norm), "fc1": vk.clip_by_norm(float(10 * np_norm(raw["fc1"])))}
    grads = maybe_jit(stateless(hooks))(params, x, y)  # no hook_state
    expected = jax.tree.map(lambda g: np.float32(max_norm / norm2) * np.asarray(g), raw["fc2"])
    tree_allclose(grads["fc2"], expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np_norm(grads["fc2"]), max_norm, rtol=1e-5)
    tree_allclose(grads["fc1"], raw["fc1"], rtol=1e-5, atol=1e-7)  # below max_norm: unchanged
    tree_allclose(grads["fc3"], raw["fc3"], rtol=1e-5, atol=1e-7)


def test_clip_by_norm_grad_input_propagates_upstream(maybe_jit):
    params, x, y = mlp_setup()
    raw = jax.grad(mlp_loss)(params, x, y)
    ga1 = mlp_chain(params, x, y)["fc2"]["grad_input"]  # what fc2 sends to relu1 / fc1
    max_norm = float(np_norm(ga1) / 4)
    clipped = ga1 * np.float32(max_norm / np_norm(ga1))
    grads = maybe_jit(stateless({"fc2": vk.clip_by_norm(max_norm, "grad_input")}))(params, x, y)
    tree_allclose(grads["fc1"], hand_chained_fc1(params, x, y, clipped), rtol=1e-5, atol=1e-7)
    tree_allclose(grads["fc2"], raw["fc2"], rtol=1e-5, atol=1e-7)  # its own grad_params untouched
    tree_allclose(grads["fc3"], raw["fc3"], rtol=1e-5, atol=1e-7)


def test_clip_by_norm_both_fields_clips_each_by_its_own_norm(maybe_jit):
    params, x, y = mlp_setup()
    raw = jax.grad(mlp_loss)(params, x, y)
    ga1 = mlp_chain(params, x, y)["fc2"]["grad_input"]
    max_norm = float(min(np_norm(ga1), np_norm(raw["fc2"])) / 2)
    hooks = {"fc2": vk.clip_by_norm(max_norm, ("grad_params", "grad_input"))}
    grads = maybe_jit(stateless(hooks))(params, x, y)
    clipped = ga1 * np.float32(max_norm / np_norm(ga1))
    np.testing.assert_allclose(np_norm(grads["fc2"]), max_norm, rtol=1e-5)
    tree_allclose(grads["fc1"], hand_chained_fc1(params, x, y, clipped), rtol=1e-5, atol=1e-7)


def test_scale(maybe_jit):
    params, x, y = mlp_setup()
    raw = jax.grad(mlp_loss)(params, x, y)
    ga1 = mlp_chain(params, x, y)["fc2"]["grad_input"]
    hooks = {"fc3": vk.scale(0.5), "fc2": vk.scale(3.0, "grad_input")}
    grads = maybe_jit(stateless(hooks))(params, x, y)
    tree_allclose(grads["fc3"], jax.tree.map(lambda g: 0.5 * g, raw["fc3"]), rtol=1e-6, atol=1e-8)
    tree_allclose(grads["fc2"], raw["fc2"], rtol=1e-6, atol=1e-8)
    tree_allclose(grads["fc1"], hand_chained_fc1(params, x, y, 3.0 * ga1), rtol=1e-5, atol=1e-7)


def test_zero_freezes_a_layer(maybe_jit):
    params, x, y = mlp_setup()
    raw = jax.grad(mlp_loss)(params, x, y)
    grads = maybe_jit(stateless({"fc2": vk.zero()}))(params, x, y)
    tree_allclose(grads["fc2"], jax.tree.map(jnp.zeros_like, raw["fc2"]), rtol=0, atol=0)
    tree_allclose(grads["fc1"], raw["fc1"], rtol=1e-5, atol=1e-7)  # layers below still learn
    tree_allclose(grads["fc3"], raw["fc3"], rtol=1e-5, atol=1e-7)
    # zero on grad_input stops the gradient below fc2 instead
    grads = maybe_jit(stateless({"fc2": vk.zero("grad_input")}))(params, x, y)
    tree_allclose(grads["fc1"], jax.tree.map(jnp.zeros_like, raw["fc1"]), rtol=0, atol=0)
    tree_allclose(grads["fc2"], raw["fc2"], rtol=1e-5, atol=1e-7)


def test_add_noise_is_deterministic_fresh_each_step_and_has_the_right_std(maybe_jit):
    params, x, y = mlp_setup()
    stddev = 0.1
    raw = jax.grad(mlp_loss)(params, x, y)
    g = maybe_jit(vk.grad(mlp_loss, hooks={"fc*": vk.add_noise(jax.random.key(7), stddev)}))
    state = vk.init_hook_state(g, params, x, y)
    assert sorted(state) == list(LAYERS) and isinstance(state["fc1"], vk.AddNoiseState)
    first, state1 = g(params, x, y, hook_state=state)
    again, _ = g(params, x, y, hook_state=state)
    tree_allclose(first, again, rtol=0, atol=0)  # same key and step: same noise
    noises = []
    steps = 6 if maybe_jit is jax.jit else 3  # eager retraces every call; the noise is the same either way
    for step in range(steps):
        grads, state = g(params, x, y, hook_state=state)
        assert all(float(state[k].count) == step + 1 for k in LAYERS)
        noises.append(jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), grads, raw))
    assert not np.allclose(noises[0]["fc1"]["weight"], noises[1]["fc1"]["weight"])  # fresh each step
    tree_allclose(noises[0], jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), first, raw))
    sample = np.concatenate([leaf.ravel() for n in noises for leaf in jax.tree.leaves(n)])
    assert sample.size >= 50 * steps  # enough draws for the std check: 162 eager, 324 under jit
    assert 0.75 * stddev < np.std(sample) < 1.25 * stddev
    assert abs(np.mean(sample)) < 4 * stddev / np.sqrt(sample.size)


def test_add_noise_on_grad_input_reaches_the_layer_below():
    params, x, y = mlp_setup()
    g = vk.grad(mlp_loss, hooks={"fc2": vk.add_noise(jax.random.key(3), 0.5, "grad_input")})
    state = vk.init_hook_state(g, params, x, y)
    grads, _ = jax.jit(g)(params, x, y, hook_state=state)
    raw = jax.grad(mlp_loss)(params, x, y)
    tree_allclose(grads["fc2"], raw["fc2"], rtol=1e-5, atol=1e-7)
    assert not np.allclose(grads["fc1"]["weight"], raw["fc1"]["weight"], atol=1e-3)


def test_add_noise_is_independent_across_layers():
    model = nn.serial(a=nn.dense(4), b=nn.dense(4))
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.sum(model.apply(p, x))
    g = vk.grad(loss, hooks={"*": vk.add_noise(jax.random.key(1), 1.0)})
    grads, _ = g(params, x, hook_state=vk.init_hook_state(g, params, x))
    raw = jax.grad(loss)(params, x)
    noise = {k: np.asarray(grads[k]["weight"] - raw[k]["weight"]) for k in ("a", "b")}
    assert not np.allclose(noise["a"], noise["b"], atol=1e-3)


def test_accumulate_stats_matches_numpy_over_steps(maybe_jit):
    params, _, _ = mlp_setup()
    xs, ys = batches(5 if maybe_jit is jax.jit else 3)  # eager retraces every step: 3 steps suffice
    g = vk.grad(mlp_loss, hooks={"fc*": vk.accumulate_stats()})
    state = vk.init_hook_state(g, params, xs[0], ys[0])
    step = maybe_jit(lambda p, s, x, y: g(p, x, y, hook_state=s))
    seen = []
    for x, y in zip(xs, ys):
        raw = jax.grad(mlp_loss)(params, x, y)
        grads, state = step(params, state, x, y)
        tree_allclose(grads, raw, rtol=1e-5, atol=1e-7)  # observing only
        seen.append(np_tree(raw))
        params = sgd(params, raw)
    for name in LAYERS:
        s = state[name]
        assert isinstance(s, vk.AccumulateState) and float(s.count) == len(seen)
        stacked = {k: np.stack([d[name][k] for d in seen]) for k in s.mean}
        tree_allclose(s.mean, f32({k: v.mean(0) for k, v in stacked.items()}), rtol=1e-5, atol=1e-7)
        variance = jax.tree.map(lambda m2, s=s: np.asarray(m2) / np.float32(s.count), s.m2)
        tree_allclose(variance, f32({k: v.var(0) for k, v in stacked.items()}), rtol=1e-4, atol=1e-8)


# ---------------------------------------------------------------- 4. weight sharing


def test_weight_sharing_gives_one_state_per_call(maybe_jit):
    params, _, _ = mlp_setup()
    xs, ys = batches(3)

    def shared(p, x, y):  # the same model applied twice: fc1, fc1#1, ...
        return mlp_loss(p, x, y) + mlp_loss(p, 2.0 * x[::-1], y)

    def split(pa, pb, x, y):  # the same with separate params: per-call gradients
        return mlp_loss(pa, x, y) + mlp_loss(pb, 2.0 * x[::-1], y)

    g = vk.grad(shared, hooks={"fc1": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, xs[0], ys[0])
    assert sorted(state) == ["fc1", "fc1#1"]
    step = maybe_jit(lambda p, s, x, y: g(p, x, y, hook_state=s))
    ref = {"fc1": None, "fc1#1": None}
    for x, y in zip(xs, ys):
        ga, gb = jax.grad(split, argnums=(0, 1))(params, params, x, y)
        normalized = {}
        for key, per_call in (("fc1", ga), ("fc1#1", gb)):
            ref[key] = ref[key] or np_ema_init(per_call["fc1"])
            ref[key], normalized[key] = np_ema(ref[key], np_tree(per_call["fc1"]))
        grads, state = step(params, state, x, y)
        for key in ref:
            tree_allclose(state[key], as_ema_state(ref[key]), rtol=1e-5, atol=1e-9)
        expected_fc1 = {k: normalized["fc1"][k] + normalized["fc1#1"][k] for k in normalized["fc1"]}
        tree_allclose(grads["fc1"], f32(expected_fc1), rtol=1e-4, atol=1e-5)
        for other in ("fc2", "fc3"):
            tree_allclose(grads[other], jax.tree.map(jnp.add, ga[other], gb[other]), rtol=1e-5, atol=1e-7)
        params = sgd(params, grads)
    assert not np.allclose(state["fc1"].var["weight"], state["fc1#1"].var["weight"])


# ---------------------------------------------------------------- 5. calls that did not run

side = nn.dense(3, name="side")


def with_side(params, x):
    return dict(params, side=side.init(jax.random.key(5), x))


def test_call_in_untaken_cond_branch_keeps_its_state(maybe_jit):
    params, x, y = mlp_setup()
    params = with_side(params, x)

    def loss(p, x, y, use_side):
        main = mlp_loss({k: v for k, v in p.items() if k != "side"}, x, y)
        extra = jax.lax.cond(use_side, lambda: jnp.mean(side.apply(p["side"], x) ** 2), lambda: jnp.zeros(()))
        return main + extra

    g = vk.grad(loss, hooks={"fc1": vk.ema_normalize(DECAY), "side": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, x, y, True)
    assert sorted(state) == ["fc1", "side"]
    step = maybe_jit(lambda p, s, x, y, flag: g(p, x, y, flag, hook_state=s))
    _, state = step(params, state, x, y, True)
    assert float(state["side"].count) == 1.0
    before = state
    _, state = step(params, before, x, y, False)  # side's backward never runs
    tree_allclose(state["side"], before["side"], rtol=0, atol=0)
    assert float(state["fc1"].count) == 2.0
    assert not np.allclose(state["fc1"].var["weight"], before["fc1"].var["weight"])
    _, state = step(params, state, x, y, True)
    assert float(state["side"].count) == 2.0


def test_call_whose_output_is_unused_keeps_its_state():
    params, x, y = mlp_setup()
    params = with_side(params, x)

    def loss(p, x, y):
        side.apply(p["side"], x)  # called, but the loss does not depend on it
        return mlp_loss({k: v for k, v in p.items() if k != "side"}, x, y)

    g = vk.grad(loss, hooks={"fc1": vk.ema_normalize(DECAY), "side": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, x, y)
    _, new_state = g(params, x, y, hook_state=state)
    assert sorted(new_state) == ["fc1", "side"]
    tree_allclose(new_state["side"], state["side"], rtol=0, atol=0)
    assert float(new_state["fc1"].count) == 1.0


# ---------------------------------------------------------------- 6. bad input


def state_hook(init_state, new_state):
    return vk.HookTransform(lambda params: init_state, lambda rec, state: (rec, new_state(state)))


def all_ways(g, *args, **kwargs):
    """Calls ``g`` eagerly, under jit lowering and under eval_shape: each must raise at trace time."""
    yield lambda: g(*args, **kwargs)
    yield lambda: jax.jit(g).lower(*args, **kwargs)
    yield lambda: jax.eval_shape(lambda *a: g(*a, **kwargs), *args)


@pytest.mark.parametrize(
    "new_state, words",
    [
        (lambda s: {"a": s["a"], "b": s["a"]}, ["structure"]),
        (lambda s: {"a": s["a"].astype(jnp.bfloat16)}, ["bfloat16", "float32"]),
        (lambda s: {"a": jnp.zeros((2,), jnp.float32)}, ["float32[2]"]),
    ],
    ids=["structure", "dtype", "shape"],
)
def test_update_returning_a_different_state_raises(new_state, words):
    params, x, y = mlp_setup()
    g = vk.grad(mlp_loss, hooks={"fc2": state_hook({"a": jnp.zeros(())}, new_state)})
    state = vk.init_hook_state(g, params, x, y)
    for call in all_ways(g, params, x, y, hook_state=state):
        with pytest.raises(vk.HookError, match="fc2") as info:
            call()
        assert all(w in str(info.value) for w in words), str(info.value)


def test_missing_hook_state_raises():
    params, x, y = mlp_setup()
    g = vk.value_and_grad(mlp_loss, hooks={"fc2": vk.ema_normalize(DECAY)})
    for call in all_ways(g, params, x, y):
        with pytest.raises(vk.ConfigError, match="init_hook_state") as info:
            call()
        assert "fc2" in str(info.value) and "hook_state=" in str(info.value)


def test_hook_state_of_another_model_or_other_hooks_raises():
    params, x, y = mlp_setup()
    g = vk.grad(mlp_loss, hooks={"fc2": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, x, y)
    other_layer = vk.grad(mlp_loss, hooks={"fc1": vk.ema_normalize(DECAY)})
    other_hook = vk.grad(mlp_loss, hooks={"fc2": vk.accumulate_stats()})
    cases = [
        (other_layer, state, "'fc1'"),  # missing key
        (g, dict(state, fc9=state["fc2"]), "fc9"),  # extra key
        (g, {}, "'fc2'"),  # empty
        (other_hook, state, "structure"),  # same key, another transform's state
    ]
    for fn, bad, word in cases:
        for call in all_ways(fn, params, x, y, hook_state=bad):
            with pytest.raises(vk.ConfigError, match="init_hook_state") as info:
                call()
            assert word in str(info.value), str(info.value)


def test_hook_state_that_is_not_a_dict_raises_config_error():
    params, x, y = mlp_setup()
    g = vk.grad(mlp_loss, hooks={"fc2": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, x, y)
    result = g(params, x, y, hook_state=state)
    for bad in (result, state["fc2"], 1.0):  # common slips when threading the state
        with pytest.raises(vk.ConfigError, match="hook_state"):
            g(params, x, y, hook_state=bad)


def test_non_float_state_leaves_raise():
    params, x, y = mlp_setup()
    counter = vk.HookTransform(
        lambda params: {"steps": {"n": jnp.zeros((), jnp.int32)}},
        lambda rec, state: (rec, jax.tree.map(lambda n: n + 1, state)),
    )
    g = vk.grad(mlp_loss, hooks={"fc2": counter})
    with pytest.raises(vk.ConfigError, match="fc2") as info:
        vk.init_hook_state(g, params, x, y)
    message = str(info.value)
    assert "['steps']['n']" in message and "int32" in message and "float" in message
    float_state = {"fc2": {"steps": {"n": jnp.zeros((), jnp.float32)}}}
    for kwargs in ({}, {"hook_state": float_state}):
        for call in all_ways(g, params, x, y, **kwargs):
            with pytest.raises(vk.ConfigError, match="fc2") as info:
                call()
            assert "['steps']['n']" in str(info.value)


def test_hook_state_without_stateful_hooks_raises():
    params, x, y = mlp_setup()
    observing = vk.grad(mlp_loss, hooks={"fc2": lambda rec: None})
    with pytest.raises(vk.ConfigError, match="hook_state"):
        observing(params, x, y, hook_state={})
    stateless = vk.grad(mlp_loss, hooks={"fc2": vk.scale(2.0)})
    some_state = {"fc2": vk.EmaNormalizeState(jnp.zeros(()), {}, {})}
    for call in all_ways(stateless, params, x, y, hook_state=some_state):
        with pytest.raises(vk.ConfigError, match="fc2"):
            call()


def test_init_hook_state_needs_a_vjpkit_function():
    params, x, y = mlp_setup()
    with pytest.raises(vk.ConfigError, match="init_hook_state"):
        vk.init_hook_state(mlp_loss, params, x, y)


# ---------------------------------------------------------------- 7. retracing


def test_jitted_step_with_state_threading_traces_once():
    params, _, _ = mlp_setup()
    xs, ys = batches(5)
    traces = []

    def loss(p, x, y):
        traces.append(None)  # runs only while JAX traces
        return mlp_loss(p, x, y)

    g = vk.value_and_grad(
        loss, hooks={"fc*": vk.hook_chain(vk.ema_normalize(DECAY), vk.add_noise(jax.random.key(0), 1e-3))}
    )
    state = vk.init_hook_state(g, params, xs[0], ys[0])
    after_init = len(traces)

    @jax.jit
    def step(params, state, x, y):
        (value, grads), state = g(params, x, y, hook_state=state)
        return sgd(params, grads), state, value

    counts = []
    for x, y in zip(xs, ys):
        params, state, _ = step(params, state, x, y)
        counts.append(len(traces))
    assert counts[0] > after_init
    assert counts == [counts[0]] * len(counts), counts
    assert float(state["fc1"][0].count) == len(xs)
