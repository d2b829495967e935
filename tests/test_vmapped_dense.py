"""``jax.vmap`` of a per-example ``weight @ x + bias`` (Equinox's ``Linear`` under ``jax.vmap``,
or the same in plain JAX) traces as ``W @ x`` followed by a transpose: plain-JAX matching reads it
as the dense layer ``x @ W.T + b`` with a stored ``(out, in)`` weight, so it gets Kronecker
curvature factors and the dense per-example fast path (it was a "local" layer: a diagonal block,
and the masked per-example path).

Oracles: the same model written batched as ``x @ W.T + b`` (a layout already read as dense),
``jax.vmap(jax.grad)`` for per-example norms, and NumPy for the K-FAC factors.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose

N = 16


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "l1": {"weight": jax.random.normal(k[0], (7, 5)) * 0.4, "bias": jax.random.normal(k[1], (7,)) * 0.1},
        "l2": {"weight": jax.random.normal(k[2], (3, 7)) * 0.4, "bias": jax.random.normal(k[3], (3,)) * 0.1},
    }


def _data():
    k = jax.random.split(jax.random.key(1), 2)
    return jax.random.normal(k[0], (N, 5)), jax.random.randint(k[1], (N,), 0, 3)


def per_example_model(p, x):  # one example: weight @ x + bias, as Equinox's Linear
    h = jnp.tanh(p["l1"]["weight"] @ x + p["l1"]["bias"])
    return p["l2"]["weight"] @ h + p["l2"]["bias"]


def batched_model(p, x):  # the same, written batched: x @ W.T + b
    h = jnp.tanh(x @ p["l1"]["weight"].T + p["l1"]["bias"])
    return h @ p["l2"]["weight"].T + p["l2"]["bias"]


def vmapped_loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(jax.vmap(per_example_model, in_axes=(None, 0))(p, x), y)


def batched_loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(batched_model(p, x), y)


def test_the_vmapped_program_is_w_at_x_then_a_transpose():
    """What the test is about: the traced equations (if JAX stops emitting the transpose, the
    layer is plain x @ W.T and this test should be revisited)."""
    x, _ = _data()
    eqns = jax.make_jaxpr(jax.vmap(per_example_model, in_axes=(None, 0)))(_params(), x).jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    i = names.index("dot_general")
    assert names[i + 1] == "transpose"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_kfac_factors_equal_the_batched_models_and_numpy(jit):
    params, (x, y) = _params(), _data()
    spec = vk.curvature.stats("*", ["kfac", "kflr"])
    key = jax.random.key(2)

    def run(loss):
        fn = vk.grad(loss, capture=spec)
        return jax.jit(fn) if jit else fn

    g, got = run(vmapped_loss)(params, x, y, key=key)
    _, want = run(batched_loss)(params, x, y, key=key)
    tree_allclose(g, jax.grad(batched_loss)(params, x, y), rtol=1e-5, atol=1e-6)
    for name in ("l1", "l2"):
        assert type(got[name].kfac).__name__ == "Factors", got[name].kfac
        assert got[name].layout.kind == "dense" and got[name].layout.transpose
        tree_allclose(got[name].kfac, want[name].kfac, rtol=1e-5, atol=1e-6)
        tree_allclose(got[name].kflr, want[name].kflr, rtol=1e-5, atol=1e-6)
    # A of the first layer in NumPy: the mean over examples of [x, 1] [x, 1]^T
    a = np.concatenate([np.asarray(x, np.float64), np.ones((N, 1))], axis=1)
    np.testing.assert_allclose(np.asarray(got["l1"].kfac.A), a.T @ a / N, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_per_example_norms_take_the_dense_path(jit):
    params, (x, y) = _params(), _data()

    def loss(p, x, y):
        return vmapped_loss(p, x, y)

    fn = vk.inspect.per_example_grad_norms(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no "no known kind" note
        _, grads, norms = (jax.jit(fn) if jit else fn)(params, x, y)
    one = jax.grad(lambda p, xi, yi: loss(p, xi[None], yi[None]))
    per = jax.vmap(one, in_axes=(None, 0, 0))(params, x, y)
    want = jnp.sqrt(sum(jnp.sum(jnp.square(v.reshape(N, -1)), axis=1) for v in jax.tree.leaves(per)))
    np.testing.assert_allclose(np.asarray(norms.total), np.asarray(want), rtol=1e-5, atol=1e-6)
    tree_allclose(grads, jax.grad(loss)(params, x, y), rtol=1e-5, atol=1e-6)


def test_kfac_preconditions_both_layers_with_kronecker_blocks():
    params, (x, y) = _params(), _data()
    spec = vk.curvature.stats("*", ["kfac"])
    grad_fn = vk.value_and_grad(vmapped_loss, capture=spec)
    like = jax.eval_shape(lambda p: grad_fn(p, x, y, key=jax.random.key(0))[1], params)
    opt = vk.curvature.kfac(0.1, like=like, damping=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "plain gradient" / diagonal warning
        state = opt.init(params)
        (_, g), curv = grad_fn(params, x, y, key=jax.random.key(3))
        updates, _ = opt.update(g, state, params, curvature=curv)
    grad0 = vk.value_and_grad(batched_loss, capture=spec)
    like0 = jax.eval_shape(lambda p: grad0(p, x, y, key=jax.random.key(0))[1], params)
    opt0 = vk.curvature.kfac(0.1, like=like0, damping=0.1)
    (_, g0), curv0 = grad0(params, x, y, key=jax.random.key(3))
    want, _ = opt0.update(g0, opt0.init(params), params, curvature=curv0)
    tree_allclose(updates, want, rtol=1e-4, atol=1e-6)


def test_equinox_linear_under_vmap():
    eqx = pytest.importorskip("equinox")
    k = jax.random.split(jax.random.key(4), 2)
    model = [eqx.nn.Linear(5, 7, key=k[0]), eqx.nn.Linear(7, 3, key=k[1])]
    params, static = eqx.partition(model, eqx.is_array)
    x, y = _data()

    def loss(p, x, y):
        l1, l2 = eqx.combine(p, static)
        return vk.curvature.softmax_cross_entropy(jax.vmap(lambda v: l2(jnp.tanh(l1(v))))(x), y)

    _, got = vk.grad(loss, capture=vk.curvature.stats("*", ["kfac"]))(params, x, y, key=jax.random.key(5))
    assert sorted(got) and all(type(c.kfac).__name__ == "Factors" for c in got.values()), got
    same = {f"l{i + 1}": {"weight": m.weight, "bias": m.bias} for i, m in enumerate(params)}
    spec = vk.curvature.stats("*", ["kfac"])
    _, want = vk.grad(batched_loss, capture=spec)(same, x, y, key=jax.random.key(5))
    for (_, c), w in zip(sorted(got.items()), (want["l1"], want["l2"])):
        tree_allclose(c.kfac, w.kfac, rtol=1e-5, atol=1e-6)


def _per_position_bias(vmapped: bool):
    """A "bias" over the positions, not the output features (``T == out``, so shapes cannot
    tell): ``W @ x_t + b_t`` per position, or ``x @ W.T + b[:, None]`` batched. Not a dense
    layer's bias: the call is a local layer (before, the batched form was read as dense with a
    bias block of the wrong axis: NaN per-example norms, meaningless factors)."""
    t = 3

    def loss(p, x, y):
        if vmapped:
            inner = jax.vmap(lambda xt, bt: p["l1"]["weight"] @ xt + bt)
            h = jax.vmap(inner, in_axes=(0, None))(x, p["l1"]["bias"])
        else:
            h = x @ p["l1"]["weight"].T + p["l1"]["bias"][:, None]
        return vk.curvature.softmax_cross_entropy(jnp.tanh(h).sum(1), y)

    k = jax.random.split(jax.random.key(6), 3)
    bias = jnp.arange(t, dtype=jnp.float32) * 0.3
    params = {"l1": {"weight": jax.random.normal(k[0], (t, 5)) * 0.4, "bias": bias}}
    x, y = jax.random.normal(k[1], (6, t, 5)), jax.random.randint(k[2], (6,), 0, 3)
    return loss, params, x, y


@pytest.mark.parametrize("vmapped", [True, False], ids=["vmapped", "batched"])
def test_a_bias_over_another_axis_is_not_a_dense_bias(vmapped):
    loss, params, x, y = _per_position_bias(vmapped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the local path's note
        _, _, norms = vk.inspect.per_example_grad_norms(loss)(params, x, y)
    one = jax.grad(lambda p, xi, yi: loss(p, xi[None], yi[None]))
    per = jax.vmap(one, in_axes=(None, 0, 0))(params, x, y)
    want = jnp.sqrt(sum(jnp.sum(jnp.square(v.reshape(6, -1)), axis=1) for v in jax.tree.leaves(per)))
    np.testing.assert_allclose(np.asarray(norms.total), np.asarray(want), rtol=1e-5, atol=1e-6)
    _, got = vk.grad(loss, capture=vk.curvature.stats("*", ["kfac"]))(params, x, y, key=jax.random.key(7))
    assert type(got["l1"].kfac).__name__ == "Diagonal", got["l1"].kfac
