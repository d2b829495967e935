"""A hand-written plain-``jnp`` K-FAC of the benchmark MLP: the floor for ``curvature_bench``.

The MLP's loss, gradient and K-FAC factors with nothing but the products K-FAC cannot avoid: one
forward pass, one backward pass that also returns each layer's output cotangents (zero probes
added to the pre-activations), for ``kfac`` one more backward pass of a sampled seed to the
probes only, and the factor products ``A = [a,1]^T [a,1] / N`` and ``G = g^T g``. Its factors
are vjpkit's ``kfac`` (same key) and ``kfac_empirical`` (``tests/test_kfac_floor.py``), so its
time against a ``value_and_grad`` step is what any JAX implementation of the same estimator pays
on this machine; vjpkit's rows are compared with it.
"""

from __future__ import annotations

import os

# K-FAC's refresh (inverses, eigh) calls LAPACK through scipy's OpenBLAS, whose threads contend with
# XLA's on CPU: one thread each (before jax loads it), docs/curvature.md, "LAPACK threads"
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import optax

LAYERS = ("fc1", "fc2", "fc3")  # models.mlp_mnist: dense, relu, dense, relu, dense


def _forward(params, x, probes):
    acts, h = [], x
    for i, name in enumerate(LAYERS):
        acts.append(h)
        h = h @ params[name]["weight"] + params[name]["bias"] + probes[i]
        if i + 1 < len(LAYERS):
            h = jax.nn.relu(h)
    return h, acts


def _a_factor(a):
    a = jnp.concatenate([a, jnp.ones((a.shape[0], 1), a.dtype)], axis=1)
    return a.T @ a / a.shape[0]


def kfac(params, x, y, key=None):
    """``((loss, grads), {layer: (A, G)})`` of the mean cross-entropy with integer labels ``y``:
    the Monte-Carlo Fisher's factors with one sample drawn with ``key`` (vjpkit's ``kfac``), or
    with ``key=None`` the empirical Fisher's (``kfac_empirical``)."""
    n = x.shape[0]
    probes = [jnp.zeros((n, params[name]["bias"].shape[-1]), x.dtype) for name in LAYERS]
    (logits, acts), pull = jax.vjp(lambda p, pr: _forward(p, x, pr), params, probes)
    classes = logits.shape[-1]
    p = jax.nn.softmax(logits)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    d = (p - jax.nn.one_hot(y, classes, dtype=p.dtype)) / n
    grads, gs = pull((d, [jnp.zeros_like(a) for a in acts]))
    if key is None:
        gs = [g * jnp.sqrt(jnp.asarray(n, g.dtype)) for g in gs]
    else:
        sample = jax.random.categorical(key, logits)
        seed = (p - jax.nn.one_hot(sample, classes, dtype=p.dtype)) / jnp.sqrt(n)
        _, pull_probes = jax.vjp(lambda pr: _forward(params, x, pr)[0], probes)
        (gs,) = pull_probes(seed)
    factors = {name: (_a_factor(a), g.T @ g) for name, a, g in zip(LAYERS, acts, gs)}
    return (loss, grads), factors
