"""EKFAC statistics (``stats(..., ["kfac", "ekfac"])``) on model structures beyond
``tests/test_ekfac.py``'s plain MLP and CNN: Flax linen, Flax NNX and Equinox MLPs, and a plain
model whose hidden layer sits inside ``jax.checkpoint``, an inner ``jax.jit`` or a ``lax.cond``
branch (a traced predicate; distinct layers per branch, or one layer in both).

Oracle (float64, shared with no vjpkit code path but the Monte-Carlo seeds, drawn by hand with
``_losses.sampled`` as ``test_ekfac.py`` does): ``jax.vmap(jax.grad)`` of each example's pass
``<s_kn, logits_n>`` gives ``J_kn``, the example's gradient of the layer's ``[W; b]``. Then

* ``ekfac_scaling(st, U_A, U_G) == sum_{k,n} (U_A^T J_kn U_G)**2`` in the factors' eigenbasis
  and in a random orthogonal one;
* EKFAC's ``A``, ``G`` are ``kfac``'s from the same call, and both equal what the ``J_kn`` say
  they are: one row per example (``T = 1``), so ``J_kn = a_n g_kn^T`` with ``a_n[-1] = 1``,
  hence ``g_kn = J_kn[-1]``, ``G = sum_{k,n} g_kn g_kn^T`` and
  ``A = (1/N) sum_n (sum_k J_kn J_kn^T) / (sum_k |g_kn|^2)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vjpkit as vk
from vjpkit.curvature import _losses

N, D, H, C, K = 5, 3, 4, 3, 2  # examples, inputs, hidden width, classes, Monte-Carlo samples
TOL = {"rtol": 1e-9, "atol": 1e-13}
SPEC = ("*", ["kfac", "ekfac"])


pytestmark = pytest.mark.usefixtures("x64")  # float64 (conftest)


def _plain_params(seed: int = 0, extra: tuple[str, ...] = ()) -> dict:
    rng = np.random.default_rng(seed)
    p = {
        "fc1": {"w": 0.7 * rng.standard_normal((D, H)), "b": 0.2 * rng.standard_normal(H)},
        "fc2": {"w": 0.7 * rng.standard_normal((H, H)), "b": 0.2 * rng.standard_normal(H)},
        "out": {"w": 0.7 * rng.standard_normal((H, C)), "b": 0.2 * rng.standard_normal(C)},
    }
    for name in extra:
        p[name] = {"w": 0.7 * rng.standard_normal((H, H)), "b": 0.2 * rng.standard_normal(H)}
    return jax.tree.map(jnp.asarray, p)


def _data(seed: int = 1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((N, D))), jnp.asarray(rng.integers(0, C, (N,)))


def mc_jacobians(forward, params, x, y, key, extract) -> dict:
    """``{layer: J (K, N, in + 1, out)}``: each example's gradient of ``[W; b]`` in each
    Monte-Carlo pass, by ``vmap(grad)`` of ``<s_kn, forward(params, x_n)>``; ``extract[layer]``
    maps the gradient tree to that layer's ``(W as (in, out), b)`` (leading ``(K, N)`` axes)."""
    logits = forward(params, x)
    mark = _losses.Mark("softmax_cross_entropy", logits, jax.nn.one_hot(y, C, dtype=logits.dtype))
    seeds = _losses.sampled(mark, key, K)
    one = lambda s, xn: jax.grad(lambda p: jnp.sum(s * forward(p, xn[None])[0]))(params)
    grads = jax.vmap(jax.vmap(one), in_axes=(0, None))(seeds, x)
    out = {}
    for layer, fn in extract.items():
        w, b = fn(grads)
        out[layer] = np.concatenate([np.asarray(w), np.asarray(b)[..., None, :]], axis=-2)
    return out


