"""Per-example statistics of local layers and unread leaves on model structures.

The local layers of ``tests/test_curvature_local_paths.py`` (an embedding lookup, a positional
table ``x + pos``, a layer norm's scale and bias, a scalar gain) and a temperature no layer reads
(a ``"leaf"`` entry), with a dense head, under: the model in ``jax.checkpoint`` or an inner
``jax.jit``; the model written per example and ``jax.vmap``-ed inside the loss; per-iteration
layer norms and gains under ``lax.scan`` (also ``reverse=True`` and a ``fori_loop``) over stacked
params, and closed over by a scan; a layer norm in a ``lax.cond`` branch; Flax linen, Flax NNX
and Equinox models; ``jax.grad`` of a function of the returned gradient (and of the statistics);
a batch sharded over 4 host devices (a subprocess, ``tests/_curvature_local_sharded_script.py``);
and K-FAC's records form (``grad_rows``) on an MLP with per-iteration layer norms and dense
layers under ``lax.scan`` and a temperature, under the same wrappers.

Oracles (float64), shared with no vjpkit code path: ``jax.vmap(jax.grad)`` of each sequence's
share of the mean loss for ``sum_grad_squared`` and ``batch_l2``; the brute-force GGN diagonal
(``jax.jacobian`` of the logits and the cross-entropy's Hessian per position) for ``diag_ggn``
and for the ``kflr`` diagonal blocks; plain ``jax.grad`` for grad-of-grad; the unsharded call for
the sharded one; the Kronecker form (``stats(..., ["kfac"])``) for the records form.
"""

from __future__ import annotations

import pathlib
import types
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree

import vjpkit as vk
from tests.helpers import run_with_devices, tree_allclose

# The default tier runs this test's eager twin (conftest.py): the first one's is slow.
DEFAULT_TIER_EAGER = "test_closed_over_local_layers_under_scan_are_per_call"

V, D, T, N, C, L = 7, 4, 3, 5, 6, 2  # vocabulary, width, positions, sequences, classes, scan length
WHICH = ["sum_grad_squared", "batch_l2", "diag_ggn", "kflr"]
TOL = {"rtol": 1e-9, "atol": 1e-14}
SCRIPT = pathlib.Path(__file__).resolve().parent / "_curvature_local_sharded_script.py"

pytestmark = pytest.mark.usefixtures("x64")  # float64 (conftest)


# --- the model and its oracle -------------------------------------------------------------------


def problem(seed=0, n=N, blocks=False):
    rng = np.random.default_rng(seed)
    p = {
        "embed": rng.standard_normal((V, D)),
        "pos": 0.3 * rng.standard_normal((T, D)),
        "ln": {"scale": 1 + 0.1 * rng.standard_normal(D), "bias": 0.1 * rng.standard_normal(D)},
        "gain": np.float64(1.3),
        "out": {"w": rng.standard_normal((D, C)) / 2, "b": 0.1 * rng.standard_normal(C)},
        "temp": np.float64(1.2),  # read by no layer: a "leaf" entry
    }
    if blocks:  # per-iteration layer norms and gains, stacked for lax.scan
        p["blocks"] = {
            "ln": {"scale": 1 + 0.1 * rng.standard_normal((L, D)), "bias": 0.1 * rng.standard_normal((L, D))},
            "gain": 1 + 0.2 * rng.standard_normal(L),
        }
    tok = rng.integers(0, V, (n, T))
    tok[0, :2] = 1  # a sequence repeating an id
    return jax.tree.map(jnp.asarray, p), jnp.asarray(tok), jnp.asarray(rng.integers(0, C, (n, T)))


def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def model(p, tok):
    """Any leading axes of ``tok``: ``(N, T)`` batched or ``(T,)`` one sequence."""
    x = layer_norm(p["embed"][tok] + p["pos"], p["ln"]) * p["gain"]
    return (x @ p["out"]["w"] + p["out"]["b"]) / p["temp"]


def block(h, q):
    return h + jnp.tanh(layer_norm(h, q["ln"]) * q["gain"])


