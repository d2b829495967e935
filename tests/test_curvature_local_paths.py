"""Curvature statistics of layers with no Kronecker rule, by the paths of ``curvature/_local.py``.

A lookup (``table[ids]``, out-of-range ids read zeros, ids repeated within a sequence) takes
``vjpkit.stats``' rows; a positional table ``x + pos``, a norm's affine and a scalar gain take
the shared path (the program split where the params' values meet the input's); a parameter
broadcast over the examples before it meets the input takes the masked vjps. Each model is
written examples-first and time-major (the examples on axis 1 of the layers, found by dataflow).

Oracles (float64): ``jax.vmap(jax.grad)`` of each example's share of the mean loss for
``sum_grad_squared`` and ``batch_l2``; the brute-force GGN diagonal (``jax.jacobian`` of the
logits with the cross-entropy's Hessian per position) for ``diag_ggn``; NumPy for the lookup's
``stats.sum_sq``. A spy on the masked path checks which layers take it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from vjpkit import stats
from vjpkit.curvature import _local

from . import test_curvature_blocks as cb

# The default tier runs this test's eager twin (conftest.py): the first one's is slow.
DEFAULT_TIER_EAGER = "test_vjpkit_nn_norm_and_custom_layer_take_the_shared_path"

V, D, T, N = cb.V, cb.D, cb.T, cb.N
WHICH = ["sum_grad_squared", "batch_l2", "diag_ggn"]


pytestmark = pytest.mark.usefixtures("x64")  # float64 (conftest)


def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def lookup(table, ids):  # an id past the table reads zeros
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)


def examples_first(p, tok):
    x = lookup(p["embed"], tok)
    x = layer_norm(x + p["pos"], p["ln"]) * p["gain"]
    return x @ p["out"]["w"] + p["out"]["b"]


def time_major(p, tok):
    x = lookup(p["embed"], tok.T)  # (T, N, D)
    x = layer_norm(x + p["pos"][:, None], p["ln"]) * p["gain"]
    return jnp.swapaxes(x @ p["out"]["w"] + p["out"]["b"], 0, 1)


def broadcast_first(p, tok):  # the gain broadcast over the examples before it meets x
    x = layer_norm(lookup(p["embed"], tok), p["ln"])
    x = x * jnp.broadcast_to(p["gain"], x.shape)
    return x @ p["out"]["w"] + p["out"]["b"]


MODELS = {"examples_first": examples_first, "time_major": time_major, "broadcast_first": broadcast_first}
FAST = {"embed", "pos", "ln", "gain"}  # the layers that must not take the masked path


def problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "embed": rng.standard_normal((V, D)),
        "pos": rng.standard_normal((T, D)),
        "gain": np.asarray(1.3),
        "ln": {"scale": 1 + 0.1 * rng.standard_normal(D), "bias": 0.1 * rng.standard_normal(D)},
        "out": {"w": rng.standard_normal((D, V)), "b": rng.standard_normal(V)},
    }
    x = rng.integers(0, 3, (N, T))  # few ids: each sequence repeats some
    x[0, 1] = V + 2  # out of range: a zero row
    return params, x, rng.integers(0, V, (N, T))


def loss_of(model):
    return lambda p, x, y: vk.curvature.softmax_cross_entropy(model(p, x), y)


def by_leaf(cap, field):
    """``{argument leaf path: statistic}`` of every local layer's entry."""
    out = {}
    for entry in cap.values():
        if entry.layout.kind != "local":
            continue
        flat = jax.tree_util.tree_flatten_with_path(getattr(entry, field))[0]
        named = {"/".join(str(k.key) for k in kp): v for kp, v in flat}
        for p, keys in entry.layout.leaves:
            out["/".join(str(k.key) for k in keys)] = named[p]
    return out


def leaf(params, path):
    for k in path.split("/"):
        params = params[k]
    return params


