"""vk.curvature never returns silent numbers (issue 31 item 8, issue 32).

Each case the held-out checks found wrong is either computed exactly, equal to a reference built
here with plain JAX in float64 (the GGN as ``J^T H J`` from ``jax.jacobian`` of the model's
output and ``jax.hessian`` of the whole loss over it; per-example gradients from
``jax.jacrev`` of the vector of per-example losses), or a ``vk.ConfigError`` at trace time
naming the layer. Every case runs eagerly and under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

F64 = {"rtol": 1e-9, "atol": 1e-12}


@pytest.fixture
def f64():
    with jax.enable_x64(True):
        yield


def _normal(rng, *shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float64)


def _ce(logits, y):
    """Plain mean softmax cross-entropy (integer or soft labels), written here."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    t = jax.nn.one_hot(y, logits.shape[-1], dtype=logits.dtype) if y.ndim == 1 else y
    return -jnp.mean(jnp.sum(t * logp, axis=-1))


def ggn_diag(forward, loss_of_output, params):
    """``diag(J^T H J)``: J of the model's whole output over the raveled params, H the Hessian
    of the whole loss over the whole output (no per-example structure assumed)."""
    flat, unravel = ravel_pytree(params)
    out = forward(params)
    J = jax.jacobian(lambda f: forward(unravel(f)))(flat).reshape(out.size, flat.size)
    H = jax.hessian(lambda o: loss_of_output(o.reshape(out.shape)))(out.reshape(-1))
    return unravel(jnp.diag(J.T @ H @ J))


def per_example_grads(per_example_losses, params):
    """``grad (l_n / N)`` for every ``n``: leaves ``(N, *leaf.shape)``."""

    def scaled(p):
        losses = per_example_losses(p)
        return losses / losses.shape[0]

    return jax.jacrev(scaled)(params)


def batch_l2_of(grads):
    return jax.tree.map(lambda g: jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1), grads)


# --------------------------------------------------------------------------------------------
# 1. a custom nn.layer with dense-shaped params whose function is not x @ W + b


def _tanh_dense(p, x):
    return jnp.tanh(x @ p["weight"]) + p["bias"]


MASK = np.tril(np.ones((4, 5)))


def _masked_dense(p, x):
    return x @ (p["weight"] * jnp.asarray(MASK, p["weight"].dtype)) + p["bias"]


@pytest.mark.parametrize("fn", [_tanh_dense, _masked_dense], ids=["tanh", "mask"])
def test_custom_dense_shaped_layer_is_exact(fn, maybe_jit, f64):
    rng = np.random.default_rng(0)
    custom = nn.layer(fn, name="custom")
    fc = nn.dense(3, name="fc")
    p = {
        "custom": {"weight": _normal(rng, 4, 5), "bias": _normal(rng, 5)},
        "fc": {"weight": _normal(rng, 5, 3), "bias": _normal(rng, 3)},
    }
    x, y = _normal(rng, 6, 4), jnp.asarray([0, 2, 1, 1, 0, 2])

    def model(p, x):
        return fc.apply(p["fc"], jnp.tanh(custom.apply(p["custom"], x)))

    def plain(p, x):
        return jnp.tanh(fn(p["custom"], x)) @ p["fc"]["weight"] + p["fc"]["bias"]

    def loss(p, x, y):
        return vk.curvature.softmax_cross_entropy(model(p, x), y)

    spec = vk.curvature.stats("*", ["diag_ggn", "batch_l2", "sum_grad_squared"])
    _, captured = maybe_jit(vk.value_and_grad(loss, capture=spec))(p, x, y)
    assert captured["fc"].layout.kind == "dense"  # nn.dense keeps its closed form
    assert captured["custom"].layout.kind != "dense"
    ref = ggn_diag(lambda q: plain(q, x), lambda o: _ce(o, y), p)
    pe = per_example_grads(
        lambda q: -jnp.take_along_axis(jax.nn.log_softmax(plain(q, x)), y[:, None], 1)[:, 0], p
    )
    for name in ("custom", "fc"):
        tree_allclose(captured[name].diag_ggn, ref[name], **F64)
        tree_allclose(captured[name].batch_l2, batch_l2_of(pe[name]), **F64)
        tree_allclose(
            captured[name].sum_grad_squared, jax.tree.map(lambda g: jnp.sum(g**2, 0), pe[name]), **F64
        )


# --------------------------------------------------------------------------------------------
# 2. a time-major layer (T, N, d), examples on axis 1, with T == N


