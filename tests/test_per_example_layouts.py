"""Per-example gradient norms on layouts and uses that once gave silently wrong or NaN norms.

Issue 21, items 2, 4 and 8. The example axis of each layer record is found by dataflow (the loss
vmapped over the examples), so time-major layers, batches permuted inside the loss and
``T == B`` are exact; convolutions give their own strides and padding; a leaf used outside its
layers (weight decay in the loss, a tied ``Embed.attend``) falls back exactly with a warning
naming it; Equinox layers under nested ``vmap`` keep their fast path; a layer that mixes the
examples (batch norm in training mode) is a clear error, and a loss that mixes them (centering
over the batch) is caught by ``check=True`` with a warning. The reference is always
``jax.vmap(jax.grad(per_example_loss))`` with the per-example loss ``loss_fn`` on a batch of one,
to 1e-5; where a fast path is expected, warnings are errors. The layout cases run on
``vjpkit.nn``, Flax linen and Equinox (when installed), jitted and eager.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

B = 4  # == T in the time-major cases
MIXES = "loss_fn does not reduce independent per-example losses"


def _key(i):
    return jax.random.key(i)


def oracle(loss, params, *batch):
    """``(total, per-leaf norms, per-example grads)`` from vmap(grad) of the per-example loss
    (``loss`` on a batch of one); the norms in float32, summed in float64."""
    one = lambda p, *ex: loss(p, *jax.tree.map(lambda a: a[None], ex))
    g = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, *[0] * len(batch))))(params, *batch)
    sq = jax.tree.map(lambda a: np.sum(np.square(np.asarray(a, np.float64)).reshape(a.shape[0], -1), 1), g)
    total = np.sqrt(sum(jax.tree.leaves(sq))).astype(np.float32)
    return total, jax.tree.map(lambda a: np.sqrt(a).astype(np.float32), sq), g


def assert_exact(norms, loss, params, *batch):
    total, leaves, _ = oracle(loss, params, *batch)
    tree_allclose(norms.total, total, rtol=1e-5, atol=1e-6)
    tree_allclose(norms.params, leaves, rtol=1e-5, atol=1e-6)


def fast(fn, *args):
    """``fn(*args)`` with every warning an error (a fallback warns), host callbacks included."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fn(*args)
        jax.block_until_ready(out)
        jax.effects_barrier()
    return out


