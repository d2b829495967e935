"""EKFAC (issue 32, item 2): ``stats(..., ["ekfac"])`` and ``kfac(..., estimator="ekfac")``.

Oracles (float64):

* the scaling ``sum_{k,n} (U_A^T J_kn U_G)**2`` against ``jax.vmap(jax.grad)`` of each example's
  Monte-Carlo pass ``<s_kn, logits_n>`` (the same seeds, drawn by hand with ``_losses.sampled``),
  in the factors' eigenbasis and in a random orthogonal one;
* two optimizer steps on ``test_curvature_blocks``'s LM (a tied embedding, layer norms, residual
  biases, blocks under ``lax.scan`` over stacked weights) against a NumPy EKFAC: its Kronecker
  blocks from the captured rows with ``np.einsum`` and ``np.linalg.eigh``, the scaling carried
  into each new basis by ``(R*R) S (R*R)^T``; its diagonal blocks equal K-FAC's.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vjpkit as vk
from tests import test_curvature_blocks as cb
from vjpkit.curvature import _losses

N, T, D, H, C, K = 6, 3, 4, 5, 7, 2


pytestmark = pytest.mark.usefixtures("x64")  # float64 (conftest)


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "fc1": {"w": rng.standard_normal((D, H)) * 0.5, "b": 0.1 * rng.standard_normal(H)},
        "fc2": {"w": rng.standard_normal((H, C)) * 0.5, "b": 0.1 * rng.standard_normal(C)},
    }


def mlp(p, x):  # x (N, T, D): each example a sequence, its rows the positions
    h = jnp.tanh(x @ p["fc1"]["w"] + p["fc1"]["b"])
    return h @ p["fc2"]["w"] + p["fc2"]["b"]


def mlp_loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(mlp(p, x), y)


def data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, T, D)), rng.integers(0, C, (N, T))


def per_example_grads(params, x, y, key):
    """``J[layer] (K, N, in + 1, out)``: each example's gradient of ``[W; b]`` in each
    Monte-Carlo pass, by ``vmap(grad)`` of ``<s_kn, logits_n>``."""
    logits = mlp(params, x)
    seeds = _losses.sampled(_losses.Mark("softmax_cross_entropy", logits, jax.nn.one_hot(y, C)), key, K)
    one = lambda s, xn: jax.grad(lambda p: jnp.sum(s * mlp(p, xn[None])[0]))(params)
    grads = jax.vmap(jax.vmap(one), in_axes=(0, None))(seeds, x)
    return {k: np.concatenate([grads[k]["w"], grads[k]["b"][..., None, :]], axis=-2) for k in grads}


def test_scaling_equals_vmap_grad_in_the_eigenbasis(maybe_jit):
    params, (x, y), key = mlp_params(), data(), jax.random.key(2)
    spec = vk.curvature.stats("*", ["kfac", "ekfac"], mc_samples=K)
    _, cap = maybe_jit(vk.grad(mlp_loss, capture=spec))(params, x, y, key=key)
    jac = per_example_grads(params, x, y, key)
    rng = np.random.default_rng(3)
    for layer in ("fc1", "fc2"):
        st = cap[layer].ekfac
        assert isinstance(st, vk.curvature.Ekfac)
        np.testing.assert_array_equal(st.A, cap[layer].kfac.A)  # kfac's factors, the same passes
        np.testing.assert_array_equal(st.G, cap[layer].kfac.G)
        eig = (np.linalg.eigh(st.A)[1], np.linalg.eigh(st.G)[1])
        rand = tuple(
            np.linalg.qr(rng.standard_normal((d, d)))[0]
            for d in (H + 1 if layer == "fc2" else D + 1, st.G.shape[0])
        )
        for u_a, u_g in (eig, rand):
            want = np.sum(np.square(np.einsum("ai,knab,bj->knij", u_a, jac[layer], u_g)), axis=(0, 1))
            got = vk.curvature.ekfac_scaling(st, jnp.asarray(u_a), jnp.asarray(u_g))
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-16)
        # the identity basis: the Monte-Carlo Fisher's diagonal, the layer's diag_ggn_mc
        ident = np.sum(np.square(jac[layer]), axis=(0, 1))
        np.testing.assert_allclose(vk.curvature.ekfac_scaling(st), ident, rtol=1e-10, atol=1e-16)


def cnn(p, x):  # NHWC, a stride-2 SAME convolution with a bias, then a dense head
    y = lax.conv_general_dilated(
        x, p["conv"]["w"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jnp.tanh(y + p["conv"]["b"]).reshape(x.shape[0], -1)
    return h @ p["fc"]["w"] + p["fc"]["b"]


def test_conv_scaling_equals_vmap_grad_in_the_eigenbasis():
    """A convolution's rows are its output positions with the unfolded patches (and the bias's
    input 1): its scaling equals the per-example kernel and bias gradients' rotated squares."""
    rng = np.random.default_rng(6)
    params = {
        "conv": {"w": 0.4 * rng.standard_normal((3, 3, 2, 3)), "b": 0.1 * rng.standard_normal(3)},
        "fc": {"w": 0.3 * rng.standard_normal((27, C)), "b": np.zeros(C)},
    }
    x, y = rng.standard_normal((N, 6, 6, 2)), rng.integers(0, C, (N,))
    key = jax.random.key(8)
    loss = lambda p, x, y: vk.curvature.softmax_cross_entropy(cnn(p, x), y)
    _, cap = jax.jit(vk.grad(loss, capture=vk.curvature.stats("conv", ["ekfac"], mc_samples=K)))(
        params, x, y, key=key
    )
    logits = cnn(params, x)
    seeds = _losses.sampled(_losses.Mark("softmax_cross_entropy", logits, jax.nn.one_hot(y, C)), key, K)
    one = lambda s, xn: jax.grad(lambda p: jnp.sum(s * cnn(p, xn[None])[0]))(params)["conv"]
    g = jax.vmap(jax.vmap(one), in_axes=(0, None))(seeds, x)
    jac = np.concatenate([np.asarray(g["w"]).reshape(K, N, 18, 3), np.asarray(g["b"])[..., None, :]], axis=-2)
    st = cap["conv"].ekfac
    u_a, u_g = np.linalg.eigh(st.A)[1], np.linalg.eigh(st.G)[1]
    want = np.sum(np.square(np.einsum("ai,knab,bj->knij", u_a, jac, u_g)), axis=(0, 1))
    np.testing.assert_allclose(vk.curvature.ekfac_scaling(st, u_a, u_g), want, rtol=1e-10, atol=1e-16)