def scanned(p, tok, loop="scan"):
    """Per-iteration layer norms and gains: ``lax.scan`` over the stacked ``p["blocks"]``
    (``reverse=True``: the last slice first), or a ``fori_loop`` indexing them by its counter."""
    x = p["embed"][tok] + p["pos"]
    if loop == "fori_loop":
        x = lax.fori_loop(0, L, lambda i, h: block(h, jax.tree.map(lambda a: a[i], p["blocks"])), x)
    else:
        x, _ = lax.scan(lambda h, q: (block(h, q), None), x, p["blocks"], reverse=loop == "reverse")
    x = layer_norm(x, p["ln"]) * p["gain"]
    return (x @ p["out"]["w"] + p["out"]["b"]) / p["temp"]


def closed_over(p, tok, copies=False):
    """The same layer norm and gain every iteration (``lax.scan`` closes over them); with
    ``copies``, the scan's ``xs`` are ``p["blocks"]`` (the oracle's model: one copy each)."""
    x = p["embed"][tok] + p["pos"]
    if copies:
        x, _ = lax.scan(lambda h, q: (block(h, q), None), x, p["blocks"])
    else:
        x, _ = lax.scan(lambda h, _: (block(h, p), None), x, None, length=L)
    return (x @ p["out"]["w"] + p["out"]["b"]) / p["temp"]


def conded(p, tok, flag):
    x = p["embed"][tok] + p["pos"]
    x = lax.cond(flag, lambda h: layer_norm(h, p["ln"]) * p["gain"], lambda h: 0.5 * jnp.tanh(h), x)
    return (x @ p["out"]["w"] + p["out"]["b"]) / p["temp"]


def ce(forward):
    return lambda p, x, y: vk.curvature.softmax_cross_entropy(forward(p, x), y)


def oracle(forward, params, x, y):
    return jax.jit(_oracle, static_argnums=0)(forward, params, x, y)


def _oracle(forward, params, x, y):
    """``(per, ggn)``: each sequence's gradient of its share of the mean loss (a leading ``N``
    axis on every leaf), and the brute-force GGN diagonal of the mean loss, both as ``params``."""
    loss, n = ce(forward), x.shape[0]
    per = jax.vmap(jax.grad(lambda p, xi, yi: loss(p, xi[None], yi[None]) / n), in_axes=(None, 0, 0))(
        params, x, y
    )
    flat, unravel = ravel_pytree(params)
    logits = forward(params, x)
    jac = jax.jacobian(lambda f: forward(unravel(f), x))(flat).reshape(-1, C, flat.size)
    prob = jax.nn.softmax(logits).reshape(-1, C)
    hess = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(prob) / prob.shape[0]
    return per, unravel(jnp.einsum("rcp,rcd,rdp->p", jac, hess, jac))


