"""Stateful hooks on plain-JAX models, and transforms built anew for each eager call (issue 31, item 8).

1. A model written in plain ``jax.numpy`` (its layers found by plain-JAX matching, named by
   parameter path) keeps hook state as a ``vjpkit.nn`` model does: ``vk.init_hook_state`` gives
   one state per matched layer call, keyed like its records; the state advances once per call
   and once per ``lax.scan`` iteration, in backward order; ``vk.train.fit`` threads it. The
   references are hand-chained: ``jax.vjp`` of each layer with ``ema_normalize``'s update done in
   float64 numpy, and the same model written with ``vjpkit.nn`` layers.
2. A hooked transform built for each eager call (``vk.grad(loss, hooks={...})(params, x)`` in a
   loop, the hooks made in the loop too) reuses the traces and compiled inner ``jax.jit`` of the
   first one when its configuration is the same, and never when it differs (DESIGN.md, "Trace
   identity"); its caches stay bounded. Traces are counted with Python side effects in the traced
   functions; no test times anything.

Tests of part 1 run jitted and eagerly (``maybe_jit``); part 2 is about eager calls.
"""

from __future__ import annotations

import gc
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.models import mlp_chain, mlp_loss, mlp_setup
from vjpkit import _context
from vjpkit._engine import _run

DECAY = 0.9
LR = 0.1
LAYERS = ("fc1", "fc2", "fc3")


def plain_apply(params, x):
    """``tests.models.mlp`` written in plain jnp: its layers are found by matching."""
    h = jax.nn.relu(x @ params["fc1"]["weight"] + params["fc1"]["bias"])
    h = jax.nn.relu(h @ params["fc2"]["weight"] + params["fc2"]["bias"])
    return h @ params["fc3"]["weight"] + params["fc3"]["bias"]