def test_scaling_under_jit_of_a_scan_over_the_seeds():
    """More Monte-Carlo passes than one go through ``lax.scan``; the jitted function traces once."""
    params, (x, y), key = mlp_params(), data(), jax.random.key(5)
    _, cap = jax.jit(vk.grad(mlp_loss, capture=vk.curvature.stats("fc1", ["ekfac"], mc_samples=K)))(
        params, x, y, key=key
    )
    traces = []

    @jax.jit
    def scaling(st):
        traces.append(1)
        return vk.curvature.ekfac_scaling(st)

    first = scaling(cap["fc1"].ekfac)
    second = scaling(jax.tree.map(lambda a: a * 2.0, cap["fc1"].ekfac))
    np.testing.assert_allclose(second, 16.0 * first, rtol=1e-12)  # J scales by 4: its square by 16
    assert len(traces) == 1


# --- the optimizer on a model mixing Kronecker and diagonal blocks ------------------------------


def _numpy_ekfac_block(caps, grads_w, grads_b, decay, damping, lr):
    """NumPy EKFAC of one stacked Kronecker block over several steps: per step, the EMA factors,
    the scaling in the last refresh's basis, the refresh carrying it, the preconditioned step."""
    out, state = [], None
    for st, gw, gb in zip(caps, grads_w, grads_b or [None] * len(caps), strict=True):
        A, G, a, g = (np.asarray(z) for z in st)
        slices = []
        for i in range(A.shape[0]):
            J = np.einsum("nta,knto->knao", a[i], g[i])  # each example's gradient, each pass
            if state is None:
                u_a, u_g = np.eye(A.shape[-1]), np.eye(G.shape[-1])
                ema_a, ema_g, s = A[i], G[i], np.sum(np.square(J), axis=(0, 1))
            else:
                ema_a, ema_g, s, u_a, u_g = state[i]
                rot = np.sum(np.square(np.einsum("ai,knab,bj->knij", u_a, J, u_g)), axis=(0, 1))
                ema_a, ema_g = decay * ema_a + (1 - decay) * A[i], decay * ema_g + (1 - decay) * G[i]
                s = decay * s + (1 - decay) * rot
            v_a, v_g = np.linalg.eigh(ema_a)[1], np.linalg.eigh(ema_g)[1]
            s = np.square(v_a.T @ u_a) @ s @ np.square(v_g.T @ u_g).T
            m = np.asarray(gw[i]) if gb is None else np.vstack([np.asarray(gw[i]), np.asarray(gb[i])[None]])
            p = v_a @ ((v_a.T @ m @ v_g) / (s + damping)) @ v_g.T
            slices.append(((ema_a, ema_g, s, v_a, v_g), -lr * p))
        state = [z[0] for z in slices]
        out.append(np.stack([z[1] for z in slices]))
    return out


