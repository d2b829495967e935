"""Per-example gradients of norm affines and other per-example layers' vector leaves, given to
the loss per example (issue 31, the ResNet's memory).

A group norm, layer norm or gain layer's vector and scalar leaves are broadcast over the
examples before the one backward pass, so their per-example gradients come out of it (``B x``
their floats), with no record of the layer kept and no per-example pull. These tests check the
path is taken (the leaves are ``_Materialized`` from that pass, the layer is not captured), that
it equals ``jax.vmap(jax.grad)`` with every warning an error, eagerly and jitted, under the
structures users write (a scan over stacked blocks, ``jax.checkpoint``, an inner ``jax.jit``,
``vmap`` inside the loss, a ``cond`` branch), that ``dp_clip`` and ``gradient_stats`` agree, and
that a residual bias beside its weight (``x + h @ W + b``) keeps the dense path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.test_per_example import per_example_grads
from tests.test_per_example_layouts import fast
from tests.test_per_example_scan import assert_matches
from vjpkit.inspect import _per_example as pe

# The default tier runs this test's eager twin (conftest.py): the first one's is slow.
DEFAULT_TIER_EAGER = "test_layer_norm_under_scan_and_a_cond_branch"

DN = ("NHWC", "HWIO", "NHWC")
B, C, G = 4, 8, 2


def group_norm(x, p):
    b, h, w, ch = x.shape
    g = x.reshape(b, h, w, G, ch // G)
    mu = g.mean((1, 2, 4), keepdims=True)
    var = jnp.square(g - mu).mean((1, 2, 4), keepdims=True)
    return ((g - mu) * lax.rsqrt(var + 1e-5)).reshape(b, h, w, ch) * p["scale"] + p["bias"]


def conv(x, w, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=DN)


def _normal(key, *shape, scale=0.3):
    return scale * jax.random.normal(jax.random.key(key), shape)


def cnn_params():
    return {
        "stem": {"w": _normal(0, 3, 3, 3, C)},
        "gn": {"scale": 1.0 + _normal(1, C), "bias": _normal(2, C)},
        "conv": {"w": _normal(3, 3, 3, C, C)},
        "gn2": {"scale": 1.0 + _normal(4, C), "bias": _normal(5, C)},
        "head": {"w": _normal(6, C, 5), "b": _normal(7, 5)},
    }


def cnn_loss(p, x, y, wrap=lambda f: f):
    h = jax.nn.relu(group_norm(conv(x, p["stem"]["w"]), p["gn"]))
    h = h + wrap(lambda h, q: group_norm(conv(h, q["conv"]["w"], 1), q["gn2"]))(h, p)
    logits = h.mean((1, 2)) @ p["head"]["w"] + p["head"]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def cnn_batch():
    x = jax.random.normal(jax.random.key(10), (B, 6, 6, 3))
    return x, jax.random.randint(jax.random.key(11), (B,), 0, 5)


WRAPS = {
    "plain": lambda f: f,
    "checkpoint": jax.checkpoint,
    "inner_jit": jax.jit,
    "vmap_inside": lambda f: lambda h, q: jax.vmap(lambda hi: f(hi[None], q)[0])(h),
}


def _kinds(loss, params, batch):
    out = {}

    def f(p, *b):
        a = pe.analyze(loss, p, b, reduction="mean", who="test", norms_only=True)
        out.update({k: type(v).__name__ for k, v in zip(a.paths, a.leaves)})
        out["captured"] = sorted(a.captured)
        return [leaf.sq_norms() for leaf in a.leaves]

    jax.jit(f)(params, *batch)
    return out


@pytest.mark.parametrize("wrap", list(WRAPS), ids=list(WRAPS))
def test_group_norm_leaves_come_from_the_one_backward_pass(maybe_jit, wrap):
    params, batch = cnn_params(), cnn_batch()

    def loss(p, x, y):
        return cnn_loss(p, x, y, WRAPS[wrap])

    value, grads, norms = fast(maybe_jit(vk.inspect.per_example_grad_norms(loss)), params, *batch)
    assert_matches(norms, loss, params, *batch)
    tree_allclose((value, grads), jax.value_and_grad(loss)(params, *batch), rtol=1e-5, atol=1e-6)
    kinds = _kinds(loss, params, batch)
    for path in ("gn/scale", "gn/bias", "gn2/scale", "gn2/bias"):
        assert kinds[path] == "_Materialized", (path, kinds[path])
    assert not any(k.startswith("gn") for k in kinds["captured"]), kinds["captured"]


def test_layer_norm_under_scan_and_a_cond_branch(maybe_jit):
    d, length = 6, 3
    params = {
        "blocks": {
            "ln": {"scale": 1.0 + _normal(0, length, d), "bias": _normal(1, length, d)},
            "w": _normal(2, length, d, d),
        },
        "gain": 1.0 + _normal(3, d),
    }

    def layer_norm(x, p):
        mu = x.mean(-1, keepdims=True)
        var = jnp.square(x - mu).mean(-1, keepdims=True)
        return (x - mu) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def loss(p, x):
        def body(h, bp):
            return h + jnp.tanh(layer_norm(h, bp["ln"]) @ bp["w"]), None

        h, _ = lax.scan(body, x, p["blocks"])
        h = lax.cond(jnp.sum(x) > -1e9, lambda h: h * p["gain"], lambda h: h, h)
        return jnp.mean(jnp.square(h))

    x = jax.random.normal(jax.random.key(5), (B, 7, d))
    _, grads, norms = fast(maybe_jit(vk.inspect.per_example_grad_norms(loss)), params, x)
    assert_matches(norms, loss, params, x)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-6)
    kinds = _kinds(loss, params, (x,))
    assert kinds["blocks/ln/scale"] == kinds["blocks/ln/bias"] == "_Materialized"
    assert not any(k.startswith("blocks/ln") for k in kinds["captured"]), kinds["captured"]


def test_dp_clip_and_gradient_stats_agree_with_vmap_grad():
    params, batch = cnn_params(), cnn_batch()
    per = per_example_grads(cnn_loss, params, *batch)
    clip = 0.05
    _, grads, _ = jax.jit(vk.inspect.dp_clip(clip, 0.0, jax.random.key(0))(cnn_loss))(params, *batch, step=0)
    flat = jax.tree.leaves(per)
    norms = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)).reshape(B, -1), 1) for g in flat))
    factor = np.minimum(1.0, clip / norms)
    want = jax.tree.map(
        lambda g: (np.tensordot(factor, np.asarray(g, np.float64), axes=1) / B).astype(g.dtype), per
    )
    tree_allclose(jax.tree.map(np.asarray, grads), want, rtol=1e-4, atol=1e-7)
    _, _, stats = jax.jit(vk.inspect.gradient_stats(cnn_loss))(params, *batch)
    gn = stats["gn"].variance
    np.testing.assert_allclose(gn["scale"], np.var(np.asarray(per["gn"]["scale"]), 0), rtol=1e-4, atol=1e-9)


def test_a_residual_bias_beside_its_weight_keeps_the_dense_path():
    d = 5
    params = {"o": {"w": _normal(0, d, d), "b": _normal(1, d)}, "ln": {"scale": 1.0 + _normal(2, d)}}

    def loss(p, x):
        h = x + jnp.tanh(x) @ p["o"]["w"] + p["o"]["b"]
        return jnp.mean(jnp.square(h * p["ln"]["scale"]))

    x = jax.random.normal(jax.random.key(3), (B, 4, d))
    _, _, norms = fast(jax.jit(vk.inspect.per_example_grad_norms(loss)), params, x)
    assert_matches(norms, loss, params, x)
    kinds = _kinds(loss, params, (x,))
    assert kinds["ln/scale"] == "_Materialized" and "ln" not in kinds["captured"], kinds
    assert {"o/w", "o/b"} <= set(kinds["captured"]), kinds  # the bias's calls are captured, as before


def test_flax_and_equinox_norms_come_from_the_one_backward_pass():
    """Flax ``LayerNorm`` (a known per-example layer) and ``GroupNorm`` (no known kind), and an
    Equinox ``LayerNorm``: their scale and bias are given per example; the dense layers keep
    their records."""
    nn = pytest.importorskip("flax.linen", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")
    eqx = pytest.importorskip("equinox", reason="Equinox is an optional extra: pip install 'vjpkit[equinox]'")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(nn.Dense(6)(x))
            return nn.Dense(3)(nn.GroupNorm(num_groups=2)(x[:, None, :])[:, 0])

    x = jax.random.normal(jax.random.key(0), (B, 5))
    model = Model()
    params = model.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.mean(jnp.square(model.apply(p, x)))

    class Eqx(eqx.Module):
        l1: eqx.nn.Linear
        ln: eqx.nn.LayerNorm
        l2: eqx.nn.Linear

        def __call__(self, x):
            return self.l2(self.ln(self.l1(x)))

    k1, k2 = jax.random.split(jax.random.key(2))
    emodel = Eqx(eqx.nn.Linear(5, 6, key=k1), eqx.nn.LayerNorm(6), eqx.nn.Linear(6, 3, key=k2))

    def eloss(m, x):
        return jnp.mean(jnp.square(jax.vmap(m)(x)))

    # Only the two dense layers are captured (their names depend on whether vk.hookable patched
    # Equinox's Linear earlier in the process: "l1" or "Linear"; a count does not).
    for f, p in ((loss, params), (eloss, emodel)):
        _, _, norms = fast(jax.jit(vk.inspect.per_example_grad_norms(f)), p, x)
        assert_matches(norms, f, p, x)
        kinds = _kinds(f, p, (x,))
        assert len(kinds["captured"]) == 2, kinds["captured"]
