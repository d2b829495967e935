"""Parameter initialisers: deterministic per key, the same traced and eager, right distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vjpkit import nn
from vjpkit.nn import _random

from .helpers import tree_allclose


@pytest.mark.parametrize("shape", [(3,), (3, 3, 1, 8), (70_000,)])
def test_uniform_is_deterministic_and_the_same_under_jit(shape):
    key = jax.random.key(3)
    eager = _random.uniform(key, shape, -0.5, 0.5, jnp.float32)
    tree_allclose(eager, _random.uniform(key, shape, -0.5, 0.5, jnp.float32), rtol=0, atol=0)
    traced = jax.jit(lambda k: _random.uniform(k, shape, -0.5, 0.5, jnp.float32))(key)
    tree_allclose(eager, traced, rtol=0, atol=0)
    assert eager.shape == shape and eager.dtype == jnp.float32
    assert float(eager.min()) >= -0.5 and float(eager.max()) < 0.5
    other = _random.uniform(jax.random.key(4), shape, -0.5, 0.5, jnp.float32)
    assert not np.array_equal(eager, other)


def test_distributions_match_their_moments():
    n = 200_000  # standard errors: uniform mean 1/sqrt(12 n) ~ 6e-4, normal mean 1/sqrt(n) ~ 2e-3
    u = np.asarray(_random.uniform(jax.random.key(0), (n,), 0.0, 1.0, jnp.float32), np.float64)
    np.testing.assert_allclose([u.mean(), u.var()], [0.5, 1 / 12], atol=5e-3)
    z = np.asarray(_random.normal(jax.random.key(1), (n,), jnp.float32), np.float64)
    np.testing.assert_allclose([z.mean(), z.std(), np.mean(np.abs(z) > 1.96)], [0.0, 1.0, 0.05], atol=1e-2)
    traced = jax.jit(lambda k: _random.normal(k, (1000,), jnp.float32))(jax.random.key(1))
    tree_allclose(traced, _random.normal(jax.random.key(1), (1000,), jnp.float32), rtol=1e-6, atol=1e-6)


def test_model_init_is_deterministic_and_jittable():
    model = nn.serial(conv=nn.conv2d(4, 3), act=nn.relu(), flat=nn.flatten(), fc=nn.dense(2))
    x = jnp.ones((2, 5, 5, 1))
    a = model.init(jax.random.key(0), x)
    tree_allclose(a, model.init(jax.random.key(0), x), rtol=0, atol=0)
    tree_allclose(a, jax.jit(model.init)(jax.random.key(0), x), rtol=1e-6, atol=1e-7)
    bound = 1 / np.sqrt(3 * 3 * 1)
    assert float(jnp.max(jnp.abs(a["conv"]["weight"]))) <= bound
    assert a["conv"]["weight"].dtype == jnp.float32
    b16 = model.init(jax.random.key(0), x.astype(jnp.bfloat16))
    assert b16["fc"]["weight"].dtype == jnp.bfloat16
