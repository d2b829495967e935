"""fit against hand-written optax loops: iterators, non-finite steps, memory, optax's optimizers,
the progress bar and the metrics callback.

Every reference is a plain jitted optax loop over the same batches, written as optax's own
documentation writes it (``update(grads, state, params, value=..., ...)`` where the
transformation reads the loss).
"""

from __future__ import annotations

import gc
import io
import re
import weakref

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


def make_data(n=100, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([0.1, 2.0, 3.0], np.float32) > 2.5).astype(np.int32)
    return x, y


def loss_fn(params, batch):
    x, y = batch[0], batch[1]
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


def init_params(x):
    return model.init(jax.random.key(0), x[:2])


def reference(optimizer, params, batches, *, extra=False, loss=loss_fn):
    """A plain optax loop: value_and_grad, update (with value=, grad=, value_fn= when asked)."""
    state = optimizer.init(params)

    @jax.jit
    def step(p, s, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        if extra:
            kwargs = dict(value=value, grad=grads, value_fn=lambda q: loss(q, batch))
            updates, s = optimizer.update(grads, s, p, **kwargs)
        else:
            updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    losses = []
    for batch in batches:
        params, state, value = step(params, state, batch)
        losses.append(float(value))
    return params, state, losses


def array_batches(data, batch_size, steps, seed=0):
    b = ArrayBatches(data, batch_size, seed=seed)
    return [b.batch(t) for t in range(steps)]


# ------------------------------------------------------------------------------ iterables


def test_a_generator_loses_no_batch():
    x, y = make_data()
    params = init_params(x)
    batches = [(x[i : i + 20], y[i : i + 20]) for i in range(0, 100, 20)]  # 5 batches
    opt = optax.sgd(0.1, momentum=0.9)
    state, history = vk.train.fit(loss_fn, opt, params, (b for b in batches))
    assert int(state.step) == 5 and history["step"] == [0, 1, 2, 3, 4]
    ref_params, _, ref_losses = reference(opt, params, batches)
    tree_allclose(state.params, ref_params, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history["loss"], ref_losses, rtol=1e-6)
    it = iter(batches)  # a plain iterator too
    state, _ = vk.train.fit(loss_fn, opt, params, it)
    assert int(state.step) == 5


# ------------------------------------------------------------------------------ non-finite steps


def flagged_loss(params, batch):
    """The loss, NaN on batches whose flag is set; its gradient stays finite (stop_gradient)."""
    x, y, flag = batch
    bad = jax.lax.stop_gradient(jnp.where(flag.any(), jnp.float32(jnp.nan), jnp.float32(0)))
    return loss_fn(params, (x, y)) + bad


def test_continue_records_every_nonfinite_step():
    x, y = make_data()
    params = init_params(x)
    bad_steps = [1, 3, 4]
    batches = [
        (x[i * 10 : i * 10 + 10], y[i * 10 : i * 10 + 10], np.full(10, i in bad_steps)) for i in range(8)
    ]
    opt = optax.sgd(0.1)
    with pytest.warns(RuntimeWarning) as caught:
        state, history = vk.train.fit(flagged_loss, opt, params, batches, nan_policy="continue", log_every=3)
    assert history["nonfinite"] == bad_steps
    for step in bad_steps:
        assert any(f"step {step} " in str(w.message) for w in caught)
    # the gradients were finite, so every step was applied, as in the plain loop
    ref_params, _, ref_losses = reference(opt, params, batches, loss=flagged_loss)
    tree_allclose(state.params, ref_params, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.isnan(history["loss"]), np.isnan(ref_losses))


dropout_model = nn.serial(fc1=nn.dense(8), sqrt=nn.layer(lambda p, x: jnp.sqrt(x)), drop=nn.dropout(0.1))


def keyed_loss(params, batch, *, key):
    x, _ = batch
    return dropout_model.apply(params, x - 0.5, key=key).mean()  # sqrt of negatives: NaN


def test_stop_with_a_key_taking_loss_raises_nonfinite_error():
    x, y = make_data()
    params = dropout_model.init(jax.random.key(0), x[:2])
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 50, 10)]
    with pytest.raises(vk.NonFiniteError, match="step 0") as err:
        vk.train.fit(keyed_loss, optax.sgd(0.1), params, batches)
    assert err.value.step == 0 and err.value.layer is not None