def warned(fn, *args):
    """``(fn(*args), [warning messages])``, host callbacks included."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn(*args)
        jax.block_until_ready(out)
        jax.effects_barrier()
    return out, [str(w.message) for w in rec if issubclass(w.category, UserWarning)]


def norms_of(loss, wrap=jax.jit, **kw):
    return wrap(vk.inspect.per_example_grad_norms(loss, **kw))


# ------------------------------------------------------------------ example axis by dataflow

mlp = nn.serial(fc1=nn.dense(5), act=nn.tanh(), fc2=nn.dense(2))
FRAMEWORKS = ["nn", "linen", "equinox"]


def mlp_for(framework, x):
    """``(params, apply)``: Dense(5), tanh, Dense(2) over the last axis of ``x`` (any leading axes)
    in ``vjpkit.nn``, Flax linen or Equinox (skipped when not installed)."""
    if framework == "nn":
        return mlp.init(_key(1), x), mlp.apply
    if framework == "linen":
        linen = pytest.importorskip("flax.linen")

        class LinenMLP(linen.Module):
            @linen.compact
            def __call__(self, h):
                return linen.Dense(2)(jnp.tanh(linen.Dense(5)(h)))

        model = LinenMLP()
        return model.init(_key(1), x), model.apply
    eqx = pytest.importorskip("equinox")

    class EqxMLP(eqx.Module):
        fc1: eqx.nn.Linear
        fc2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.fc1 = eqx.nn.Linear(x.shape[-1], 5, key=k1)
            self.fc2 = eqx.nn.Linear(5, 2, key=k2)

        def __call__(self, v):  # one vector: vmapped over every leading axis below
            return self.fc2(jnp.tanh(self.fc1(v)))

    params, static = eqx.partition(vk.hookable(EqxMLP(_key(1))), eqx.is_array)

    def apply(p, h):
        f = eqx.combine(p, static)
        for _ in range(h.ndim - 1):
            f = jax.vmap(f)
        return f(h)

    return params, apply


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_time_major_with_t_equal_to_b(framework, maybe_jit):
    x = jax.random.normal(_key(0), (B, B, 3))  # T == B: axis 0 of each layer input is time
    params, apply = mlp_for(framework, x)

    def loss(p, x):  # every layer sees (T, B, d): the batch on axis 1
        return jnp.mean(jnp.sum(apply(p, jnp.swapaxes(x, 0, 1)) ** 2, axis=(0, 2)))

    _, grads, norms = fast(norms_of(loss, maybe_jit), params, x)
    assert_exact(norms, loss, params, x)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_batch_permuted_inside_the_loss(framework, maybe_jit):
    x = jax.random.normal(_key(0), (B, 3))
    y = jax.random.normal(_key(1), (B, 2))
    params, apply = mlp_for(framework, x)

    def loss(p, x, y):  # the rows reach the layers sorted (as a sort by length would)
        order = jnp.argsort(x[:, 0])
        return jnp.mean(jnp.sum((apply(p, x[order]) - y[order]) ** 2, axis=1))

    assert not np.array_equal(np.argsort(np.asarray(x[:, 0])), np.arange(B))  # really permuted
    _, grads, norms = fast(norms_of(loss, maybe_jit), params, x, y)
    assert_exact(norms, loss, params, x, y)
    tree_allclose(grads, jax.grad(loss)(params, x, y), rtol=1e-5, atol=1e-6)


def test_dp_clip_with_the_batch_permuted_inside_the_loss():
    x = jax.random.normal(_key(0), (B, 3))
    y = jax.random.normal(_key(1), (B, 2))
    params = mlp.init(_key(2), x)
    perm = np.array([2, 0, 3, 1])

    def loss(p, x, y):  # a fixed permutation of the batch (the identity on a batch of one or two)
        idx = jnp.asarray(perm if x.shape[0] == B else np.arange(x.shape[0]))
        return jnp.mean(jnp.sum((mlp.apply(p, x[idx]) - y[idx]) ** 2, axis=1))

    total, _, g = oracle(loss, params, x, y)
    clip, key = float(np.median(total)), _key(3)
    dp_grad = jax.jit(vk.inspect.dp_clip(clip, 0.5, key)(loss))
    _, dp_grads, norms = fast(lambda *a: dp_grad(*a, step=0), params, x, y)
    assert_exact(norms, loss, params, x, y)
    factor = np.minimum(1.0, clip / total)
    noise = vk.inspect.dp_noise(key, 0, params, 0.5 * clip)
    expected = jax.tree.map(
        lambda a, n: ((np.tensordot(factor, np.asarray(a), axes=1) + n) / B).astype(np.float32), g, noise
    )
    tree_allclose(dp_grads, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["nn", "linen", "equinox", "nn-layer"])
def test_a_loss_that_mixes_the_examples_warns(where, maybe_jit):
    """Centering over the batch: one example's loss depends on the others, so ``l_i`` (the loss on
    a batch of one) is not its share of the batch loss. ``check=True`` says so in a warning; the
    norms are still exactly those of ``grad l_i``, and the grads their mean."""
    x = jax.random.normal(_key(0), (B, 3))
    y = jax.random.normal(_key(1), (B, 2))
    params, apply = mlp_for("nn" if where == "nn-layer" else where, x)
    center = nn.layer(lambda p, h: h - 0.5 * jnp.mean(h, axis=0), name="center")

    def loss(p, x, y):
        h = apply(p, x)
        h = center.apply({}, h) if where == "nn-layer" else h - 0.5 * jnp.mean(h, axis=0)
        return jnp.mean(jnp.sum((h - y) ** 2, axis=1))

    (_, grads, norms), messages = warned(norms_of(loss, maybe_jit), params, x, y)
    assert len(messages) == 1 and MIXES in messages[0], messages  # only that: no fallback
    assert "(reduction='mean')" in messages[0] and "centering or normalising over the batch" in messages[0]
    assert_exact(norms, loss, params, x, y)
    _, _, g = oracle(loss, params, x, y)
    tree_allclose(grads, jax.tree.map(lambda a: jnp.mean(a, axis=0), g), rtol=1e-5, atol=1e-6)
    batch_grads = jax.grad(loss)(params, x, y)  # of loss_fn on the whole batch: not what it returns
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(batch_grads)))
    fast(norms_of(loss, maybe_jit, check=False), params, x, y)  # check=False: no warning


def test_params_through_inner_jit_and_checkpoint_keep_the_fast_path():
    x = jax.random.normal(_key(0), (B, B, 3))
    params = mlp.init(_key(1), x)
    apply = jax.checkpoint(jax.jit(mlp.apply))  # the layers run inside a jit inside a checkpoint
    loss = lambda p, x: jnp.mean(jnp.sum(apply(p, jnp.swapaxes(x, 0, 1)) ** 2, axis=(0, 2)))
    _, _, norms = fast(norms_of(loss), params, x)
    assert_exact(norms, loss, params, x)


def test_a_layer_whose_input_is_the_same_for_every_example():
    """Its params are lifted over the examples: exact per-example gradients in the same pass."""
    pos = nn.dense(3, name="pos")
    fc = nn.dense(2, name="fc")
    x = jax.random.normal(_key(0), (B, 3, 3))
    params = {"pos": pos.init(_key(1), jnp.eye(3)), "fc": fc.init(_key(2), x)}

    def loss(p, x):  # positional features from constant data: the same for every example
        h = jnp.tanh(x + pos.apply(p["pos"], jnp.eye(x.shape[1])))
        return jnp.mean(jnp.sum(fc.apply(p["fc"], h) ** 2, axis=(1, 2)))

    _, _, norms = fast(norms_of(loss), params, x)
    assert_exact(norms, loss, params, x)

    def shared(p, x):  # the same weights also applied to the examples: no fast path for them
        h = jnp.tanh(x + pos.apply(p["pos"], jnp.eye(x.shape[1])))
        return jnp.mean(jnp.sum(fc.apply(p["fc"], pos.apply(p["pos"], h)) ** 2, axis=(1, 2)))

    with pytest.warns(
        UserWarning, match=r"'pos' \(no fast path: its input does not depend on the example"
    ) as rec:
        _, _, norms = norms_of(shared)(params, x)
    assert "'fc'" not in str(rec[0].message)
    assert_exact(norms, shared, params, x)


def test_linen_positional_embedding_keeps_a_fast_path():
    linen = pytest.importorskip("flax.linen")

    class PosModel(linen.Module):
        @linen.compact
        def __call__(self, ids):
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)  # no example in it
            h = linen.Embed(7, 4)(ids) + linen.Embed(5, 4, name="pos")(positions)
            return linen.Dense(2)(jnp.tanh(h))

    model = PosModel()
    ids = jax.random.randint(_key(0), (B, 5), 0, 7)
    params = model.init(_key(1), ids)
    loss = lambda p, ids: jnp.mean(jnp.sum(model.apply(p, ids) ** 2, axis=(1, 2)))
    _, _, norms = fast(norms_of(loss), params, ids)
    assert_exact(norms, loss, params, ids)


# ------------------------------------------------------------------------- convolutions


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.conv2d(2, 3, padding="VALID"), (B, 5, 5, 2)),  # VALID on width 5 was read as SAME, stride 2
        (nn.conv2d(2, 3, padding=[(0, 2), (2, 0)]), (B, 6, 6, 2)),  # asymmetric: never inferable
        (nn.conv1d(3, 3, stride=2, padding=[(1, 0)]), (B, 7, 2)),
    ],
    ids=["valid-w5", "explicit-2d", "explicit-1d"],
)
def test_nn_convs_give_their_strides_and_padding(layer, shape):
    model = nn.serial(conv=layer, flat=nn.flatten(), fc=nn.dense(1))
    x = jax.random.normal(_key(0), shape)
    params = model.init(_key(1), x)
    loss = lambda p, x: jnp.mean(model.apply(p, x)[:, 0] ** 2)
    _, _, norms = fast(norms_of(loss), params, x)
    assert_exact(norms, loss, params, x)


def test_linen_conv_with_dilation_and_1d():
    linen = pytest.importorskip("flax.linen")

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):  # (B, 9, 8, 2)
            h = linen.Conv(3, (3, 3), kernel_dilation=(2, 1), strides=(1, 2), padding="SAME")(x)
            h = jnp.tanh(h).reshape(h.shape[0], -1, h.shape[-1])
            h = linen.Conv(2, (2,), padding=1)(h)
            return linen.Dense(1)(h.reshape(h.shape[0], -1))[:, 0]

    model = Net()
    x = jax.random.normal(_key(0), (B, 9, 8, 2))
    params = model.init(_key(1), x)
    loss = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
    _, _, norms = fast(norms_of(loss), params, x)
    assert_exact(norms, loss, params, x)


# --------------------------------------------------------- leaves used outside their layers


def _decay_setup():
    x = jax.random.normal(_key(0), (B, 3))
    y = jax.random.randint(_key(1), (B,), 0, 2)
    return mlp.init(_key(2), x), x, y


def _ce(p, x, y):
    logits = mlp.apply(p, x)
    return jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0]


def _penalty(p):
    return p["fc1"]["weight"] ** 2, p["fc2"]["weight"] ** 2


def decayed_loss(p, x, y):  # mean cross-entropy + 1e-3 * sum(w**2) over the weights
    return jnp.mean(_ce(p, x, y)) + 1e-3 * sum(jnp.sum(w2) for w2 in _penalty(p))


def test_weight_decay_in_the_loss_falls_back_naming_the_leaf(maybe_jit):
    """The penalty is part of every per-example loss in full: ``l_i = ce_i + 1e-3 * sum(w**2)``
    (``loss_fn`` on a batch of one), so ``g_i = grad ce_i + 2e-3 w`` and ``mean_i l_i`` is the
    loss. The weights fall back to vmap(grad) with a warning naming them; the biases keep their
    fast path; nothing else warns (the loss keeps to the contract)."""
    params, x, y = _decay_setup()
    (_, grads, norms), messages = warned(norms_of(decayed_loss, maybe_jit), params, x, y)
    assert len(messages) == 1, messages
    message = messages[0]
    for name in ("fc1", "fc2"):
        assert re.search(rf"'{name}' \(no fast path: the leaf is also used by .* in the loss itself", message)
        assert f"params ['{name}/weight'])" in message and f"{name}/bias" not in message
    assert "weight decay in the optimizer" in message
    assert_exact(norms, decayed_loss, params, x, y)
    tree_allclose(grads, jax.grad(decayed_loss)(params, x, y), rtol=1e-5, atol=1e-6)
    # the oracle's definition, spelled out: the cross-entropy's g_i plus the penalty's gradient
    _, _, g_ce = oracle(lambda p, x, y: jnp.mean(_ce(p, x, y)), params, x, y)
    for name in ("fc1", "fc2"):
        g_i = np.asarray(g_ce[name]["weight"]) + 2e-3 * np.asarray(params[name]["weight"])
        want = np.sqrt(np.sum(np.square(g_i.astype(np.float64)), axis=(1, 2))).astype(np.float32)
        tree_allclose(norms.params[name]["weight"], want, rtol=1e-5, atol=1e-6)


def test_weight_decay_with_sum_reduction_breaks_the_contract_and_warns():
    """With ``reduction="sum"``, ``sum_i l_i`` counts a once-per-batch penalty ``B`` times: the
    check says so. The norms are still those of ``grad l_i``, ``l_i`` as above."""
    params, x, y = _decay_setup()

    def loss(p, x, y):
        return jnp.sum(_ce(p, x, y)) + 1e-3 * sum(jnp.sum(w2) for w2 in _penalty(p))

    (_, _, norms), messages = warned(norms_of(loss, reduction="sum"), params, x, y)
    mixing = [m for m in messages if MIXES in m]
    assert len(mixing) == 1 and "(reduction='sum')" in mixing[0] and "weight penalty" in mixing[0]
    assert_exact(norms, loss, params, x, y)


def test_linen_tied_embedding_attend():
    linen = pytest.importorskip("flax.linen")

    class TiedLM(linen.Module):
        @linen.compact
        def __call__(self, ids):
            embed = linen.Embed(7, 4)
            h = jnp.tanh(linen.Dense(4)(embed(ids)))
            return embed.attend(h)  # runs inside TiedLM, not as a layer call of its own

    model = TiedLM()
    ids = jax.random.randint(_key(0), (B, 3), 0, 7)
    params = model.init(_key(1), ids)
    loss = lambda p, ids: jnp.mean(jnp.sum(jax.nn.log_softmax(model.apply(p, ids)), axis=(1, 2)))
    with pytest.warns(
        UserWarning, match=r"'Embed_0' \(no fast path: the leaf is also used by .*'TiedLM'"
    ) as rec:
        _, _, norms = norms_of(loss)(params, ids)
    assert "Embed.attend" in str(rec[0].message) and "Dense_0" not in str(rec[0].message)
    assert_exact(norms, loss, params, ids)


def test_nnx_tied_embedding_attend():
    pytest.importorskip("flax")
    from flax import nnx

    class TiedLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(7, 4, rngs=rngs)
            self.fc = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, ids):
            return self.embed.attend(jnp.tanh(self.fc(self.embed(ids))))

    graphdef, state = nnx.split(vk.hookable(TiedLM(nnx.Rngs(0))))
    ids = jax.random.randint(_key(0), (B, 3), 0, 7)
    loss = lambda s, ids: jnp.mean(jnp.sum(nnx.merge(graphdef, s)(ids) ** 2, axis=(1, 2)))
    with pytest.warns(UserWarning, match=r"'embed' \(no fast path: the leaf is also used") as rec:
        _, _, norms = norms_of(loss)(state, ids)
    assert "'fc'" not in str(rec[0].message)
    assert_exact(norms, loss, state, ids)


def test_a_dense_shaped_custom_layer_gets_nan_with_a_message():
    squash = nn.layer(
        lambda p, x: jnp.tanh(x @ p["weight"] + p["bias"]),
        lambda key, x: nn.dense(3).init(key, x),
        name="squash",
    )
    model = nn.serial(squash=squash, fc=nn.dense(2))
    x = jax.random.normal(_key(0), (B, 5))
    params = model.init(_key(1), x)
    loss = lambda p, x: jnp.mean(jnp.sum(model.apply(p, x) ** 2, axis=1))
    with pytest.warns(UserWarning, match=r"'squash' \(squash/weight\) do not sum to the batch gradient"):
        _, _, norms = norms_of(loss)(params, x)
        jax.block_until_ready(norms)
        jax.effects_barrier()
    assert np.all(np.isnan(norms.params["squash"]["weight"]))
    _, leaves, _ = oracle(loss, params, x)
    tree_allclose(norms.params["fc"], leaves["fc"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- Equinox under nested vmap


def test_equinox_embedding_and_layer_norm_under_nested_vmap(maybe_jit):
    eqx = pytest.importorskip("equinox")

    class Seq(eqx.Module):
        emb: eqx.nn.Embedding
        norm: eqx.nn.LayerNorm
        fc: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.emb = eqx.nn.Embedding(7, 4, key=k1)
            self.norm = eqx.nn.LayerNorm(4)
            self.fc = eqx.nn.Linear(4, 2, key=k2)

        def __call__(self, ids):  # (T,) ids: a vmap over the sequence inside the model
            return jax.vmap(lambda i: self.fc(self.norm(self.emb(i))))(ids)

    params, static = eqx.partition(vk.hookable(Seq(_key(0))), eqx.is_array)
    ids = jax.random.randint(_key(1), (B, 3), 0, 7)
    loss = lambda p, ids: jnp.mean(jnp.sum(jnp.tanh(jax.vmap(eqx.combine(p, static))(ids)) ** 2, axis=(1, 2)))
    _, _, norms = fast(norms_of(loss, maybe_jit), params, ids)
    assert_exact(norms, loss, params, ids)


# ------------------------------------------------------- layers that mix examples: an error


def test_batch_norm_in_training_mode_is_a_clear_error():
    bn, fc = nn.batch_norm(name="bn"), nn.dense(2, name="fc")
    x = jax.random.normal(_key(0), (B, 3))
    params = {"bn": bn.init(_key(1), x), "fc": fc.init(_key(2), x)}

    def loss(p, x):
        h, _ = bn.apply(p["bn"], x, train=True)
        return jnp.mean(jnp.sum(fc.apply(p["fc"], h) ** 2, axis=1))

    with pytest.raises(vk.ConfigError, match=r"\['bn'\] normalise with statistics of the batch"):
        norms_of(loss)(params, x)
    with pytest.raises(vk.ConfigError, match=r"\['bn'\]"):
        vk.inspect.dp_clip(1.0, 1.0, _key(3))(loss)(params, x, step=0)


def test_linen_batch_norm_in_training_mode_is_a_clear_error():
    linen = pytest.importorskip("flax.linen")

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(2)(linen.BatchNorm(use_running_average=False)(x))

    model = Net()
    x = jax.random.normal(_key(0), (B, 3))
    variables = model.init(_key(1), x)

    def loss(p, x):
        y, _ = model.apply({"params": p, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
        return jnp.mean(y**2)

    with pytest.raises(vk.ConfigError, match=r"\['BatchNorm_0'\] normalise with statistics of the batch"):
        norms_of(loss)(variables["params"], x)


def test_a_batch_of_one_is_the_batch_gradient():
    x = jax.random.normal(_key(0), (1, 3))
    y = jax.random.normal(_key(1), (1, 2))
    params = mlp.init(_key(2), x)
    loss = lambda p, x, y: jnp.mean(jnp.sum((mlp.apply(p, x) - y) ** 2, axis=1))
    _, _, norms = fast(norms_of(loss), params, x, y)
    assert norms.total.shape == (1,)
    assert_exact(norms, loss, params, x, y)