def check_ekfac(captured, jac: dict, seed: int = 3) -> None:
    """Each layer's ``ekfac`` against its ``kfac`` and against the per-example Jacobians."""
    rng = np.random.default_rng(seed)
    for layer, J in jac.items():
        st = captured[layer].ekfac
        assert isinstance(st, vk.curvature.Ekfac), (layer, type(st))
        d_a, d_g = J.shape[-2:]
        assert st.a.shape == (N, 1, d_a) and st.g.shape == (K, N, 1, d_g), (layer, st.a.shape, st.g.shape)
        np.testing.assert_array_equal(st.A, captured[layer].kfac.A, err_msg=layer)
        np.testing.assert_array_equal(st.G, captured[layer].kfac.G, err_msg=layer)
        g = J[:, :, -1, :]  # the bias row: the output cotangents (the bias's input is 1)
        np.testing.assert_allclose(st.G, np.einsum("kni,knj->ij", g, g), **TOL, err_msg=layer)
        outer = np.einsum("knai,knbi->nab", J, J) / np.sum(np.square(g), axis=(0, 2))[:, None, None]
        np.testing.assert_allclose(st.A, np.mean(outer, axis=0), **TOL, err_msg=layer)
        eig = (np.linalg.eigh(np.asarray(st.A))[1], np.linalg.eigh(np.asarray(st.G))[1])
        rand = tuple(np.linalg.qr(rng.standard_normal((d, d)))[0] for d in (d_a, d_g))
        for u_a, u_g in (eig, rand):
            want = np.sum(np.square(np.einsum("ai,knab,bj->knij", u_a, J, u_g)), axis=(0, 1))
            got = vk.curvature.ekfac_scaling(st, jnp.asarray(u_a), jnp.asarray(u_g))
            np.testing.assert_allclose(got, want, **TOL, err_msg=layer)
        ident = np.sum(np.square(J), axis=(0, 1))  # no bases: the Monte-Carlo Fisher's diagonal
        np.testing.assert_allclose(vk.curvature.ekfac_scaling(st), ident, **TOL, err_msg=layer)


def _wb(name, w="w", b="b", transpose=False):
    """The gradient tree's ``(W as (in, out), b)`` of layer ``name`` (dicts or attributes)."""

    def get(grads):
        pick = lambda t, k: t[k] if isinstance(t, dict) else getattr(t, k)
        layer = pick(grads, name)
        ww, bb = pick(layer, w), pick(layer, b)
        return (jnp.swapaxes(ww, -1, -2) if transpose else ww), bb

    return get


def _run(maybe_jit, loss, params, *args, key):
    spec = vk.curvature.stats(*SPEC, mc_samples=K)
    (value, grads), captured = maybe_jit(vk.value_and_grad(loss, capture=spec))(params, *args, key=key)
    want_value, want_grads = jax.value_and_grad(loss)(params, *args)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    return captured


# --- Flax NNX, Flax linen, Equinox ---------------------------------------------------------------


def test_flax_nnx_mlp(maybe_jit):
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            kw = dict(param_dtype=jnp.float64, rngs=rngs)
            self.fc1 = nnx.Linear(D, H, **kw)
            self.fc2 = nnx.Linear(H, H, **kw)
            self.out = nnx.Linear(H, C, **kw)

        def __call__(self, x):
            return self.out(jnp.tanh(self.fc2(jnp.tanh(self.fc1(x)))))

    graphdef, state = nnx.split(vk.hookable(Model(nnx.Rngs(0))))
    forward = lambda s, x: nnx.merge(graphdef, s)(x)
    loss = lambda s, x, y: vk.curvature.softmax_cross_entropy(forward(s, x), y)
    x, y = _data()
    key = jax.random.key(5)
    captured = _run(maybe_jit, loss, state, x, y, key=key)
    assert {"fc1", "fc2", "out"} <= set(captured)

    def layer(name):
        def get(grads):
            d = nnx.to_pure_dict(grads)[name]
            return d["kernel"], d["bias"]

        return get

    layers = {k: layer(k) for k in ("fc1", "fc2", "out")}
    check_ekfac(captured, mc_jacobians(forward, state, x, y, key, layers))