def test_fit_holds_no_batch_once_its_step_is_fetched():
    """The old loop kept the last log_every + 1 batches alive; at each evaluation (after a fetch
    of every dispatched step) no batch of a generator may be referenced any more."""
    x, y = make_data(200)
    params = init_params(x)
    alive = []
    refs: list = []

    def make(i):
        xb = x[i : i + 10].copy()
        refs.append(weakref.ref(xb))
        return xb, y[i : i + 10]

    def gen():
        for i in range(0, 200, 10):
            yield make(i)

    def eval_fn(p):
        gc.collect()
        alive.append([k for k, r in enumerate(refs) if r() is not None])
        return {}

    vk.train.fit(loss_fn, optax.sgd(0.1), params, gen(), eval_fn=eval_fn, eval_every=5, log_every=1000)
    # The old loop held every batch since the last log_every fetch here (5, 10, 15, then 20 of them).
    # Now at most two: the newest, which the suspended batch iterator still names, and the first,
    # which fit checks and traces the step with before the loop (something during that setup keeps
    # it until fit returns; it is one batch whatever log_every is).
    for t, kept in zip((5, 10, 15, 20), alive):
        assert set(kept) <= {0, t - 1}, alive


# ------------------------------------------------------------------------------ optax optimizers


def test_multisteps_gradient_accumulation():
    x, y = make_data()
    params = init_params(x)
    opt = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=3)
    with jax.numpy_dtype_promotion("standard"):  # optax's MultiSteps arithmetic is not strict-clean
        state, history = vk.train.fit(loss_fn, opt, params, (x, y), batch_size=10, steps=9)
        ref_params, ref_state, ref_losses = reference(opt, params, array_batches((x, y), 10, 9))
    tree_allclose(state.params, ref_params, rtol=1e-6, atol=1e-7)
    tree_allclose(state.opt_state, ref_state, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history["loss"], ref_losses, rtol=1e-6)
    assert int(state.opt_state.gradient_step) == 3  # 9 mini-steps, 3 updates


def test_reduce_on_plateau_gets_the_loss():
    x, y = make_data()
    params = init_params(x)
    opt = optax.chain(
        optax.sgd(0.5),
        optax.contrib.reduce_on_plateau(patience=1, cooldown=0, factor=0.5, accumulation_size=2),
    )
    with jax.numpy_dtype_promotion("standard"):
        state, history = vk.train.fit(loss_fn, opt, params, (x, y), batch_size=10, steps=20)
        ref_params, ref_state, ref_losses = reference(opt, params, array_batches((x, y), 10, 20), extra=True)
    tree_allclose(state.params, ref_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["loss"], ref_losses, rtol=1e-5)
    scale = float(state.opt_state[1].scale)
    assert scale == float(ref_state[1].scale)
    assert scale < 1.0  # the plateau logic saw the losses and lowered the learning rate


