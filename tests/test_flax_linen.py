"""Flax linen modules are vjpkit layer calls inside vjpkit transforms, with no wrapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")

import flax.linen as nn

import vjpkit as vk
from tests.helpers import tree_allclose


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(6)(x))
        return nn.Dense(5)(x)


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(8)(x))
        h = Encoder()(h)
        h = nn.LayerNorm()(h)
        return nn.Dense(2, name="head")(h)


def _setup():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (4, 3))
    y = jax.random.normal(jax.random.key(2), (4, 2))
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    return model, params, x, y, loss


DENSES = ["Dense_0", "Encoder_0/Dense_0", "Encoder_0/Dense_1", "head"]


def test_names_follow_flax_paths():
    _, params, x, y, loss = _setup()
    names = []
    vk.grad(loss, hooks={"*": lambda rec: names.append((rec.name, rec.call))})(params, x, y)
    assert sorted(names) == sorted([(n, 0) for n in [*DENSES, "Encoder_0", "LayerNorm_0", "Model"]])


def test_parent_hook_sees_parent_call_and_children_recorded():
    _, params, x, y, loss = _setup()
    seen = {}

    def spy(rec):
        seen[rec.name] = rec

    expected = jax.grad(loss)(params, x, y)
    vk.grad(loss, hooks={"Encoder_0": spy, "Encoder_0/*": spy})(params, x, y)
    assert sorted(seen) == ["Encoder_0", "Encoder_0/Dense_0", "Encoder_0/Dense_1"]
    enc = seen["Encoder_0"]
    assert sorted(enc.params) == ["Dense_0", "Dense_1"]
    tree_allclose(enc.grad_params, expected["Encoder_0"], rtol=1e-5, atol=1e-6)
    tree_allclose(enc.grad_output, seen["Encoder_0/Dense_1"].grad_output)
    tree_allclose(enc.grad_input, seen["Encoder_0/Dense_0"].grad_input, rtol=1e-5, atol=1e-6)


def test_plain_outside_transforms_and_dropout_rng_unchanged(maybe_jit):
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x, *, train):
            h = nn.Dropout(0.5, deterministic=not train)(nn.Dense(8)(x))
            return nn.Dense(1)(nn.Dropout(0.5, deterministic=not train)(h)).sum()

    model = Drop()
    x = jax.random.normal(jax.random.key(1), (4, 3))
    params = model.init(jax.random.key(0), x, train=False)["params"]

    def loss(p, key):
        return model.apply({"params": p}, x, train=True, rngs={"dropout": key})

    key = jax.random.key(3)
    expected = jax.grad(loss)(params, key)
    grads = maybe_jit(vk.grad(loss, hooks={"*": lambda rec: None}))(params, key)
    tree_allclose(grads, expected)


def test_vjp_and_value_and_grad_on_linen():
    model, params, x, y, loss = _setup()
    value, grads = vk.value_and_grad(loss, hooks={"head": lambda r: None})(params, x, y)
    ref_value, ref = jax.value_and_grad(loss)(params, x, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    tree_allclose(grads, ref)
    f = lambda p: model.apply({"params": p}, x)
    out, pullback = vk.vjp(f, params, hooks={"Dense_0": lambda r: None})
    seed = jnp.ones_like(out)
    (gp,) = pullback(seed)
    tree_allclose(gp, jax.vjp(f, params)[1](seed)[0], rtol=1e-5, atol=1e-6)


def test_explain_lists_linen_modules():
    _, params, x, y, loss = _setup()
    text = str(vk.explain(loss, params, x, y))
    for name in DENSES:
        assert name in text


class SeqModel(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(11, 6)(ids)  # (B, T, 6)
        h = nn.LayerNorm()(h)
        h = nn.DenseGeneral((2, 3), axis=-1)(h)  # (B, T, 2, 3)
        h = nn.DenseGeneral(5, axis=(-2, -1))(jnp.tanh(h))
        h = nn.RMSNorm()(h)
        img = h.reshape(h.shape[0], h.shape[1], 5, 1)
        img = nn.Conv(2, (3, 1), strides=(2, 1), padding="SAME")(img)
        return nn.Dense(1)(img.reshape(img.shape[0], -1))[:, 0]


def _per_example_ref(loss_one, params, *batch):
    per = jax.jit(jax.vmap(jax.grad(loss_one), in_axes=(None, *[0] * len(batch))))(params, *batch)
    sq = sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1) for g in jax.tree.leaves(per))
    return per, jnp.sqrt(sq)


def test_per_example_norms_fast_paths_equal_vmap_grad(maybe_jit):
    import warnings

    model = SeqModel()
    ids = jax.random.randint(jax.random.key(1), (6, 4), 0, 11)
    y = jax.random.normal(jax.random.key(2), (6,))
    params = model.init(jax.random.key(0), ids)["params"]

    def loss(p, ids, y):
        return jnp.mean((model.apply({"params": p}, ids) - y) ** 2)

    def loss_one(p, ids, y):
        return loss(p, ids[None], y[None])

    per, total = _per_example_ref(loss_one, params, ids, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no vmap(grad) fallback for these layer kinds
        _, grads, norms = maybe_jit(vk.inspect.per_example_grad_norms(loss))(params, ids, y)
    tree_allclose(grads, jax.jit(jax.grad(loss))(params, ids, y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms.total, total, rtol=1e-5, atol=1e-6)
    ref_leaves = jax.tree.map(lambda g: jnp.sqrt(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1)), per)
    tree_allclose(norms.params, ref_leaves, rtol=1e-5, atol=1e-6)
    assert {"Embed_0", "LayerNorm_0", "DenseGeneral_0", "Conv_0", "Dense_0"} <= set(norms.layers)
