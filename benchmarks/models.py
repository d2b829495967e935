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


def _no_params(fn):
    """``fn(h)`` as a layer of ``sequential``: ``(params, h) -> fn(h)``."""
    return lambda _, h: fn(h)


def _mlp_layers():
    """The raw MLPs as ``(name, fn(layer params or None, h))`` pairs, named as the vjpkit model's layers."""
    relu = _no_params(jax.nn.relu)
    return [("fc1", _dense), ("relu1", relu), ("fc2", _dense), ("relu2", relu), ("fc3", _dense)]


def mlp_small():
    model = nn.serial(fc1=nn.dense(20), relu1=nn.relu(), fc2=nn.dense(30), relu2=nn.relu(), fc3=nn.dense(2))
    return "MLP 3-20-30-2, batch 9000", model, sequential(_mlp_layers()), (9000, 3), 2


def mlp_mnist():
    model = nn.serial(
        fc1=nn.dense(512), relu1=nn.relu(), fc2=nn.dense(512), relu2=nn.relu(), fc3=nn.dense(10)
    )
    return "MLP 784-512-512-10, batch 128", model, sequential(_mlp_layers()), (128, 784), 10


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


def _cnn_layers(pool):
    """The raw CNN as ``(name, fn(layer params or None, h))`` pairs, named as the vjpkit model's layers."""
    relu, pooled = _no_params(jax.nn.relu), _no_params(pool)
    flat = _no_params(lambda h: h.reshape(h.shape[0], -1))
    return [
        ("conv1", _conv), ("relu1", relu), ("pool1", pooled), ("conv2", _conv), ("relu2", relu),
        ("pool2", pooled), ("flat", flat), ("fc", _dense),
    ]  # fmt: skip


def _cnn_raw(pool):
    return sequential(_cnn_layers(pool))


def sequential(layers):
    """The raw apply of ``layers`` (``(name, fn)`` pairs) called in order: ``fn(params.get(name), h)``."""

    def raw(params, x):
        for name, fn in layers:
            x = fn(params.get(name), x)
        return x

    raw.layers = layers
    return raw


def probed_norms_loss(raw):
    """The raw model's loss with the norms that ``vk.capture("*", reduce="norm")`` records, by hand.

    ``loss(params, x, y) -> ((loss, grads), norms)``, as ``vk.value_and_grad`` with capture
    returns them: a zero probe is added to each layer's input
    (after the first layer, whose input is the data) and to its output, and the loss is
    differentiated with respect to the parameters and the probes at once. A probe's gradient is
    that layer's ``grad_output`` (output probe) or ``grad_input`` (input probe); ``grad_params``
    are the parameter gradients (each layer's parameters are used once). ``norms`` is keyed like
    the captured records: ``{layer: {"grad_output", "grad_input", "grad_params": {leaf: norm}}}``.
    It is what a user writes without vjpkit, and the floor of what the same norms cost in XLA.
    """
    layers = raw.layers

    def forward(params, probes, x):
        for i, (name, fn) in enumerate(layers):
            if i:
                x = x + probes[name]["in"]
            x = fn(params.get(name), x) + probes[name]["out"]
        return x

    def objective(params, probes, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, probes, x), y).mean()

    def probe_shapes(params, x):
        shapes, h = {}, x
        for i, (name, fn) in enumerate(layers):
            out = jax.eval_shape(fn, params.get(name), h)
            shapes[name] = {"in": h, "out": out} if i else {"out": out}
            h = out
        return shapes

    def norm(g):
        return jnp.sqrt(jnp.sum(g * g))

    def loss(params, x, y):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), probe_shapes(params, x))
        value, (grads, cts) = jax.value_and_grad(objective, argnums=(0, 1))(params, zeros, x, y)
        norms = {}
        for name, _ in layers:
            rec = {"grad_output": norm(cts[name]["out"])}
            if "in" in cts[name]:
                rec["grad_input"] = norm(cts[name]["in"])
            rec["grad_params"] = jax.tree.map(norm, grads.get(name, {}))
            norms[name] = rec
        return (value, grads), norms

    return loss


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
