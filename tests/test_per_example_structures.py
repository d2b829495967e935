"""Per-example gradient norms on the structures of real models (issue 31), every one on a fast
path (any fallback warning is an error) and equal to ``jax.vmap(jax.grad)`` of the per-example
loss: a tied embedding and head (``h @ embed.T``, ``einsum("btd,vd->btv")``, ``jnp.take``),
transposed weights, residual biases written ``x + h @ W + b``, blocks under ``lax.scan``, nested
scans, ``jax.checkpoint``, per-sequence losses and a time-major layer with ``T == B`` (``fori_loop``:
``tests/test_fori_loop.py``); jitted and eagerly. DP clipping and ``gradient_stats`` on the tied
table are checked against the same reference, and the statistics layer's ``Rows`` against numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.test_per_example import per_example_grads
from tests.test_per_example_layouts import fast
from tests.test_per_example_scan import assert_matches, layer_norm
from vjpkit import stats

# The default tier runs this test's eager twin (conftest.py): the first one's is slow.
DEFAULT_TIER_EAGER = "test_transposed_and_einsum_weights"

V, D, T, B, L = 17, 8, 6, 5, 3


def lm_params(key, tied=True):
    k = iter(jax.random.split(key, 16))

    def normal(shape, scale=0.5):
        return scale * jax.random.normal(next(k), shape, jnp.float32)

    p = {
        "embed": normal((V, D), 1.0),
        "pos": normal((T, D), 0.1),
        "blocks": {
            "ln": {"scale": 1.0 + normal((L, D), 0.1), "bias": normal((L, D), 0.1)},
            "q": normal((L, D, D), D**-0.5),
            "k": normal((L, D, D), D**-0.5),
            "o": {"w": normal((L, D, D), D**-0.5), "b": normal((L, D), 0.1)},
            "fc": {"w": normal((L, D, 2 * D), D**-0.5), "b": normal((L, 2 * D), 0.1)},
            "proj": {"w": normal((L, 2 * D, D), (2 * D) ** -0.5), "b": normal((L, D), 0.1)},
        },
        "ln_f": {"scale": 1.0 + normal((D,), 0.1), "bias": normal((D,), 0.1)},
    }
    if not tied:
        p["head"] = normal((D, V), D**-0.5)
    return p


def block(x, p):
    h = layer_norm(x, p["ln"])
    q, k = h @ p["q"], h @ p["k"]
    s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool)), s, -1e9)
    x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), h) @ p["o"]["w"] + p["o"]["b"]  # x + h @ W + b
    h = jax.nn.gelu(layer_norm(x, p["ln"]) @ p["fc"]["w"] + p["fc"]["b"])
    return x + h @ p["proj"]["w"] + p["proj"]["b"]


HEADS = {
    "matmul_T": lambda h, e: h @ e.T,
    "einsum": lambda h, e: jnp.einsum("btd,vd->btv", h, e),
}
LOOKUPS = {
    "index": lambda e, ids: e[ids],
    "take": lambda e, ids: jnp.take(e, ids, axis=0),
}


def make_lm(head="matmul_T", lookup="index", loop="scan", remat=False):
    step = jax.checkpoint(block) if remat else block

    def apply(p, ids):
        x = LOOKUPS[lookup](p["embed"], ids) + p["pos"][: ids.shape[1]]
        if loop == "scan":
            x, _ = jax.lax.scan(lambda h, bp: (step(h, bp), None), x, p["blocks"])
        elif loop == "fori":
            x = jax.lax.fori_loop(0, L, lambda i, h: step(h, jax.tree.map(lambda a: a[i], p["blocks"])), x)
        else:  # a Python loop over a list of blocks
            for bp in p["blocks"]:
                x = step(x, bp)
        h = layer_norm(x, p["ln_f"])
        return HEADS[head](h, p["embed"]) if "head" not in p else h @ p["head"]

    def loss(p, tokens):  # per sequence: the mean over positions and sequences
        logits = apply(p, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    return loss


def tokens(seed=1, n=B):
    return jax.random.randint(jax.random.key(seed), (n, T + 1), 0, V)


SLOW = pytest.mark.slow  # the full tier (CI); the default tier keeps one form of each structure
TIED = [
    pytest.param(h, lk, marks=() if (h, lk) == ("matmul_T", "index") else SLOW, id=f"{h}-{lk}")
    for h in HEADS
    for lk in LOOKUPS
]


@pytest.mark.parametrize("head, lookup", TIED)
def test_tied_embedding_and_head_under_scan(maybe_jit, head, lookup):
    """The table is one leaf used by the lookup and the head: its g_i is their sum (the cross
    term included), never formed (B x T^2 Gram matrices)."""
    loss, params, tok = make_lm(head, lookup), lm_params(jax.random.key(0)), tokens()
    value, grads, norms = fast(maybe_jit(vk.inspect.per_example_grad_norms(loss)), params, tok)
    assert_matches(norms, loss, params, tok)
    tree_allclose(grads, jax.grad(loss)(params, tok), rtol=1e-5, atol=1e-6)
    assert {"embed", "embed#1"} <= set(norms.layers) or "embed" in norms.layers


@pytest.mark.parametrize("loop", [pytest.param("unrolled", marks=SLOW), "scan_remat"])
def test_loops_and_remat(maybe_jit, loop):
    remat = loop == "scan_remat"
    loss = make_lm(loop="scan" if remat else loop, remat=remat)
    params, tok = lm_params(jax.random.key(2)), tokens(3)
    if loop == "unrolled":
        params["blocks"] = [jax.tree.map(lambda a, i=i: a[i], params["blocks"]) for i in range(L)]
    _, _, norms = fast(maybe_jit(vk.inspect.per_example_grad_norms(loss)), params, tok)
    assert_matches(norms, loss, params, tok)


@SLOW
def test_untied_head_and_nested_scan():
    params = lm_params(jax.random.key(4), tied=False)
    params["blocks"] = jax.tree.map(lambda a: a.reshape(1, L, *a.shape[1:]) * 1.0, params["blocks"])

    def loss(p, tok):
        x = p["embed"][tok[:, :-1]] + p["pos"]
        inner = lambda h, bp: (block(h, bp), None)
        x, _ = jax.lax.scan(lambda h, bps: (jax.lax.scan(inner, h, bps)[0], None), x, p["blocks"])
        logp = jax.nn.log_softmax(layer_norm(x, p["ln_f"]) @ p["head"], -1)
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], -1))

    tok = tokens(5)
    _, _, norms = fast(jax.jit(vk.inspect.per_example_grad_norms(loss)), params, tok)
    assert_matches(norms, loss, params, tok)


def test_transposed_and_einsum_weights(maybe_jit):
    """``x @ W.T`` (a weight stored (out, in)), an einsum with two contracting axes and a weight
    whose contracting axis is its last: all dense, in the leaf's own layout."""
    k = jax.random.split(jax.random.key(6), 4)
    params = {
        "fc": {"w": jax.random.normal(k[0], (6, 4)) * 0.5, "b": jax.random.normal(k[1], (6,)) * 0.1},
        "heads": jax.random.normal(k[2], (2, 3, 6)) * 0.5,
        "out": jax.random.normal(k[3], (5, 2, 3)) * 0.5,
    }
    x = jax.random.normal(jax.random.key(7), (B, 3, 4))

    def loss(p, x):
        h = jnp.tanh(x @ p["fc"]["w"].T + p["fc"]["b"])  # (B, 3, 6)
        h = jnp.tanh(jnp.einsum("btd,hkd->bthk", h, p["heads"]))  # contracting the weight's last axis
        y = jnp.einsum("bthk,ohk->bto", h, p["out"])  # two contracting axes, weight's last two
        return jnp.mean(jnp.sum(jnp.square(y), (1, 2)))

    _, grads, norms = fast(maybe_jit(vk.inspect.per_example_grad_norms(loss)), params, x)
    assert_matches(norms, loss, params, x)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-6)


