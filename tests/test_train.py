"""vjpkit.train: fit and make_step against hand-written optax loops, and the bad-input catalogue."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn
from vjpkit.train._data import ArrayBatches

model = nn.serial(fc1=nn.dense(8), act=nn.tanh(), fc2=nn.dense(2))
OPT = optax.sgd(0.1, momentum=0.9)


def make_data(n=103, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([0.1, 2.0, 3.0], np.float32) > 2.5).astype(np.int32)
    return x, y


def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


def init_params(x):
    return model.init(jax.random.key(0), x[:2])


def hand_loop(params, data, batch_size, steps, seed=0, loss=loss_fn):
    """The reference: a plain jitted optax loop over fit's batch order."""
    batches = ArrayBatches(data, batch_size, seed=seed)
    state = OPT.init(params)

    @jax.jit
    def step(p, s, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, s = OPT.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    losses = []
    for t in range(steps):
        params, state, value = step(params, state, batches.batch(t))
        losses.append(float(value))
    return params, losses


def test_fit_equals_hand_written_loop():
    x, y = make_data()
    params = init_params(x)
    state, history = vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=10, epochs=3, log_every=7)
    ref_params, ref_losses = hand_loop(params, (x, y), 10, 30)
    assert int(state.step) == 30 and history["step"] == list(range(30))  # 103 // 10 = 10 per epoch
    tree_allclose(state.params, ref_params, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history["loss"], ref_losses, rtol=1e-6)
    for leaf in jax.tree.leaves(params):  # the caller's params were not donated away
        assert np.isfinite(np.asarray(leaf)).all()


def test_scan_steps_equal_single_steps_including_remainder():
    x, y = make_data()
    params = init_params(x)
    s1, h1 = vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=10, steps=23)
    s8, h8 = vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=10, steps=23, scan_steps=8)
    tree_allclose(s8.params, s1.params, rtol=1e-6, atol=1e-7)
    assert h8["step"] == list(range(23))
    np.testing.assert_allclose(h8["loss"], h1["loss"], rtol=1e-6)


def test_fit_on_iterables_runs_until_exhausted():
    x, y = make_data()
    params = init_params(x)
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 100, 10)]
    state, history = vk.train.fit(loss_fn, OPT, params, batches)
    assert int(state.step) == 10
    p, s = params, OPT.init(params)
    for batch in batches:
        grads = jax.grad(loss_fn)(p, batch)
        updates, s = OPT.update(grads, s, p)
        p = optax.apply_updates(p, updates)
    tree_allclose(state.params, p, rtol=1e-6, atol=1e-7)
    state, _ = vk.train.fit(loss_fn, OPT, params, iter(batches), steps=4)  # a generator, cut short
    assert int(state.step) == 4


def test_make_step_retraces_only_when_shapes_change():
    x, y = make_data()
    traces = []

    def counted(params, batch):
        traces.append(batch[0].shape)
        return loss_fn(params, batch)

    step = vk.train.make_step(counted, OPT)
    state = vk.train.TrainState.create(init_params(x), OPT)
    for i in range(4):
        state, _ = step(state, (x[i * 10 : i * 10 + 10], y[i * 10 : i * 10 + 10]))
    assert len(traces) == 1
    state, _ = step(state, (x[:20], y[:20]))
    assert len(traces) == 2 and traces[-1] == (20, 3)


def test_hooks_capture_and_hook_state_in_fit():
    x, y = make_data()
    params = init_params(x)
    records = []
    spec = vk.capture("fc*", fields=["grad_params"], reduce="norm")
    state, _ = vk.train.fit(
        loss_fn,
        OPT,
        params,
        (x, y),
        batch_size=10,
        steps=12,
        scan_steps=5,
        hooks={"fc1": vk.ema_normalize(0.9)},
        capture=spec,
        on_records=lambda step, rec: records.append((step, rec)),
    )
    assert [s for s, _ in records] == list(range(12))
    assert float(state.hook_state["fc1"].count) == 12.0
    # reference: the same steps by hand with vk.value_and_grad and explicit hook-state threading
    g = jax.jit(vk.value_and_grad(loss_fn, hooks={"fc1": vk.ema_normalize(0.9)}, capture=spec))
    hook_state = vk.init_hook_state(g, params, (x[:10], y[:10]))
    batches = ArrayBatches((x, y), 10, seed=0)
    p, s = params, OPT.init(params)
    for t in range(12):
        (_, grads), captured, hook_state = g(p, batches.batch(t), hook_state=hook_state)
        tree_allclose(records[t][1], jax.tree.map(np.asarray, captured), rtol=1e-5, atol=1e-7)
        updates, s = OPT.update(grads, s, p)
        p = optax.apply_updates(p, updates)
    tree_allclose(state.params, p, rtol=1e-5, atol=1e-6)
    tree_allclose(state.hook_state, hook_state, rtol=1e-5, atol=1e-7)