def test_lbfgs_with_its_line_search():
    x, y = make_data()
    params = init_params(x)
    opt = optax.lbfgs()
    batches = [(x, y)] * 6  # L-BFGS is a full-batch method: the same batch every step
    with jax.numpy_dtype_promotion("standard"):
        state, history = vk.train.fit(loss_fn, opt, params, batches)
        ref_params, _, ref_losses = reference(opt, params, batches, extra=True)
    tree_allclose(state.params, ref_params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(history["loss"], ref_losses, rtol=1e-5)
    assert history["loss"][-1] < history["loss"][0]


def weak_state_sgd(lr=0.1):
    """SGD whose state is a weakly typed scalar at init and strongly typed after an update (as
    some of optax's own states are, whatever optax's version)."""

    def init(params):
        return {"scale": jnp.asarray(1.0)}  # a Python float: weakly typed

    def update(grads, state, params=None):
        scale = state["scale"] * jnp.ones((), jnp.float32)  # strongly typed from here on
        return jax.tree.map(lambda g: -lr * scale * g, grads), {"scale": scale}

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize(
    "opt", [weak_state_sgd(), optax.lbfgs(), optax.adam(1e-2)], ids=["weak-state", "lbfgs", "adam"]
)
def test_the_step_compiles_once_whatever_the_state_types(opt):
    # a weakly typed initial state (optax.lbfgs's has some leaves) comes back strongly typed from
    # a step, so without keep_types the jitted step would compile again at the second step
    x, y = make_data()
    traces = []

    def counted(params, batch):
        traces.append(None)
        return loss_fn(params, batch)

    counts = []
    for n in (1, 4):
        traces.clear()
        with jax.numpy_dtype_promotion("standard"):
            vk.train.fit(counted, opt, init_params(x), [(x, y)] * n, progress=False)
        counts.append(len(traces))
    assert counts[0] == counts[1] > 0, f"loss traced {counts[0]} times for 1 step, {counts[1]} for 4"


def test_state_leaves_are_strongly_typed_and_keep_their_types():
    from vjpkit.train._state import keep_types

    assert weak_state_sgd().init(None)["scale"].weak_type
    state = vk.train.TrainState.create({"w": jnp.asarray(1.0)}, weak_state_sgd())
    assert not any(leaf.weak_type for leaf in jax.tree.leaves(state))
    old = {"a": jnp.zeros((), jnp.float32), "b": jnp.asarray(0.0)}  # b: weakly typed

    @jax.jit
    def update(old):
        new = {"a": jnp.asarray(2.0), "b": jnp.asarray(3.0)}  # both weakly typed
        return keep_types(new, old), new

    kept, raw = update(old)
    assert raw["a"].weak_type and not kept["a"].weak_type and kept["b"].weak_type
    assert kept["a"].dtype == old["a"].dtype
    tree_allclose(kept, {"a": jnp.float32(2.0), "b": jnp.asarray(3.0)})


def test_a_non_optax_optimizer_is_still_refused():
    x, y = make_data()
    with pytest.raises(vk.ConfigError, match=r"optax\.MultiSteps"):
        vk.train.fit(loss_fn, optax.sgd(0.1).update, init_params(x), (x, y), batch_size=10, steps=1)


# ------------------------------------------------------------------------------ display and metrics


def test_progress_bar_shows_one_rate_and_the_eval_metrics(monkeypatch):
    x, y = make_data()
    out = io.StringIO()
    import tqdm.auto

    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **k: real(*a, file=out, **k))

    def eval_fn(p):
        return {"acc": 0.5}

    vk.train.fit(
        loss_fn,
        optax.sgd(0.1),
        init_params(x),
        (x, y),
        batch_size=10,
        steps=20,
        eval_fn=eval_fn,
        progress=True,
    )
    text = out.getvalue()
    final = text.replace("\r", "\n").strip().splitlines()[-1]
    assert "20/20" in final and "loss=" in final and "eval_acc=0.5" in final
    assert len(re.findall(r"step/s|s/step", final)) == 1, final  # tqdm's rate only
    assert "steps_per_s" not in text


def test_on_metrics_gets_the_loss_of_every_step_and_each_evaluation():
    x, y = make_data()
    got = []
    state, history = vk.train.fit(
        loss_fn,
        optax.sgd(0.1),
        init_params(x),
        (x, y),
        batch_size=10,
        steps=6,
        eval_fn=lambda p: {"acc": 1.0},
        eval_every=3,
        on_metrics=lambda step, m: got.append((step, m)),
    )
    losses = [(s, m["train/loss"]) for s, m in got if "train/loss" in m]
    assert losses == list(zip(history["step"], history["loss"]))
    assert [(s, m) for s, m in got if "eval/acc" in m] == [(3, {"eval/acc": 1.0}), (6, {"eval/acc": 1.0})]


def test_the_checkpointer_is_closed_on_success_and_on_error(tmp_path, monkeypatch):
    from vjpkit.train import _checkpoint

    closed = []
    original = _checkpoint.Checkpointer.close
    monkeypatch.setattr(_checkpoint.Checkpointer, "close", lambda self: closed.append(original(self)))
    x, y = make_data()
    params = init_params(x)
    vk.train.fit(
        loss_fn, optax.sgd(0.1), params, (x, y), batch_size=10, steps=2, checkpoint_dir=str(tmp_path)
    )
    assert len(closed) == 1
    x_bad = x.copy()
    x_bad[:] = np.nan
    with pytest.raises(vk.NonFiniteError):
        vk.train.fit(
            loss_fn,
            optax.sgd(0.1),
            params,
            (x_bad, y),
            batch_size=10,
            steps=4,
            checkpoint_dir=str(tmp_path / "b"),
        )
    assert len(closed) == 2