def pick(tree, keys):
    """The leaf of ``tree`` at the key path ``keys`` (as ``tree_flatten_with_path`` names it)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return dict((jax.tree_util.keystr(kp), v) for kp, v in flat)[jax.tree_util.keystr(tuple(keys))]


def field_by_path(entry, field):
    """``{path inside the layer's params: array}`` of one statistic (a ``Diagonal``'s vector)."""
    value = getattr(entry, field)
    value = value.diagonal if isinstance(value, vk.curvature.Diagonal) else value
    flat = jax.tree_util.tree_flatten_with_path(value)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in kp): v for kp, v in flat}


def want_of(field, g, ggn, lead):
    """The oracle of one statistic of a leaf: ``g`` its per-example gradients ``(N, *leaf)``,
    ``lead`` how many leading axes are scan iterations (one entry each)."""
    if field == "sum_grad_squared":
        return np.sum(np.square(g), 0)
    if field == "batch_l2":  # (*iterations, N)
        return np.moveaxis(np.square(g).reshape(*g.shape[: 1 + lead], -1).sum(-1), 0, -1)
    return ggn  # diag_ggn, and kflr's Diagonal block


def check(cap, per, ggn, fields=WHICH, kinds=("local", "leaf"), rename=None, lead=None):
    """Every entry of ``kinds`` whose layout names its leaves against the oracle; returns the
    leaves checked (key strings). ``rename[entry]`` gives ``{param path: key path}`` for an
    entry whose layout names no leaf (a layer in a ``lax.cond`` branch) or whose leaves are the
    oracle's other ones; ``lead`` overrides the number of leading iteration axes."""
    seen = set()
    for name, entry in cap.items():
        if entry.layout.kind not in kinds:
            continue
        leaves = dict(entry.layout.leaves)
        if entry.layout.kind == "dense":
            leaves = {
                entry.layout.weight: entry.layout.weight_leaf,
                entry.layout.bias: entry.layout.bias_leaf,
            }
        if rename and name in rename:
            leaves = rename[name]
        for field in fields:
            got = field_by_path(entry, field)
            for inner, keys in leaves.items():
                if keys is None:
                    continue
                g, d = np.asarray(pick(per, keys)), np.asarray(pick(ggn, keys))
                n_lead = entry.layout.scans.count("s") if lead is None else lead
                want = want_of(field, g, d, n_lead)
                np.testing.assert_allclose(got[inner], want, **TOL, err_msg=f"{name}:{inner}:{field}")
                seen.add(jax.tree_util.keystr(tuple(keys)))
    return seen


def capture(loss, params, *args, jit, which=WHICH):
    g = vk.value_and_grad(loss, capture=vk.curvature.stats("*", which))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no layer reads the leaves temp ..."
        (value, grads), cap = (jax.jit(g) if jit else g)(params, *args)
    want_value, want_grads = jax.value_and_grad(loss)(params, *args)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    tree_allclose(grads, want_grads, rtol=1e-10, atol=1e-14)
    return cap


LOCAL = {"['embed']", "['pos']", "['ln']['scale']", "['ln']['bias']", "['gain']", "['temp']"}
KINDS = {"embed": "local", "pos": "local", "ln": "local", "gain": "local", "out": "dense", "temp": "leaf"}
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


# --- 1. jax.checkpoint, an inner jax.jit; 2. jax.vmap inside the loss ----------------------------


STRUCTURES = {
    "checkpoint": lambda p, x: jax.checkpoint(model)(p, x),
    "inner_jit": lambda p, x: jax.jit(model)(p, x),
    "vmap_in_loss": jax.vmap(model, in_axes=(None, 0)),  # the model written for one sequence
}


@JIT
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_local_layers_and_leaf_under_a_wrapper(structure, jit):
    forward = STRUCTURES[structure]
    params, x, y = problem()
    cap = capture(ce(forward), params, x, y, jit=jit)
    assert {k: e.layout.kind for k, e in cap.items()} == KINDS
    per, ggn = oracle(forward, params, x, y)
    assert check(cap, per, ggn) == LOCAL
    assert check(cap, per, ggn, fields=WHICH[:3], kinds=("dense",)) == {"['out']['w']", "['out']['b']"}


# --- 3. lax.scan over stacked local layers, lax.cond ---------------------------------------------


@pytest.mark.parametrize(
    "loop, jit",
    [("scan", False), ("scan", True), ("reverse", True), ("fori_loop", True)],
    ids=["scan-eager", "scan-jit", "reverse-jit", "fori_loop-jit"],
)
def test_per_iteration_local_layers_under_scan(loop, jit):
    """One entry per iteration, stacked on axis 0 as the leaves are (``layout.scans == "s"``);
    ``batch_l2`` is ``(L, N)``. Equal to the oracle of the stacked leaves."""
    params, x, y = problem(blocks=True)
    forward = lambda p, x: scanned(p, x, loop)
    cap = capture(ce(forward), params, x, y, jit=jit)
    for name in ("blocks", "blocks/ln"):
        assert cap[name].layout.kind == "local" and cap[name].layout.scans == "s", cap[name].layout
    assert cap["blocks/ln"].batch_l2["scale"].shape == (L, N)
    per, ggn = oracle(forward, params, x, y)
    stacked = {"['blocks']['ln']['scale']", "['blocks']['ln']['bias']", "['blocks']['gain']"}
    assert check(cap, per, ggn) == LOCAL | stacked