def test_optimizer_equals_numpy_ekfac_on_the_lm():
    params, x, y = cb.problem()
    damping, decay, lr = 1e-2, 0.5, 0.1
    spec = vk.curvature.stats("*", ["kfac", "ekfac"], mc_samples=2)
    step = jax.jit(vk.value_and_grad(cb.loss, capture=spec))
    key = jax.random.key(7)
    like = jax.eval_shape(step, params, x, y, key=key)[1]
    ek = vk.curvature.kfac(lr, like=like, estimator="ekfac", damping=damping, decay=decay)
    kf = vk.curvature.kfac(lr, like=like, estimator="kfac", damping=damping, decay=decay, solver="eigh")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every leaf has a block: no SGD warning
        states = ek.init(params), kf.init(params)
        update = jax.jit(lambda g, s, c: ek.update(g, s, params, curvature=c))
        k_update = jax.jit(lambda g, s, c: kf.update(g, s, params, curvature=c))
        caps, grads, got, k_got = [], [], [], []
        for i, (p, xb, yb) in enumerate((cb.problem(0), cb.problem(1), cb.problem(2))):
            (_, g), c = step(p, xb, yb, key=jax.random.fold_in(key, i))
            u, s0 = update(g, states[0], c)
            ku, s1 = k_update(g, states[1], c)
            states = s0, s1
            caps.append(c), grads.append(g), got.append(u), k_got.append(ku)
    assert isinstance(states[0].inverses["blocks/fc"], vk.curvature.EkfacBasis)
    for layer, leaf, bias in (("blocks/fc", "fc", True), ("blocks/proj/w", "proj", False)):
        want = _numpy_ekfac_block(  # the residual bias of proj is a diagonal block of its own
            [c[layer].ekfac for c in caps],
            [g["blocks"][leaf]["w"] for g in grads],
            [g["blocks"][leaf]["b"] for g in grads] if bias else None,
            decay, damping, lr,
        )  # fmt: skip
        for u, w in zip(got, want, strict=True):
            np.testing.assert_allclose(
                u["blocks"][leaf]["w"], w[:, :-1] if bias else w, rtol=1e-7, atol=1e-12
            )
            if bias:
                np.testing.assert_allclose(u["blocks"][leaf]["b"], w[:, -1], rtol=1e-7, atol=1e-12)
    for u, ku in zip(got, k_got, strict=True):  # the diagonal blocks are K-FAC's (the same diagonal)
        for leaf in (("embed",), ("ln_f", "scale"), ("blocks", "ln", "bias"), ("blocks", "proj", "b")):
            a, b = u, ku
            for k in leaf:
                a, b = a[k], b[k]
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_ekfac_lowers_the_loss_through_make_step():
    """``vk.train.make_step`` with the ``ekfac`` capture and optimizer, every leaf preconditioned
    (warnings are errors), a refresh every 3 steps: the loss falls and stays finite."""
    params, x, y = cb.problem()
    spec = vk.curvature.stats("*", ["ekfac"])
    like = jax.eval_shape(vk.value_and_grad(cb.loss, capture=spec), params, x, y, key=jax.random.key(0))[1]
    opt = vk.curvature.kfac(0.05, like=like, estimator="ekfac", damping=1e-2, update_every=3, momentum=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = vk.train.TrainState.create(params, opt)
        step = vk.train.make_step(lambda p, b: cb.loss(p, *b), opt, capture=spec)
        losses = []
        for _ in range(12):
            state, metrics = step(state, (x, y))  # its key= split from state.rng
            losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


def test_ekfac_errors():
    params, (x, y) = mlp_params(), data()
    spec = vk.curvature.stats("*", ["ekfac"])
    with pytest.raises(vk.ConfigError, match="key="):
        vk.grad(mlp_loss, capture=spec)(params, x, y)
    like = jax.eval_shape(vk.grad(mlp_loss, capture=spec), params, x, y, key=jax.random.key(0))[1]
    with pytest.raises(vk.ConfigError, match=r"solver='inverse'.*eigenbasis"):
        vk.curvature.kfac(0.1, like=like, estimator="ekfac", solver="inverse")
    kf_like = jax.eval_shape(
        vk.grad(mlp_loss, capture=vk.curvature.stats("*", ["kfac"])), params, x, y, key=jax.random.key(0)
    )[1]
    with pytest.raises(vk.ConfigError, match="no 'ekfac' factors"):
        vk.curvature.kfac(0.1, like=kf_like, estimator="ekfac")
    opt = vk.curvature.kfac(0.1, like=like, estimator="ekfac")
    with pytest.raises(vk.ConfigError, match="first update"):
        opt.update(params, opt.init(params), params)


def test_scanned_weight_closed_over_joins_its_iterations():
    """A weight closed over by ``lax.scan`` (the same every iteration) is one block whose
    examples' gradients sum over the iterations: its rows are joined, so its scaling equals
    the unrolled model's (one weight used three times)."""
    rng = np.random.default_rng(4)
    p = {"w": 0.5 * rng.standard_normal((D, D)), "out": 0.5 * rng.standard_normal((D, C))}
    x, y = rng.standard_normal((N, D)), rng.integers(0, C, (N,))

    def scanned(p, x, y):
        h = lax.scan(lambda h, _: (jnp.tanh(h @ p["w"]), None), x, None, length=3)[0]
        return vk.curvature.softmax_cross_entropy(h @ p["out"], y)

    def unrolled(p, x, y):
        h = x
        for _ in range(3):
            h = jnp.tanh(h @ p["w"])
        return vk.curvature.softmax_cross_entropy(h @ p["out"], y)

    spec, key = vk.curvature.stats("*", ["ekfac"]), jax.random.key(9)
    out = []
    for fn in (scanned, unrolled):
        step = jax.jit(vk.value_and_grad(fn, capture=spec))
        like = jax.eval_shape(step, p, x, y, key=key)[1]
        opt = vk.curvature.kfac(0.1, like=like, estimator="ekfac", damping=1e-2)
        state = opt.init(p)
        (_, g), c = step(p, x, y, key=key)
        u, state = opt.update(g, state, p, curvature=c)
        out.append((u, state.factors))
    np.testing.assert_allclose(out[0][0]["w"], out[1][0]["w"], rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(out[0][1]["w"].scaling, out[1][1]["w"].scaling, rtol=1e-9, atol=1e-14)
