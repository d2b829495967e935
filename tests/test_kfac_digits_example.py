"""The K-FAC example: its runs, and its first K-FAC step against the hand-chained pieces.

The reference for the first step never uses ``make_step``: the statistics from a jitted
``vk.value_and_grad`` with the key ``make_step`` draws (``jax.random.split(PRNGKey(seed))[1]``),
then ``vk.curvature.kfac``'s ``update`` by hand and ``optax.apply_updates``.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import load_example, tree_allclose

pytest.importorskip("sklearn", reason='the digits examples need scikit-learn: pip install -e ".[examples]"')

STEPS = 30


@pytest.fixture(scope="module")
def module():
    return load_example("kfac_digits")


@pytest.fixture(scope="module")
def example(module, tmp_path_factory):
    plot = tmp_path_factory.mktemp("kfac") / "curves.png"
    printed = io.StringIO()
    # optax.adam's bias correction (1 - b1**count) is not strict-promotion clean
    with contextlib.redirect_stdout(printed), jax.numpy_dtype_promotion("standard"):
        out = module.main(["--steps", str(STEPS), "--plot", str(plot)])
    return out, printed.getvalue(), plot


def test_runs_report_and_plot(example):
    out, printed, plot = example
    assert set(out) == {"K-FAC", "Adam", "SGD"}
    for name, run in out.items():
        assert len(run["loss"]) == STEPS and np.all(np.isfinite(run["loss"])), name
        assert np.all(np.diff(run["seconds"]) >= 0)
    first = {name: run["loss"][0] for name, run in out.items()}
    assert max(first.values()) - min(first.values()) < 1e-6  # same init, same first batch
    assert out["K-FAC"]["final"] < out["K-FAC"]["loss"][0]
    for word in ("K-FAC", "Adam", "SGD", "loss @ last step", "test acc"):
        assert word in printed
    assert plot.exists() and plot.stat().st_size > 10_000


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_first_kfac_step_equals_the_hand_chained_pieces(module, kind):
    (x, y), _ = module.load_data(0)
    model = module.make_model(kind)
    params = model.init(jax.random.key(0), jnp.asarray(x[:1]))
    loss_fn = module.make_loss(model)
    batch = module.batches(x, y, 32, 1, 0)[0]

    class Args:
        kfac_lr, damping, update_every = 0.05, 0.1, 5

    opt, spec = module.kfac_optimizer(loss_fn, params, batch, Args)
    step = vk.train.make_step(loss_fn, opt, capture=spec)
    state, metrics = step(vk.train.TrainState.create(params, opt, seed=3), batch)

    key = jax.random.split(jax.random.PRNGKey(3))[1]  # the key make_step draws for its first step
    (loss, grads), curvature = jax.jit(vk.value_and_grad(loss_fn, capture=spec))(params, batch, key=key)
    assert sorted(curvature) == sorted(k for k in curvature if k.startswith(("fc", "conv")))
    # the update by hand, jitted (eagerly, its eigendecompositions dispatch op by op)
    updates, _ = jax.jit(lambda g, p, c: opt.update(g, opt.init(p), p, curvature=c))(grads, params, curvature)
    tree_allclose(state.params, optax.apply_updates(params, updates), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