@JIT
def test_closed_over_local_layers_under_scan_are_per_call(jit):
    """A layer norm and gain a ``lax.scan`` closes over (``layout.scans == "c"``): non-dense
    kinds keep each call's own statistics (docs/curvature.md, "A weight used twice"), one
    entry per iteration, equal to the oracle of the model given one copy of them per iteration
    as the scan's ``xs``."""
    params, x, y = problem()
    cap = capture(ce(closed_over), params, x, y, jit=jit)
    assert cap["ln"].layout.scans == "c" and cap["gain"].layout.scans == "c"
    copies = {
        **params,
        "blocks": jax.tree.map(lambda a: jnp.stack([a] * L), {"ln": params["ln"], "gain": params["gain"]}),
    }
    per, ggn = oracle(lambda p, x: closed_over(p, x, copies=True), copies, x, y)
    keys = lambda *k: tuple(jax.tree_util.DictKey(s) for s in k)
    as_copies = {
        "ln": {"scale": keys("blocks", "ln", "scale"), "bias": keys("blocks", "ln", "bias")},
        "gain": {"gain": keys("blocks", "gain")},
    }
    # the oracle's leaves are stacked: one leading iteration axis, as the entries have
    got = check({k: cap[k] for k in as_copies}, per, ggn, rename=as_copies, lead=1)
    assert got == {"['blocks']['ln']['scale']", "['blocks']['ln']['bias']", "['blocks']['gain']"}
    per, ggn = oracle(closed_over, params, x, y)
    assert check({k: cap[k] for k in ("embed", "pos", "temp")}, per, ggn) == {
        "['embed']",
        "['pos']",
        "['temp']",
    }


@JIT
def test_local_layer_in_a_cond_branch(jit):
    """The layer norm and gain in the taken branch of a ``lax.cond`` (a traced flag): their
    ``"local"`` entries (no leaf named) hold the taken branch's statistics, NaN when the branch
    is not taken; their leaves' ``"leaf"`` entries are exact either way."""
    params, x, y = problem()
    loss = lambda p, x, y, flag: ce(lambda p, x: conded(p, x, flag))(p, x, y)
    keys = lambda *k: tuple(jax.tree_util.DictKey(s) for s in k)
    in_branch = {
        "ln": {"scale": keys("ln", "scale"), "bias": keys("ln", "bias")},
        "gain": {"gain": keys("gain")},
    }
    for flag in (True, False):
        cap = capture(loss, params, x, y, jnp.asarray(flag), jit=jit)
        assert {k: e.layout.kind for k, e in cap.items() if e.layout.kind == "leaf"} == {
            "ln/scale": "leaf", "ln/bias": "leaf", "gain#leaf": "leaf", "temp": "leaf",
        }  # fmt: skip
        assert all(k is None for e in (cap["ln"], cap["gain"]) for _, k in e.layout.leaves)
        per, ggn = oracle(lambda p, x, flag=flag: conded(p, x, jnp.asarray(flag)), params, x, y)
        assert check(cap, per, ggn) == LOCAL  # embed, pos (local), ln/*, gain, temp (leaf)
        branch = {k: cap[k] for k in in_branch}
        if flag:
            assert check(branch, per, ggn, rename=in_branch) == LOCAL - {"['embed']", "['pos']", "['temp']"}
        else:
            for field in WHICH:
                for e in branch.values():
                    assert all(np.all(np.isnan(v)) for v in field_by_path(e, field).values()), field


# --- 4. Flax linen, Flax NNX, Equinox ------------------------------------------------------------


def _framework_check(forward, params, x, y, jit, local):
    cap = capture(ce(forward), params, x, y, jit=jit)
    per, ggn = oracle(forward, params, x, y)
    assert check(cap, per, ggn) == local, sorted(cap)
    return cap