def test_eval_history_and_progress(capsys):
    x, y = make_data()
    evals = []

    def eval_fn(params):
        evals.append(1)
        return {"loss": float(loss_fn(params, (x, y)))}

    state, history = vk.train.fit(
        loss_fn,
        OPT,
        init_params(x),
        (x, y),
        batch_size=10,
        steps=20,
        eval_fn=eval_fn,
        eval_every=8,
        progress=True,
    )
    assert [e["step"] for e in history["eval"]] == [8, 16, 20]
    assert history["eval"][-1]["loss"] == pytest.approx(float(loss_fn(state.params, (x, y))), rel=1e-6)
    assert "20/20" in capsys.readouterr().err  # the tqdm bar reached the end


def test_dropout_gets_a_fresh_key_each_step_and_runs_are_deterministic():
    drop_model = nn.serial(fc1=nn.dense(8), drop=nn.dropout(0.5), fc2=nn.dense(2))

    def dropout_loss(params, batch, *, key):
        x, y = batch
        logits = drop_model.apply(params, x, key=key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    x, y = make_data()
    params = drop_model.init(jax.random.key(0), x[:2])
    a, ha = vk.train.fit(dropout_loss, OPT, params, (x, y), batch_size=10, steps=15, seed=3)
    b, hb = vk.train.fit(dropout_loss, OPT, params, (x, y), batch_size=10, steps=15, seed=3)
    c, _ = vk.train.fit(dropout_loss, OPT, params, (x, y), batch_size=10, steps=15, seed=4)
    tree_allclose(a, b, rtol=0, atol=0)  # bit-identical
    assert ha["loss"] == hb["loss"]
    assert not np.allclose(np.asarray(a.params["fc1"]["weight"]), np.asarray(c.params["fc1"]["weight"]))


def test_state_lives_on_the_present_backend():
    x, y = make_data()
    state, _ = vk.train.fit(loss_fn, OPT, init_params(x), (x, y), batch_size=10, steps=3)
    devices = set(jax.devices())
    for leaf in jax.tree.leaves(state):
        assert leaf.devices() <= devices
        assert next(iter(leaf.devices())).platform == jax.default_backend()


def test_incomplete_last_batch_is_dropped():
    x, y = make_data(n=25)
    seen = []

    def recording_loss(params, batch):
        jax.debug.callback(lambda n: seen.append(int(n)), batch[0].shape[0])
        return loss_fn(params, batch)

    state, _ = vk.train.fit(recording_loss, OPT, init_params(x), (x, y), batch_size=10, epochs=3)
    jax.effects_barrier()
    assert int(state.step) == 6 and set(seen) == {10}


# ---------------------------------------------------------------- non-finite losses

bad_model = nn.serial(
    fc1=nn.dense(4), log=nn.layer(lambda p, h: jnp.log(h), name="log"), fc2=nn.dense(2)
)  # log of a negative pre-activation: NaN in the middle of the net


def bad_loss(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(bad_model.apply(params, x), y).mean()


def test_nan_stop_names_step_and_first_layer():
    x, y = make_data()
    params = bad_model.init(jax.random.key(1), x[:2])
    with pytest.raises(vk.NonFiniteError) as err:
        vk.train.fit(bad_loss, OPT, params, (x, y), batch_size=10, steps=5)
    e = err.value
    assert e.step == 0 and "step 0" in str(e)
    # the reference: the first record in backward order (fc2, log, fc1) with a non-finite field
    spec = vk.capture("*", fields=["grad_output", "grad_input", "grad_params"], reduce="nonfinite_count")
    _, captured = vk.grad(bad_loss, capture=spec)(params, ArrayBatches((x, y), 10).batch(0))
    first = next(
        (k, f)
        for k in ("fc2", "log", "fc1")
        for f in ("grad_output", "grad_input", "grad_params")
        if any(float(c) > 0 for c in jax.tree.leaves(getattr(captured[k], f)))
    )
    assert (e.layer, e.field) == first and repr(e.layer) in str(e)
    tree_allclose(e.state.params, params, rtol=0, atol=0)  # the bad step was not applied
    assert e.history["nonfinite"] == [0]


def test_nan_continue_warns_and_goes_on():
    x, y = make_data()
    params = bad_model.init(jax.random.key(1), x[:2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, history = vk.train.fit(
            bad_loss, OPT, params, (x, y), batch_size=10, steps=4, nan_policy="continue"
        )
    # step 0's NaN gradients are applied, so every later step is non-finite too: each is recorded
    assert int(state.step) == 4 and history["nonfinite"] == [0, 1, 2, 3]
    for step in range(4):
        assert any(f"step {step} " in str(w.message) for w in caught)


# ---------------------------------------------------------------- bad input, before any compile


def test_bad_inputs_are_clear_errors():
    x, y = make_data()
    params = init_params(x)
    with pytest.raises(vk.SeedError, match="scalar"):
        vk.train.fit(lambda p, b: model.apply(p, b[0]), OPT, params, (x, y), batch_size=10, steps=2)
    with pytest.raises(vk.ConfigError, match=r"optax\.GradientTransformation"):
        vk.train.fit(loss_fn, OPT.update, params, (x, y), batch_size=10, steps=2)
    with pytest.raises(vk.ConfigError, match=r"disagree.*\[0\]: 103.*\[1\]: 50"):
        vk.train.fit(loss_fn, OPT, params, (x, y[:50]), batch_size=10, steps=2)
    with pytest.raises(vk.ConfigError, match="larger than the data"):
        vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=500, steps=2)
    with pytest.raises(vk.ConfigError, match="batch_size"):
        vk.train.fit(loss_fn, OPT, params, (x, y), steps=2)
    with pytest.raises(vk.ConfigError, match="steps= or epochs="):
        vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=10)
    with pytest.raises(vk.ConfigError, match="nan_policy"):
        vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=10, steps=2, nan_policy="ignore")
    with pytest.raises(vk.ConfigError, match="on_records"):
        vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=10, steps=2, on_records=print)