def test_time_major_with_t_equal_to_b(maybe_jit):
    """The layers see (T, B, d) with T == B: the example axis is found by dataflow, not by size."""
    k = jax.random.split(jax.random.key(8), 3)
    params = {"w": jax.random.normal(k[0], (4, 4)) * 0.5, "head": jax.random.normal(k[1], (4, 2)) * 0.5}
    x = jax.random.normal(k[2], (5, 5, 4))  # (B, T, d) with T == B

    def loss(p, x):
        h = jnp.tanh(jnp.swapaxes(x, 0, 1) @ p["w"])  # (T, B, d)
        return jnp.mean(jnp.sum(jnp.square(h @ p["head"]), (0, 2)))

    _, _, norms = fast(maybe_jit(vk.inspect.per_example_grad_norms(loss)), params, x)
    assert_matches(norms, loss, params, x)


def test_dp_clip_and_gradient_stats_on_the_tied_table():
    loss, params, tok = make_lm(), lm_params(jax.random.key(9)), tokens(10)
    per = per_example_grads(loss, params, tok)
    flat = jnp.concatenate([g.reshape(B, -1) for g in jax.tree.leaves(per)], 1)
    norm = jnp.linalg.norm(flat, axis=1)
    c = jnp.minimum(1.0, 0.5 / norm)
    want = jax.tree.map(lambda g: jnp.tensordot(c, g, 1) / B, per)
    dp = vk.inspect.dp_clip(0.5, 0.0, jax.random.key(0))(loss)
    _, grads, _ = fast(jax.jit(lambda p, t: dp(p, t, step=0)), params, tok)
    tree_allclose(grads, want, rtol=1e-4, atol=1e-6)
    _, _, st = fast(jax.jit(vk.inspect.gradient_stats(loss, layers="embed*")), params, tok)
    (got,) = st["embed"].variance.values()
    np.testing.assert_allclose(got, np.var(np.asarray(per["embed"]), axis=0), rtol=1e-4, atol=1e-7)