def test_flax_linen_mlp(maybe_jit):
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(H, name="fc1", param_dtype=jnp.float64)(x))
            h = jnp.tanh(nn.Dense(H, name="fc2", param_dtype=jnp.float64)(h))
            return nn.Dense(C, name="out", param_dtype=jnp.float64)(h)

    model = Model()
    params = jax.tree.map(
        lambda q: {"kernel": q["w"], "bias": q["b"]}, _plain_params(), is_leaf=lambda t: "w" in t
    )
    x, y = _data()
    assert jax.tree.structure(params) == jax.tree.structure(model.init(jax.random.key(0), x)["params"])
    forward = lambda q, x: model.apply({"params": q}, x)
    loss = lambda q, x, y: vk.curvature.softmax_cross_entropy(forward(q, x), y)
    key = jax.random.key(4)
    captured = _run(maybe_jit, loss, params, x, y, key=key)
    assert {"fc1", "fc2", "out"} <= set(captured)
    layers = {k: _wb(k, w="kernel", b="bias") for k in ("fc1", "fc2", "out")}
    check_ekfac(captured, mc_jacobians(forward, params, x, y, key, layers))


def test_equinox_mlp(maybe_jit):
    """``eqx.nn.Linear`` stores ``weight (out, in)``: EKFAC's rows are still ``[x, 1]`` and the
    output cotangents, ``J`` the transposed weight's gradient over the bias's."""
    eqx = pytest.importorskip("equinox")
    plain = _plain_params()

    class Model(eqx.Module):
        fc1: Any
        fc2: Any
        out: Any

        def __init__(self):
            for name, q in plain.items():
                lin = eqx.nn.Linear(*q["w"].shape, key=jax.random.key(0), dtype=jnp.float64)
                setattr(self, name, eqx.tree_at(lambda m: (m.weight, m.bias), lin, (q["w"].T, q["b"])))

        def __call__(self, x):
            return self.out(jnp.tanh(self.fc2(jnp.tanh(self.fc1(x)))))

    params, static = eqx.partition(vk.hookable(Model()), eqx.is_array)
    forward = lambda q, x: jax.vmap(eqx.combine(q, static))(x)
    loss = lambda q, x, y: vk.curvature.softmax_cross_entropy(forward(q, x), y)
    x, y = _data()
    key = jax.random.key(6)
    captured = _run(maybe_jit, loss, params, x, y, key=key)
    for name in ("fc1", "fc2", "out"):
        assert captured[name].layout.transpose is True
    layers = {k: _wb(k, w="weight", b="bias", transpose=True) for k in ("fc1", "fc2", "out")}
    check_ekfac(captured, mc_jacobians(forward, params, x, y, key, layers))


# --- plain JAX: the hidden layer under jax.checkpoint, an inner jax.jit, lax.cond ----------------


def dense(q, h):
    return h @ q["w"] + q["b"]


PLAIN_LAYERS = {k: _wb(k) for k in ("fc1", "fc2", "out")}


@pytest.mark.parametrize("wrap", ["checkpoint", "inner_jit"])
def test_hidden_layer_under_checkpoint_or_inner_jit(wrap, maybe_jit):
    """The wrapped hidden layer's EKFAC rows are the oracle's, and every layer's statistics equal
    the unwrapped program's with the same key."""
    inner = {"checkpoint": jax.checkpoint, "inner_jit": jax.jit}[wrap](lambda q, h: jnp.tanh(dense(q, h)))
    forward = lambda p, x: dense(p["out"], inner(p["fc2"], jnp.tanh(dense(p["fc1"], x))))
    unwrapped = lambda p, x: dense(p["out"], jnp.tanh(dense(p["fc2"], jnp.tanh(dense(p["fc1"], x)))))
    params, (x, y), key = _plain_params(), _data(), jax.random.key(7)
    loss = lambda p, x, y: vk.curvature.softmax_cross_entropy(forward(p, x), y)
    captured = _run(maybe_jit, loss, params, x, y, key=key)
    assert set(captured) == {"fc1", "fc2", "out"}
    check_ekfac(captured, mc_jacobians(forward, params, x, y, key, PLAIN_LAYERS))
    plain_loss = lambda p, x, y: vk.curvature.softmax_cross_entropy(unwrapped(p, x), y)
    plain = _run(maybe_jit, plain_loss, params, x, y, key=key)
    for name in ("fc1", "fc2", "out"):
        for a, b in zip(captured[name].ekfac, plain[name].ekfac, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15, err_msg=name)


