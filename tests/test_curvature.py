"""vk.curvature (issue 23) against references computed here from the definitions.

The statistics of ``vk.curvature.stats`` are compared with references that share no code with
vjpkit's own path, each written from its definition (``vjpkit/curvature/_types.py``):

* the exact GGN by brute force: ``jax.jacobian`` of the model over its raveled params and
  ``jax.hessian`` of each example's loss over its output (over ``N``), ``GGN = sum J^T H J``;
  ``diag_ggn`` is its diagonal, and on a one-layer model with one example ``kron(A, G)`` of
  ``kflr`` is the whole GGN (K-FAC is exact there);
* K-FAC factors from hand-chained ``jax.vjp`` pulls of the model's stages: ``A`` from the
  layer inputs of a plain forward (a convolution's patches unfolded here with NumPy slicing),
  ``G`` from the output cotangents of pulls seeded with the columns of a square root of each
  example's output Hessian (an ``eigh`` root, not vjpkit's), of the loss gradient
  (``kfac_empirical``) or, in expectation, of every label the model's distribution can sample
  (``kfac`` / ``diag_ggn_mc``: their mean and variance are exact sums over the outcomes, so the
  Monte-Carlo tolerance is six standard errors of the sample count);
* the first-order statistics from ``jax.vmap(jax.grad(l_n / N))``, with BackPACK's formulas.

The model sources and control-flow cases run jitted and eagerly (``jit_or_eager``: the eager
variants but the MLP's are marked slow, as an eager call compiles each of its small programs on
first use), the sweeps over losses jitted only; references and tight comparisons run in float64
under the suite's strict dtype promotion. A library bug found here is an
``xfail(strict=True)`` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.tree_util import DictKey

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

F64 = {"rtol": 1e-10, "atol": 1e-12}
F32 = {"rtol": 2e-5, "atol": 1e-6}
EXACT = ["kflr", "kfac_empirical", "diag_ggn", "sum_grad_squared", "batch_l2"]
ALL = [
    "kflr",
    "kfac",
    "kfac_empirical",
    "diag_ggn",
    "diag_ggn_mc",
    "sum_grad_squared",
    "batch_l2",
    "backpack_variance",
]


@contextlib.contextmanager
def x64():
    """float64, for the tight comparisons (strict promotion stays on, as conftest sets it)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def f64():
    with x64():
        yield


JIT = {"eager": lambda f: f, "jit": jax.jit}
SLOW = pytest.mark.slow  # still run by CI; the loss sweeps beyond the first, and the eager variants


@pytest.fixture(params=[pytest.param("eager", marks=SLOW), "jit"])
def jit_or_eager(request):
    """Like ``maybe_jit``, with the eager variant marked slow (an eager call compiles each of its
    small programs on first use: seconds on a shared CPU)."""
    return JIT[request.param]


def _normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    """float64 data (inside ``x64``) from NumPy's generator: no compile per shape."""
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float64)


# ----------------------------------------------------------------------------- models as stages
# A model is a list of stages ``(name, fn)``: ``fn(params[name], h)`` for a layer with params,
# ``fn(h)`` for a stage without (name ``None``). ``apply`` runs them; ``chain`` runs them with
# one ``jax.vjp`` per stage so that any output cotangent can be pulled back by hand.

Stages = list[tuple[str | None, Callable]]


def dense(q: dict, h: jax.Array) -> jax.Array:
    return h @ q["w"] + q["b"]


