"""Per-example gradient norms and DP clipping against ``jax.vmap(jax.grad)`` of the plain loss.

The reference never uses vjpkit transforms: ``g_i`` is ``jax.grad`` of the loss on example
``i`` alone (a batch of one), vmapped over the batch, with the layers as plain functions.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.models import mlp, mlp_loss, mlp_setup
from vjpkit import nn
from vjpkit.inspect import _per_example as pe


def _path_name(path) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def per_example_grads(loss_fn, params, *batch):
    def single(p, *example):
        return loss_fn(p, *jax.tree.map(lambda a: a[None], example))

    return jax.jit(jax.vmap(jax.grad(single), in_axes=(None, *[0] * len(batch))))(params, *batch)


def reference(loss_fn, params, *batch, owners=None):
    """``(total, {leaf path: norms}, {owner: norms})`` from vmap(grad), in numpy float64."""
    grads = per_example_grads(loss_fn, params, *batch)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    sq = {
        _path_name(path): np.sum(np.asarray(g, np.float64).reshape(g.shape[0], -1) ** 2, axis=1)
        for path, g in flat
    }
    by_owner = {}
    for path, s in sq.items():
        owner = (owners or {}).get(path, path.rsplit("/", 1)[0])
        by_owner[owner] = by_owner.get(owner, 0.0) + s
    total = np.sqrt(sum(sq.values()))
    return total, {k: np.sqrt(v) for k, v in sq.items()}, {k: np.sqrt(v) for k, v in by_owner.items()}


def assert_norms_match(norms, loss_fn, params, *batch, owners=None, rtol=1e-5, atol=1e-6):
    total, leaves, layers = reference(loss_fn, params, *batch, owners=owners)
    np.testing.assert_allclose(norms.total, total, rtol=rtol, atol=atol)
    got = {_path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(norms.params)[0]}
    assert sorted(got) == sorted(leaves)
    for k in leaves:
        np.testing.assert_allclose(got[k], leaves[k], rtol=rtol, atol=atol, err_msg=k)
    assert sorted(norms.layers) == sorted(layers)
    for k in layers:
        np.testing.assert_allclose(norms.layers[k], layers[k], rtol=rtol, atol=atol, err_msg=k)
    assert norms.total.dtype == jnp.float32


def run(loss_fn, params, *batch, wrap=jax.jit, **kw):
    return wrap(pe.per_example_grad_norms(loss_fn, **kw))(params, *batch)


# ------------------------------------------------------------------------------------- MLP


def test_mlp_mean_loss(maybe_jit):  # eager too: once, on the smallest model
    params, x, y = mlp_setup()
    loss, grads, norms = run(mlp_loss, params, x, y, wrap=maybe_jit)
    assert_norms_match(norms, mlp_loss, params, x, y)
    # loss and grads are exactly jax.value_and_grad's
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(mlp_loss))(params, x, y)
    tree_allclose((loss, grads), (ref_loss, ref_grads))
    assert sorted(norms.layers) == ["fc1", "fc2", "fc3"]  # named like the records
    assert jax.tree.structure(norms.params) == jax.tree.structure(params)


def test_mean_and_sum_conventions_give_grad_of_per_example_loss():
    """Norms are of grad l_i for both reductions: for a mean, B times each example's share."""
    params, x, y = mlp_setup(batch=5)

    def sum_loss(p, x, y):
        return mlp_loss(p, x, y) * x.shape[0]

    _, _, mean_norms = run(mlp_loss, params, x, y, reduction="mean")
    _, _, sum_norms = run(sum_loss, params, x, y, reduction="sum")
    assert_norms_match(sum_norms, sum_loss, params, x, y)
    tree_allclose(mean_norms, sum_norms, rtol=1e-5, atol=1e-6)
    # and the per-example share of grad L (the mean) is 1/B of them
    shares = per_example_grads(mlp_loss, params, x, y)
    share_norm = np.sqrt(sum(np.sum(np.asarray(g).reshape(5, -1) ** 2, 1) for g in jax.tree.leaves(shares)))
    np.testing.assert_allclose(mean_norms.total, share_norm, rtol=1e-5)


# -------------------------------------------------------------------------------- sequences