@JIT
def test_flax_linen(jit):
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tok):
            h = nn.Embed(V, D, name="embed", param_dtype=jnp.float64)(tok)
            # flax promotes the statistics' dtype with float32 (an error under strict promotion)
            h = nn.LayerNorm(name="ln", param_dtype=jnp.float64, force_float32_reductions=False)(h)
            temp = self.param("temp", lambda key: jnp.asarray(1.2, jnp.float64))
            return nn.Dense(C, name="out", param_dtype=jnp.float64)(h) / temp

    m = Model()
    _, x, y = problem()
    params = m.init(jax.random.key(0), x)["params"]
    cap = _framework_check(
        lambda q, x: m.apply({"params": q}, x), params, x, y, jit,
        {"['embed']['embedding']", "['ln']['scale']", "['ln']['bias']", "['temp']"},
    )  # fmt: skip
    assert cap["temp"].layout.kind == "leaf" and cap["ln"].layout.kind == "local"


@JIT
def test_flax_nnx(jit):
    pytest.importorskip("flax")
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            kw = dict(param_dtype=jnp.float64, rngs=rngs)
            self.embed = nnx.Embed(V, D, **kw)
            self.ln = nnx.LayerNorm(D, **kw)
            self.out = nnx.Linear(D, C, **kw)
            self.temp = nnx.Param(jnp.asarray(1.2, jnp.float64))

        def __call__(self, tok):
            return self.out(self.ln(self.embed(tok))) / self.temp[...]

    _, x, y = problem()
    # nnx.LayerNorm promotes its statistics' dtype with float32: an error under strict promotion
    with jax.numpy_dtype_promotion("standard"):
        graphdef, state = nnx.split(vk.hookable(Model(nnx.Rngs(0))))
        leaves = {"['embed']['embedding']", "['ln']['scale']", "['ln']['bias']", "['temp']"}
        cap = _framework_check(
            lambda s, x: nnx.merge(graphdef, s)(x), state, x, y, jit, {k + ".value" for k in leaves}
        )
    assert cap["ln"].layout.kind == "local"
    assert [e.layout.kind for e in cap.values()].count("leaf") == 1


@JIT
def test_equinox(jit):
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        embed: Any
        ln: Any
        out: Any
        temp: Any

        def __init__(self):
            k1, k2 = jax.random.split(jax.random.key(0))
            self.embed = eqx.nn.Embedding(V, D, key=k1, dtype=jnp.float64)
            ln = eqx.nn.LayerNorm(D, dtype=jnp.float64)
            rng = np.random.default_rng(3)  # not the init's ones and zeros
            self.ln = eqx.tree_at(
                lambda m: (m.weight, m.bias),
                ln,
                (1 + 0.1 * rng.standard_normal(D), 0.1 * rng.standard_normal(D)),
            )
            self.out = eqx.nn.Linear(D, C, key=k2, dtype=jnp.float64)
            self.temp = jnp.asarray(1.2, jnp.float64)

        def __call__(self, tok):  # one sequence
            return jax.vmap(self.out)(jax.vmap(self.ln)(jax.vmap(self.embed)(tok))) / self.temp

    params, static = eqx.partition(vk.hookable(Model()), eqx.is_array)
    _, x, y = problem()
    cap = _framework_check(
        lambda q, x: jax.vmap(eqx.combine(q, static))(x), params, x, y, jit,
        {".embed.weight", ".ln.weight", ".ln.bias", ".temp"},
    )  # fmt: skip
    assert cap["temp"].layout.kind == "leaf" and cap["ln"].layout.kind == "local"


# --- 5. grad-of-grad ----------------------------------------------------------------------------


def squares(tree):
    return sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(tree))


@JIT
@pytest.mark.parametrize("structure", ["plain", "checkpoint", "vmap_in_loss"])
def test_grad_of_the_returned_gradient(structure, jit):
    """``jax.grad`` of the returned gradient's sum of squares (the statistics asked for beside
    it) equals ``jax.grad`` of plain ``jax.grad``'s."""
    forward = {"plain": model, **STRUCTURES}[structure]
    params, x, y = problem()
    loss = ce(forward)
    f = vk.grad(loss, capture=vk.curvature.stats("*", WHICH))

    def outer(p):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return squares(f(p, x, y)[0])

    got = (jax.jit(jax.grad(outer)) if jit else jax.grad(outer))(params)
    want = jax.grad(lambda p: squares(jax.grad(loss)(p, x, y)))(params)
    tree_allclose(got, want, rtol=1e-9, atol=1e-14)