def test_rows_against_numpy():
    """``stats.Rows``: a lookup and a transposed head on one table, float64, against numpy."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (B, T))
    ids[0, 1] = ids[0, 4]  # a repeated token: its rows add before the norm
    e, h, dl = rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D)), rng.standard_normal((B, T, V))
    want = np.zeros((B, V, D))
    for i in range(B):
        np.add.at(want[i], ids[i], e[i])
        want[i] += dl[i].T @ h[i]
    with jax.enable_x64(True):
        rows = [stats.Rows.lookup(jnp.asarray(ids), jnp.asarray(e), (V, D)),
                stats.Rows.dense(jnp.asarray(h), jnp.asarray(dl), (V, D), (1,), (0,))]  # fmt: skip
        np.testing.assert_allclose(stats.sq_norms(rows), np.sum(want**2, (1, 2)), rtol=1e-12)
        np.testing.assert_allclose(stats.materialize(rows), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(stats.sum_sq(rows), np.sum(want**2, 0), rtol=1e-12, atol=1e-12)
        c = rng.standard_normal(B)
        np.testing.assert_allclose(
            stats.weighted_sum(rows, jnp.asarray(c)), np.tensordot(c, want, 1), rtol=1e-12, atol=1e-12
        )
        assert bool(stats.check(rows, jnp.asarray(want.sum(0)), 1e-9))
        assert not bool(stats.check(rows, jnp.asarray(want.sum(0) + 1e-3), 1e-9))


@pytest.mark.parametrize("index", ["wrap", "clip", "computed"])
def test_lookup_index_is_the_row_numpy_reads(index):
    """``stats.lookup_index``: the table row each position reads, as the lookup program builds
    it (negative ids wrapped; ids computed in the program), against numpy's indexing. Ids past
    the table are left as given (``mode="clip"``: the gather clips them, the caller applies
    the mode)."""
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.standard_normal((V, D)), jnp.float32)
    ids = jnp.asarray(rng.integers(-V, 2 * V if index == "clip" else V, (B, T)), jnp.int32)
    fn = {
        "wrap": lambda t, i: t[i],
        "clip": lambda t, i: t.at[i].get(mode="clip"),
        "computed": lambda t, i: t[jnp.abs(i)],
    }[index]
    rows = np.asarray(stats.lookup_index(jax.make_jaxpr(fn)(table, ids))(table, ids))
    assert rows.shape == ids.shape
    if index == "clip":
        assert rows.max() >= V  # left as given
        rows = np.clip(rows, 0, V - 1)
    np.testing.assert_array_equal(np.asarray(table)[rows], np.asarray(fn(table, ids)))


def test_inspect_and_curvature_agree():
    """``vk.curvature``'s ``batch_l2`` and ``sum_grad_squared`` (BackPACK's: of ``grad l_n / N``)
    and ``vk.inspect``'s per-example norms and ``gradient_stats`` (of ``grad l_n``) come from the
    same statistics layer: they agree up to the ``N^2`` of their definitions, and both equal
    ``vmap(grad)``. A sequence layer (T = 4 rows per example: the ghost norm) and a plain one."""
    k = jax.random.split(jax.random.key(11), 5)
    params = {
        "seq": {"w": jax.random.normal(k[0], (3, 6)) * 0.5, "b": jax.random.normal(k[1], (6,)) * 0.1},
        "head": {"w": jax.random.normal(k[2], (6, 4)) * 0.5, "b": jnp.zeros(4)},
    }
    x = jax.random.normal(k[3], (B, 4, 3))
    y = jax.random.randint(k[4], (B,), 0, 4)

    def loss(p, x, y):
        h = jnp.tanh(x @ p["seq"]["w"] + p["seq"]["b"]).mean(1)
        return vk.curvature.softmax_cross_entropy(h @ p["head"]["w"] + p["head"]["b"], y)

    spec = vk.curvature.stats("*", ["batch_l2", "sum_grad_squared"])
    _, cap = jax.jit(vk.grad(loss, capture=spec))(params, x, y)
    _, _, norms = fast(jax.jit(vk.inspect.per_example_grad_norms(loss)), params, x, y)
    _, _, st = fast(jax.jit(vk.inspect.gradient_stats(loss)), params, x, y)
    per = per_example_grads(loss, params, x, y)
    for layer in ("seq", "head"):
        for leaf in ("w", "b"):
            inspect_sq = np.square(norms.params[layer][leaf])
            np.testing.assert_allclose(cap[layer].batch_l2[leaf] * B**2, inspect_sq, rtol=2e-5, err_msg=layer)
            sgs = st[layer].variance[leaf] * B + B * np.square(st[layer].mean[leaf])  # keyed as records are
            np.testing.assert_allclose(cap[layer].sum_grad_squared[leaf] * B**2, sgs, rtol=2e-4, atol=1e-7)
            want = np.sum(np.square(np.asarray(per[layer][leaf], np.float64)), 0)
            np.testing.assert_allclose(sgs, want, rtol=2e-4, atol=1e-7)


def test_curvature_of_a_transposed_weight_is_its_layout():
    """``x @ W.T`` is dense to ``vk.curvature`` too, stored ``(out, in)``: its statistics equal
    those of the same model with the weight stored ``(in, out)``, transposed."""
    k = jax.random.split(jax.random.key(12), 4)
    w = jax.random.normal(k[0], (4, 3)) * 0.5  # (out, in)
    head = jax.random.normal(k[1], (4, 5)) * 0.5
    x, y = jax.random.normal(k[2], (B, 3)), jax.random.randint(k[3], (B,), 0, 5)

    def stored_t(p, x, y):
        return vk.curvature.softmax_cross_entropy(jnp.tanh(x @ p["fc"].T) @ p["head"], y)

    def stored(p, x, y):
        return vk.curvature.softmax_cross_entropy(jnp.tanh(x @ p["fc"]) @ p["head"], y)

    spec = vk.curvature.stats("fc", ["kflr", "diag_ggn", "batch_l2"])
    _, got = jax.jit(vk.grad(stored_t, capture=spec))({"fc": w, "head": head}, x, y)
    _, want = jax.jit(vk.grad(stored, capture=spec))({"fc": w.T, "head": head}, x, y)
    tree_allclose(got["fc"].kflr, want["fc"].kflr, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["fc"].diag_ggn["fc"], want["fc"].diag_ggn["fc"].T, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(got["fc"].batch_l2["fc"], want["fc"].batch_l2["fc"], rtol=1e-5)


@pytest.mark.parametrize("stride, padding, size", [(2, "SAME", 6), (1, "VALID", 3)])  # formed / ghost
@pytest.mark.parametrize("patches", [1 << 30, 0], ids=["patches", "per-offset"])
def test_conv_rows_against_the_convs_own_vjp(stride, padding, size, patches, monkeypatch):
    """``stats.Rows.conv``: each of its ways (formed from the patches or per window offset, and
    the ghost norm over patches) against ``jax.vjp`` of ``lax.conv_general_dilated`` per
    example, float64."""
    monkeypatch.setattr("vjpkit.stats._rows._PATCHES", patches)
    rng = np.random.default_rng(1)
    dn = ("NHWC", "HWIO", "NHWC")
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((3, 1, size, size, 2)))
        w = jnp.zeros((3, 3, 2, 4) if padding == "SAME" else (2, 2, 2, 6))

        def conv(w, xi):
            return jax.lax.conv_general_dilated(xi, w, (stride, stride), padding, dimension_numbers=dn)

        d = jnp.asarray(rng.standard_normal(jax.vmap(lambda xi: conv(w, xi))(x).shape))
        want = jax.vmap(lambda xi, di: jax.vjp(lambda v: conv(v, xi), w)[1](di)[0])(x, d)
        r = stats.Rows.conv(x, d, w.shape, (stride, stride), padding)
        assert r.ghost == (padding == "VALID")
        sq = np.sum(np.square(want), axis=(1, 2, 3, 4))
        np.testing.assert_allclose(stats.sq_norms([r]), sq, rtol=1e-12)
        np.testing.assert_allclose(stats.sq_norms([r.rows()]), sq, rtol=1e-12)
        np.testing.assert_allclose(stats.materialize([r]), want, rtol=1e-12, atol=1e-12)
        done = stats.reduced([r])
        assert (done is None) == r.ghost
        if done is not None:
            np.testing.assert_allclose(done[0], sq, rtol=1e-12)
            np.testing.assert_allclose(done[1], want.sum(0), rtol=1e-12, atol=1e-12)
        c = jnp.asarray(rng.standard_normal(3))
        np.testing.assert_allclose(
            stats.weighted_sum([r], c), jnp.tensordot(c, want, 1), rtol=1e-12, atol=1e-12
        )
        np.testing.assert_allclose(stats.sum_sq([r]), np.sum(np.square(want), 0), rtol=1e-12, atol=1e-12)
        assert bool(stats.check([r], want.sum(0), 1e-9))