@pytest.mark.parametrize(
    "t, d_in, d_out",
    [(4, 5, 6), (9, 2, 3)],  # T^2 <= in*out: Gram matrices; T^2 > in*out: that layer's X_i^T D_i
    ids=["gram", "direct"],
)
def test_sequence_dense(t, d_in, d_out):
    model = nn.serial(fc1=nn.dense(d_out), act=nn.tanh(), fc2=nn.dense(2))
    x = jax.random.normal(jax.random.key(0), (5, t, d_in))
    y = jax.random.normal(jax.random.key(1), (5, t, 2))
    params = model.init(jax.random.key(2), x)

    def loss(p, x, y):
        return jnp.mean(jnp.sum((model.apply(p, x) - y) ** 2, axis=(1, 2)))

    _, _, norms = run(loss, params, x, y)
    assert_norms_match(norms, loss, params, x, y)


@pytest.mark.slow
def test_dense_without_bias_and_4d_input():
    model = nn.serial(fc1=nn.dense(3, use_bias=False), act=nn.relu(), fc2=nn.dense(2))
    x = jax.random.normal(jax.random.key(0), (4, 2, 3, 5))

    def loss(p, x):
        return jnp.mean(jnp.sum(model.apply(p, x) ** 2, axis=(1, 2, 3)))

    params = model.init(jax.random.key(1), x)
    _, _, norms = run(loss, params, x)
    assert_norms_match(norms, loss, params, x)


# ------------------------------------------------------------------------------------- conv

cnn = nn.serial(
    conv1=nn.conv2d(4, 3),
    act1=nn.relu(),
    conv2=nn.conv2d(5, 3, stride=2, padding="VALID"),
    act2=nn.tanh(),
    conv3=nn.conv2d(3, (2, 3), stride=(2, 1)),
    flat=nn.flatten(),
    fc=nn.dense(2),
)


def cnn_loss(params, x, y):
    logits = cnn.apply(params, x)
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])


