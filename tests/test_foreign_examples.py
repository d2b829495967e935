"""The Flax transformer and Equinox MLP examples run, learn, and their records are exact."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

from tests.helpers import load_example, tree_allclose


def test_equinox_mlp_example_grad_dict_is_jax_grad(capsys):
    pytest.importorskip("equinox", reason="Equinox is an optional extra: pip install 'vjpkit[equinox]'")
    import equinox as eqx

    example = load_example("equinox_mlp")
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
        out = example.main(["--steps", "150"])
    assert "train accuracy" in capsys.readouterr().out
    assert out["accuracy"] > 0.9
    grad_dict = out["grad_dict"]
    assert sorted(grad_dict) == ["layers/0", "layers/1", "layers/2"]
    assert all(len(v) == 150 for v in grad_dict.values())
    # step 0's records are jax.grad of the unchanged model at the initial parameters
    model = eqx.nn.MLP(2, 2, 32, 2, activation=jax.nn.tanh, key=jax.random.split(jax.random.key(0))[1])
    x, y = example.make_data(jax.random.split(jax.random.key(0))[0])
    params, static = eqx.partition(model, eqx.is_array)
    import optax

    def loss(p):
        logits = jax.vmap(eqx.combine(p, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    expected = jax.grad(loss)(params)
    for i in range(3):
        got = jax.tree.map(np.asarray, grad_dict[f"layers/{i}"][0])
        tree_allclose(got, jax.tree.map(np.asarray, expected.layers[i]), rtol=1e-4, atol=1e-6)


def test_flax_transformer_example_learns(tmp_path, capsys):
    pytest.importorskip("flax", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")
    example = load_example("flax_transformer")
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # optax's Adam mixes int and float: standard promotion
        out = example.main(["--steps", "150", "--out", str(tmp_path)])
        jax.effects_barrier()
    # as its docstring says: no layer falls back to vmap(grad), and the loss keeps to the contract
    per_example = [str(w.message) for w in caught if "per_example_grad_norms" in str(w.message)]
    assert not per_example, per_example
    printed = capsys.readouterr().out
    assert "test answer accuracy" in printed
    assert out["accuracy"] > 0.5  # chance is 0.1
    assert (tmp_path / "flax_gradient_flow.png").exists()
    keys = set(out["history"][-1][1])
    assert {"block_0/attn/query", "block_1/mlp/fc", "block_1/attn/out"} <= keys
    # per-example norms equal vmap(grad) of the per-example loss
    loss_fn, params, batch = out["loss_fn"], out["state"].params, out["test"][:16]
    per = jax.jit(jax.vmap(jax.grad(lambda p, t: loss_fn(p, t[None])), in_axes=(None, 0)))(params, batch)
    sq = sum(np.sum(np.square(g).reshape(g.shape[0], -1), 1) for g in jax.tree.leaves(per))
    np.testing.assert_allclose(out["norms"].total, np.sqrt(sq), rtol=1e-4, atol=1e-6)
