"""The three benchmark models, each as a vjpkit model and as hand-written raw JAX.

Both versions share one params pytree, so any difference in step time is vjpkit's. The raw CNN
max-pools by reshaping (``max_pool_reshape``), the same computation as ``vjpkit.nn.max_pool``
(``peers.py``'s like-for-like Flax NNX and Equinox CNNs pool with it too);
``EXTRA_RAW`` holds the CNN written with ``lax.reduce_window`` pooling instead, whose gradient
(``select_and_scatter``) is much slower on XLA:CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from vjpkit import nn


def _dense(p, x):
    return x @ p["weight"] + p["bias"]


def _conv(p, x):
    y = jax.lax.conv_general_dilated(
        x, p["weight"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y + p["bias"]


def max_pool_reshape(x):
    """2x2, stride 2, VALID max pool over axes 1 and 2 as a reshape and a max.

    ``x`` is NHWC, or one CHW example (Equinox's layout under ``vmap``): H and W are axes 1, 2.
    """
    ho, wo = x.shape[1] // 2, x.shape[2] // 2
    x = x[:, : ho * 2, : wo * 2]
    return x.reshape(x.shape[0], ho, 2, wo, 2, *x.shape[3:]).max(axis=(2, 4))


def max_pool_reduce_window(x):
    """The same pool with ``lax.reduce_window``."""
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def mlp_small():
    model = nn.serial(fc1=nn.dense(20), relu1=nn.relu(), fc2=nn.dense(30), relu2=nn.relu(), fc3=nn.dense(2))

    def raw(p, x):
        h = jax.nn.relu(_dense(p["fc1"], x))
        h = jax.nn.relu(_dense(p["fc2"], h))
        return _dense(p["fc3"], h)

    return "MLP 3-20-30-2, batch 9000", model, raw, (9000, 3), 2


def mlp_mnist():
    model = nn.serial(
        fc1=nn.dense(512), relu1=nn.relu(), fc2=nn.dense(512), relu2=nn.relu(), fc3=nn.dense(10)
    )

    def raw(p, x):
        h = jax.nn.relu(_dense(p["fc1"], x))
        h = jax.nn.relu(_dense(p["fc2"], h))
        return _dense(p["fc3"], h)

    return "MLP 784-512-512-10, batch 128", model, raw, (128, 784), 10


def cnn():
    model = nn.serial(
        conv1=nn.conv2d(16, 3),
        relu1=nn.relu(),
        pool1=nn.max_pool(2),
        conv2=nn.conv2d(32, 3),
        relu2=nn.relu(),
        pool2=nn.max_pool(2),
        flat=nn.flatten(),
        fc=nn.dense(10),
    )

    return "CNN 1-16-32 (3x3, pool), 28x28, batch 64", model, _cnn_raw(max_pool_reshape), (64, 28, 28, 1), 10


def _cnn_raw(pool):
    def raw(p, x):
        h = pool(jax.nn.relu(_conv(p["conv1"], x)))
        h = pool(jax.nn.relu(_conv(p["conv2"], h)))
        return _dense(p["fc"], h.reshape(h.shape[0], -1))

    return raw


MODELS = {"mlp_small": mlp_small, "mlp_mnist": mlp_mnist, "cnn": cnn}
# Extra raw-JAX rows per model: name -> raw apply on the same params.
EXTRA_RAW = {"cnn": {"raw JAX, lax.reduce_window pool": _cnn_raw(max_pool_reduce_window)}}


def data(shape, classes, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, shape), jax.random.randint(ky, (shape[0],), 0, classes)


def loss_of(apply):
    def loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    return loss
