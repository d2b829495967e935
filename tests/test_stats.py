"""Training statistics against numpy computed from ``jax.vmap(jax.grad)`` per-example gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.models import mlp_loss, mlp_setup
from vjpkit import nn
from vjpkit.inspect import _stats as st

HIST = vk.histogram(8, (-0.05, 0.05))


def per_example_grads(loss_fn, params, *batch):
    def single(p, *example):
        return loss_fn(p, *jax.tree.map(lambda a: a[None], example))

    grads = jax.jit(jax.vmap(jax.grad(single), in_axes=(None, *[0] * len(batch))))(params, *batch)
    return jax.tree.map(lambda g: np.asarray(g, np.float64), grads)


def numpy_stats(layer_grads, batch_size, reduction):
    """The statistics of one layer from its per-example gradients ``{leaf: (B, ...)}``."""
    mean = {k: g.mean(axis=0) for k, g in layer_grads.items()}
    var = {k: g.var(axis=0) for k, g in layer_grads.items()}  # population variance: 1/B
    var_sum = sum(v.sum() for v in var.values())
    mean_sq = sum(np.sum(m**2) for m in mean.values())
    scale = 1.0 if reduction == "mean" else batch_size
    batch_grad = {k: m * scale for k, m in mean.items()}
    lo, hi = HIST.range
    hist = {
        k: np.histogram(np.clip(g.ravel(), lo, hi), bins=HIST.bins, range=(lo, hi))[0]
        for k, g in batch_grad.items()
    }
    return dict(
        grad_norm=np.sqrt(sum(np.sum(g**2) for g in batch_grad.values())),
        mean=mean,
        variance=var,
        variance_sum=var_sum,
        snr=mean_sq / var_sum,
        histogram=hist,
    )


def assert_stats_match(stats, expected_by_layer, rtol=2e-5, atol=1e-7):
    assert sorted(stats) == sorted(expected_by_layer)
    for name, expected in expected_by_layer.items():
        got = stats[name]
        for field in ("grad_norm", "variance_sum", "snr"):
            value = getattr(got, field)
            assert value.dtype == jnp.float32 and value.shape == ()
            np.testing.assert_allclose(
                value, expected[field], rtol=rtol, atol=atol, err_msg=f"{name}.{field}"
            )
        for field in ("mean", "variance"):
            assert sorted(getattr(got, field)) == sorted(expected[field])
            for leaf, ref in expected[field].items():
                scale = np.abs(ref).max() + 1e-12
                np.testing.assert_allclose(
                    getattr(got, field)[leaf],
                    ref,
                    rtol=rtol,
                    atol=1e-5 * scale,
                    err_msg=f"{name}.{field}.{leaf}",
                )
        for leaf, ref in expected["histogram"].items():
            np.testing.assert_array_equal(
                got.histogram[leaf], ref.astype(np.float32), err_msg=f"{name}.{leaf}"
            )


@pytest.mark.parametrize(
    "reduction, wrap",
    [("mean", lambda f: f), ("mean", jax.jit), ("sum", jax.jit)],
    ids=["eager", "jit", "sum-jit"],
)
def test_mlp_stats(reduction, wrap):
    params, x, y = mlp_setup()
    loss_fn = mlp_loss if reduction == "mean" else (lambda p, x, y: mlp_loss(p, x, y) * x.shape[0])
    stats_fn = wrap(st.gradient_stats(loss_fn, reduction=reduction, histogram=HIST))
    loss, grads, stats = stats_fn(params, x, y)
    per_example = per_example_grads(loss_fn, params, x, y)
    expected = {name: numpy_stats(per_example[name], 6, reduction) for name in ("fc1", "fc2", "fc3")}
    assert_stats_match(stats, expected)
    ref_loss = jax.jit(loss_fn)(params, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


def test_conv_sequence_and_fallback_layers():
    """Conv kernels, dense on a 4-D input (no (x*x)^T(d*d) shortcut) and layer_norm (its affine
    norm fast path), against per-example gradients."""
    model = nn.serial(
        conv=nn.conv2d(3, 3, stride=(1, 2)),
        act=nn.tanh(),
        mix=nn.dense(4),
        flat=nn.flatten(),
        ln=nn.layer_norm(),
        fc=nn.dense(2),
    )
    x = jax.random.normal(jax.random.key(0), (5, 6, 5, 2))
    y = jax.random.randint(jax.random.key(1), (5,), 0, 2)
    params = model.init(jax.random.key(2), x)

    def loss_fn(p, x, y):
        logits = model.apply(p, x)
        return jnp.mean(jax.nn.logsumexp(logits, 1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])

    _, _, stats = jax.jit(st.gradient_stats(loss_fn, histogram=HIST))(params, x, y)
    per_example = per_example_grads(loss_fn, params, x, y)
    expected = {name: numpy_stats(per_example[name], 5, "mean") for name in params}
    assert_stats_match(stats, expected)


def test_layer_selection_and_norm_only():
    params, x, y = mlp_setup(batch=6)
    _, grads, stats = jax.jit(st.gradient_stats(mlp_loss, ["fc2", "fc3"], variance=False))(params, x, y)
    assert sorted(stats) == ["fc2", "fc3"]
    assert stats["fc2"].variance is None and stats["fc2"].snr is None and stats["fc2"].histogram is None
    ref = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads["fc2"])))
    np.testing.assert_allclose(stats["fc2"].grad_norm, ref, rtol=1e-6)


def test_stats_inside_scan():
    params, x, y = mlp_setup(batch=6)
    stats_fn = st.gradient_stats(mlp_loss, "fc1")
    xs, ys = jnp.stack([x, -x, 2 * x]), jnp.stack([y, y, 1 - y])

    def body(carry, batch):
        _, _, stats = stats_fn(params, *batch)
        return carry, stats["fc1"].snr

    _, snrs = jax.lax.scan(body, 0.0, (xs, ys))
    for t in range(3):
        ref = numpy_stats(per_example_grads(mlp_loss, params, xs[t], ys[t])["fc1"], 6, "mean")["snr"]
        np.testing.assert_allclose(snrs[t], ref, rtol=2e-5)


def test_update_ratio():
    params, x, y = mlp_setup()
    opt = optax.sgd(0.5, momentum=0.9)
    grads = jax.grad(mlp_loss)(params, x, y)
    updates, _ = opt.update(grads, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    ratios = jax.jit(st.update_ratio)(params, new)
    assert sorted(ratios) == ["fc1", "fc2", "fc3"]
    for name in ratios:
        old_l = [np.asarray(a, np.float64) for a in jax.tree.leaves(params[name])]
        new_l = [np.asarray(a, np.float64) for a in jax.tree.leaves(new[name])]
        num = np.sqrt(sum(np.sum((b - a) ** 2) for a, b in zip(old_l, new_l)))
        den = np.sqrt(sum(np.sum(a**2) for a in old_l))
        np.testing.assert_allclose(ratios[name], num / den, rtol=1e-5)
    top = st.update_ratio(
        {"w": jnp.ones(3), "b": {"c": jnp.ones(2)}}, {"w": jnp.full(3, 2.0), "b": {"c": jnp.ones(2)}}
    )
    assert sorted(top) == ["b", "w"] and float(top["w"]) == 1.0 and float(top["b"]) == 0.0


def test_bad_input():
    params, x, y = mlp_setup()
    with pytest.raises(vk.ConfigError, match=r"match no layer with parameters.*'fc1'"):
        st.gradient_stats(mlp_loss, "conv*")(params, x, y)
    with pytest.raises(vk.ConfigError, match=r"vk\.histogram"):
        st.gradient_stats(mlp_loss, histogram=8)
    with pytest.raises(vk.ConfigError, match="glob"):
        st.gradient_stats(mlp_loss, [])
    with pytest.raises(vk.ConfigError, match="reduction"):
        st.gradient_stats(mlp_loss, reduction="none")
    with pytest.raises(vk.ConfigError, match="same tree structure"):
        st.update_ratio(params, {"fc1": params["fc1"]})
    with pytest.raises(vk.ConfigError, match="shape"):
        st.update_ratio({"w": jnp.ones(3)}, {"w": jnp.ones(4)})
