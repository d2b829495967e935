"""Equinox models made hookable with vk.hookable: records named by attribute path."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("equinox", reason="Equinox is an optional extra: pip install 'vjpkit[equinox]'")

import equinox as eqx

import vjpkit as vk
from tests.helpers import tree_allclose


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    layers: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.fc1 = eqx.nn.Linear(3, 8, key=k1)
        self.layers = [eqx.nn.Linear(8, 8, key=k2), eqx.nn.LayerNorm(8)]
        self.head = eqx.nn.Linear(8, 2, key=k3)

    def __call__(self, x):
        x = jax.nn.relu(self.fc1(x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _setup():
    model = MLP(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 3))
    y = jax.random.normal(jax.random.key(2), (4, 2))
    return model, x, y


def _loss(static):
    def loss(p, x, y):
        m = eqx.combine(p, static)
        return jnp.mean(jnp.stack([jnp.sum((m(xi) - yi) ** 2) for xi, yi in zip(x, y)]))

    return loss


def test_hookable_keeps_structure_outputs_and_serialisation(tmp_path):
    model, x, _ = _setup()
    before = jax.tree.structure(model)
    out = jax.vmap(model)(x)
    hooked = vk.hookable(model)
    assert jax.tree.structure(hooked) == before
    tree_allclose(jax.vmap(hooked)(x), out)
    tree_allclose(jax.jit(jax.vmap(hooked))(x), out)
    eqx.tree_serialise_leaves(tmp_path / "m.eqx", hooked)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "m.eqx", MLP(jax.random.key(5)))
    tree_allclose(jax.vmap(loaded)(x), out)


def test_names_and_records_match_jax_grad_and_algebra(maybe_jit):
    model, x, y = _setup()
    params, static = eqx.partition(vk.hookable(model), eqx.is_array)
    loss = _loss(static)
    expected = jax.grad(loss)(params, x, y)
    names = []
    vk.grad(loss, hooks={"*": lambda rec: names.append(rec.name)})(params, x[:1], y[:1])
    assert sorted(names) == ["MLP", "fc1", "head", "layers/0", "layers/1"]
    grads, captured = maybe_jit(vk.grad(loss, capture=["fc1", "layers/0", "head"]))(params, x, y)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)
    by_name = {"fc1": params.fc1, "layers/0": params.layers[0], "head": params.head}
    ref = {"fc1": expected.fc1, "layers/0": expected.layers[0], "head": expected.head}
    for name in by_name:
        # one record per example call: fc1, fc1#1, ... (each a 1-D input)
        recs = [captured[name]] + [captured[f"{name}#{k}"] for k in range(1, len(x))]
        total = jax.tree.map(lambda *a: sum(a), *[r.grad_params for r in recs])
        tree_allclose(total, ref[name], rtol=1e-5, atol=1e-6)
        for rec in recs:
            w, xin, g = rec.params.weight, rec.input, rec.grad_output
            tree_allclose(rec.params, by_name[name])
            np.testing.assert_allclose(rec.output, w @ xin + rec.params.bias, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(rec.grad_params.weight, jnp.outer(g, xin), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(rec.grad_params.bias, g, rtol=1e-5, atol=1e-6)
            if name != "fc1":
                np.testing.assert_allclose(rec.grad_input, w.T @ g, rtol=1e-5, atol=1e-6)


def test_vmap_inside_the_loss_gives_jax_grad(maybe_jit):
    model, x, y = _setup()
    params, static = eqx.partition(vk.hookable(model), eqx.is_array)

    def loss(p, x, y):
        return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

    expected = jax.grad(loss)(params, x, y)
    grads = maybe_jit(vk.grad(loss, hooks={"*": lambda rec: None}))(params, x, y)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)


def test_rewriting_hook_changes_exactly_upstream_gradients(maybe_jit):
    model, x, y = _setup()
    params, static = eqx.partition(vk.hookable(model), eqx.is_array)
    loss = _loss(static)
    expected = jax.grad(loss)(params, x, y)
    double = lambda rec: rec.replace(grad_input=2.0 * rec.grad_input)
    grads = maybe_jit(vk.grad(loss, hooks={"layers/0": double}))(params, x, y)
    tree_allclose(grads.fc1, jax.tree.map(lambda a: 2.0 * a, expected.fc1), rtol=1e-5, atol=1e-6)
    tree_allclose(grads.layers, expected.layers, rtol=1e-5, atol=1e-6)
    tree_allclose(grads.head, expected.head, rtol=1e-5, atol=1e-6)


def test_sequential_names_and_unsupported_types():
    mlp = vk.hookable(
        eqx.nn.Sequential([eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.Lambda(jax.nn.relu)])
    )
    params, static = eqx.partition(mlp, eqx.is_array)
    names = []
    loss = lambda p, x: jnp.sum(eqx.combine(p, static)(x))
    vk.grad(loss, hooks={"*": lambda rec: names.append(rec.name)})(params, jnp.ones(3))
    assert sorted(names) == ["Sequential", "layers/0", "layers/1"]
    with pytest.raises(vk.ConfigError, match="dict"):
        vk.hookable({"not": "a model"})


def test_per_example_norms_equal_vmap_grad():
    model, x, y = _setup()
    params, static = eqx.partition(vk.hookable(model), eqx.is_array)

    def loss(p, x, y):
        return jnp.mean(jnp.sum((jax.vmap(eqx.combine(p, static))(x) - y) ** 2, axis=1))

    one = lambda p, a, b: loss(p, a[None], b[None])
    per = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0, 0)))(params, x, y)  # the reference, jitted
    ref = jax.tree.map(lambda g: jnp.sqrt(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1)), per)
    with warnings.catch_warnings():
        # a vmapped call is one record of the batched call: the fast paths apply, no vmap(grad) fallback
        warnings.simplefilter("error")
        _, _, norms = vk.inspect.per_example_grad_norms(loss)(params, x, y)
    tree_allclose(norms.params, ref, rtol=1e-5, atol=1e-6)