@pytest.fixture
def masked_calls(monkeypatch):
    """The layers (by their params' paths) whose statistics took the masked vjps."""
    seen = []
    masked = _local._masked

    def spy(closed, flat):
        linearize = masked(closed, flat)

        def traced(params, x, axis=0):
            seen.append(tuple(sorted(params)))
            return linearize(params, x, axis)

        return traced

    monkeypatch.setattr(_local, "_masked", spy)
    return seen


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(MODELS))
def test_local_statistics_equal_vmap_grad_and_the_ggn(name, jit, masked_calls):
    params, x, y = problem()
    model = MODELS[name]
    loss = loss_of(model)
    g = vk.grad(loss, capture=vk.curvature.stats("*", WHICH))
    _, cap = (jax.jit(g) if jit else g)(params, x, y)

    def share(p, xi, yi):  # example i's share of the mean loss: g_i = grad l_i / N
        return loss(p, xi[None], yi[None]) / N

    per = jax.vmap(jax.grad(share), in_axes=(None, 0, 0))(params, x, y)
    sgs, l2, ggn = (by_leaf(cap, f) for f in WHICH)
    assert set(sgs) >= {"embed", "ln/scale", "ln/bias", "gain"}, sorted(sgs)
    for path, got in sgs.items():
        g_i = leaf(per, path)
        np.testing.assert_allclose(got, np.sum(np.square(g_i), 0), rtol=1e-10, atol=1e-14, err_msg=path)
        want = np.sum(np.square(g_i).reshape(N, -1), 1)
        np.testing.assert_allclose(l2[path], want, rtol=1e-10, atol=1e-14, err_msg=path)
        fn = lambda v, x, path=path: model(cb.with_leaf(params, tuple(path.split("/")), v), x)
        want = cb.ggn_diagonal(fn, leaf(params, path), x)
        np.testing.assert_allclose(ggn[path], want, rtol=1e-9, atol=1e-14, err_msg=path)
    slow = {p for names in masked_calls for p in names}
    if name == "broadcast_first":
        assert slow == {"gain"}, slow  # its value differs per example before it meets x
    else:
        assert not slow & FAST, slow


@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_sum_sq_with_repeated_ids_equals_numpy(weighted):
    rng = np.random.default_rng(1)
    index = rng.integers(0, 4, (6, 9))  # 9 rows per example over 4 table rows: many repeats
    b = rng.standard_normal((6, 9, 5))
    w = rng.standard_normal((6, 9)) if weighted else None
    rows = stats.Rows.lookup(
        jnp.asarray(index), jnp.asarray(b), (4, 5), None if w is None else jnp.asarray(w)
    )
    g = np.zeros((6, 4, 5))
    for i in range(6):
        for r in range(9):
            g[i, index[i, r]] += (1.0 if w is None else w[i, r]) * b[i, r]
    np.testing.assert_allclose(stats.sum_sq([rows]), np.sum(g**2, 0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stats.sq_norms([rows]), np.sum(g**2, (1, 2)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vjpkit_nn_norm_and_custom_layer_take_the_shared_path(jit, masked_calls):
    """``nn.layer_norm`` (its normalization is the input's own computation, left out of the
    vjp) and a custom ``nn.layer`` with a scalar gain: no masked vjps, and the statistics equal
    ``vmap(grad)``'s."""
    from vjpkit import nn

    gain = nn.layer(lambda p, x: x * p["g"], lambda key, x: {"g": jnp.asarray(1.5)}, name="gain")
    net = nn.serial(nn.dense(4), nn.layer_norm(), gain, nn.dense(V))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((N, T, 3)))
    y = jnp.asarray(rng.integers(0, V, (N, T)))
    params = net.init(jax.random.key(0), x)

    def loss(p, x, y):
        return vk.curvature.softmax_cross_entropy(net.apply(p, x), y)

    g = vk.grad(loss, capture=vk.curvature.stats("*", ["sum_grad_squared", "batch_l2"]))
    _, cap = (jax.jit(g) if jit else g)(params, x, y)
    per = jax.vmap(jax.grad(lambda p, xi, yi: loss(p, xi[None], yi[None]) / N), in_axes=(None, 0, 0))(
        params, x, y
    )
    sgs, l2 = by_leaf(cap, "sum_grad_squared"), by_leaf(cap, "batch_l2")
    assert len(sgs) == 3, sorted(sgs)  # the norm's scale and bias, the gain
    for path, got in sgs.items():
        g_i = leaf(per, path)
        np.testing.assert_allclose(got, np.sum(np.square(g_i), 0), rtol=1e-10, atol=1e-14, err_msg=path)
        np.testing.assert_allclose(l2[path], np.sum(np.square(g_i).reshape(N, -1), 1), rtol=1e-10, atol=1e-14)
    assert not masked_calls, masked_calls
