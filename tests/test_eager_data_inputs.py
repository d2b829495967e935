"""An eager call finds the layers a jitted one finds, when the batch meets a parameter
computation before any layer (``x * a**2 @ W``, a learned input scale ``x * softplus(s)``).

An eager trace computes what does not depend on the parameters as it is written, so the batch is
a concrete value there, which plain-JAX matching cannot tell from a constant: ``x * a**2`` was
then a parameter computation, no layer read it, and the eager call raised "matched no layer"
(curvature statistics) or ran no hook, where the jitted call captured ``out``. The driver now
traces such a program again with the data as inputs (``_engine._driver._data_as_inputs``).

Oracles: the jitted call's layer names and values; ``jax.grad`` for the gradient; ``jax.vmap``
of ``jax.grad`` for the per-example statistics. A loss that needs its labels concrete
(``int(y.max())``) keeps the eager trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose

N, D, C = 6, 4, 3

MODELS = {
    "squared_scale": lambda p, x: (x * p["a"] ** 2) @ p["out"]["w"] + p["out"]["b"],
    "softplus_scale": lambda p, x: (x * jax.nn.softplus(p["a"])) @ p["out"]["w"] + p["out"]["b"],
}


def problem():
    rng = np.random.default_rng(0)
    params = {
        "a": jnp.asarray(rng.standard_normal(D), jnp.float32),
        "out": {
            "w": jnp.asarray(rng.standard_normal((D, C)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(C), jnp.float32),
        },
    }
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    return params, x, jnp.asarray(rng.integers(0, C, N))


def loss_of(model):
    return lambda p, x, y: vk.curvature.softmax_cross_entropy(model(p, x), y)


@pytest.mark.parametrize("name", list(MODELS))
def test_hooks_run_on_the_same_layers_eagerly_and_jitted(name):
    params, x, y = problem()
    loss = loss_of(MODELS[name])
    seen = {True: [], False: []}

    def grads_of(jit):
        def hook(rec):
            seen[jit].append(rec.name)
            return rec

        g = vk.grad(loss, hooks={"*": hook})
        return (jax.jit(g) if jit else g)(params, x, y)

    eager, jitted = grads_of(False), grads_of(True)
    assert seen[False] == seen[True] == ["out"]
    tree_allclose(eager, jax.grad(loss)(params, x, y), rtol=1e-6)
    tree_allclose(jitted, eager, rtol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_curvature_statistics_agree_eagerly_and_jitted(name):
    params, x, y = problem()
    loss = loss_of(MODELS[name])
    g = vk.grad(loss, capture=vk.curvature.stats("*", ["sum_grad_squared", "batch_l2"]))
    with pytest.warns(UserWarning, match="no layer reads the leaves a "):  # its per-example passes
        eager_grads, eager = g(params, x, y)
    with pytest.warns(UserWarning, match="no layer reads the leaves a "):
        jit_grads, jitted = jax.jit(g)(params, x, y)
    assert sorted(eager) == sorted(jitted) == ["a", "out"]
    assert eager["out"].layout.kind == "dense" and eager["a"].layout.kind == "leaf"
    tree_allclose(eager_grads, jax.grad(loss)(params, x, y), rtol=1e-6)
    tree_allclose(jit_grads, eager_grads, rtol=1e-6)

    def share(p, xi, yi):  # example i's share of the mean loss
        return loss(p, xi[None], yi[None]) / N

    per = jax.vmap(jax.grad(share), in_axes=(None, 0, 0))(params, x, y)
    for layer, g_i in (("out", per["out"]), ("a", per["a"])):
        want = jax.tree.map(lambda g: jnp.sum(jnp.square(g), 0), g_i)
        norms = sum(jnp.sum(jnp.square(g).reshape(N, -1), 1) for g in jax.tree.leaves(g_i))
        for got in (eager, jitted):
            tree_allclose(got[layer].sum_grad_squared, want, rtol=1e-5)
            tree_allclose(sum(jax.tree.leaves(got[layer].batch_l2)), norms, rtol=1e-5)


def test_a_loss_reading_its_labels_concretely_keeps_the_eager_trace():
    params, x, y = problem()

    def loss(p, x, y):  # int(y.max()) needs the labels concrete: no trace with data as inputs
        logits = MODELS["squared_scale"](p, x)[:, : int(y.max()) + 1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    # the eager trace stands: the batch is a constant there, so x * a**2 @ W is a parameter
    # computation and no layer is found (what the jitted call cannot do at all: int() of a tracer)
    with pytest.raises(vk.ConfigError, match="matched no layer"):
        vk.grad(loss, hooks={"out": lambda rec: rec})(params, x, y)
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.jit(vk.grad(loss, hooks={"out": lambda rec: rec}))(params, x, y)

    def plain(p, x, y):  # a model whose layer the eager trace finds: unchanged
        logits = (x @ p["out"]["w"] + p["out"]["b"])[:, : int(y.max()) + 1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    seen = []
    g = vk.grad(plain, hooks={"out": lambda rec: seen.append(rec.name) or rec})
    tree_allclose(g(params, x, y), jax.grad(plain)(params, x, y), rtol=1e-6)
    assert seen == ["out"]