def conv_s2(q: dict, h: jax.Array) -> jax.Array:
    """NHWC / HWIO, stride 2, SAME."""
    y = lax.conv_general_dilated(h, q["w"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + q["b"]


def flatten(h: jax.Array) -> jax.Array:
    return h.reshape(h.shape[0], -1)


def apply(stages: Stages, p: dict, x: jax.Array) -> jax.Array:
    h = x
    for name, fn in stages:
        h = fn(p[name], h) if name else fn(h)
    return h


def chain(stages: Stages, p: dict, x: jax.Array):
    """The output, each layer's input, and ``pull(seed) -> {name: grad_output}`` (hand-chained vjps)."""
    inputs, pulls, h = {}, [], x
    for name, fn in stages:
        if name:
            inputs[name] = h
            h, pull = jax.vjp(lambda h, fn=fn, q=p[name]: fn(q, h), h)
        else:
            h, pull = jax.vjp(fn, h)
        pulls.append((name, pull))

    def pull_back(seed):
        out, g = {}, seed
        for i, (name, pull) in reversed(list(enumerate(pulls))):
            if name:
                out[name] = g
            if i:  # not into the model input (integer ids have no cotangent)
                (g,) = pull(g)
        return out

    return h, inputs, pull_back


MLP: Stages = [("fc1", dense), (None, jnp.tanh), ("fc2", dense), (None, jnp.tanh), ("fc3", dense)]


def mlp_params(rng, sizes=(3, 5, 4, 4)) -> dict:
    return {
        f"fc{i + 1}": {"w": _normal(rng, m, n, scale=0.7), "b": _normal(rng, n, scale=0.3)}
        for i, (m, n) in enumerate(itertools.pairwise(sizes))
    }


CNN: Stages = [("conv", conv_s2), (None, jnp.tanh), (None, flatten), ("fc", dense)]


def cnn_params(rng, c_in=2, c_out=3, hw=5, classes=3) -> dict:
    flat = math.ceil(hw / 2) ** 2 * c_out
    return {
        "conv": {"w": _normal(rng, 3, 3, c_in, c_out, scale=0.4), "b": _normal(rng, c_out, scale=0.3)},
        "fc": {"w": _normal(rng, flat, classes, scale=0.4), "b": _normal(rng, classes, scale=0.3)},
    }


# ----------------------------------------------------------------------------- losses
# Each registered loss against its own per-example loss ``l_n`` (the loss is their mean).

PER_EXAMPLE = {
    "ce_int": lambda o, t: -jax.nn.log_softmax(o)[t],
    "ce_onehot": lambda o, t: -jnp.sum(t * jax.nn.log_softmax(o)),
    "mse": lambda o, t: jnp.mean((o - t) ** 2),
    "bce": lambda o, t: jnp.mean(jnp.logaddexp(0.0, o) - t * o),
}
REGISTERED = {
    "ce_int": vk.curvature.softmax_cross_entropy,
    "ce_onehot": vk.curvature.softmax_cross_entropy,
    "mse": vk.curvature.mse,
    "bce": vk.curvature.sigmoid_binary_cross_entropy,
}


def targets(kind: str, rng, n: int, c: int) -> jax.Array:
    if kind == "ce_int":
        return jnp.asarray(rng.integers(0, c, n), jnp.int32)
    if kind == "ce_onehot":
        return jax.nn.one_hot(jnp.asarray(rng.integers(0, c, n)), c, dtype=jnp.float64)
    if kind == "mse":
        return _normal(rng, n, c)
    return jnp.asarray(rng.uniform(size=(n, c)), jnp.float64)  # bce: probabilities in [0, 1]


def loss_fn(stages: Stages, kind: str) -> Callable:
    return lambda p, x, y: REGISTERED[kind](apply(stages, p, x), y)


def reference_loss(stages: Stages, kind: str) -> Callable:
    def loss(p, x, y):
        return jnp.mean(jax.vmap(PER_EXAMPLE[kind])(apply(stages, p, x), y))

    return loss


# ----------------------------------------------------------------------------- references


def output_hessians(kind: str, out: jax.Array, y: jax.Array) -> jax.Array:
    """Each example's ``d^2 (l_n / N) / d out_n^2``, ``(N, d, d)``."""
    n = out.shape[0]
    h = jax.vmap(jax.hessian(PER_EXAMPLE[kind]))(out, y) / n
    d = math.prod(out.shape[1:])
    return h.reshape(n, d, d)


def brute_ggn(stages: Stages, kind: str, p: Any, x, y) -> tuple[jax.Array, Callable]:
    """The exact GGN over ``ravel_pytree(p)`` and the unravel function."""
    flat, unravel = ravel_pytree(p)
    out = apply(stages, p, x)
    n = out.shape[0]
    jac = jax.jacobian(lambda f: apply(stages, unravel(f), x))(flat).reshape(n, -1, flat.size)
    hess = output_hessians(kind, out, y)
    return jnp.einsum("nap,nab,nbq->pq", jac, hess, jac), unravel


def sqrt_seeds(kind: str, out: jax.Array, y: jax.Array) -> jax.Array:
    """``(d, *out.shape)``: seed ``k`` holds column ``k`` of an eigh square root of each example's
    output Hessian, so that ``sum_k s_k s_k^T`` is that Hessian for every example."""
    lam, vec = jnp.linalg.eigh(output_hessians(kind, out, y))
    roots = vec * jnp.sqrt(jnp.clip(lam, 0.0, None))[:, None, :]  # (N, d, k): columns
    return jnp.moveaxis(roots, -1, 0).reshape(-1, *out.shape)


def unfold(x: np.ndarray, kh: int, kw: int, stride: int) -> np.ndarray:
    """SAME-padded NHWC patches ``(N, Ho, Wo, kh*kw*c)``, features ordered ``(kh, kw, c)``."""
    n, hh, ww, c = x.shape
    pads = []
    for size, k in ((hh, kh), (ww, kw)):
        total = max((math.ceil(size / stride) - 1) * stride + k - size, 0)
        pads.append((total // 2, total - total // 2))
    xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    ho, wo = math.ceil(hh / stride), math.ceil(ww / stride)
    out = np.zeros((n, ho, wo, kh * kw * c))
    for i in range(ho):
        for j in range(wo):
            out[:, i, j] = xp[:, i * stride : i * stride + kh, j * stride : j * stride + kw].reshape(n, -1)
    return out


def weight(q: dict) -> jax.Array:
    return q["w"] if "w" in q else q["weight"]


def layer_rows(name: str, p: dict, h: jax.Array) -> np.ndarray:
    """The rows ``a`` of a layer's input: a dense input's positions, a convolution's patches."""
    h = np.asarray(h)
    w = weight(p[name])
    if w.ndim == 4:
        return unfold(h, w.shape[0], w.shape[1], 2).reshape(-1, w.shape[0] * w.shape[1] * w.shape[2])
    return h.reshape(-1, w.shape[0])


def a_factor(rows: np.ndarray, n: int, conv: bool = False) -> np.ndarray:
    """``(1/N) sum_rows [a, c][a, c]^T``: ``c = 1``, or ``1/sqrt(T)`` for a convolution's ``T``
    patches per example (BackPACK's convention: the bias entry is 1)."""
    c = 1 / np.sqrt(rows.shape[0] // n) if conv else 1.0
    rows = np.concatenate([rows, np.full((rows.shape[0], 1), c)], axis=1)
    return rows.T @ rows / n


def g_factor(grad_outputs: list[jax.Array], conv: bool = False) -> np.ndarray:
    """``sum_seeds sum_rows g g^T``; for a convolution (BackPACK's convention) each example's
    cotangents are summed over the output positions first."""
    total = 0.0
    for g in grad_outputs:
        g = np.asarray(g)
        g = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1) if conv else g.reshape(-1, g.shape[-1])
        total = total + g.T @ g
    return total


@functools.cache
def _reference_arrays(stages: tuple, kind: str) -> Callable:
    """The JAX side of ``references``, jitted once per model and loss."""

    def arrays(p, x, y):
        out, inputs, pull = chain(stages, p, x)
        n = out.shape[0]
        exact = jax.vmap(pull)(sqrt_seeds(kind, out, y))  # one pull per seed, stacked
        d_out = jax.grad(lambda o: jnp.mean(jax.vmap(PER_EXAMPLE[kind])(o, y)))(out)
        ggn, unravel = brute_ggn(stages, kind, p, x, y)

        def one(xn, yn):
            return jax.grad(lambda q: PER_EXAMPLE[kind](apply(stages, q, xn[None])[0], yn) / n)(p)

        per = jax.vmap(one)(x, y)  # gradients of l_n / N, stacked
        return inputs, exact, pull(d_out), unravel(jnp.diag(ggn)), per

    return jax.jit(arrays)


def references(stages: Stages, kind: str, p: dict, x, y, local=()) -> dict[str, dict[str, Any]]:
    """Per layer: ``A``, ``G`` of kflr, ``G`` of kfac_empirical (not for the ``local`` layers, which
    have no matrix form), and the param-shaped ``diag_ggn``, ``sum_grad_squared``, ``batch_l2``,
    ``variance`` (BackPACK's)."""
    inputs, exact, emp, diag, per = _reference_arrays(tuple(stages), kind)(p, x, y)
    n = x.shape[0]
    per = jax.tree.map(np.asarray, per)
    sgs = jax.tree.map(lambda g: np.sum(g**2, axis=0), per)
    l2 = jax.tree.map(lambda g: np.sum(g.reshape(n, -1) ** 2, axis=1), per)
    # BackPACK's Variance (backpack/extensions/firstorder/variance/variance_base.py):
    # sgs / N - (grad / N)^2, the variance over the examples of the rows g_n = grad(l_n) / N
    var = jax.tree.map(lambda g: np.sum(g**2, axis=0) / n - (np.sum(g, axis=0) / n) ** 2, per)
    refs = {}
    for name in inputs:
        refs[name] = {}
        if name not in local:
            conv = weight(p[name]).ndim == 4
            refs[name]["A"] = a_factor(layer_rows(name, p, inputs[name]), n, conv)
            refs[name]["G"] = g_factor(list(exact[name]), conv)
            refs[name]["G_emp"] = n * g_factor([emp[name]], conv)
        refs[name] |= {
            "diag_ggn": jax.tree.map(np.asarray, diag[name]),
            "sum_grad_squared": sgs[name],
            "batch_l2": l2[name],
            "backpack_variance": var[name],
        }
    return refs


def check_exact(captured: dict, refs: dict, tol: dict = F64, rename=lambda tree: tree) -> None:
    """The exact statistics of every layer against ``references`` (``rename`` maps a captured
    param tree to the reference's ``{"w", "b"}``)."""
    assert set(captured) == set(refs), (sorted(captured), sorted(refs))
    for name, ref in refs.items():
        cur = captured[name]
        assert isinstance(cur, vk.curvature.LayerCurvature)
        if "A" in ref:
            assert isinstance(cur.kflr, vk.curvature.Factors)
            tree_allclose(np.asarray(cur.kflr.A), ref["A"], **tol)
            tree_allclose(np.asarray(cur.kflr.G), ref["G"], **tol)
            tree_allclose(np.asarray(cur.kfac_empirical.A), ref["A"], **tol)
            tree_allclose(np.asarray(cur.kfac_empirical.G), ref["G_emp"], **tol)
        else:
            assert cur.kflr is None and cur.kfac_empirical is None
        for stat in ("diag_ggn", "sum_grad_squared", "batch_l2"):
            tree_allclose(rename(getattr(cur, stat)), ref[stat], **tol)


# ----------------------------------------------------------------------------- exact statistics


@pytest.mark.parametrize(
    "kind, mode",
    [
        ("ce_int", "eager"),
        ("ce_int", "jit"),
        pytest.param("ce_onehot", "jit", marks=SLOW),
        pytest.param("mse", "jit", marks=SLOW),
        pytest.param("bce", "jit", marks=SLOW),
    ],
)
def test_mlp_statistics_equal_brute_force_references(kind, mode, f64):
    rng = np.random.default_rng(0)
    p = mlp_params(rng)
    x = _normal(rng, 6, 3)
    y = targets(kind, rng, 6, 4)
    spec = vk.curvature.stats("*", EXACT)
    (loss, grads), captured = JIT[mode](vk.value_and_grad(loss_fn(MLP, kind), capture=spec))(p, x, y)
    want_loss, want_grads = jax.value_and_grad(reference_loss(MLP, kind))(p, x, y)
    tree_allclose(loss, want_loss, **F64)
    tree_allclose(grads, want_grads, **F64)
    refs = references(MLP, kind, p, x, y)
    check_exact(captured, refs)
    for name in refs:
        assert captured[name].kfac is None and captured[name].diag_ggn_mc is None  # not asked for


@pytest.mark.parametrize(
    "kind, mode",
    [pytest.param("ce_int", "eager", marks=SLOW), ("ce_int", "jit"), pytest.param("mse", "jit", marks=SLOW)],
)
def test_conv_statistics_equal_brute_force_references(kind, mode, f64):
    """A stride-2 SAME convolution (``lax.conv_general_dilated``, NHWC / HWIO): ``A`` over the
    patches unfolded here, ordered ``(kh, kw, c_in)``."""
    rng = np.random.default_rng(1)
    p = cnn_params(rng)
    x = _normal(rng, 3, 5, 5, 2)
    y = targets(kind, rng, 3, 3)
    # the unfolding reference reproduces the convolution it stands for
    rows = unfold(np.asarray(x), 3, 3, 2)
    conv = np.asarray(conv_s2(p["conv"], x))
    np.testing.assert_allclose(rows @ np.asarray(p["conv"]["w"]).reshape(-1, 3) + p["conv"]["b"], conv)
    spec = vk.curvature.stats("*", EXACT)
    (loss, grads), captured = JIT[mode](vk.value_and_grad(loss_fn(CNN, kind), capture=spec))(p, x, y)
    tree_allclose(grads, jax.grad(reference_loss(CNN, kind))(p, x, y), **F64)
    check_exact(captured, references(CNN, kind, p, x, y))
    assert captured["conv"].layout.kind == "conv"
    assert captured["conv"].layout.strides == (2, 2)


def embed(q: dict, ids: jax.Array) -> jax.Array:
    return q["table"][ids]


def layer_norm(q: dict, h: jax.Array) -> jax.Array:
    m = jnp.mean(h, -1, keepdims=True)
    v = jnp.mean((h - m) ** 2, -1, keepdims=True)
    return (h - m) / jnp.sqrt(v + 1e-5) * q["scale"] + q["bias"]


LOCAL: Stages = [("emb", embed), ("ln", layer_norm), (None, jnp.tanh), ("fc", dense)]


@pytest.mark.parametrize(
    "source",
    ["plain", "nn"],
)
def test_embedding_and_layer_norm_diagonal_and_first_order(source, jit_or_eager, f64):
    """Layers without a matrix form (an embedding lookup, a layer norm's affine) get the
    diagonal GGN and the first-order statistics, the dense head its factors too (two specs)."""
    rng = np.random.default_rng(20)
    ids = jnp.asarray([0, 3, 1, 6, 3], jnp.int32)
    y = targets("ce_int", rng, 5, 3)
    if source == "plain":
        stages = LOCAL
        loss = loss_fn(LOCAL, "ce_int")
        p = {
            "emb": {"table": _normal(rng, 7, 4)},
            "ln": {"scale": 1 + _normal(rng, 4, scale=0.3), "bias": _normal(rng, 4, scale=0.3)},
            "fc": {"w": _normal(rng, 4, 3), "b": _normal(rng, 3)},
        }
    else:
        layers = {"emb": nn.embedding(7, 4, dtype=jnp.float64), "ln": nn.layer_norm(), "fc": nn.dense(3)}
        model = nn.serial(emb=layers["emb"], ln=layers["ln"], act=nn.tanh(), fc=layers["fc"])
        p = jax.tree.map(lambda a: a + _normal(rng, *a.shape, scale=0.3), model.init(jax.random.key(0), ids))
        # the reference runs each layer's own apply outside any vjpkit transform: plain JAX there
        stages = [(k, layers[k].apply) for k in ("emb", "ln")] + [
            (None, jnp.tanh),
            ("fc", layers["fc"].apply),
        ]
        tree_allclose(apply(stages, p, ids), model.apply(p, ids), **F64)
        loss = lambda p, ids, y: vk.curvature.softmax_cross_entropy(model.apply(p, ids), y)
    spec = [
        vk.curvature.stats("fc", EXACT),
        vk.curvature.stats(["emb*", "ln"], ["diag_ggn", "sum_grad_squared", "batch_l2"]),
    ]
    (value, grads), captured = jit_or_eager(vk.value_and_grad(loss, capture=spec))(p, ids, y)
    tree_allclose(grads, jax.grad(reference_loss(stages, "ce_int"))(p, ids, y), **F64)
    assert captured["ln"].layout.kind == "local"
    check_exact(captured, references(stages, "ce_int", p, ids, y, local=("emb", "ln")))


@pytest.mark.parametrize("kind", ["ce_int", pytest.param("mse", marks=SLOW), pytest.param("bce", marks=SLOW)])
def test_kflr_is_the_exact_ggn_of_one_dense_layer_on_one_example(kind, f64):
    """Logistic / linear regression on one example: ``kron(A, G)`` is the whole GGN of
    ``vec([W; b])`` (``W`` as ``(in, out)``, row-major), built here by brute force."""
    rng = np.random.default_rng(2)
    n_in, n_out = 4, 3
    p = {"fc": {"w": _normal(rng, n_in, n_out), "b": _normal(rng, n_out)}}
    x = _normal(rng, 1, n_in)
    y = targets(kind, rng, 1, n_out)
    spec = vk.curvature.stats("fc", "kflr")
    _, captured = jax.jit(vk.grad(loss_fn([("fc", dense)], kind), capture=spec))(p, x, y)
    A, G = captured["fc"].kflr

    def model(theta):
        m = theta.reshape(n_in + 1, n_out)
        return x @ m[:-1] + m[-1]

    theta = jnp.concatenate([p["fc"]["w"], p["fc"]["b"][None]]).reshape(-1)
    jac = jax.jacobian(model)(theta)[0]  # (out, P)
    hess = jax.hessian(lambda o: PER_EXAMPLE[kind](o, y[0]))(model(theta)[0])
    tree_allclose(np.kron(np.asarray(A), np.asarray(G)), np.asarray(jac.T @ hess @ jac), **F64)


def test_float64_inputs_under_strict_promotion():
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        p = {"fc": {"w": jnp.ones((3, 2), jnp.float64), "b": jnp.zeros(2, jnp.float64)}}
        x, y = jnp.ones((4, 3), jnp.float64), jnp.zeros(4, jnp.int32)
        _, captured = jax.jit(vk.grad(loss_fn([("fc", dense)], "ce_int"), capture=vk.curvature.stats()))(
            p, x, y
        )
        assert captured["fc"].kflr.A.dtype == jnp.float64


def test_float32_statistics_are_float32_and_close_to_float64():
    rng = np.random.default_rng(3)
    with x64():
        p64, x64_, y = mlp_params(rng), _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)
        refs = references(MLP, "ce_int", p64, x64_, y)
    p, x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (p64, x64_))
    _, captured = jax.jit(vk.grad(loss_fn(MLP, "ce_int"), capture=vk.curvature.stats("*", EXACT)))(p, x, y)
    f32 = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float32), tree)
    for name, ref in refs.items():
        assert captured[name].kflr.A.dtype == jnp.float32
        tree_allclose(captured[name].kflr, vk.curvature.Factors(*f32((ref["A"], ref["G"]))), **F32)
        tree_allclose(captured[name].diag_ggn, f32(ref["diag_ggn"]), **F32)