def test_uneven_batches_of_an_iterable_are_skipped_with_a_warning():
    x, y = make_data()
    params = init_params(x)
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 103, 10)]  # the last one has 3 rows
    with pytest.warns(RuntimeWarning, match="skipped a batch of 3"):
        state, history = vk.train.fit(loss_fn, OPT, params, batches)
    assert int(state.step) == 10 and len(history["loss"]) == 10


def test_make_step_by_hand_with_stateful_hooks_keeps_callers_arrays():
    x, y = make_data()
    params = init_params(x)
    hooks = {"fc*": vk.ema_normalize(0.9)}
    g = vk.value_and_grad(loss_fn, hooks=hooks)
    state = vk.train.TrainState.create(params, OPT, hook_state=vk.init_hook_state(g, params, (x, y)))
    step = vk.train.make_step(loss_fn, OPT, hooks=hooks)
    for i in range(3):
        state, _ = step(state, (x[i * 10 : i * 10 + 10], y[i * 10 : i * 10 + 10]))
    assert float(state.hook_state["fc1"].count) == 3.0
    assert np.isfinite(np.asarray(params["fc1"]["weight"])).all()  # not donated away


def test_nan_stop_freezes_step_and_rng_and_checks_gradients():
    x, y = make_data()
    # finite loss, non-finite gradient: sqrt at 0 has an infinite derivative
    sqrt_model = nn.serial(
        fc1=nn.dense(4), root=nn.layer(lambda p, h: jnp.sqrt(h * 0.0), name="root"), fc2=nn.dense(2)
    )
    params = sqrt_model.init(jax.random.key(1), x[:2])

    def loss(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(sqrt_model.apply(p, batch[0]), batch[1]).mean()

    assert np.isfinite(float(loss(params, (x[:10], y[:10]))))
    with pytest.raises(vk.NonFiniteError) as err:
        vk.train.fit(loss, OPT, params, (x, y), batch_size=10, steps=6, log_every=3)
    e = err.value
    assert e.step == 0 and int(e.state.step) == 0  # step count and rng did not run ahead
    tree_allclose(e.state.rng, jax.random.PRNGKey(0), rtol=0, atol=0)
    assert e.layer == "root" and e.field == "grad_input"
