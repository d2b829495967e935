"""Per-example norms of scanned layers formed inside the backward pass (issue 31, ViT memory).

``vk.inspect.per_example_grad_norms`` reduces each iteration's record of a layer under
``lax.scan`` whose leaves are its own and sliced by the scan to that iteration's squared norms
where the record is made, so no record is stacked over the iterations. These tests check that
this path is the one taken, that it gives what ``jax.vmap(jax.grad)`` gives and exactly what the
post-backward path (``_Stacked``, still used by ``dp_clip`` and ``gradient_stats``) gives, and
that its consistency check still turns a dense-shaped custom layer's norms into NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.test_per_example_layouts import fast
from tests.test_per_example_scan import assert_matches, reference_norms, tf_init, tf_loss
from vjpkit import nn
from vjpkit.inspect import _per_example as pe

SCANNED = ("blocks/attn/q", "blocks/fc/w", "blocks/fc/b", "blocks/proj/b")
NORMS = ("blocks/ln1/scale", "blocks/ln1/bias")  # small norm leaves: per example from the one pass


def _leaves(analysis):
    return dict(zip(analysis.paths, analysis.leaves))


def test_scanned_leaves_are_reduced_in_the_backward_pass():
    params = tf_init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (5, 7), 0, 13)

    def run(norms_only):
        kinds = {}

        def f(p, t):
            a = pe.analyze(tf_loss, p, (t,), reduction="mean", who="test", norms_only=norms_only)
            kinds.update({k: type(v).__name__ for k, v in _leaves(a).items()})
            return [leaf.sq_norms() for leaf in a.leaves]

        return jax.jit(f)(params, tokens), kinds

    sq_in, kinds_in = run(True)
    sq_after, kinds_after = run(False)
    for path in SCANNED:
        assert kinds_in[path] == "_Summed", (path, kinds_in[path])
        assert kinds_after[path] == "_Stacked", (path, kinds_after[path])
    for path in NORMS:
        assert kinds_in[path] == kinds_after[path] == "_Materialized", (path, kinds_in[path])
    assert kinds_in["embed"] == kinds_after["embed"]  # the tied/outside leaves keep their paths
    for a, b in zip(sq_in, sq_after):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
    total, _ = reference_norms(tf_loss, params, tokens)
    np.testing.assert_allclose(np.sqrt(sum(np.asarray(s, np.float64) for s in sq_in)), total, rtol=1e-5)


@pytest.mark.slow
def test_norms_match_vmap_grad_without_the_check():  # with it: test_per_example_scan's transformer
    check = False
    params = tf_init(jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(3), (6, 7), 0, 13)
    _, grads, norms = fast(jax.jit(vk.inspect.per_example_grad_norms(tf_loss, check=check)), params, tokens)
    assert_matches(norms, tf_loss, params, tokens)
    grads_ref = jax.grad(tf_loss)(params, tokens)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------- the check inside the backward pass, under scan

B, D, L = 4, 4, 3
SEQ = {"ghost": 3, "materialised": 6}  # T^2 = 9 <= 16 < 36


def _scanned(custom, t):
    body = (lambda p, x: jnp.tanh(x @ p["weight"] + p["bias"])) if custom else None
    layer = (
        nn.layer(body, lambda key, x: nn.dense(D).init(key, x), name="seq")
        if custom
        else nn.dense(D, name="seq")
    )
    x = jax.random.normal(jax.random.key(4), (B, t, D))
    stacked = jax.vmap(lambda k: layer.init(k, x))(jax.random.split(jax.random.key(5), L))
    params = {"seq": stacked, "head": jax.random.normal(jax.random.key(6), (D, 2))}

    def loss(p, x):
        h, _ = jax.lax.scan(lambda h, q: (layer.apply(q, h), None), x, p["seq"])
        return jnp.mean(jnp.sum((h @ p["head"]) ** 2, axis=(1, 2)))

    return loss, params, x


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("path", list(SEQ))
def test_scanned_dense_layer_passes_the_check(path, jit):
    loss, params, x = _scanned(custom=False, t=SEQ[path])
    fn = vk.inspect.per_example_grad_norms(loss)
    _, _, norms = fast(jax.jit(fn) if jit else fn, params, x)
    assert_matches(norms, loss, params, x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("path", list(SEQ))
def test_scanned_dense_shaped_custom_layer_fails_the_check(path, jit):
    loss, params, x = _scanned(custom=True, t=SEQ[path])
    fn = vk.inspect.per_example_grad_norms(loss)
    with pytest.warns(UserWarning, match="do not sum to the batch gradient"):
        _, _, norms = jax.block_until_ready((jax.jit(fn) if jit else fn)(params, x))
    assert np.all(np.isnan(norms.params["seq"]["weight"]))
    assert np.all(np.isnan(norms.total))
    _, want = reference_norms(loss, params, x)
    np.testing.assert_allclose(norms.params["head"], want["head"], rtol=1e-5, atol=1e-7)