def test_variance_is_backpacks(f64):
    rng = np.random.default_rng(4)
    p, x, y = mlp_params(rng), _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)
    _, captured = jax.jit(
        vk.grad(loss_fn(MLP, "ce_int"), capture=vk.curvature.stats("*", "backpack_variance"))
    )(p, x, y)
    refs = references(MLP, "ce_int", p, x, y)
    for name, ref in refs.items():
        tree_allclose(captured[name].backpack_variance, ref["backpack_variance"], **F64)


def test_the_old_name_variance_says_which_variance():
    """Two meanings, two names: curvature's is BackPACK's (of grad l_n / N), inspect's of grad l_n."""
    with pytest.raises(vk.ConfigError, match=r"'variance' is now 'backpack_variance'.*N\^2 times larger"):
        vk.curvature.stats("*", "variance")


# ----------------------------------------------------------------------------- Monte-Carlo


def outcomes(kind: str, out_n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every label a model output can sample, with its probability, and the seed it gives (before
    the ``1/sqrt(N M)``): ``(K,)`` probabilities and ``(K, d)`` seeds for one example."""
    if kind == "ce_int":
        prob = jax.nn.softmax(out_n)
        return prob, prob[None] - jnp.eye(out_n.shape[0], dtype=out_n.dtype)
    assert kind == "bce"  # every y in {0, 1}^d
    s = jax.nn.sigmoid(out_n)
    d = out_n.shape[0]
    ys = jnp.asarray([[(k >> i) & 1 for i in range(d)] for k in range(2**d)], out_n.dtype)
    prob = jnp.prod(jnp.where(ys == 1, s, 1 - s), axis=1)
    return prob, (s[None] - ys) / jnp.sqrt(jnp.asarray(d, out_n.dtype))


def mc_mean_and_var(stages: Stages, kind: str, p: dict, x, y):
    """``_mc_mean_and_var``, jitted once per model and loss."""
    return _mc_jit(tuple(stages), kind)(p, x, y)


@functools.cache
def _mc_jit(stages: tuple, kind: str) -> Callable:
    return jax.jit(functools.partial(_mc_mean_and_var, stages, kind))


def _mc_mean_and_var(stages: Stages, kind: str, p: dict, x, y):
    """The exact mean and variance of one Monte-Carlo sample of ``diag_ggn_mc`` (param-shaped)
    and of the ``G`` of ``kfac`` (per layer), by summing over every outcome of every example."""
    out, _, pull = chain(stages, p, x)
    n = out.shape[0]
    if kind == "mse":  # seeds z sqrt(2 / (N d)), z ~ N(0, I): (u.z)^2 has mean |u|^2, variance 2|u|^4
        flat, unravel = ravel_pytree(p)
        jac = jax.jacobian(lambda f: apply(stages, unravel(f), x))(flat).reshape(n, -1, flat.size)
        c = 2.0 / (n * jac.shape[1])
        sq = jnp.sum(jac**2, axis=1)  # (N, P): |u_n|^2 per parameter
        return unravel(c * sq.sum(0)), unravel(2 * c**2 * jnp.sum(sq**2, axis=0)), None
    prob, seeds = jax.vmap(lambda o: outcomes(kind, o))(out)  # (N, K), (N, K, d)
    seeds = seeds / jnp.sqrt(jnp.asarray(n, out.dtype))
    rows = jnp.arange(n)

    def grad_of(xn, s):  # the parameter gradient a seed gives one example
        return jax.vjp(lambda q: apply(stages, q, xn[None])[0], p)[1](s)[0]

    v = jax.vmap(lambda xn, sn: jax.vmap(lambda s: grad_of(xn, s))(sn))(x, seeds)  # leaves (N, K, ...)

    def moments(t):  # t (N, K, ...): one sample's value is sum_n t[n, k_n] with k_n ~ prob[n]
        w = prob.reshape(*prob.shape, *(1,) * (t.ndim - 2))
        m1 = jnp.sum(w * t, axis=1)
        return m1.sum(0), jnp.sum(jnp.sum(w * t**2, axis=1) - m1**2, axis=0)

    diag = jax.tree.map(lambda g: moments(g**2), v)
    mean_d = jax.tree.map(lambda m: m[0], diag, is_leaf=lambda t: isinstance(t, tuple))
    var_d = jax.tree.map(lambda m: m[1], diag, is_leaf=lambda t: isinstance(t, tuple))
    # K-FAC G: the seed of outcome k on every example at once (the examples do not interact)
    per_k = [pull(seeds[rows, k]) for k in range(seeds.shape[1])]
    g_moments = {}
    for name in per_k[0]:
        g = jnp.stack([pk[name] for pk in per_k], axis=1)  # (N, K, out)
        g_moments[name] = moments(g[..., :, None] * g[..., None, :])
    return mean_d, var_d, g_moments


@pytest.mark.parametrize("kind", ["ce_int", pytest.param("bce", marks=SLOW), pytest.param("mse", marks=SLOW)])
def test_monte_carlo_statistics_converge_to_the_exact_ggn(kind, f64):
    """With ``M`` samples, each entry is within 6 standard errors ``sqrt(Var / M)`` of its exact
    expectation, which is the exact GGN's (checked here too), with ``Var`` one sample's exact
    variance. ``A`` is the exact one."""
    rng = np.random.default_rng(5)
    m = 4000
    stages = MLP
    p = mlp_params(rng, sizes=(3, 4, 4, 3 if kind == "ce_int" else 2))
    x = _normal(rng, 5, 3)
    y = targets(kind, rng, 5, 3 if kind == "ce_int" else 2)
    spec = vk.curvature.stats("*", ["kflr", "kfac", "diag_ggn", "diag_ggn_mc"], mc_samples=m)
    _, captured = jax.jit(vk.grad(loss_fn(stages, kind), capture=spec))(p, x, y, key=jax.random.key(3))
    refs = references(stages, kind, p, x, y)
    mean_d, var_d, g_moments = mc_mean_and_var(stages, kind, p, x, y)
    for name, ref in refs.items():
        cur = captured[name]
        tree_allclose(mean_d[name], ref["diag_ggn"], **F64)  # the sampler's expectation is the GGN
        tree_allclose(cur.kfac.A, cur.kflr.A, **F64)
        err = jax.tree.map(
            lambda got, mu, var: np.abs(got - mu) - 6 * np.sqrt(var / m) - 1e-12,
            cur.diag_ggn_mc,
            mean_d[name],
            var_d[name],
        )
        assert all(np.all(e <= 0) for e in jax.tree.leaves(err)), (name, err)
        if g_moments is not None:
            mu, var = g_moments[name]
            tree_allclose(mu, ref["G"], **F64)
            assert np.all(np.abs(cur.kfac.G - mu) <= 6 * np.sqrt(var / m) + 1e-12), name
        # and far enough from the exact value that the samples are really random
        assert not np.allclose(cur.diag_ggn_mc["w"], ref["diag_ggn"]["w"], rtol=1e-6, atol=0)


@SLOW
def test_monte_carlo_key_reproducible_jitted_and_eager(f64):
    rng = np.random.default_rng(6)
    p, x, y = mlp_params(rng), _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)
    spec = vk.curvature.stats("*", ["kfac", "diag_ggn_mc"], mc_samples=3)
    f = vk.grad(loss_fn(MLP, "ce_int"), capture=spec)
    key = jax.random.key(7)
    _, eager = f(p, x, y, key=key)
    _, jitted = jax.jit(f)(p, x, y, key=key)
    _, again = jax.jit(f)(p, x, y, key=key)
    _, other = jax.jit(f)(p, x, y, key=jax.random.key(8))
    for name in eager:
        tree_allclose(jitted[name].kfac, eager[name].kfac, rtol=1e-6, atol=1e-12)
        tree_allclose(jitted[name].diag_ggn_mc, eager[name].diag_ggn_mc, rtol=1e-6, atol=1e-12)
        tree_allclose(again[name].kfac, jitted[name].kfac, rtol=0, atol=0)
        assert not np.allclose(other[name].kfac.G, jitted[name].kfac.G)
        assert not np.allclose(other[name].diag_ggn_mc["w"], jitted[name].diag_ggn_mc["w"])
        tree_allclose(other[name].kfac.A, jitted[name].kfac.A, rtol=0, atol=0)  # A is not sampled


@SLOW
def test_all_statistics_at_once_and_the_loss_value(f64):
    """Every statistic in one spec: each equals its own single-statistic run, and the value and
    gradient equal ``jax.value_and_grad``; ``vk.grad`` returns the gradient alone."""
    rng = np.random.default_rng(7)
    p, x, y = mlp_params(rng), _normal(rng, 6, 3), targets("ce_onehot", rng, 6, 4)
    key = jax.random.key(1)
    loss = loss_fn(MLP, "ce_onehot")
    (value, grads), captured = jax.jit(vk.value_and_grad(loss, capture=vk.curvature.stats("*", ALL)))(
        p, x, y, key=key
    )
    want_value, want_grads = jax.value_and_grad(reference_loss(MLP, "ce_onehot"))(p, x, y)
    tree_allclose(value, want_value, **F64)
    tree_allclose(grads, want_grads, **F64)
    g_only, cap_g = jax.jit(vk.grad(loss, capture=vk.curvature.stats("fc2", ALL)))(p, x, y, key=key)
    tree_allclose(g_only, want_grads, **F64)
    assert set(cap_g) == {"fc2"}
    for stat in ALL:
        _, one = jax.jit(vk.grad(loss, capture=vk.curvature.stats("fc*", stat)))(
            p, x, y, **({"key": key} if stat in ("kfac", "diag_ggn_mc") else {})
        )
        for name in captured:
            tree_allclose(getattr(one[name], stat), getattr(captured[name], stat), **F64)
        tree_allclose(getattr(cap_g["fc2"], stat), getattr(captured["fc2"], stat), **F64)
    check_exact({k: v for k, v in captured.items()}, references(MLP, "ce_onehot", p, x, y))


def test_has_aux_and_argnums(f64):
    """``has_aux`` passes the aux through; with ``argnums=(0, 1)`` each layout names the
    argument its leaves belong to and their key paths in it."""
    rng = np.random.default_rng(8)
    p = mlp_params(rng)
    head, body = {"fc3": p["fc3"]}, {"fc1": p["fc1"], "fc2": p["fc2"]}
    x, y = _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)

    def loss(body, head, x, y):
        out = apply(MLP, {**body, **head}, x)
        return vk.curvature.softmax_cross_entropy(out, y), out

    spec = vk.curvature.stats("*", ["kflr", "diag_ggn"])
    ((value, out), (g_body, g_head)), captured = jax.jit(
        vk.value_and_grad(loss, argnums=(0, 1), has_aux=True, capture=spec)
    )(body, head, x, y)
    tree_allclose(out, apply(MLP, p, x), **F64)
    want = jax.grad(reference_loss(MLP, "ce_int"))(p, x, y)
    tree_allclose((g_body, g_head), ({"fc1": want["fc1"], "fc2": want["fc2"]}, {"fc3": want["fc3"]}), **F64)
    assert set(captured) == {"arg0/fc1", "arg0/fc2", "arg1/fc3"}  # named per argument
    for name, argnum in (("fc1", 0), ("fc2", 0), ("fc3", 1)):
        layout = captured[f"arg{argnum}/{name}"].layout
        assert layout.argnum == argnum, (name, layout)
        assert layout.weight_leaf == (DictKey(name), DictKey("w"))
        assert layout.bias_leaf == (DictKey(name), DictKey("b"))
        assert (layout.kind, layout.weight, layout.bias, layout.transpose) == ("dense", "w", "b", False)
    refs = references(MLP, "ce_int", p, x, y)
    for name, argnum in (("fc1", 0), ("fc2", 0), ("fc3", 1)):
        tree_allclose(captured[f"arg{argnum}/{name}"].diag_ggn, refs[name]["diag_ggn"], **F64)


# ----------------------------------------------------------------------------- model sources


def test_vjpkit_nn_mlp_and_conv(jit_or_eager, f64):
    """``nn.dense`` and ``nn.conv2d`` (stride 2, SAME) against the references of the plain model
    with the same weights."""
    rng = np.random.default_rng(9)
    model = nn.serial(
        conv=nn.conv2d(3, 3, stride=2, padding="SAME"), act=nn.tanh(), flat=nn.flatten(), fc=nn.dense(3)
    )
    x = _normal(rng, 3, 5, 5, 2)
    y = targets("ce_int", rng, 3, 3)
    plain = cnn_params(rng)
    params = {k: {"weight": v["w"], "bias": v["b"]} for k, v in plain.items()}
    assert jax.tree.structure(params) == jax.tree.structure(model.init(jax.random.key(0), x))
    loss = lambda q, x, y: vk.curvature.softmax_cross_entropy(model.apply(q, x), y)
    (value, grads), captured = jit_or_eager(vk.value_and_grad(loss, capture=vk.curvature.stats("*", EXACT)))(
        params, x, y
    )
    tree_allclose(value, reference_loss(CNN, "ce_int")(plain, x, y), **F64)
    rename = lambda t: {"w": t["weight"], "b": t["bias"]}
    check_exact(captured, references(CNN, "ce_int", plain, x, y), rename=rename)
    assert captured["conv"].layout.weight_leaf == (DictKey("conv"), DictKey("weight"))


def test_flax_linen(jit_or_eager, f64):
    flax_nn = pytest.importorskip("flax.linen")

    class Model(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            h = jnp.tanh(flax_nn.Dense(5, name="fc1", param_dtype=jnp.float64)(x))
            h = jnp.tanh(flax_nn.Dense(4, name="fc2", param_dtype=jnp.float64)(h))
            return flax_nn.Dense(4, name="fc3", param_dtype=jnp.float64)(h)

    rng = np.random.default_rng(10)
    plain = mlp_params(rng)
    params = {k: {"kernel": v["w"], "bias": v["b"]} for k, v in plain.items()}
    x, y = _normal(rng, 6, 3), targets("mse", rng, 6, 4)
    model = Model()
    assert jax.tree.structure(params) == jax.tree.structure(model.init(jax.random.key(0), x)["params"])
    loss = lambda q, x, y: vk.curvature.mse(model.apply({"params": q}, x), y)
    _, captured = jit_or_eager(vk.grad(loss, capture=vk.curvature.stats("fc*", EXACT)))(params, x, y)
    rename = lambda t: {"w": t["kernel"], "b": t["bias"]}
    check_exact(captured, references(MLP, "mse", plain, x, y), rename=rename)


def test_equinox_linear_stores_out_in(jit_or_eager, f64):
    """``eqx.nn.Linear`` keeps ``weight (out, in)``: ``layout.transpose``; the factors are over the
    same input and output, the diagonal is laid out as the weight."""
    eqx = pytest.importorskip("equinox")
    rng = np.random.default_rng(11)
    plain = mlp_params(rng)

    class Model(eqx.Module):
        fc1: Any
        fc2: Any
        fc3: Any

        def __init__(self):
            for name, q in plain.items():
                lin = eqx.nn.Linear(*q["w"].shape, key=jax.random.key(0), dtype=jnp.float64)
                lin = eqx.tree_at(lambda m: (m.weight, m.bias), lin, (q["w"].T, q["b"]))
                setattr(self, name, lin)

        def __call__(self, x):
            return self.fc3(jnp.tanh(self.fc2(jnp.tanh(self.fc1(x)))))

    params, static = eqx.partition(vk.hookable(Model()), eqx.is_array)
    x, y = _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)
    loss = lambda q, x, y: vk.curvature.softmax_cross_entropy(jax.vmap(eqx.combine(q, static))(x), y)
    _, captured = jit_or_eager(vk.grad(loss, capture=vk.curvature.stats("fc*", EXACT)))(params, x, y)
    for name in plain:
        assert captured[name].layout.transpose is True
    check_exact(
        captured,
        references(MLP, "ce_int", plain, x, y),
        rename=lambda t: {"w": t.weight.T if t.weight.ndim == 2 else t.weight, "b": t.bias},
    )


def test_star_glob_on_a_flax_model(f64):
    flax_nn = pytest.importorskip("flax.linen")

    class Model(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            return flax_nn.Dense(2, name="fc")(jnp.tanh(flax_nn.Dense(3, name="hid")(x)))

    x = jnp.ones((2, 3), jnp.float32)
    params = Model().init(jax.random.key(0), x)["params"]
    loss = lambda q, x, y: vk.curvature.softmax_cross_entropy(Model().apply({"params": q}, x), y)
    _, captured = jax.jit(vk.grad(loss, capture=vk.curvature.stats("*", "kflr")))(
        params, x, jnp.zeros(2, jnp.int32)
    )
    assert set(captured) == {"hid", "fc"}


# ----------------------------------------------------------------------------- control flow

SCAN_DEPTH = 3


def scan_params(rng) -> dict:
    blocks = {"w": _normal(rng, SCAN_DEPTH, 4, 4, scale=0.6), "b": _normal(rng, SCAN_DEPTH, 4, scale=0.3)}
    return {
        "fc_in": {"w": _normal(rng, 3, 4), "b": _normal(rng, 4)},
        "blocks": blocks,
        "fc_out": {"w": _normal(rng, 4, 3), "b": _normal(rng, 3)},
    }


def scanned(p, x):
    h = jnp.tanh(dense(p["fc_in"], x))
    h, _ = lax.scan(lambda h, q: (jnp.tanh(dense(q, h)), None), h, p["blocks"])
    return dense(p["fc_out"], h)


def unrolled_params(p: dict) -> dict:
    out = {"fc_in": p["fc_in"], "fc_out": p["fc_out"]}
    for i in range(SCAN_DEPTH):
        out[f"blk{i}"] = jax.tree.map(lambda a, i=i: a[i], p["blocks"])
    return out


UNROLLED: Stages = [("fc_in", dense), (None, jnp.tanh)]
for _i in range(SCAN_DEPTH):
    UNROLLED += [(f"blk{_i}", dense), (None, jnp.tanh)]
UNROLLED += [("fc_out", dense)]


def test_scan_iterations_equal_the_unrolled_program(jit_or_eager, f64):
    rng = np.random.default_rng(12)
    p = scan_params(rng)
    x, y = _normal(rng, 5, 3), targets("ce_int", rng, 5, 3)
    key = jax.random.key(4)
    spec = vk.curvature.stats("*", ALL, mc_samples=2)
    loss = lambda p, x, y: vk.curvature.softmax_cross_entropy(scanned(p, x), y)
    (value, grads), captured = jit_or_eager(vk.value_and_grad(loss, capture=spec))(p, x, y, key=key)
    q = unrolled_params(p)
    tree_allclose(apply(UNROLLED, q, x), scanned(p, x), **F64)  # the same program
    want = jax.value_and_grad(lambda p: reference_loss(UNROLLED, "ce_int")(unrolled_params(p), x, y))
    want_value, want_grads = want(p)
    tree_allclose((value, grads), (want_value, want_grads), **F64)
    assert set(captured) == {"fc_in", "blocks", "fc_out"}
    refs = references(UNROLLED, "ce_int", q, x, y)
    stacked = {"blocks": captured["blocks"]}
    # per iteration, the exact statistics are the unrolled layer's
    per_iter = {f"blk{i}": jax.tree.map(lambda a, i=i: a[i], stacked["blocks"]) for i in range(SCAN_DEPTH)}
    check_exact({"fc_in": captured["fc_in"], "fc_out": captured["fc_out"], **per_iter}, refs)
    blocks = captured["blocks"]
    assert blocks.kflr.A.shape == (SCAN_DEPTH, 5, 5) and blocks.kflr.G.shape == (SCAN_DEPTH, 4, 4)
    assert blocks.batch_l2["w"].shape == (SCAN_DEPTH, 5)
    # the stacked leaves, given to the scan as xs: one slice (and one K-FAC block) per iteration
    assert blocks.layout.weight_leaf == (DictKey("blocks"), DictKey("w")) and blocks.layout.scans == "s"
    assert blocks.layout.bias_leaf == (DictKey("blocks"), DictKey("b"))
    assert captured["fc_in"].layout.weight_leaf == (DictKey("fc_in"), DictKey("w"))
    # the Monte-Carlo statistics and the variance: the unrolled program's, with the same key
    loss_u = lambda q, x, y: vk.curvature.softmax_cross_entropy(apply(UNROLLED, q, x), y)
    _, cap_u = jit_or_eager(vk.grad(loss_u, capture=spec))(q, x, y, key=key)
    for i in range(SCAN_DEPTH):
        for stat in ("kfac", "diag_ggn_mc", "backpack_variance"):
            tree_allclose(getattr(per_iter[f"blk{i}"], stat), getattr(cap_u[f"blk{i}"], stat), **F64)


def test_cond_takes_the_statistics_of_the_taken_branch(jit_or_eager, f64):
    """The taken branch's layer has the statistics of the program with that branch inlined; the
    other branch's call is NaN, as its record is (vjpkit's convention for an untaken call)."""
    rng = np.random.default_rng(13)
    p = mlp_params(rng, sizes=(3, 4, 4, 3))
    p["alt"] = {"w": _normal(rng, 4, 4), "b": _normal(rng, 4)}
    x, y = _normal(rng, 5, 3), targets("ce_int", rng, 5, 3)

    def model(p, x, flag):
        h = jnp.tanh(dense(p["fc1"], x))
        h = lax.cond(flag, lambda h: jnp.tanh(dense(p["fc2"], h)), lambda h: jnp.sin(dense(p["alt"], h)), h)
        return dense(p["fc3"], h)

    loss = lambda p, x, y, flag: vk.curvature.softmax_cross_entropy(model(p, x, flag), y)
    f = jit_or_eager(vk.value_and_grad(loss, capture=vk.curvature.stats("*", EXACT)))
    for flag, taken, other, act in ((True, "fc2", "alt", jnp.tanh), (False, "alt", "fc2", jnp.sin)):
        (value, grads), captured = f(p, x, y, jnp.asarray(flag))
        want = jax.grad(lambda p: jnp.mean(jax.vmap(PER_EXAMPLE["ce_int"])(model(p, x, flag), y)))(p)  # noqa: B023
        tree_allclose(grads, want, **F64)
        stages = [("fc1", dense), (None, jnp.tanh), (taken, dense), (None, act), ("fc3", dense)]
        q = {k: p[k] for k in ("fc1", taken, "fc3")}
        refs = references(stages, "ce_int", q, x, y)
        check_exact({k: captured[k] for k in refs}, refs)
        untaken = captured[other]
        for leaf in (untaken.kflr.G, *jax.tree.leaves(untaken.diag_ggn), *jax.tree.leaves(untaken.batch_l2)):
            assert np.all(np.isnan(np.asarray(leaf))), (other, leaf)


def test_a_weight_used_twice_has_factors_per_call(jit_or_eager, f64):
    """Each call of a shared weight (``fc``, ``fc#1``) has its own K-FAC factors (docs/curvature.md):
    those of the same program with the weight untied into two copies, one per call. Its
    per-example statistics are the weight's, the same in both entries (their exactness against
    the brute-force GGN: tests/test_curvature_shared.py)."""
    rng = np.random.default_rng(17)
    p = {
        "fc": {"w": _normal(rng, 4, 4, scale=0.6), "b": _normal(rng, 4)},
        "head": mlp_params(rng, (4, 3))["fc1"],
    }
    x, y = _normal(rng, 5, 4), targets("ce_int", rng, 5, 3)
    tied: Stages = [("fc", dense), (None, jnp.tanh), ("fc", dense), (None, jnp.tanh), ("head", dense)]
    untied: Stages = [("fc", dense), (None, jnp.tanh), ("again", dense), (None, jnp.tanh), ("head", dense)]
    _, captured = jit_or_eager(vk.grad(loss_fn(tied, "ce_int"), capture=vk.curvature.stats("*", EXACT)))(
        p, x, y
    )
    assert set(captured) == {"fc", "fc#1", "head"}
    refs = references(untied, "ce_int", {**p, "again": p["fc"]}, x, y)
    check_exact({"head": captured["head"]}, {"head": refs["head"]})
    for key, ref in (("fc", refs["fc"]), ("fc#1", refs["again"])):
        tree_allclose(np.asarray(captured[key].kflr.A), ref["A"], **F64)
        tree_allclose(np.asarray(captured[key].kflr.G), ref["G"], **F64)
        tree_allclose(np.asarray(captured[key].kfac_empirical.G), ref["G_emp"], **F64)
    for stat in ("diag_ggn", "sum_grad_squared", "batch_l2"):
        tree_allclose(getattr(captured["fc"], stat), getattr(captured["fc#1"], stat), **F64)
        assert not np.allclose(getattr(captured["fc"], stat)["w"], refs["fc"][stat]["w"])  # not one call's


@pytest.mark.parametrize("wrap", ["checkpoint", pytest.param("inner_jit", marks=SLOW)])
def test_checkpoint_and_inner_jit_leave_the_statistics_unchanged(wrap, jit_or_eager, f64):
    rng = np.random.default_rng(14)
    p, x, y = mlp_params(rng), _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)
    inner = {"checkpoint": jax.checkpoint, "inner_jit": jax.jit}[wrap](lambda q, h: jnp.tanh(dense(q, h)))

    def model(p, x):
        h = jnp.tanh(dense(p["fc1"], x))
        return dense(p["fc3"], inner(p["fc2"], h))

    loss = lambda p, x, y: vk.curvature.softmax_cross_entropy(model(p, x), y)
    key = jax.random.key(2)
    spec = vk.curvature.stats("*", ALL)
    _, captured = jit_or_eager(vk.grad(loss, capture=spec))(p, x, y, key=key)
    _, plain = jit_or_eager(vk.grad(loss_fn(MLP, "ce_int"), capture=spec))(p, x, y, key=key)
    tree_allclose(captured, plain, **F64)
    check_exact({k: captured[k] for k in ("fc1", "fc2", "fc3")}, references(MLP, "ce_int", p, x, y))


def test_jitted_transform_traces_once(f64):
    rng = np.random.default_rng(15)
    p, x, y = mlp_params(rng), _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)
    traces = []

    def loss(p, x, y):
        traces.append(1)
        return loss_fn(MLP, "ce_int")(p, x, y)

    f = jax.jit(vk.value_and_grad(loss, capture=vk.curvature.stats("*", ALL)))
    f(p, x, y, key=jax.random.key(0))
    first = len(traces)
    assert first >= 1
    f(jax.tree.map(lambda a: a + 1, p), x + 1, y, key=jax.random.key(1))
    assert len(traces) == first


# ----------------------------------------------------------------------------- errors


def _mlp_loss_and_data():
    rng = np.random.default_rng(16)
    return loss_fn(MLP, "ce_int"), mlp_params(rng), _normal(rng, 6, 3), targets("ce_int", rng, 6, 4)


def test_unregistered_loss_says_how_to_register(f64):
    _, p, x, y = _mlp_loss_and_data()
    plain = lambda p, x, y: -jnp.mean(jax.nn.log_softmax(apply(MLP, p, x))[jnp.arange(6), y])
    with pytest.raises(vk.ConfigError, match=r"vk\.curvature\.softmax_cross_entropy"):
        jax.jit(vk.grad(plain, capture=vk.curvature.stats()))(p, x, y)


def test_monte_carlo_without_key_names_the_argument(f64):
    loss, p, x, y = _mlp_loss_and_data()
    for stat in ("kfac", "diag_ggn_mc"):
        with pytest.raises(vk.ConfigError, match=r"key=") as info:
            jax.jit(vk.grad(loss, capture=vk.curvature.stats("*", ["kflr", stat])))(p, x, y)
        assert stat in str(info.value)


def _norm_model(norm: nn.Layer):
    x, y = jnp.ones((4, 3), jnp.float32), jnp.zeros(4, jnp.int32)
    model = nn.serial(ln=norm, fc=nn.dense(2))
    loss = lambda q, x, y: vk.curvature.softmax_cross_entropy(model.apply(q, x), y)
    return loss, model.init(jax.random.key(0), x), x, y


def test_layer_without_a_rule_answers_kfac_with_its_diagonal_block():
    """K-FAC fields of a norm or an embedding (no Kronecker rule): their diagonal block of the
    same curvature, ``kflr``'s equal to ``diag_ggn``, ``kfac_empirical``'s to
    ``N * sum_grad_squared`` (the empirical Fisher of the mean loss)."""
    loss, params, x, y = _norm_model(nn.rms_norm())
    spec = vk.curvature.stats("*", ["diag_ggn", "kflr", "sum_grad_squared", "kfac_empirical"])
    _, captured = jax.jit(vk.grad(loss, capture=spec))(params, x, y)
    ln = captured["ln"]
    assert isinstance(ln.kflr, vk.curvature.Diagonal) and ln.layout.kind == "local"
    tree_allclose(ln.kflr.diagonal, ln.diag_ggn)
    n = x.shape[0]
    tree_allclose(ln.kfac_empirical.diagonal, jax.tree.map(lambda s: n * s, ln.sum_grad_squared))
    _, captured = jax.jit(vk.grad(loss, capture=vk.curvature.stats("fc", "kflr")))(
        params, x, y
    )  # left out: fine
    assert set(captured) == {"fc"}

    fc = {"w": jnp.ones((3, 2), jnp.float32), "b": jnp.zeros(2, jnp.float32)}
    emb = {"emb": {"table": jnp.ones((5, 3), jnp.float32)}, "fc": fc}
    ids = jnp.asarray([0, 1, 4, 2], jnp.int32)
    loss_e = lambda q, ids, y: vk.curvature.softmax_cross_entropy(dense(q["fc"], q["emb"]["table"][ids]), y)
    _, captured = jax.jit(vk.grad(loss_e, capture=vk.curvature.stats("*", ["kflr", "diag_ggn"])))(emb, ids, y)
    assert isinstance(captured["emb"].kflr, vk.curvature.Diagonal)
    tree_allclose(captured["emb"].kflr.diagonal, captured["emb"].diag_ggn)
    assert captured["emb"].layout.leaves == (("table", (DictKey("emb"), DictKey("table"))),)


def test_nn_embedding_is_not_read_as_dense():
    ids, y = jnp.asarray([0, 1, 4, 2], jnp.int32), jnp.zeros(4, jnp.int32)
    model = nn.serial(emb=nn.embedding(5, 3), fc=nn.dense(2))
    params = model.init(jax.random.key(0), ids)
    loss = lambda q, ids, y: vk.curvature.softmax_cross_entropy(model.apply(q, ids), y)
    _, captured = jax.jit(vk.grad(loss, capture=vk.curvature.stats("emb", "diag_ggn")))(params, ids, y)
    assert captured["emb"].diag_ggn["weight"].shape == (5, 3)


def test_layer_norm_kflr_is_its_diagonal_block():
    loss, params, x, y = _norm_model(nn.layer_norm())
    spec = vk.curvature.stats("*", ["kflr", "diag_ggn"])
    _, captured = jax.jit(vk.grad(loss, capture=spec))(params, x, y)
    assert isinstance(captured["ln"].kflr, vk.curvature.Diagonal)
    tree_allclose(captured["ln"].kflr.diagonal, captured["ln"].diag_ggn)


def test_stats_arguments_are_checked():
    with pytest.raises(vk.ConfigError, match=r"unknown statistic.*'kfrl'"):
        vk.curvature.stats("*", ["kflr", "kfrl"])
    with pytest.raises(vk.ConfigError, match=r"mc_samples"):
        vk.curvature.stats("*", "kfac", mc_samples=0)
    with pytest.raises(vk.ConfigError, match=r"layers"):
        vk.curvature.stats("")


def test_bad_labels_shape_is_refused(f64):
    loss, p, x, y = _mlp_loss_and_data()
    with pytest.raises(vk.ConfigError, match=r"labels must be integer classes \(6,\)"):
        jax.jit(vk.grad(loss, capture=vk.curvature.stats()))(p, x, y[:, None])
    with pytest.raises(vk.ConfigError, match=r"labels must be integer classes"):
        vk.curvature.softmax_cross_entropy(jnp.zeros((6, 4), jnp.float64), jnp.zeros((6, 3), jnp.float64))
    with pytest.raises(vk.ConfigError, match=r"target .* must have the shape"):
        vk.curvature.mse(jnp.zeros((6, 4), jnp.float64), jnp.zeros((6,), jnp.float64))
