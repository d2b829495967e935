"""Curvature blocks on every leaf of a real model's structure (issue 32, items 2 and 3).

The model: a tiny LM with a tied embedding (lookup and head ``h @ E.T``), two blocks under
``lax.scan`` over stacked weights, layer norms with scale and shift, and residual biases
written ``x + h @ W + b``. ``vk.curvature.stats("*", [...])`` answers for every layer kind: the
K-FAC fields of a layer with no Kronecker rule hold its ``Diagonal`` block, and a factor side
longer than ``max_factor_dim`` is its diagonal.

Oracles (float64): the GGN of each leaf by brute force (``jax.jacobian`` of the logits, the
cross-entropy's Hessian per position) for the diagonal blocks; the full factors' diagonals for
``max_factor_dim``; and a NumPy K-FAC step for the optimizer: each Kronecker block solved with
``np.kron`` of the damped factors (a diagonal side as ``np.diag``), each diagonal block and the
tied weight's combined block (the lookup's diagonal plus ``diag(A) kron diag(G)`` of the head)
by division.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import vjpkit as vk

V, D, H, T, N, L = 11, 3, 8, 4, 5, 2


pytestmark = pytest.mark.usefixtures("x64")  # float64 (conftest)


def problem(seed=0):
    rng = np.random.default_rng(seed)
    norm = lambda *lead: {
        "scale": 1 + 0.1 * rng.standard_normal((*lead, D)),
        "bias": 0.1 * rng.standard_normal((*lead, D)),
    }
    params = {
        "embed": rng.standard_normal((V, D)) * 0.5,
        "blocks": {
            "ln": norm(L),
            "fc": {"w": rng.standard_normal((L, D, H)) * 0.5, "b": 0.1 * rng.standard_normal((L, H))},
            "proj": {"w": rng.standard_normal((L, H, D)) * 0.3, "b": 0.1 * rng.standard_normal((L, D))},
        },
        "ln_f": norm(),
    }
    tok = rng.integers(0, V, (N, T + 1))
    return params, tok[:, :-1], tok[:, 1:]


def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(x, p):
    h = jnp.tanh(layer_norm(x, p["ln"]) @ p["fc"]["w"] + p["fc"]["b"])
    return x + h @ p["proj"]["w"] + p["proj"]["b"]  # the residual bias


def model(p, tok):
    x = p["embed"][tok]
    x, _ = lax.scan(lambda h, q: (block(h, q), None), x, p["blocks"])
    return layer_norm(x, p["ln_f"]) @ p["embed"].T  # the tied head


def loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(model(p, x), y)


def ggn_diagonal(fn, leaf, x):
    """The GGN diagonal of the mean cross-entropy of ``fn(leaf)``'s ``(N, T, V)`` logits."""
    jac = jax.jacobian(lambda v: fn(v, x))(leaf).reshape(N * T, V, -1)
    prob = jax.nn.softmax(fn(leaf, x)).reshape(N * T, V)
    hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob) / (N * T)
    return np.einsum("rcp,rcd,rdp->p", jac, hess, jac).reshape(leaf.shape)