@pytest.mark.slow  # a measurement beyond the docs' promises (3-8 s)
@JIT
def test_statistics_are_differentiable(jit):
    """Not promised by the docs; measured: ``jax.grad`` through the local layers' and the leaf's
    ``sum_grad_squared``, ``batch_l2``, ``diag_ggn`` and ``kflr`` equals ``jax.grad`` of the
    oracle's same function of the params."""
    params, x, y = problem()
    f = vk.grad(ce(model), capture=vk.curvature.stats("*", WHICH))
    names = ("embed", "pos", "ln", "gain", "temp")

    def of_stats(p):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            cap = f(p, x, y)[1]
        return sum(
            squares(field_by_path(cap[k], field)) * w
            for k in names
            for field, w in zip(WHICH, (1.0, 2.0, 3.0, 5.0))
        )

    def of_oracle(p):
        per, ggn = _oracle(model, p, x, y)
        total = 0.0
        for k in names:
            g, d = per[k], ggn[k]
            total = total + squares(jax.tree.map(lambda a: jnp.sum(jnp.square(a), 0), g))
            total = total + 2.0 * squares(jax.tree.map(lambda a: jnp.sum(jnp.square(a).reshape(N, -1), 1), g))
            total = total + (3.0 + 5.0) * squares(d)
        return total

    np.testing.assert_allclose(of_stats(params), of_oracle(params), rtol=1e-10)
    got = (jax.jit(jax.grad(of_stats)) if jit else jax.grad(of_stats))(params)
    tree_allclose(got, jax.jit(jax.grad(of_oracle))(params), rtol=1e-8, atol=1e-12)


# --- 6. a batch sharded over 4 host devices -----------------------------------------------------


@pytest.mark.slow  # a subprocess (about 10 s), as tests/test_curvature_sharded.py
def test_sharded_batch_over_4_devices_equals_unsharded():
    """``tests/_curvature_local_sharded_script.py`` (4 host devices) checks, itself, that loss,
    gradient and statistics of a batch sharded over the devices under ``jax.jit`` equal those of
    the batch on one device, for the plain model, the one ``vmap``-ed inside the loss and the one
    with local layers under ``lax.scan``, and the local and leaf entries against the oracle."""
    out = run_with_devices(SCRIPT, 4)
    assert out["devices"] == 4
    stacked = {"['blocks']['ln']['scale']", "['blocks']['ln']['bias']", "['blocks']['gain']"}
    for structure, leaves in (("plain", LOCAL), ("vmap_in_loss", LOCAL), ("scan", LOCAL | stacked)):
        got = out[structure]
        assert got["sharded"] and set(got["checked"]) == leaves, got
        assert set(got["layers"]) >= set(KINDS), got


# --- 7. K-FAC's records form --------------------------------------------------------------------

RN, IN, H, RC = 6, 24, 32, 5  # a batch smaller than the layers' widths: the records form's case