def test_hidden_layers_in_cond_branches_traced_predicate(maybe_jit):
    """``lax.cond`` on a traced flag, a different layer in each branch: the taken branch's layer
    has the EKFAC of the program with that branch inlined, the other's rows are NaN."""
    params, (x, y), key = _plain_params(extra=("alt",)), _data(), jax.random.key(8)

    def forward(p, x, flag):
        h = jnp.tanh(dense(p["fc1"], x))
        h = lax.cond(flag, lambda h: jnp.tanh(dense(p["fc2"], h)), lambda h: jnp.sin(dense(p["alt"], h)), h)
        return dense(p["out"], h)

    loss = lambda p, x, y, flag: vk.curvature.softmax_cross_entropy(forward(p, x, flag), y)
    spec = vk.curvature.stats(*SPEC, mc_samples=K)
    f = maybe_jit(vk.grad(loss, capture=spec))
    for flag, taken, other in ((True, "fc2", "alt"), (False, "alt", "fc2")):
        _, captured = f(params, x, y, jnp.asarray(flag), key=key)
        fwd = lambda p, x, flag=flag: forward(p, x, jnp.asarray(flag))
        layers = {k: _wb(k) for k in ("fc1", taken, "out")}
        check_ekfac(captured, mc_jacobians(fwd, params, x, y, key, layers))
        untaken = captured[other].ekfac
        assert isinstance(untaken, vk.curvature.Ekfac)
        for leaf in (untaken.G, untaken.g):
            assert np.all(np.isnan(np.asarray(leaf))), (other, leaf)


def test_one_layer_in_both_cond_branches(maybe_jit):
    """Both branches call ``fc2`` (different activations after it): one ``fc2`` entry, with the
    taken branch's EKFAC. A layer in a branch names no leaf (``layout.weight_leaf is None``), so
    ``fc2/w`` and ``fc2/b`` also get ``"leaf"`` entries: ``Diagonal(sum_k (sum_n J_kn)**2)``, the
    squared batch gradient of each Monte-Carlo pass (``_transform._add_unread``), checked here
    against the same Jacobians while they exist."""
    params, (x, y), key = _plain_params(), _data(), jax.random.key(9)

    def forward(p, x, flag):
        h = jnp.tanh(dense(p["fc1"], x))
        h = lax.cond(flag, lambda h: jnp.tanh(dense(p["fc2"], h)), lambda h: jnp.sin(dense(p["fc2"], h)), h)
        return dense(p["out"], h)

    loss = lambda p, x, y, flag: vk.curvature.softmax_cross_entropy(forward(p, x, flag), y)
    spec = vk.curvature.stats(*SPEC, mc_samples=K)
    f = maybe_jit(vk.grad(loss, capture=spec))
    scalings = []
    for flag in (True, False):
        _, captured = f(params, x, y, jnp.asarray(flag), key=key)
        assert {"fc1", "fc2", "out"} <= set(captured) and "fc2#1" not in captured
        fwd = lambda p, x, flag=flag: forward(p, x, jnp.asarray(flag))
        jac = mc_jacobians(fwd, params, x, y, key, PLAIN_LAYERS)
        check_ekfac(captured, jac)
        scalings.append(np.asarray(vk.curvature.ekfac_scaling(captured["fc2"].ekfac)))
        if "fc2/w" in captured:  # the leaves' own diagonal blocks (no Kronecker block names them)
            batch = np.sum(np.square(np.sum(jac["fc2"], axis=1)), axis=0)
            np.testing.assert_allclose(captured["fc2/w"].ekfac.diagonal, batch[:-1], **TOL)
            np.testing.assert_allclose(captured["fc2/b"].ekfac.diagonal, batch[-1], **TOL)
    assert not np.allclose(scalings[0], scalings[1])  # each flag took its own branch