def with_leaf(params, path, value):
    out = jax.tree.map(lambda a: a, params)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_every_kind_answers_kflr_with_its_block(jit):
    """``stats("*", ["kflr"])`` on the whole model: dense layers give factors, every other kind
    (layer norms, residual biases, the embedding lookup) its ``Diagonal``, equal to the
    brute-force GGN diagonal of the leaves it reads."""
    params, x, y = problem()
    g = vk.grad(loss, capture=vk.curvature.stats("*", ["kflr"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, cap = (jax.jit(g) if jit else g)(params, x, y)
    kinds = {k: type(v.kflr).__name__ for k, v in cap.items()}
    assert kinds == {
        "embed": "Diagonal", "embed#1": "Factors", "ln_f": "Diagonal", "blocks/ln": "Diagonal",
        "blocks/fc": "Factors", "blocks/proj/w": "Factors", "blocks/proj/b": "Diagonal",
    }, kinds  # fmt: skip
    for key, path in (
        ("ln_f", ("ln_f", "scale")),
        ("ln_f", ("ln_f", "bias")),
        ("blocks/ln", ("blocks", "ln", "scale")),
        ("blocks/proj/b", ("blocks", "proj", "b")),
    ):
        leaf = params
        for k in path:
            leaf = leaf[k]
        want = ggn_diagonal(lambda v, x, path=path: model(with_leaf(params, path, v), x), leaf, x)
        got = jax.tree.leaves(cap[key].kflr.diagonal)[0 if path[-1] in ("bias", "b") else -1]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15, err_msg=str(path))
        layout = cap[key].layout
        assert layout.kind == "local" and all(p is not None for _, p in layout.leaves)

    def lookup_only(v, x):  # the embedding's lookup use alone (the head keeps the table)
        h = v[x]
        h, _ = lax.scan(lambda a, q: (block(a, q), None), h, params["blocks"])
        return layer_norm(h, params["ln_f"]) @ params["embed"].T

    want = ggn_diagonal(lookup_only, params["embed"], x)
    np.testing.assert_allclose(cap["embed"].kflr.diagonal["embed"], want, rtol=1e-9, atol=1e-15)


def test_diagonal_blocks_follow_the_estimator():
    """``kfac``'s diagonal block is ``diag_ggn_mc`` and ``kfac_empirical``'s is
    ``N * sum_grad_squared`` (the empirical Fisher of the mean loss)."""
    params, x, y = problem()
    spec = vk.curvature.stats("ln_f", ["kfac", "kfac_empirical", "diag_ggn_mc", "sum_grad_squared"])
    _, cap = jax.jit(vk.grad(loss, capture=spec))(params, x, y, key=jax.random.key(3))
    rec = cap["ln_f"]
    for leaf in ("scale", "bias"):
        np.testing.assert_array_equal(rec.kfac.diagonal[leaf], rec.diag_ggn_mc[leaf])
        np.testing.assert_allclose(
            rec.kfac_empirical.diagonal[leaf], N * rec.sum_grad_squared[leaf], rtol=1e-12
        )
        per_example = jax.vmap(jax.grad(lambda p, xi, yi: loss(p, xi[None], yi[None])), (None, 0, 0))(
            params, x, y
        )
        ef = np.sum(np.square(per_example["ln_f"][leaf] / N), axis=0) * N
        np.testing.assert_allclose(rec.kfac_empirical.diagonal[leaf], ef, rtol=1e-9)


def test_max_factor_dim_keeps_the_diagonal_of_a_long_side():
    params, x, y = problem()
    key = jax.random.key(0)
    full = jax.jit(vk.grad(loss, capture=vk.curvature.stats("*", ["kfac"])))(params, x, y, key=key)[1]
    cut = vk.curvature.stats("*", ["kfac"], max_factor_dim=6)
    short = jax.jit(vk.grad(loss, capture=cut))(params, x, y, key=key)[1]
    for name in ("embed#1", "blocks/fc", "blocks/proj/w"):
        for side in ("A", "G"):
            a, b = getattr(full[name].kfac, side), getattr(short[name].kfac, side)
            if a.shape[-1] > 6:
                np.testing.assert_allclose(b, np.diagonal(a, axis1=-2, axis2=-1), rtol=1e-12, err_msg=name)
            else:
                np.testing.assert_allclose(b, a, rtol=1e-12, err_msg=name)
    assert short["embed#1"].kfac.G.shape == (V,) and short["blocks/fc"].kfac.G.shape == (L, H)
    with pytest.raises(vk.ConfigError, match="max_factor_dim must be an int >= 1"):
        vk.curvature.stats("*", ["kfac"], max_factor_dim=0)


# --- the optimizer against a NumPy K-FAC ------------------------------------------------------


def _kron_step(a, g, m, damping):
    """``(A_d kron G_d)^-1 vec M`` (row-major ``vec``) with pi-damping; a 1-D side is diagonal."""
    da, dg = a.shape[-1], g.shape[-1]
    tr = lambda f, d: (f.sum() if f.ndim == 1 else np.trace(f)) / d
    pi = np.sqrt(tr(a, da) / tr(g, dg))
    full = lambda f: np.diag(f) if f.ndim == 1 else f
    a_d = full(a) + pi * np.sqrt(damping) * np.eye(da)
    g_d = full(g) + np.sqrt(damping) / pi * np.eye(dg)
    return np.linalg.solve(np.kron(a_d, g_d), m.reshape(-1)).reshape(m.shape)


def _numpy_direction(grads, cap, tied_diagonal, damping):
    """The preconditioned gradient of every leaf, by the block table (see the module docstring)."""
    g = jax.tree.map(np.asarray, grads)
    s = {k: jax.tree.map(np.asarray, v.kflr) for k, v in cap.items()}
    out = {"blocks": {"ln": {}, "fc": {}, "proj": {}}, "ln_f": {}}
    for leaf in ("scale", "bias"):  # diagonal blocks
        out["ln_f"][leaf] = g["ln_f"][leaf] / (s["ln_f"].diagonal[leaf] + damping)
        out["blocks"]["ln"][leaf] = g["blocks"]["ln"][leaf] / (s["blocks/ln"].diagonal[leaf] + damping)
    out["blocks"]["proj"]["b"] = g["blocks"]["proj"]["b"] / (
        s["blocks/proj/b"].diagonal["blocks/proj/b"] + damping
    )
    fc_w, fc_b, pw = [], [], []
    for i in range(L):  # one Kronecker block per scan iteration
        m = np.vstack([g["blocks"]["fc"]["w"][i], g["blocks"]["fc"]["b"][i][None]])
        r = _kron_step(s["blocks/fc"].A[i], s["blocks/fc"].G[i], m, damping)
        fc_w.append(r[:-1])
        fc_b.append(r[-1])
        pw.append(
            _kron_step(s["blocks/proj/w"].A[i], s["blocks/proj/w"].G[i], g["blocks"]["proj"]["w"][i], damping)
        )
    out["blocks"]["fc"] = {"w": np.stack(fc_w), "b": np.stack(fc_b)}
    out["blocks"]["proj"]["w"] = np.stack(pw)
    out["embed"] = g["embed"] / (tied_diagonal + damping)
    return out


def tied(cap):
    """The tied table's diagonal block: the lookup's diagonal plus the head's ``diag(A) kron
    diag(G)`` (the head reads the table transposed: its ``(in, out)`` matrix is ``E.T``)."""
    head = jax.tree.map(np.asarray, cap["embed#1"].kflr)
    diag = lambda f: f if f.ndim == 1 else np.diagonal(f)
    return np.asarray(cap["embed"].kflr.diagonal["embed"]) + np.outer(diag(head.A), diag(head.G)).T


@pytest.mark.parametrize("solver", ["inverse", "eigh"])
def test_optimizer_preconditions_every_leaf_as_numpy_kfac(solver):
    """Two K-FAC steps (EMA, refresh, precondition) on the model mixing Kronecker blocks (with a
    diagonal side past ``max_factor_dim``) and diagonal blocks equal a float64 NumPy reference;
    no leaf is left to SGD (warnings are errors)."""
    params, x, y = problem()
    damping, decay, lr = 1e-2, 0.5, 0.1
    spec = vk.curvature.stats("*", ["kflr"], max_factor_dim=6)
    step = jax.jit(vk.value_and_grad(loss, capture=spec))
    like = jax.eval_shape(step, params, x, y)[1]
    opt = vk.curvature.kfac(lr, like=like, estimator="kflr", damping=damping, decay=decay, solver=solver)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = opt.init(params)
        update = jax.jit(lambda g, s, c: opt.update(g, s, params, curvature=c))
        (_, g1), c1 = step(params, x, y)
        u1, state = update(g1, state, c1)
        params2, x2, y2 = problem(1)  # another batch, other statistics: the EMA
        (_, g2), c2 = step(params2, x2, y2)
        u2, state = update(g2, state, c2)
    ema = jax.tree.map(lambda a, b: decay * np.asarray(a) + (1 - decay) * np.asarray(b), c1, c2)
    tied_ema = decay * tied(c1) + (1 - decay) * tied(c2)  # a block averages its own statistics
    for got, grads, cap, diag in ((u1, g1, c1, tied(c1)), (u2, g2, ema, tied_ema)):
        if solver == "eigh":  # the exactly damped Kronecker product: pi = 1 and no factored damping
            continue
        want = jax.tree.map(lambda d: -lr * d, _numpy_direction(grads, cap, diag, damping))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-14), got, want)
    if solver == "eigh":
        for got, grads, cap in ((u1, g1, c1), (u2, g2, ema)):
            s = jax.tree.map(np.asarray, cap["blocks/fc"].kflr)
            for i in range(L):
                m = np.vstack(
                    [
                        np.asarray(grads["blocks"]["fc"]["w"][i]),
                        np.asarray(grads["blocks"]["fc"]["b"][i])[None],
                    ]
                )
                full = np.kron(s.A[i], np.diag(s.G[i])) + damping * np.eye(m.size)
                want = -lr * np.linalg.solve(full, m.reshape(-1)).reshape(m.shape)
                np.testing.assert_allclose(got["blocks"]["fc"]["w"][i], want[:-1], rtol=1e-8, atol=1e-14)
    for leaf, grad in zip(jax.tree.leaves(u1), jax.tree.leaves(g1), strict=True):  # none is SGD
        assert not np.allclose(
            np.asarray(leaf) / np.linalg.norm(leaf), -np.asarray(grad) / np.linalg.norm(grad)
        )


