"""The quickstart example runs, learns, and its collected records are the true cotangents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.helpers import load_example, tree_allclose


def dense_fn(p, x):
    return x @ p["weight"] + p["bias"]


def test_quickstart_records_are_exact(capsys):
    quickstart = load_example("quickstart")
    out = quickstart.main(["--steps", "30", "--batch-size", "16", "--keep", "30"])
    printed = capsys.readouterr().out
    assert "Accuracy of prediction on test dataset" in printed
    assert "grad_input              None" in printed  # fc1's input is the data batch
    grad_dict = out["grad_dict"]
    assert sorted(grad_dict) == ["fc1", "fc2", "fc3"]
    assert all(len(records) == 30 for records in grad_dict.values())
    for step in (0, 29):
        fc3, fc2, fc1 = (grad_dict[n][step] for n in ("fc3", "fc2", "fc1"))
        for rec in (fc3, fc2, fc1):  # each record is jax.vjp of the plain layer at its grad_output
            p = jax.tree.map(jnp.asarray, rec.params)
            x = jnp.asarray(rec.input)
            y, pullback = jax.vjp(dense_fn, p, x)
            tree_allclose(rec.output, np.asarray(y), rtol=1e-5, atol=1e-6)
            gp, gx = pullback(jnp.asarray(rec.grad_output))
            tree_allclose(rec.grad_params, jax.tree.map(np.asarray, gp), rtol=1e-5, atol=1e-6)
            if rec.grad_input is not None:
                tree_allclose(rec.grad_input, np.asarray(gx), rtol=1e-5, atol=1e-6)
        assert fc1.grad_input is None
        # the chain: fc3's grad_input passes through relu2 to become fc2's grad_output
        np.testing.assert_allclose(fc2.grad_output, fc3.grad_input * (fc2.output > 0), rtol=1e-6)
        np.testing.assert_allclose(fc1.grad_output, fc2.grad_input * (fc1.output > 0), rtol=1e-6)
        np.testing.assert_allclose(fc2.input, np.maximum(fc1.output, 0), rtol=1e-6)
        # the seed: fc3's grad_output is d(mean cross-entropy)/d(logits) = (softmax - onehot) / B
        probs = np.asarray(jax.nn.softmax(jnp.asarray(fc3.output)))
        labels = np.argmax(probs - fc3.grad_output * fc3.output.shape[0], axis=-1)
        onehot = np.eye(2, dtype=np.float32)[labels]
        np.testing.assert_allclose(fc3.grad_output, (probs - onehot) / 16, rtol=1e-4, atol=1e-7)


def test_quickstart_keeps_only_the_last_records_by_default():
    out = load_example("quickstart").main(["--steps", "5", "--batch-size", "16"])
    assert {name: len(records) for name, records in out["grad_dict"].items()} == {
        "fc1": 1,
        "fc2": 1,
        "fc3": 1,
    }


def test_quickstart_final_params_match_plain_optax():
    quickstart = load_example("quickstart")
    out = quickstart.main(["--steps", "20", "--batch-size", "16"])
    # the same run with jax.value_and_grad and no hooks
    key_data, key_init = jax.random.split(jax.random.key(0))
    (x_train, y_train), _ = quickstart.make_data(key_data)
    params = quickstart.model.init(key_init, x_train[:16])
    opt = optax.sgd(0.05, momentum=0.8)
    state = opt.init(params)
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = rng.choice(len(x_train), size=16, replace=False)
        grads = jax.grad(quickstart.loss_fn)(params, x_train[idx], y_train[idx])
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    tree_allclose(out["params"], params, rtol=1e-5, atol=1e-6)
    # --no-hooks, the memory benchmark's baseline, is that same plain run and keeps no records
    bare = quickstart.main(["--steps", "20", "--batch-size", "16", "--no-hooks"])
    assert bare["grad_dict"] == {}
    tree_allclose(bare["params"], params, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_quickstart_learns():
    out = load_example("quickstart").main([])
    assert out["accuracy"] > 0.9
