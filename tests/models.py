"""Small models and losses shared by tests, with plain-jnp references."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vjpkit import nn

mlp = nn.serial(fc1=nn.dense(5), relu1=nn.relu(), fc2=nn.dense(4), relu2=nn.relu(), fc3=nn.dense(2))


def mlp_setup(batch: int = 6, seed: int = 0):
    kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (batch, 3))
    y = jax.random.randint(ky, (batch,), 0, 2)
    params = mlp.init(kp, x)
    return params, x, y


def mlp_loss(params, x, y):
    logits = mlp.apply(params, x)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def dense_fn(p, x):
    return x @ p["weight"] + p["bias"]


def conv_fn(p, x):
    """``nn.conv2d``'s computation (stride 1, SAME, NHWC / HWIO) in plain lax."""
    y = jax.lax.conv_general_dilated(
        x, p["weight"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y + p["bias"]


def max_pool_fn(x):
    """``nn.max_pool(2)``'s computation in plain jnp: 2x2 windows, stride 2, VALID."""
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def mlp_chain(params, x, y):
    """Hand-chained forward pass and vjps of ``mlp_loss``: the reference records.

    Returns ``{layer: dict(input, output, grad_output, grad_input, grad_params)}``.
    """
    h1 = dense_fn(params["fc1"], x)
    a1 = jax.nn.relu(h1)
    h2 = dense_fn(params["fc2"], a1)
    a2 = jax.nn.relu(h2)
    h3 = dense_fn(params["fc3"], a2)

    def head(logits):
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    g3 = jax.grad(head)(h3)
    gp3, ga2 = jax.vjp(dense_fn, params["fc3"], a2)[1](g3)
    g2 = jax.vjp(jax.nn.relu, h2)[1](ga2)[0]
    gp2, ga1 = jax.vjp(dense_fn, params["fc2"], a1)[1](g2)
    g1 = jax.vjp(jax.nn.relu, h1)[1](ga1)[0]
    gp1, _ = jax.vjp(dense_fn, params["fc1"], x)[1](g1)
    return {
        "fc3": dict(input=a2, output=h3, grad_output=g3, grad_input=ga2, grad_params=gp3),
        "fc2": dict(input=a1, output=h2, grad_output=g2, grad_input=ga1, grad_params=gp2),
        "fc1": dict(input=x, output=h1, grad_output=g1, grad_input=None, grad_params=gp1),
    }