def test_update_before_statistics_is_an_error_with_diagonal_blocks():
    params, x, y = problem()
    step = vk.value_and_grad(loss, capture=vk.curvature.stats("*", ["kflr"]))
    like = jax.eval_shape(step, params, x, y)[1]
    opt = vk.curvature.kfac(0.1, like=like, estimator="kflr")
    state = opt.init(params)
    with pytest.raises(vk.ConfigError, match="first update"):
        opt.update(jax.tree.map(jnp.ones_like, params), state, params)
    jitted = jax.jit(lambda s: opt.update(jax.tree.map(jnp.ones_like, params), s, params)[0])(state)
    assert all(np.isnan(np.asarray(u)).all() for u in jax.tree.leaves(jitted))  # never a silent step


# --- the GPT-2-shaped LM of benchmarks/real_models_bench.py -----------------------------------


def _gpt2(size):
    root = Path(__file__).resolve().parents[1]
    for sub in ("benchmarks", "examples"):
        if str(root / sub) not in sys.path:
            sys.path.append(str(root / sub))
    import real_models_bench as rb

    c = dict(rb.SIZES["gpt2"] if size == "full" else rb.QUICK_SIZES["gpt2"])
    _, _, params, (x, y) = rb.gpt2(c)

    def lm_loss(p, x, y):
        return vk.curvature.softmax_cross_entropy(rb.gpt2_apply(p, x, c["heads"]), y)

    return lm_loss, params, x, y