def test_cnn():
    x = jax.random.normal(jax.random.key(0), (4, 11, 9, 2))
    y = jax.random.randint(jax.random.key(1), (4,), 0, 2)
    params = cnn.init(jax.random.key(2), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer has a fast path: no fallback warning
        _, _, norms = run(cnn_loss, params, x, y)
    assert_norms_match(norms, cnn_loss, params, x, y)


@pytest.mark.slow
def test_conv_gives_its_explicit_padding_and_a_custom_conv_needs_conv_config():
    """Asymmetric explicit padding cannot be inferred from shapes, and is not: ``nn.conv2d`` gives
    its own; a custom conv-shaped layer gives none, so it falls back (exact, with a warning naming
    it) unless ``conv=`` supplies its stride and padding."""
    pads = [(0, 2), (2, 0)]
    model = nn.serial(conv=nn.conv2d(3, 3, padding=pads), flat=nn.flatten(), fc=nn.dense(2))
    x = jax.random.normal(jax.random.key(0), (3, 6, 6, 2))
    params = model.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.mean(jnp.sum(model.apply(p, x) ** 2, axis=1))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fast path: no fallback warning, no failed check
        _, _, norms = run(loss, params, x)
        jax.effects_barrier()
    assert_norms_match(norms, loss, params, x)

    def conv_fn(p, x):  # the same convolution, as a layer that does not say it is one
        dn = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_general_dilated(x, p["weight"], (1, 1), pads, dimension_numbers=dn) + p["bias"]

    custom = nn.serial(conv=nn.layer(conv_fn, nn.conv2d(3, 3).init), flat=nn.flatten(), fc=nn.dense(2))

    def custom_loss(p, x):
        return jnp.mean(jnp.sum(custom.apply(p, x) ** 2, axis=1))

    no_kind = r"'conv' \(no fast path: a conv-shaped weight, but the layer does not give its strides"
    with pytest.warns(UserWarning, match=no_kind) as rec:
        _, _, fallen_back = run(custom_loss, params, x)
    assert "'fc'" not in str(rec[0].message)
    assert_norms_match(fallen_back, custom_loss, params, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, configured = run(custom_loss, params, x, conv={"conv": (1, pads)})
        jax.effects_barrier()
    assert_norms_match(configured, custom_loss, params, x)


# ----------------------------------------------------------------------------- weight sharing


def test_layer_called_twice():
    fc = nn.dense(4, name="fc")
    head = nn.dense(1, name="head")
    x = jax.random.normal(jax.random.key(0), (6, 4))
    params = {"fc": fc.init(jax.random.key(1), x), "head": head.init(jax.random.key(2), x)}

    def loss(p, x):
        h = jnp.tanh(fc.apply(p["fc"], x))
        h = fc.apply(p["fc"], h)  # the same layer again: record "fc#1"
        return jnp.mean(head.apply(p["head"], h)[:, 0] ** 2)

    _, _, norms = run(loss, params, x)
    assert_norms_match(norms, loss, params, x)


def test_one_array_shared_by_two_layers():
    """Two differently named layers given the same params: the leaf is found by identity."""
    a, b = nn.dense(3, name="a"), nn.dense(3, name="b")
    x = jax.random.normal(jax.random.key(0), (5, 2, 3))
    params = {"shared": a.init(jax.random.key(1), x)}

    def loss(p, x):
        return jnp.mean(jnp.sum(b.apply(p["shared"], jax.nn.relu(a.apply(p["shared"], x))) ** 2, axis=(1, 2)))

    _, _, norms = run(loss, params, x)
    owners = {"shared/weight": "a", "shared/bias": "a"}  # reported under the first user
    assert_norms_match(norms, loss, params, x, owners=owners)


# --------------------------------------------------------------------------------- fallback


def test_layers_without_a_fast_path_take_their_own_vjp():
    """A layer of no known kind (vjpkit's embedding, a custom ``nn.layer``): a vmap over the
    examples of that layer's own vjp, with a warning naming it, never ``vmap(grad)`` of the loss."""
    model = nn.serial(emb=nn.embedding(10, 4), ln=nn.layer_norm(), fc=nn.dense(3))
    ids = jax.random.randint(jax.random.key(0), (5, 6), 0, 10)
    params = model.init(jax.random.key(1), ids)

    def loss(p, ids):
        return jnp.mean(jnp.sum(model.apply(p, ids) ** 2, axis=(1, 2)))

    with pytest.warns(
        UserWarning, match=r"'emb' \(a layer of no known kind; params \['emb/weight'\]\)"
    ) as record:
        _, _, norms = run(loss, params, ids)
    messages = [str(w.message) for w in record]
    assert not any("fall back" in m for m in messages)
    # the dense layer and the layer norm (an affine norm) keep their fast paths
    assert not any("'fc'" in m or "'ln'" in m for m in messages)
    assert_norms_match(norms, loss, params, ids)


def test_custom_layer_takes_its_own_vjp_jitted_and_under_scan(maybe_jit):
    d = 4
    mixer = nn.layer(
        lambda p, x: x * p["gain"] + jnp.sin(x) @ p["mix"],
        lambda key, x: {"gain": jnp.ones((d,)), "mix": 0.3 * jax.random.normal(key, (d, d))},
        name="mixer",
    )
    x = jax.random.normal(jax.random.key(2), (5, 3, d))
    one = mixer.init(jax.random.key(3), x)
    params = {"head": one, "blocks": jax.tree.map(lambda a: jnp.stack([a, 0.5 * a]), one)}

    def loss(p, x):
        h, _ = jax.lax.scan(lambda h, q: (jnp.tanh(mixer.apply(q, h)), None), x, p["blocks"])
        return jnp.mean(jnp.sum(mixer.apply(p["head"], h) ** 2, axis=(1, 2)))

    with pytest.warns(UserWarning, match="no known kind") as record:
        _, grads, norms = maybe_jit(pe.per_example_grad_norms(loss))(params, x)
    assert not any("fall back" in str(w.message) for w in record)
    owners = {f"{a}/{b}": "mixer" for a in ("blocks", "head") for b in ("gain", "mix")}  # one layer, 2 uses
    assert_norms_match(norms, loss, params, x, owners=owners)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_params_outside_layers_are_per_example_in_the_same_pass():
    """A leaf used only outside the layers (a temperature) is given to the loss broadcast over the
    examples: its gradient in the one backward pass is per example, with no fallback."""
    params, x, y = mlp_setup(batch=4)
    params = dict(params, temperature=jnp.array(1.5))

    def loss(p, x, y):
        rest = {k: v for k, v in p.items() if k != "temperature"}
        logits = mlp.apply(rest, x) / p["temperature"]
        return jnp.mean(jax.nn.logsumexp(logits, 1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_value, grads, norms = run(loss, params, x, y)
    assert_norms_match(norms, loss, params, x, y, owners={"temperature": "temperature"})
    tree_allclose((loss_value, grads), jax.value_and_grad(loss)(params, x, y), rtol=1e-5, atol=1e-6)


def test_params_in_a_loop_outside_layers_fall_back():
    params, x, y = mlp_setup(batch=4)
    params = dict(params, temperature=jnp.array(1.5))

    def loss(p, x, y):  # the temperature carried through a loop: vmap(grad) for that leaf
        rest = {k: v for k, v in p.items() if k != "temperature"}
        t = jax.lax.fori_loop(0, 2, lambda i, t: t * 1.0, p["temperature"])
        logits = mlp.apply(rest, x) / t
        return jnp.mean(jax.nn.logsumexp(logits, 1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])

    with pytest.warns(UserWarning, match=r"'temperature' \(no fast path: the leaf is carried"):
        _, _, norms = run(loss, params, x, y)
    assert_norms_match(norms, loss, params, x, y, owners={"temperature": "temperature"})


def test_dense_shaped_custom_layer_is_caught_by_the_check():
    """A custom layer whose params look dense but whose gradient is not x^T d gets NaN."""
    squash = nn.layer(
        lambda p, x: jnp.tanh(x @ p["weight"] + p["bias"]),
        lambda key, x: nn.dense(3).init(key, x),
        name="squash",
    )
    model = nn.serial(squash=squash, fc=nn.dense(2))
    x = jax.random.normal(jax.random.key(0), (4, 5))
    params = model.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.mean(jnp.sum(model.apply(p, x) ** 2, axis=1))

    _, _, norms = run(loss, params, x)
    assert np.all(np.isnan(norms.params["squash"]["weight"]))
    assert np.all(np.isnan(norms.total))
    total, leaves, _ = reference(loss, params, x)
    np.testing.assert_allclose(norms.params["fc"]["weight"], leaves["fc/weight"], rtol=1e-5)


@pytest.mark.slow
def test_tied_transposed_weight_falls_back_exactly_naming_the_leaf():
    """A weight also used transposed in the loss (tied decoder): that leaf alone falls back to
    vmap(grad), with a warning naming it and the use; the bias keeps its fast path."""
    enc = nn.dense(3, name="enc")
    dec = nn.layer(lambda p, h: h @ p["weight"], name="dec")
    x = jax.random.normal(jax.random.key(0), (4, 5))
    params = {"enc": enc.init(jax.random.key(1), x)}

    def loss(p, x):
        h = jax.nn.relu(enc.apply(p["enc"], x))
        return jnp.mean(jnp.sum((dec.apply({"weight": p["enc"]["weight"].T}, h) - x) ** 2, axis=1))

    with pytest.warns(
        UserWarning, match=r"'enc' \(no fast path: the leaf is also used by a 'transpose' in the loss itself"
    ) as rec:
        _, _, norms = run(loss, params, x)
    message = str(rec[0].message)
    assert "params ['enc/weight'])" in message and "enc/bias" not in message
    assert_norms_match(norms, loss, params, x)


def test_plain_jax_is_matched_and_without_matching_is_per_example_too(monkeypatch):
    w = jax.random.normal(jax.random.key(0), (3, 2))
    x = jax.random.normal(jax.random.key(1), (4, 3))

    def loss(p, x):
        return jnp.mean(jnp.sum(jnp.tanh(x @ p["w"]) ** 2, axis=1))

    # x @ p["w"] is a layer call named "w" (plain-JAX matching): the dense fast path, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, norms = run(loss, {"w": w}, x)
    assert_norms_match(norms, loss, {"w": w}, x, owners={"w": "w"})
    monkeypatch.setenv("VJPKIT_MATCH", "0")  # no layer at all: w given per example, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, norms = run(loss, {"w": w}, x)
    assert_norms_match(norms, loss, {"w": w}, x, owners={"w": "w"})


# ------------------------------------------------------------------------------- bad input


def test_bad_input():
    params, x, y = mlp_setup()
    with pytest.raises(vk.ConfigError, match="reduction must be 'mean'"):
        pe.per_example_grad_norms(mlp_loss, reduction="avg")
    with pytest.raises(vk.ConfigError, match="must return a scalar"):
        pe.per_example_grad_norms(lambda p, x, y: mlp.apply(p, x)[:, 0])(params, x, y)
    with pytest.raises(vk.ConfigError, match="one batch size"):
        pe.per_example_grad_norms(mlp_loss)(params, x, y[:3])
    with pytest.raises(vk.ConfigError, match="at least one batch array"):
        pe.per_example_grad_norms(lambda p: jnp.sum(p["fc1"]["weight"]))(params)
    with pytest.raises(vk.ConfigError, match="conv="):
        pe.per_example_grad_norms(mlp_loss, conv={"conv1": 2})
    with pytest.raises(vk.ConfigError, match="l2_norm_clip"):
        pe.dp_clip(0.0, 1.0, jax.random.key(0))
    with pytest.raises(vk.ConfigError, match="noise_multiplier"):
        pe.dp_clip(1.0, -1.0, jax.random.key(0))
    with pytest.raises(vk.ConfigError, match="step=t"):
        pe.dp_clip(1.0, 1.0, jax.random.key(0))(mlp_loss)(params, x, y)


# ------------------------------------------------------------------------------------- DP


def naive_dp(loss_fn, params, batch, clip, sigma, key, step):
    """DP-SGD the textbook way: vmap(grad), clip each example, sum, add noise, divide by B."""
    return jax.jit(naive_dp_step, static_argnums=(0, 3, 4))(loss_fn, params, batch, clip, sigma, key, step)


def naive_dp_step(loss_fn, params, batch, clip, sigma, key, step):
    grads = per_example_grads(loss_fn, params, *batch)
    b = jax.tree.leaves(batch)[0].shape[0]
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(b, -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
    factor = jnp.minimum(1.0, clip / norms)
    clipped = jax.tree.map(lambda g: jnp.tensordot(factor, g, axes=1), grads)
    noise = pe.dp_noise(key, step, params, sigma * clip)
    return jax.tree.map(lambda c, n: (c + n) / b, clipped, noise), norms


def test_dp_clip_matches_naive():
    params, x, y = mlp_setup(batch=8)
    key, sigma = jax.random.key(3), 1.3
    total, _, _ = reference(mlp_loss, params, x, y)
    clip = float(np.median(total))  # about half the examples are clipped
    dp_grad = jax.jit(pe.dp_clip(clip, sigma, key)(mlp_loss))
    loss, grads, dp_norms = dp_grad(params, x, y, step=5)
    expected, ref_norms = naive_dp(mlp_loss, params, (x, y), clip, sigma, key, 5)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dp_norms.total, ref_norms, rtol=1e-5)
    np.testing.assert_allclose(loss, mlp_loss(params, x, y), rtol=1e-6)


@pytest.mark.slow
def test_dp_clip_cnn_and_sequence_and_fallback():
    """Clipped sums for conv kernels, sequence dense and a fallback leaf, against the naive version."""
    model = nn.serial(conv=nn.conv2d(3, 3, stride=2), flat=nn.flatten(), ln=nn.layer_norm(), fc=nn.dense(2))
    x = jax.random.normal(jax.random.key(0), (6, 6, 5, 2))
    y = jax.random.randint(jax.random.key(1), (6,), 0, 2)
    params = dict(model.init(jax.random.key(2), x), temperature=jnp.array(1.5))

    def loss(p, x, y):  # the temperature is carried through a loop outside any layer: it falls back
        t = jax.lax.fori_loop(0, 2, lambda i, t: t * 1.0, p["temperature"])
        logits = model.apply({k: v for k, v in p.items() if k != "temperature"}, x) / t
        return jnp.mean(jax.nn.logsumexp(logits, 1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])

    key = jax.random.key(4)
    with pytest.warns(UserWarning, match="'temperature'"):
        _, grads, _ = jax.jit(pe.dp_clip(0.3, 0.7, key)(loss))(params, x, y, step=jnp.int32(2))
    expected, _ = naive_dp(loss, params, (x, y), 0.3, 0.7, key, 2)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)


def test_dp_noise_differs_between_steps_and_leaves():
    params, _, _ = mlp_setup()
    a = pe.dp_noise(jax.random.key(0), 0, params, 1.0)
    b = pe.dp_noise(jax.random.key(0), 1, params, 1.0)
    assert not np.allclose(a["fc1"]["weight"], b["fc1"]["weight"])
    assert jax.tree.structure(a) == jax.tree.structure(params)
    tree_allclose(jax.tree.map(jnp.shape, a), jax.tree.map(jnp.shape, params))