def mlp_problem(seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *s: rng.standard_normal(s) / np.sqrt(s[-2])
    p = {
        "inp": {"w": w(IN, H), "b": 0.1 * rng.standard_normal(H)},
        "blocks": {  # per-iteration layer norms and dense layers under lax.scan
            "ln": {"scale": 1 + 0.1 * rng.standard_normal((L, H)), "bias": 0.1 * rng.standard_normal((L, H))},
            "w": np.stack([w(H, H) for _ in range(L)]),
            "b": 0.1 * rng.standard_normal((L, H)),
        },
        "out": {"w": w(H, RC), "b": 0.1 * rng.standard_normal(RC)},
        "temp": np.float64(1.2),
    }
    x, y = rng.standard_normal((RN, IN)), rng.integers(0, RC, RN)
    return jax.tree.map(jnp.asarray, p), jnp.asarray(x), jnp.asarray(y)


def mlp(p, x):
    h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
    h, _ = lax.scan(lambda h, q: (jnp.tanh(layer_norm(h, q["ln"]) @ q["w"] + q["b"]), None), h, p["blocks"])
    return (h @ p["out"]["w"] + p["out"]["b"]) / p["temp"]


MLP_STRUCTURES = {
    "checkpoint": lambda p, x: jax.checkpoint(mlp)(p, x),
    "inner_jit": lambda p, x: jax.jit(mlp)(p, x),
    "vmap_in_loss": jax.vmap(mlp, in_axes=(None, 0)),
}


def kfac_run(forward, which, steps=3, jit=True):
    params, x, y = mlp_problem()
    loss = lambda p, x, y: vk.curvature.softmax_cross_entropy(forward(p, x), y)
    g = vk.value_and_grad(loss, capture=vk.curvature.stats("*", which))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the temperature's leaf entry
        like = jax.eval_shape(g, params, x, y, key=jax.random.key(0))[1]
    opt = vk.curvature.kfac(0.1, like=like, damping=1e-2, momentum=0.5, update_every=2)
    state = opt.init(params)

    def step(params, state, k):
        (_, grads), cur = g(params, x, y, key=k)
        updates, state = opt.update(grads, state, params, curvature=cur)
        return optax.apply_updates(params, updates), state, cur

    step = jax.jit(step) if jit else step
    curs = []
    for k in jax.random.split(jax.random.key(3), steps):
        params, state, cur = step(params, state, k)
        curs.append(cur)
    return params, curs


@JIT
@pytest.mark.parametrize("structure", list(MLP_STRUCTURES))
def test_records_form_equals_the_kronecker_form(structure, jit, monkeypatch):
    """Three K-FAC steps on the MLP (dense layers, stacked ones under ``lax.scan``: Kronecker
    blocks, one per slice; the per-iteration layer norms and the temperature: diagonal blocks)
    fed ``stats("*", ["kfac", "grad_rows"])`` equal those fed ``stats("*", ["kfac"])``; the
    dense blocks take the records form (a spy on the block's decision)."""
    from vjpkit.curvature import _blocks

    forward = MLP_STRUCTURES[structure]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        want, _ = kfac_run(forward, ["kfac"], jit=jit)
        got, curs = kfac_run(forward, ["kfac", "grad_rows"], jit=jit)
    tree_allclose(got, want, rtol=1e-9, atol=1e-12)
    kinds = {k: (e.layout.kind, e.layout.scans, e.grad_rows is not None) for k, e in curs[0].items()}
    assert kinds == {
        "inp": ("dense", "", True), "blocks": ("dense", "s", True), "out": ("dense", "", True),
        "blocks/ln": ("local", "s", False), "temp": ("leaf", "", False),
    }, kinds  # fmt: skip
    moved, _ = kfac_run(forward, ["kfac"], steps=0)
    with pytest.raises(AssertionError):  # the steps did something
        tree_allclose(want, moved, rtol=1e-3, atol=1e-6)

    taken = []
    cond = _blocks.lax.cond

    def spy(pred, *branches):  # the block's decision, read when the jitted update runs
        jax.debug.callback(lambda p: taken.append(bool(p)), pred)
        return cond(pred, *branches)

    params, x, y = mlp_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        g = vk.value_and_grad(ce(forward), capture=vk.curvature.stats("*", ["kfac", "grad_rows"]))
        (_, grads), cur = jax.jit(g)(params, x, y, key=jax.random.key(1))
    opt = vk.curvature.kfac(0.1, like=cur, damping=1e-2)
    monkeypatch.setattr(_blocks, "lax", types.SimpleNamespace(cond=spy))
    jax.jit(lambda g, c: opt.update(g, opt.init(params), params, curvature=c))(grads, cur)
    jax.effects_barrier()
    assert taken == [True, True], taken  # inp, blocks; the 33 x 5 head is cheaper as Kronecker