def test_time_major_layer_with_t_equal_n(maybe_jit, f64):
    rng = np.random.default_rng(1)
    enc, head = nn.dense(5, name="enc"), nn.dense(3, name="head")
    p = {
        "enc": {"weight": _normal(rng, 3, 5), "bias": _normal(rng, 5)},
        "head": {"weight": _normal(rng, 5, 3), "bias": _normal(rng, 3)},
    }
    t = n = 4
    x, y = _normal(rng, t, n, 3), jnp.asarray([0, 2, 1, 1])

    def model(p, x, apply=True):
        if apply:
            h = jnp.tanh(enc.apply(p["enc"], x))  # (T, N, 5)
            return head.apply(p["head"], jnp.mean(h, axis=0))
        h = jnp.tanh(x @ p["enc"]["weight"] + p["enc"]["bias"])
        return jnp.mean(h, axis=0) @ p["head"]["weight"] + p["head"]["bias"]

    def loss(p, x, y):
        return vk.curvature.softmax_cross_entropy(model(p, x), y)

    spec = vk.curvature.stats("*", ["batch_l2", "diag_ggn"])
    _, captured = maybe_jit(vk.value_and_grad(loss, capture=spec))(p, x, y)
    logp = lambda q: jax.nn.log_softmax(model(q, x, apply=False))
    pe = per_example_grads(lambda q: -jnp.take_along_axis(logp(q), y[:, None], 1)[:, 0], p)
    ref = ggn_diag(lambda q: model(q, x, apply=False), lambda o: _ce(o, y), p)
    for name in ("enc", "head"):
        tree_allclose(captured[name].batch_l2, batch_l2_of(pe[name]), **F64)
        tree_allclose(captured[name].diag_ggn, ref[name], **F64)


# --------------------------------------------------------------------------------------------
# 3. examples mixed between a layer and the loss (batch norm in training mode, or plain jnp)


def _bn_model(mix):
    fc1, fc2 = nn.dense(5, name="fc1"), nn.dense(3, name="fc2")
    bn = nn.batch_norm(name="bn")

    def model(p, x):
        h = fc1.apply(p["fc1"], x)
        if mix == "batch_norm":
            h, _ = bn.apply(p["bn"], h, train=True)
        else:
            h = h - jnp.mean(h, axis=0)
        return fc2.apply(p["fc2"], jnp.tanh(h))

    return model, bn


@pytest.mark.parametrize("mix", ["batch_norm", "centre"])
def test_examples_mixed_downstream_raise_naming_the_layer(mix, maybe_jit, f64):
    rng = np.random.default_rng(2)
    model, bn = _bn_model(mix)
    x, y = _normal(rng, 6, 4), jnp.asarray([0, 2, 1, 1, 0, 2])
    p = {
        "fc1": {"weight": _normal(rng, 4, 5), "bias": _normal(rng, 5)},
        "fc2": {"weight": _normal(rng, 5, 3), "bias": _normal(rng, 3)},
        "bn": bn.init(jax.random.key(0), jnp.zeros((6, 5), jnp.float64)),
    }

    def loss(p, x, y):
        return vk.curvature.softmax_cross_entropy(model(p, x), y)

    for which in (["diag_ggn"], ["batch_l2"]):
        spec = vk.curvature.stats("fc1", which)
        with pytest.raises(vk.ConfigError, match=r"'fc1'.*mix"):
            maybe_jit(vk.value_and_grad(loss, capture=spec))(p, x, y)
    # K-FAC factors read only the rows: still given
    _, captured = maybe_jit(vk.value_and_grad(loss, capture=vk.curvature.stats("fc1", ["kflr"])))(p, x, y)
    assert captured["fc1"].kflr is not None
    # the layers after the mixing are exact
    layers = "fc2" if mix == "centre" else ["fc2", "bn"]
    _, captured = maybe_jit(vk.value_and_grad(loss, capture=vk.curvature.stats(layers, ["diag_ggn"])))(
        p, x, y
    )
    ref = ggn_diag(lambda q: model(q, x), lambda o: _ce(o, y), p)
    tree_allclose(captured["fc2"].diag_ggn, ref["fc2"], **F64)
    if mix == "batch_norm":
        got = captured["bn"].diag_ggn
        tree_allclose(
            {"scale": got["scale"], "bias": got["bias"]}, {k: ref["bn"][k] for k in ("scale", "bias")}, **F64
        )


# --------------------------------------------------------------------------------------------
# 4. the differentiated loss is not the registered term


def _two_layer():
    rng = np.random.default_rng(3)
    p = {"w": _normal(rng, 4, 3), "b": _normal(rng, 3)}
    return p, _normal(rng, 6, 4), jnp.asarray([0, 2, 1, 1, 0, 2])


