"""Flax NNX models made hookable with vk.hookable: records named by attribute path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")

from flax import nnx

import vjpkit as vk
from tests.helpers import tree_allclose


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.attn = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.attn(self.norm(x))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(3, 8, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.fc1(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _setup():
    model = Net(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 3))
    y = jax.random.normal(jax.random.key(2), (4, 2))
    return model, x, y


def test_hookable_keeps_graph_state_and_outputs():
    model, x, _ = _setup()
    graphdef, state = nnx.split(model)
    out = model(x)
    hooked = vk.hookable(model)
    graphdef2, state2 = nnx.split(hooked)
    assert graphdef2 == graphdef
    tree_allclose(state2, state)
    tree_allclose(hooked(x), out)
    tree_allclose(nnx.jit(lambda m, x: m(x))(hooked, x), out)
    tree_allclose(jax.vmap(lambda xi: nnx.merge(graphdef2, state2)(xi[None])[0])(x), out, rtol=1e-6)


def test_names_follow_attribute_paths_and_grads_equal_jax_grad():
    model, x, y = _setup()
    graphdef, state = nnx.split(vk.hookable(model))

    def loss(s, x, y):
        return jnp.mean((nnx.merge(graphdef, s)(x) - y) ** 2)

    expected = jax.grad(loss)(state, x, y)
    names = []
    grads = vk.grad(loss, hooks={"*": lambda rec: names.append(rec.name)})(state, x, y)
    assert sorted(names) == sorted(
        ["Net", "fc1", "head", "blocks/0", "blocks/1"]
        + [f"blocks/{i}/{n}" for i in (0, 1) for n in ("norm", "attn")]
    )
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)  # residual blocks with LayerNorm, all hooked


def test_rewriting_hook_changes_exactly_upstream_gradients(maybe_jit):
    model, x, y = _setup()
    graphdef, state = nnx.split(vk.hookable(model))

    def loss(s, x, y):
        return jnp.mean((nnx.merge(graphdef, s)(x) - y) ** 2)

    expected = nnx.to_pure_dict(jax.grad(loss)(state, x, y))
    zero = lambda rec: rec.replace(grad_input=jnp.zeros_like(rec.grad_input))
    grads = nnx.to_pure_dict(maybe_jit(vk.grad(loss, hooks={"blocks/1": zero}))(state, x, y))
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
    tree_allclose(grads["fc1"], zeros(expected["fc1"]))
    tree_allclose(grads["blocks"][0], zeros(expected["blocks"][0]))
    tree_allclose(grads["blocks"][1], expected["blocks"][1], rtol=1e-5, atol=1e-6)
    tree_allclose(grads["head"], expected["head"], rtol=1e-5, atol=1e-6)


class Noisy(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(3, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.bn(self.drop(self.fc(x))))


def test_dropout_and_batchnorm_are_layer_calls_with_state_written_back(maybe_jit):
    model = vk.hookable(Noisy(nnx.Rngs(0, dropout=1)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (6, 3))

    def loss(p, rest):
        m = nnx.merge(graphdef, p, rest, copy=True)  # as with jax.grad: fresh Variables to mutate
        return jnp.sum(m(x) ** 2), nnx.state(m, nnx.Not(nnx.Param))

    (expected, new_ref) = jax.grad(loss, has_aux=True)(params, rest)
    names = []
    (grads, new_rest), captured = maybe_jit(
        vk.grad(loss, has_aux=True, capture=["fc", "drop", "bn", "head"])
    )(params, rest)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)
    # the same dropout key was drawn (count advanced once) and the same batch statistics kept
    plain = lambda t: jax.tree.map(
        lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a,
        nnx.to_pure_dict(t),
    )
    tree_allclose(plain(new_rest), plain(new_ref), rtol=1e-6, atol=1e-7)
    assert int(new_rest["drop"]["rngs"]["count"][...]) == int(rest["drop"]["rngs"]["count"][...]) + 1
    # records: a stateful call's output is (y, new state); its y feeds the next layer
    y_drop, state_drop = captured["drop"].output
    np.testing.assert_array_equal(captured["bn"].input, y_drop)
    assert int(state_drop["rngs"]["count"]) == int(new_rest["drop"]["rngs"]["count"][...])
    y_bn, state_bn = captured["bn"].output
    np.testing.assert_allclose(state_bn["mean"], new_ref["bn"]["mean"][...], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(captured["head"].input, y_bn)
    # dense algebra on the layers around them, and bn's grad_params against jax.grad
    head, fc = captured["head"], captured["fc"]
    np.testing.assert_allclose(head.grad_params["kernel"], y_bn.T @ head.grad_output, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fc.grad_params["kernel"], x.T @ fc.grad_output, rtol=1e-5, atol=1e-6)
    tree_allclose(captured["bn"].grad_params, nnx.to_pure_dict(expected["bn"]), rtol=1e-5, atol=1e-6)
    tree_allclose(fc.grad_params, nnx.to_pure_dict(expected["fc"]), rtol=1e-5, atol=1e-6)
    # dropout's grad_input is its mask times the incoming cotangent: zero where it dropped
    g_drop = captured["drop"]
    np.testing.assert_array_equal(g_drop.grad_input == 0, y_drop == 0)
    vk.grad(lambda p, r: loss(p, r)[0], hooks={"*": lambda rec: names.append(rec.name)})(params, rest)
    assert sorted(names) == ["Noisy", "bn", "drop", "fc", "head"]


def test_stateful_modules_in_eval_mode_record_plain_outputs(maybe_jit):
    model = vk.hookable(Noisy(nnx.Rngs(0, dropout=1)))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (6, 3))

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2)

    expected = jax.grad(loss)(params)
    grads, captured = maybe_jit(vk.grad(loss, capture=["drop", "bn"]))(params)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)
    # nothing changed: the outputs are plain arrays, dropout is the identity
    np.testing.assert_array_equal(captured["drop"].output, captured["drop"].input)
    np.testing.assert_array_equal(captured["drop"].grad_input, captured["drop"].grad_output)
    assert captured["bn"].output.shape == (6, 4)


def test_per_example_norms_fast_paths_equal_vmap_grad(maybe_jit):
    import warnings

    class Seq(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(11, 6, rngs=rngs)
            self.norm = nnx.RMSNorm(6, rngs=rngs)
            self.fc = nnx.Linear(6, 4, rngs=rngs)
            self.ln = nnx.LayerNorm(4, rngs=rngs)
            self.head = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, ids):
            h = self.ln(jnp.tanh(self.fc(self.norm(self.embed(ids)))))
            return self.head(h).sum(axis=(1, 2))

    graphdef, state = nnx.split(vk.hookable(Seq(nnx.Rngs(0))))
    ids = jax.random.randint(jax.random.key(1), (5, 3), 0, 11)
    y = jax.random.normal(jax.random.key(2), (5,))

    def loss(s, ids, y):
        return jnp.mean((nnx.merge(graphdef, s)(ids) - y) ** 2)

    per = jax.vmap(jax.grad(lambda s, i, t: loss(s, i[None], t[None])), in_axes=(None, 0, 0))(state, ids, y)
    ref = jax.tree.map(lambda g: jnp.sqrt(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1)), per)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no vmap(grad) fallback for these layer kinds
        _, _, norms = maybe_jit(vk.inspect.per_example_grad_norms(loss))(state, ids, y)
    tree_allclose(norms.params, ref, rtol=1e-5, atol=1e-6)
    total = jnp.sqrt(sum(jnp.square(a) for a in jax.tree.leaves(ref)))
    np.testing.assert_allclose(norms.total, total, rtol=1e-5)
    assert set(norms.layers) == {"embed", "norm", "fc", "ln", "head"}
