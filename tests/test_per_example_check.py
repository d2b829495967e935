"""The dense consistency check of ``vk.inspect.per_example_grad_norms`` on sequences: both the
ghost-norm path (``T^2 <= in * out``, whose rounding bound reads the Gram diagonals) and the
materialised path (``T^2 > in * out``). A real dense layer passes it (norms equal ``vmap(grad)``);
a dense-shaped custom layer whose gradient is not ``x^T d`` fails it (NaN, never a wrong number).
Eager and jitted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from vjpkit import nn

B, IN, OUT = 4, 5, 3
SEQ = {"ghost": 3, "materialised": 6}  # T^2 = 9 <= 15 < 36


def _vmap_grad_norms(loss, params, x):
    def single(p, xi):
        return loss(p, xi[None])

    grads = jax.vmap(jax.grad(single), in_axes=(None, 0))(params, x)
    return jax.tree.map(lambda g: np.sqrt(np.sum(np.square(np.asarray(g)).reshape(B, -1), axis=1)), grads)


def _setup(path, custom):
    body = (lambda p, x: jnp.tanh(x @ p["weight"] + p["bias"])) if custom else None
    first = (
        nn.layer(body, lambda key, x: nn.dense(OUT).init(key, x), name="seq")
        if custom
        else nn.dense(OUT, name="seq")
    )
    model = nn.serial(seq=first, fc=nn.dense(2))
    x = jax.random.normal(jax.random.key(0), (B, SEQ[path], IN))
    params = model.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.mean(jnp.sum(model.apply(p, x) ** 2, axis=(1, 2)))

    return loss, params, x


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("path", list(SEQ))
def test_dense_sequence_layer_passes_the_check(path, jit):
    loss, params, x = _setup(path, custom=False)
    fn = vk.inspect.per_example_grad_norms(loss)
    _, _, norms = (jax.jit(fn) if jit else fn)(params, x)
    want = _vmap_grad_norms(loss, params, x)
    for name in ("seq", "fc"):
        for leaf in ("weight", "bias"):
            np.testing.assert_allclose(norms.params[name][leaf], want[name][leaf], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("path", list(SEQ))
def test_dense_shaped_custom_sequence_layer_fails_the_check(path, jit):
    loss, params, x = _setup(path, custom=True)
    fn = vk.inspect.per_example_grad_norms(loss)
    with pytest.warns(UserWarning, match="do not sum to the batch gradient"):
        _, _, norms = jax.block_until_ready((jax.jit(fn) if jit else fn)(params, x))
    assert np.all(np.isnan(norms.params["seq"]["weight"]))
    assert np.all(np.isnan(norms.total))
    want = _vmap_grad_norms(loss, params, x)
    np.testing.assert_allclose(norms.params["fc"]["weight"], want["fc"]["weight"], rtol=1e-5, atol=1e-7)