@pytest.mark.parametrize("variant", ["scaled", "z_loss", "mean_of_two"])
def test_loss_other_than_the_registered_term_raises(variant, maybe_jit, f64):
    p, x, y = _two_layer()

    def loss(p, x, y):
        logits = x @ p["w"] + p["b"]
        ce = vk.curvature.softmax_cross_entropy(logits, y)
        if variant == "scaled":
            return 2 * ce
        if variant == "z_loss":
            return ce + 1e-3 * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return 0.5 * (ce + jnp.mean(logits**2))

    spec = vk.curvature.stats("*", ["diag_ggn"])
    with pytest.raises(vk.ConfigError, match="not the value the registered"):
        maybe_jit(vk.value_and_grad(loss, capture=spec))(p, x, y)


def test_registered_term_returned_with_aux_is_accepted(maybe_jit, f64):
    p, x, y = _two_layer()

    def loss(p, x, y):
        logits = x @ p["w"] + p["b"]
        return vk.curvature.softmax_cross_entropy(logits, y), {"logits": logits}

    spec = vk.curvature.stats("*", ["diag_ggn"])
    (_, grads), captured = maybe_jit(vk.value_and_grad(loss, has_aux=True, capture=spec))(p, x, y)
    ref = ggn_diag(lambda q: x @ q["w"] + q["b"], lambda o: _ce(o, y), p)
    tree_allclose(next(iter(captured.values())).diag_ggn, ref, **F64)


# --------------------------------------------------------------------------------------------
# 5. soft labels whose rows do not sum to 1


def test_soft_labels_not_summing_to_one_are_exact(maybe_jit, f64):
    p, x, _ = _two_layer()
    rng = np.random.default_rng(4)
    soft = jnp.asarray(rng.uniform(0.0, 1.0, (6, 3)), jnp.float64)  # row sums 0.3 .. 2.7

    def logits_of(q):
        return x @ q["w"] + q["b"]

    def loss(p, x, y):
        return vk.curvature.softmax_cross_entropy(x @ p["w"] + p["b"], y)

    spec = vk.curvature.stats("*", ["diag_ggn", "kflr"])
    (value, _), captured = maybe_jit(vk.value_and_grad(loss, capture=spec))(p, x, soft)
    np.testing.assert_allclose(value, _ce(logits_of(p), soft), rtol=1e-12)
    ref = ggn_diag(logits_of, lambda o: _ce(o, soft), p)
    rec = next(iter(captured.values()))
    tree_allclose(rec.diag_ggn, ref, **F64)
    # kron(A, G) of one dense layer has the GGN's diagonal blocks' trace: check its diagonal
    A, G = rec.kflr
    flat, unravel = ravel_pytree(p)
    J = jax.jacobian(lambda f: logits_of(unravel(f)))(flat)  # (N, C, P)
    H = jax.hessian(lambda o: _ce(o, soft))(logits_of(p))  # (N, C, N, C)
    ggn = jnp.einsum("ncp,ncmd,mdq->pq", J, H, J)
    # one-example-per-row K-FAC is not the GGN, but the bias block of G is: A[-1, -1] = 1
    b_idx = np.arange(3)  # ravel_pytree orders b before w
    np.testing.assert_allclose(A[-1, -1] * G, ggn[np.ix_(b_idx, b_idx)], rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------
# 6. integer labels out of range


def _linear_ce(p, x, y):
    return vk.curvature.softmax_cross_entropy(x @ p["w"] + p["b"], y)


@pytest.mark.parametrize("bad", [3, -1])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_out_of_range_labels(mode, bad, f64):
    """Eagerly (concrete labels) an error; under jax.jit (no host sync) NaN loss, gradient and
    statistics, so that the example is never silently dropped as one_hot would."""
    p, x, y = _two_layer()
    y = y.at[2].set(bad)
    spec = vk.curvature.stats("*", ["diag_ggn", "batch_l2"])
    if mode == "eager":
        with pytest.raises(vk.ConfigError, match=r"labels.*\[0, 3\)"):
            vk.value_and_grad(_linear_ce, capture=spec)(p, x, y)
        with pytest.raises(vk.ConfigError, match=r"labels.*\[0, 3\)"):
            _linear_ce(p, x, y)
        return
    (value, grads), captured = jax.jit(vk.value_and_grad(_linear_ce, capture=spec))(p, x, y)
    assert np.isnan(value)
    assert all(np.isnan(g).all() for g in jax.tree.leaves(grads))
    rec = next(iter(captured.values()))
    assert all(np.isnan(g).all() for g in jax.tree.leaves(rec.diag_ggn))
    assert all(np.isnan(g[2]) and np.isfinite(np.delete(g, 2)).all() for g in jax.tree.leaves(rec.batch_l2))
    assert np.isnan(jax.jit(_linear_ce)(p, x, y))
    assert np.isfinite(jax.jit(_linear_ce)(p, x, y.at[2].set(0)))
