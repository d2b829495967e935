"""The benchmark's hand-written K-FAC floor computes vjpkit's factors (so its timing is a floor
for the same estimator, not for something cheaper)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import tree_allclose

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kfac_floor
import models

import vjpkit as vk


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("stat", ["kfac", "kfac_empirical"])
def test_floor_factors_are_vjpkits(stat, jit):
    _, model, raw, _, classes = models.MODELS["mlp_mnist"]()
    params = model.init(jax.random.key(0), jnp.zeros((16, 784)))
    x, y = models.data((16, 784), classes)
    key = jax.random.key(3)

    def loss(p, x, y):
        return vk.curvature.softmax_cross_entropy(raw(p, x), y)

    ours = vk.value_and_grad(loss, capture=vk.curvature.stats("*", [stat]))
    floor = kfac_floor.kfac
    if jit:
        ours, floor = jax.jit(ours), jax.jit(floor)
    kw = {"key": key} if stat == "kfac" else {}
    (loss_v, grads), captured = ours(params, x, y, **kw)
    (f_loss, f_grads), factors = floor(params, x, y, key if stat == "kfac" else None)
    tree_allclose(f_loss, loss_v)
    tree_allclose(f_grads, grads, rtol=1e-5)
    got = {name: tuple(getattr(captured[name], stat)) for name in kfac_floor.LAYERS}
    tree_allclose(factors, got, rtol=1e-5, atol=1e-6)