def plain_loss(params, x, y):
    logp = jax.nn.log_softmax(plain_apply(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def ema_step(state, raw):
    """One ``vk.ema_normalize(DECAY)`` step on one record's ``grad_params``, in float64 numpy.

    ``state`` is ``(count, [mean per leaf], [var per leaf])`` in the order of ``jax.tree.leaves``;
    returns the new state and the normalised leaves (float32, as the gradient)."""
    count, mean, var = state
    leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(raw)]
    count += 1
    mean = [DECAY * m + (1 - DECAY) * g.mean() for m, g in zip(mean, leaves)]
    var = [DECAY * v + (1 - DECAY) * g.var() for v, g in zip(var, leaves)]
    c = 1 - DECAY**count
    out = [((g - m / c) / (np.sqrt(v / c) + 1e-8)).astype(np.float32) for g, m, v in zip(leaves, mean, var)]
    return (count, mean, var), jax.tree.unflatten(jax.tree.structure(raw), out)


def ema_init(raw):
    n = len(jax.tree.leaves(raw))
    return (0, [0.0] * n, [0.0] * n)


def check_state(state, ref):
    """A ``vk.EmaNormalizeState`` against ``ema_step``'s state."""
    count, mean, var = ref
    np.testing.assert_allclose(float(state.count), count)
    # a mean can be ~1e-9 (the last layer's bias gradient sums to zero over the classes)
    np.testing.assert_allclose([float(m) for m in jax.tree.leaves(state.mean)], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([float(v) for v in jax.tree.leaves(state.var)], var, rtol=1e-5, atol=1e-9)


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def data(steps, batch=6):
    return [mlp_setup(batch, seed=100 + t)[1:] for t in range(steps)]


# ------------------------------------------------------------ 1. hook state on plain-JAX models


def test_init_hook_state_of_a_plain_model_is_keyed_like_its_records():
    params, x, y = mlp_setup()
    g = vk.grad(plain_loss, hooks={"*": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, x, y)
    _, captured = vk.grad(plain_loss, capture="*")(params, x, y)
    assert sorted(state) == sorted(captured) == sorted(LAYERS)
    # the same model written with vjpkit.nn layers: the same states
    twin = vk.init_hook_state(vk.grad(mlp_loss, hooks={"fc*": vk.ema_normalize(DECAY)}), params, x, y)
    tree_allclose(dict(state), dict(twin), rtol=0, atol=0)
    for key in LAYERS:
        check_state(state[key], ema_init(params[key]))


def test_ema_normalize_on_a_plain_model_over_steps_matches_the_hand_chain(maybe_jit):
    params, _, _ = mlp_setup()
    batches = data(3)
    g = vk.grad(plain_loss, hooks={"*": vk.ema_normalize(DECAY)})
    twin = vk.grad(mlp_loss, hooks={"fc*": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, *batches[0])
    twin_state = vk.init_hook_state(twin, params, *batches[0])

    @maybe_jit
    def step(params, state, x, y):
        grads, state = g(params, x, y, hook_state=state)
        return sgd(params, grads), state, grads

    ref = {k: ema_init(params[k]) for k in LAYERS}
    ref_params = params
    for x, y in batches:
        chain = mlp_chain(ref_params, x, y)  # jax.vjp of each layer, chained by hand
        ref_grads = {}
        for k in LAYERS:
            ref[k], ref_grads[k] = ema_step(ref[k], chain[k]["grad_params"])
        twin_grads, twin_state = twin(params, x, y, hook_state=twin_state)
        params, state, grads = step(params, state, x, y)
        for k in LAYERS:
            check_state(state[k], ref[k])
        tree_allclose(grads, ref_grads, rtol=1e-4, atol=1e-5)
        tree_allclose(grads, twin_grads, rtol=1e-5, atol=1e-6)
        tree_allclose(dict(state), dict(twin_state), rtol=1e-5, atol=1e-7)  # a mean that cancels to ~0
        ref_params = sgd(ref_params, ref_grads)
    assert float(state["fc1"].count) == len(batches)


def rnn_setup(steps=4, batch=5):
    rng = np.random.default_rng(7)

    def normal(*shape):
        return jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32)

    params = {
        "inp": {"weight": normal(3, 4)},
        "cell": {"weight": normal(4, 4)},
        "head": {"weight": normal(4, 2)},
    }
    return params, normal(steps, batch, 3)


def rnn_cell(wi, wc, h, x):
    return jnp.tanh(x @ wi + h @ wc)


def rnn_loss(params, xs):
    def body(h, x):
        return rnn_cell(params["inp"]["weight"], params["cell"]["weight"], h, x), None

    h, _ = jax.lax.scan(body, jnp.zeros((xs.shape[1], 4)), xs)
    return jnp.mean((h @ params["head"]["weight"]) ** 2)


def rnn_reference(params, xs, ref):
    """Unrolled by hand: per iteration, in backward order, ``jax.vjp`` of the cell, then
    ``ema_step`` on each weight's per-call gradient; the weight gradients are the sums of the
    normalised per-call ones. ``ref``: ``{key: ema state}``, advanced in place."""
    wi, wc, wh = params["inp"]["weight"], params["cell"]["weight"], params["head"]["weight"]
    hs, pulls = [jnp.zeros((xs.shape[1], 4))], []
    for x in xs:
        h, pull = jax.vjp(rnn_cell, wi, wc, hs[-1], x)
        hs.append(h)
        pulls.append(pull)
    out, head_pull = jax.vjp(lambda w, h: h @ w, wh, hs[-1])
    g_wh, gh = head_pull(jax.grad(lambda o: jnp.mean(o**2))(out))
    ref["head"], g_head = ema_step(ref["head"], g_wh)
    total = {"inp": 0.0, "cell": 0.0}
    for pull in reversed(pulls):
        g_wi, g_wc, gh, _ = pull(gh)
        for key, g in (("inp", g_wi), ("cell", g_wc)):
            ref[key], normalised = ema_step(ref[key], g)
            total[key] = total[key] + normalised
    return {
        "inp": {"weight": total["inp"]},
        "cell": {"weight": total["cell"]},
        "head": {"weight": g_head},
    }


def test_state_advances_once_per_scan_iteration_in_backward_order(maybe_jit):
    params, xs = rnn_setup()
    g = vk.grad(rnn_loss, hooks={"*": vk.ema_normalize(DECAY)})
    state = vk.init_hook_state(g, params, xs)
    _, captured = vk.grad(rnn_loss, capture="*")(params, xs)
    assert sorted(state) == sorted(captured)
    ref = {k: ema_init(params[k]) for k in state}
    step = maybe_jit(g)
    for _ in range(2):
        grads, state = step(params, xs, hook_state=state)
        ref_grads = rnn_reference(params, xs, ref)
        for key in state:
            check_state(state[key], ref[key])
        tree_allclose(grads, ref_grads, rtol=1e-4, atol=1e-5)
    assert float(state["cell"].count) == 2 * len(xs)


def test_fit_threads_hook_state_on_a_plain_model():
    params, _, _ = mlp_setup()
    batches = data(4)
    state, history = vk.train.fit(
        lambda p, b: plain_loss(p, *b), optax.sgd(LR), params, batches, hooks={"*": vk.ema_normalize(DECAY)}
    )
    assert len(history["loss"]) == len(batches)
    ref = {k: ema_init(params[k]) for k in LAYERS}
    for x, y in batches:
        chain = mlp_chain(params, x, y)
        grads = {}
        for k in LAYERS:
            ref[k], grads[k] = ema_step(ref[k], chain[k]["grad_params"])
        params = sgd(params, grads)
    for k in LAYERS:
        check_state(state.hook_state[k], ref[k])
    tree_allclose(state.params, params, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------ 2. a transform built per eager call


def inner_jit_setup():
    """The forum MLP applied through an inner ``jax.jit`` that counts its traces."""
    params, x, y = mlp_setup(16)
    traces = []

    @jax.jit
    def forward(p, x):
        traces.append(None)  # runs only while JAX traces
        return plain_apply(p, x)

    def loss(p, x, y):
        logp = jax.nn.log_softmax(forward(p, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    return loss, (params, x, y), traces


def halve(seen):
    """A hook made anew each time (as in a loop), counting its traces in ``seen``."""

    def hook(rec):
        seen.append(None)
        return rec.replace(grad_params=jax.tree.map(lambda g: g / 2, rec.grad_params))

    return hook


@pytest.mark.parametrize("style", ["ready-made", "closure", "on_host"])
def test_a_transform_built_per_call_reuses_traces_and_compiled_inner_jit(style):
    loss, args, traces = inner_jit_setup()
    seen, delivered = [], []

    def make():
        if style == "ready-made":
            hooks = {"fc*": [vk.scale(0.5), halve(seen)]}
        elif style == "closure":
            hooks = {"fc*": halve(seen), "fc2": vk.before(lambda rec: rec)}
        else:
            hooks = {"fc*": [halve(seen), vk.on_host(delivered.append)]}
        return vk.grad(loss, hooks=hooks)

    first = make()(*args)
    inner_traces, size = len(traces), len(_run._JIT_CACHE)
    for _ in range(5):
        tree_allclose(make()(*args), first, rtol=0, atol=0)
    jax.effects_barrier()
    assert len(traces) == inner_traces == 1  # the user's inner jit, traced by the first call only
    assert len(seen) == len(LAYERS)  # the hook: traced into one compiled inner call, once
    factor = 0.25 if style == "ready-made" else 0.5
    tree_allclose(first, jax.tree.map(lambda g: factor * g, jax.grad(loss)(*args)), rtol=1e-5, atol=1e-7)
    assert len(_run._JIT_CACHE) <= size + 1
    if style == "on_host":
        assert len(delivered) == 6 * len(LAYERS)


def scaled(factor):
    return lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: g * factor, rec.grad_params))


def test_different_configurations_never_share_a_trace():
    loss, args, traces = inner_jit_setup()
    raw = jax.grad(loss)(*args)  # traces the inner jit outside any vjpkit transform: once
    configs = [
        ({"fc*": vk.scale(0.5)}, {k: 0.5 for k in LAYERS}),
        ({"fc*": vk.scale(0.25)}, {k: 0.25 for k in LAYERS}),
        ({"fc*": vk.scale(0.25, "grad_input")}, None),
        ({"fc1": vk.scale(0.5)}, {"fc1": 0.5, "fc2": 1.0, "fc3": 1.0}),
        ({"fc*": scaled(3.0)}, {k: 3.0 for k in LAYERS}),
        ({"fc*": scaled(-3.0)}, {k: -3.0 for k in LAYERS}),
        ({"fc*": scaled(3)}, {k: 3.0 for k in LAYERS}),
        ({"fc*": vk.hook_chain(scaled(2.0), scaled(2.0))}, {k: 4.0 for k in LAYERS}),
        ({"fc*": vk.hook_chain(scaled(2.0), scaled(-2.0))}, {k: -4.0 for k in LAYERS}),
        ({"fc*": vk.zero()}, {k: 0.0 for k in LAYERS}),
    ]
    for _ in range(2):  # the second round finds every trace made in the first
        for hooks, factors in configs:
            grads = vk.grad(loss, hooks=hooks)(*args)
            # None: grad_input scaled at fc3 and fc2, so fc2's gradient by 1/4 and fc1's by 1/16
            by = factors or {"fc1": 1 / 16, "fc2": 0.25, "fc3": 1.0}
            tree_allclose(grads, {k: jax.tree.map(lambda g, f=by[k]: f * g, raw[k]) for k in LAYERS})
    assert len(traces) == 2  # and once inside vjpkit transforms, whatever their hooks


def test_caches_stay_bounded_however_transforms_are_built():
    loss, args, _ = inner_jit_setup()
    for i in range(_context._INTERNED_MAX + 20):  # building a transform makes its configuration
        vk.grad(loss, hooks={"fc*": vk.scale(1.0 + i)})
    assert len(_context._interned) <= _context._INTERNED_MAX
    assert len(_run._JIT_CACHE) <= _run._JIT_CACHE_SIZE

    def call():
        jax.block_until_ready(vk.grad(loss, hooks={"fc*": vk.scale(0.5)})(*args))

    call()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(50):
            call()
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert growth < 4 * 2**20, f"{growth / 2**20:.1f} MB over 50 calls"