def test_gpt2_shaped_lm_kfac_preconditions_every_leaf_and_lowers_the_loss():
    with jax.enable_x64(False):
        lm_loss, params, x, y = _gpt2("quick")
        step = jax.jit(vk.value_and_grad(lm_loss, capture=vk.curvature.stats("*", ["kfac"])))
        key = jax.random.key(0)
        like = jax.eval_shape(step, params, x, y, key=key)[1]
        opt = vk.curvature.kfac(0.05, like=like, damping=1e-2, momentum=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no SGD warning: every leaf has a block
            state = opt.init(params)
            update = jax.jit(lambda g, s, c, p: opt.update(g, s, p, curvature=c))
            losses = []
            for i in range(8):
                (value, grads), cap = step(params, x, y, key=jax.random.fold_in(key, i))
                updates, state = update(grads, state, cap, params)
                params = optax.apply_updates(params, updates)
                losses.append(float(value))
        assert all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
        assert set(state.factors) == set(cap) - {"embed#1"}  # the tied table: one (diagonal) block


@pytest.mark.slow
def test_gpt2_shaped_lm_full_size_statistics_fit_in_memory():
    """The 50,257-token LM: ``stats("*", ["kfac"])`` compiles with < 4 GiB of XLA temp memory
    (the head's ``G`` is its diagonal past ``max_factor_dim``)."""
    with jax.enable_x64(False):
        lm_loss, params, x, y = _gpt2("full")
        step = jax.jit(vk.value_and_grad(lm_loss, capture=vk.curvature.stats("*", ["kfac"])))
        key = jax.random.key(0)
        compiled = step.lower(params, x, y, key=key).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < 4 * 2**30
        like = jax.eval_shape(step, params, x, y, key=key)[1]
        assert like["embed#1"].kfac.G.shape == (50257,)


# --- leaves no layer reads: a diagonal block from the Monte-Carlo passes' gradients ----------


def tempered(p, x):  # a temperature and per-class log-gains: leaves read by no layer
    return model(p, x) / p["temp"] * jnp.exp(p["gain"])


def tempered_loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(tempered(p, x), y)


def tempered_problem(seed=0):
    params, x, y = problem(seed)
    return {**params, "temp": np.float64(1.3), "gain": 0.1 * np.arange(V) / V}, x, y


def test_unread_leaves_get_the_squared_gradient_of_each_monte_carlo_pass(maybe_jit):
    """``stats("*", ["kfac"])``: a leaf no layer reads gets ``Diagonal(sum_m (J^T s_m)^2)``, the
    Monte-Carlo passes' squared gradients (hand-chained here: the same seeds, ``jax.vjp`` of
    the logits), whose mean over keys is the brute-force GGN diagonal."""
    from vjpkit.curvature import _losses

    params, x, y = tempered_problem()
    key = jax.random.key(4)
    spec = vk.curvature.stats("*", ["kfac"], mc_samples=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, cap = maybe_jit(vk.grad(tempered_loss, capture=spec))(params, x, y, key=key)
    assert cap["temp"].layout.kind == "leaf" and cap["gain"].layout.leaves == (
        ("", (jax.tree_util.DictKey("gain"),)),
    )
    logits, pullback = jax.vjp(lambda p: tempered(p, x), params)
    onehot = jax.nn.one_hot(y, V, dtype=logits.dtype)  # the registered target, as the loss marks it
    seeds = _losses.sampled(_losses.Mark("softmax_cross_entropy", logits, onehot), key, 3)
    for leaf in ("temp", "gain"):
        want = sum(np.square(np.asarray(pullback(s)[0][leaf])) for s in seeds)
        np.testing.assert_allclose(cap[leaf].kfac.diagonal, want, rtol=1e-9, atol=1e-15)
    _, some = jax.jit(vk.grad(tempered_loss, capture=vk.curvature.stats("blocks/*", ["kfac"])))(
        params, x, y, key=key
    )
    assert "gain" not in some and "temp" not in some  # the glob chooses leaves as it chooses layers


@pytest.mark.slow
def test_unread_leaf_diagonal_has_the_ggn_diagonal_as_its_mean():
    params, x, y = tempered_problem()
    many = vk.curvature.stats("*", ["kfac"], mc_samples=4000)
    _, cap = jax.jit(vk.grad(tempered_loss, capture=many))(params, x, y, key=jax.random.key(4))
    exact = ggn_diagonal(lambda v, x: tempered({**params, "gain": v}, x), params["gain"], x)
    np.testing.assert_allclose(cap["gain"].kfac.diagonal, exact, rtol=0.1)


def test_kfac_preconditions_unread_leaves_by_their_diagonal():
    params, x, y = tempered_problem()
    damping, lr = 1e-2, 0.1
    step = jax.jit(vk.value_and_grad(tempered_loss, capture=vk.curvature.stats("*", ["kfac"])))
    like = jax.eval_shape(lambda *a: step(*a, key=jax.random.key(0)), params, x, y)[1]
    opt = vk.curvature.kfac(lr, like=like, damping=damping)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no leaf is left to SGD
        state = opt.init(params)
        (_, g), cap = step(params, x, y, key=jax.random.key(1))
        u, _ = jax.jit(lambda g, s, c: opt.update(g, s, params, curvature=c))(g, state, cap)
    for leaf in ("temp", "gain"):
        want = -lr * np.asarray(g[leaf]) / (np.asarray(cap[leaf].kfac.diagonal) + damping)
        np.testing.assert_allclose(u[leaf], want, rtol=1e-9, atol=1e-15)


PER_EXAMPLE = ["kflr", "kfac_empirical", "diag_ggn", "diag_ggn_mc", "sum_grad_squared", "batch_l2",
               "backpack_variance"]  # fmt: skip


def test_unread_leaves_answer_every_statistic_per_example(maybe_jit):
    """Every statistic but ``kfac`` / ``ekfac`` of a leaf no layer reads comes from its
    per-example gradients (masked pulls of the whole program), with a warning naming the leaves:
    ``jax.vmap(jax.grad)`` of each sequence's share of the mean loss for the first-order fields
    and ``kfac_empirical``; the brute-force GGN diagonal for ``diag_ggn`` and ``kflr``; for
    ``diag_ggn_mc``, the same Monte-Carlo seeds hand-chained, each masked to one example."""
    from vjpkit.curvature import _losses

    params, x, y = tempered_problem()
    key = jax.random.key(3)
    spec = vk.curvature.stats("*", PER_EXAMPLE, mc_samples=2)
    with pytest.warns(UserWarning, match="no layer reads the leaves") as seen:
        _, cap = maybe_jit(vk.grad(tempered_loss, capture=spec))(params, x, y, key=key)
    said = str(seen[0].message)
    assert "temp (kflr," in said and "used by div" in said and "gain (kflr," in said, said

    def share(p, xi, yi):
        return tempered_loss(p, xi[None], yi[None]) / N

    per = jax.vmap(jax.grad(share), in_axes=(None, 0, 0))(params, x, y)
    logits, pullback = jax.vjp(lambda p: tempered(p, x), params)
    onehot = jax.nn.one_hot(y, V, dtype=logits.dtype)
    seeds = _losses.sampled(_losses.Mark("softmax_cross_entropy", logits, onehot), key, 2)
    mask = np.eye(N)[:, :, None, None]  # (example, N, 1, 1)
    for leaf in ("temp", "gain"):
        e, g_i = cap[leaf], np.asarray(per[leaf])
        assert e.layout.kind == "leaf"
        sgs = np.sum(np.square(g_i), 0)
        np.testing.assert_allclose(e.sum_grad_squared, sgs, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(e.batch_l2, np.square(g_i).reshape(N, -1).sum(1), rtol=1e-9)
        np.testing.assert_allclose(e.kfac_empirical.diagonal, N * sgs, rtol=1e-9, atol=1e-15)
        var = sgs / N - np.square(g_i.sum(0) / N)
        np.testing.assert_allclose(e.backpack_variance, var, rtol=1e-9, atol=1e-15)
        exact = ggn_diagonal(lambda v, x, leaf=leaf: tempered({**params, leaf: v}, x), params[leaf], x)
        np.testing.assert_allclose(e.diag_ggn, exact, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(e.kflr.diagonal, exact, rtol=1e-9, atol=1e-15)
        mc = sum(np.square(np.asarray(pullback(s * m)[0][leaf])) for s in seeds for m in mask)
        np.testing.assert_allclose(e.diag_ggn_mc, mc, rtol=1e-9, atol=1e-15)


@pytest.mark.slow
def test_unread_leaf_entries_with_several_arguments_and_other_estimators():
    """Leaf entries are the first differentiated argument's (the params) only, so K-FAC still
    builds with ``argnums=(0, 1)``; with ``estimator="kflr"`` the leaf's entry is its exact
    GGN diagonal, a diagonal block (no leaf left to SGD)."""
    params, x, y = tempered_problem()
    xf = jnp.float64(0.9)  # a float second argument

    def loss2(p, s, y):
        return vk.curvature.softmax_cross_entropy(tempered(p, x) * jnp.exp(s), y)  # no layer reads s

    g = vk.value_and_grad(loss2, argnums=(0, 1), capture=vk.curvature.stats("*", ["kfac", "kflr"]))
    with pytest.warns(UserWarning, match="no layer reads the leaves"):
        like = jax.eval_shape(lambda *a: g(*a, key=jax.random.key(0)), params, xf, y)[1]
    assert {k for k, v in like.items() if v.layout.kind == "leaf"} == {"arg0/temp", "arg0/gain"}
    vk.curvature.kfac(0.1, like=like).init(params)
    damping = 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the statistics' warning (above)
        (_, (grads, _)), cap = g(params, xf, y, key=jax.random.key(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no leaf is left to SGD
        opt = vk.curvature.kfac(0.1, like=like, estimator="kflr", damping=damping)
        state = opt.init(params)
        u, _ = opt.update(grads, state, params, curvature=cap)
    want = -0.1 * grads["temp"] / (cap["arg0/temp"].kflr.diagonal + damping)
    np.testing.assert_allclose(u["temp"], want, rtol=1e-9)
