"""Every vjpkit tool on Flax linen, Flax NNX and Equinox models, against references.

One model per framework: ``fc1`` (3 -> 8), tanh, ``fc2`` (8 -> 2), called from the loss as the
root module (a container record named by its class). References are ``jax.grad`` /
``jax.vjp`` of the unchanged model, ``vmap(grad)`` of the per-example loss, and the dense
algebra of a record (``dW = x^T g``, ``db = sum g``, ``dx = g W^T``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose

FRAMEWORKS = ["linen", "nnx", "equinox"]
B = 6


class Case(NamedTuple):
    params: Any
    apply: Callable  # apply(params, x (B, 3)) -> (B, 2)
    dense: Callable  # a layer's params-like subtree -> {"kernel": (in, out), "bias": (out,)}
    sub: Callable  # sub(params-like tree, "fc1") -> that layer's subtree
    root: str

    def loss(self, p, x, y):
        return jnp.mean(jnp.sum((self.apply(p, x) - y) ** 2, axis=1))

    def layer(self, tree, name):
        return self.dense(self.sub(tree, name))


def _linen() -> Case:
    nn = pytest.importorskip("flax.linen", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="fc2")(jnp.tanh(nn.Dense(8, name="fc1")(x)))

    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 3)))
    return Case(
        params,
        model.apply,
        lambda t: {"kernel": t["kernel"], "bias": t["bias"]},
        lambda g, n: g["params"][n],
        "MLP",
    )


def _nnx() -> Case:
    pytest.importorskip("flax", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(3, 8, rngs=rngs)
            self.fc2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    graphdef, state = nnx.split(vk.hookable(MLP(nnx.Rngs(0))))

    def dense(t):
        t = nnx.to_pure_dict(t) if isinstance(t, nnx.State) else t
        return {"kernel": t["kernel"], "bias": t["bias"]}

    return Case(state, lambda s, x: nnx.merge(graphdef, s)(x), dense, lambda g, n: g[n], "MLP")


def _equinox() -> Case:
    eqx = pytest.importorskip("equinox", reason="Equinox is an optional extra: pip install 'vjpkit[equinox]'")

    class MLP(eqx.Module):
        fc1: Any
        fc2: Any

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.fc1 = eqx.nn.Linear(3, 8, key=k1)
            self.fc2 = eqx.nn.Linear(8, 2, key=k2)

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    params, static = eqx.partition(vk.hookable(MLP(jax.random.key(0))), eqx.is_array)
    return Case(
        params,
        lambda p, x: jax.vmap(eqx.combine(p, static))(x),  # vmapped calls: records of the batched calls
        lambda t: {"kernel": t.weight.T, "bias": t.bias},
        getattr,
        "MLP",
    )


CASES = {"linen": _linen, "nnx": _nnx, "equinox": _equinox}


@pytest.fixture(params=FRAMEWORKS)
def case(request) -> Case:
    return CASES[request.param]()


def _data(seed: int = 1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (B, 3)), jax.random.normal(ky, (B, 2))


def _per_example(case: Case, x, y):
    """``g_i = grad l_i`` for each example (``vmap(grad)`` of the loss on a batch of one)."""
    one = lambda p, a, b: case.loss(p, a[None], b[None])
    return jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(case.params, x, y)


def _close(a, b, rtol=1e-5, atol=1e-6):
    tree_allclose(jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b), rtol=rtol, atol=atol)


def test_capture_records_are_dense_algebra_and_jax_grad(case, maybe_jit):
    x, y = _data()
    expected = jax.grad(case.loss)(case.params, x, y)
    grads, cap = maybe_jit(vk.grad(case.loss, capture=["fc1", "fc2", case.root]))(case.params, x, y)
    _close(grads, expected)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    for name in ("fc1", "fc2"):
        rec = cap[name]
        p, g = case.dense(rec.params), case.dense(rec.grad_params)
        _close(p, case.layer(case.params, name))
        _close(g, case.layer(expected, name))
        np.testing.assert_allclose(rec.output, rec.input @ p["kernel"] + p["bias"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g["kernel"], rec.input.T @ rec.grad_output, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g["bias"], rec.grad_output.sum(0), rtol=1e-5, atol=1e-6)
    fc1, fc2 = cap["fc1"], cap["fc2"]
    assert fc1.grad_input is None  # the data needs no gradient
    w2 = case.layer(case.params, "fc2")["kernel"]
    np.testing.assert_allclose(fc2.grad_input, fc2.grad_output @ w2.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fc2.grad_output, 2.0 * (fc2.output - y) / B, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fc1.grad_output, fc2.grad_input * (1 - fc2.input**2), rtol=1e-5, atol=1e-6)
    # the root module's record: all params, the model's input and output
    _close(jax.tree.leaves(cap[case.root].grad_params), jax.tree.leaves(expected))
    np.testing.assert_allclose(cap[case.root].output, fc2.output, rtol=1e-6)


def test_rewriting_and_host_hooks(case, maybe_jit):
    x, y = _data()
    expected = jax.grad(case.loss)(case.params, x, y)

    def rewrite(rec):
        doubled = jax.tree.map(lambda g: 2.0 * g, rec.grad_params)
        return rec.replace(grad_input=3.0 * rec.grad_input, grad_params=doubled)

    seen = []
    hooks = {"fc2": rewrite, "*": vk.on_host(lambda rec: seen.append((rec.name, rec.grad_output)))}
    grads = maybe_jit(vk.grad(case.loss, hooks=hooks))(case.params, x, y)
    jax.block_until_ready(grads)
    _close(case.layer(grads, "fc2"), jax.tree.map(lambda g: 2.0 * g, case.layer(expected, "fc2")))
    _close(case.layer(grads, "fc1"), jax.tree.map(lambda g: 3.0 * g, case.layer(expected, "fc1")))
    names = [n for n, _ in seen]
    assert sorted(names) == sorted([case.root, "fc1", "fc2"])
    assert names.index("fc2") < names.index("fc1")  # backward order
    out = case.apply(case.params, x)
    np.testing.assert_allclose(dict(seen)["fc2"], 2.0 * (out - y) / B, rtol=1e-5, atol=1e-6)


def test_hook_state_ema_normalize(case, maybe_jit):
    decay, eps = 0.9, 1e-8
    g = vk.value_and_grad(case.loss, hooks={"fc2": vk.ema_normalize(decay, eps)})
    x, y = _data()
    state = vk.init_hook_state(g, case.params, x, y)
    step = maybe_jit(g)
    mean = var = None
    for t in range(1, 4):
        x, y = _data(t)
        (loss, grads), state = step(case.params, x, y, hook_state=state)
        expected = jax.grad(case.loss)(case.params, x, y)
        ref = case.layer(expected, "fc2")
        mean = {
            k: (0 if mean is None else decay * mean[k]) + (1 - decay) * jnp.mean(v) for k, v in ref.items()
        }
        var = {k: (0 if var is None else decay * var[k]) + (1 - decay) * jnp.var(v) for k, v in ref.items()}
        c = 1 - decay**t
        normalized = {k: (v - mean[k] / c) / (jnp.sqrt(var[k] / c) + eps) for k, v in ref.items()}
        np.testing.assert_allclose(loss, case.loss(case.params, x, y), rtol=1e-6)
        _close(case.layer(grads, "fc2"), normalized, rtol=1e-4, atol=1e-5)
        _close(case.layer(grads, "fc1"), case.layer(expected, "fc1"))  # only grad_params rewritten
    s = state["fc2"]
    assert float(s.count) == 3.0
    _close(case.dense(s.mean), mean)
    _close(case.dense(s.var), var)


def test_vjp_with_hooks(case, maybe_jit):
    x, _ = _data()
    seed = jax.random.normal(jax.random.key(7), (B, 2))
    fun = lambda p: case.apply(p, x)
    out_ref, pull_ref = jax.vjp(fun, case.params)
    (expected,) = pull_ref(seed)
    seen = {}

    def run(p, s):
        out, pull = vk.vjp(fun, p, hooks={"fc*": vk.on_host(lambda rec: seen.setdefault(rec.name, rec))})
        return out, pull(s)

    out, (grads,) = maybe_jit(run)(case.params, seed)
    jax.block_until_ready((out, grads))
    _close(out, out_ref)
    _close(grads, expected)
    fc2 = seen["fc2"]
    np.testing.assert_allclose(fc2.grad_output, seed, rtol=1e-6)  # the seed is the last layer's grad_output
    np.testing.assert_allclose(
        case.dense(fc2.grad_params)["kernel"], fc2.input.T @ seed, rtol=1e-5, atol=1e-6
    )


def test_explain_lists_every_call(case, capsys):
    x, y = _data()
    rows = vk.explain(case.loss, case.params, x, y)
    assert [r["name"] for r in rows] == [case.root, "fc1", "fc2"]
    by_name = {r["name"]: r for r in rows}
    printed = capsys.readouterr().out
    assert "fc1" in printed and "fc2" in printed
    expected = jax.grad(case.loss)(case.params, x, y)
    shapes = jax.tree.map(lambda a: a.shape, case.sub(expected, "fc1"))
    assert jax.tree.map(lambda a: a.shape, by_name["fc1"]["grad_params"]) == shapes
    assert by_name["fc2"]["grad_output"].shape == (B, 2)
    assert by_name["fc1"]["grad_input"] is None


def test_find_nonfinite_names_the_layer(case, capsys):
    x, y = _data()
    report = vk.inspect.find_nonfinite(case.loss, case.params, x, y)
    assert not report
    x_bad = x.at[2, 1].set(jnp.inf)
    report = vk.inspect.find_nonfinite(case.loss, case.params, x_bad, y)
    # by hand: tanh saturates, so the outputs and the loss stay finite, and fc1's kernel gradient
    # x^T g is the first non-finite cotangent; forward, the data entering the model is infinite
    assert np.isfinite(case.loss(case.params, x_bad, y))
    plain = case.layer(jax.grad(case.loss)(case.params, x_bad, y), "fc1")["kernel"]
    assert not np.isfinite(np.asarray(plain)).all()
    assert report and report.loss_finite
    assert (report.layer, report.field) == ("fc1", "grad_params")
    assert report.counts["grad_params"] == int(np.sum(~np.isfinite(np.asarray(plain))))
    assert (report.forward_layer, report.forward_field) == (case.root, "input")
    assert report.per_layer["fc2"]["grad_input"] == 0
    assert "'fc1' grad_params" in capsys.readouterr().out


def test_gradient_stats_against_per_example_gradients(case, maybe_jit):
    x, y = _data()
    per = _per_example(case, x, y)
    expected = jax.grad(case.loss)(case.params, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fast paths for all three: no vmap(grad) fallback
        loss, grads, stats = maybe_jit(vk.inspect.gradient_stats(case.loss, "fc*"))(case.params, x, y)
    _close(grads, expected)
    np.testing.assert_allclose(loss, case.loss(case.params, x, y), rtol=1e-6)
    assert set(stats) == {"fc1", "fc2"}
    for name in ("fc1", "fc2"):
        g = jax.tree.leaves(case.sub(per, name))  # per-example leaves, batch on axis 0
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(a.mean(0))) for a in g))
        var = sum(jnp.sum(jnp.var(a, axis=0)) for a in g)
        np.testing.assert_allclose(stats[name].grad_norm, norm, rtol=1e-5)
        np.testing.assert_allclose(stats[name].variance_sum, var, rtol=1e-4)
        np.testing.assert_allclose(stats[name].snr, norm**2 / var, rtol=1e-4)


def test_per_example_norms_and_dp_clip(case, maybe_jit):
    x, y = _data()
    per = _per_example(case, x, y)
    sq = {
        n: sum(jnp.sum(jnp.square(a).reshape(B, -1), 1) for a in jax.tree.leaves(case.sub(per, n)))
        for n in ("fc1", "fc2")
    }
    total = jnp.sqrt(sq["fc1"] + sq["fc2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, norms = maybe_jit(vk.inspect.per_example_grad_norms(case.loss))(case.params, x, y)
        np.testing.assert_allclose(norms.total, total, rtol=1e-5)
        for n in ("fc1", "fc2"):
            np.testing.assert_allclose(norms.layers[n], jnp.sqrt(sq[n]), rtol=1e-5)
        clip, sigma, key = 0.5 * float(jnp.median(total)), 0.7, jax.random.key(3)
        dp = maybe_jit(vk.inspect.dp_clip(clip, sigma, key)(case.loss))
        _, dp_grads, _ = dp(case.params, x, y, step=4)
    factor = jnp.minimum(1.0, clip / total)
    noise = vk.inspect.dp_noise(key, 4, case.params, sigma * clip)
    ref = jax.tree.map(lambda g, n: (jnp.tensordot(factor, g, axes=1) + n) / B, per, noise)
    _close(dp_grads, ref, rtol=1e-4, atol=1e-5)


def test_fit_with_recorder_against_a_plain_sgd_loop(case):
    optax = pytest.importorskip("optax")
    x, y = _data()
    lr, steps = 0.1, 3
    spec = vk.capture(["fc1", "fc2"], fields=["grad_params"], reduce=["norm"])
    recorder = vk.inspect.Recorder(last=10, spec=spec)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float
        state, history = vk.train.fit(
            lambda p, batch: case.loss(p, *batch),
            optax.sgd(lr),
            case.params,
            (x, y),
            batch_size=B,  # the whole data set: shuffling does not change the mean loss
            steps=steps,
            capture=spec,
            on_records=recorder.update,
            progress=False,
            log_every=1,
        )
    p, kernel_norms = case.params, []
    for _ in range(steps):
        g = jax.grad(case.loss)(p, x, y)
        kernel_norms.append(jnp.linalg.norm(case.layer(g, "fc2")["kernel"]))
        p = jax.tree.map(lambda a, b: a - lr * b, p, g)
    _close(state.params, p, rtol=1e-4, atol=1e-6)
    series = [s for s in recorder.keys if s.key == "fc2" and s.path in ("kernel", "weight")]
    assert len(series) == 1
    steps_seen, recorded = recorder.series("fc2", "grad_params", series[0].path, "norm")
    assert list(steps_seen) == list(range(steps))
    np.testing.assert_allclose(recorded, kernel_norms, rtol=1e-4)
    np.testing.assert_allclose(history["loss"][0], case.loss(case.params, x, y), rtol=1e-5)


def test_equinox_model_inside_lax_scan_gives_one_record_per_iteration(maybe_jit):
    case = _equinox()
    xs = jax.random.normal(jax.random.key(4), (5, B, 3))  # 5 time steps

    def loss(p, xs):
        def body(carry, xt):
            return carry + jnp.sum(case.apply(p, xt) ** 2), None

        return jax.lax.scan(body, jnp.float32(0.0), xs)[0]

    expected = jax.grad(loss)(case.params, xs)
    grads, cap = maybe_jit(vk.grad(loss, capture="fc2"))(case.params, xs)
    _close(grads, expected)
    rec = cap["fc2"]
    assert rec.input.shape == (5, B, 8)  # leaves stacked on the iteration axis
    for t in range(5):
        np.testing.assert_allclose(
            rec.grad_params.weight[t].T, rec.input[t].T @ rec.grad_output[t], rtol=1e-5
        )
        np.testing.assert_allclose(rec.grad_output[t], 2.0 * rec.output[t], rtol=1e-5, atol=1e-6)
    _close(jax.tree.map(lambda a: a.sum(0), rec.grad_params), expected.fc2)


def test_linen_apply_inside_vmap_records_the_batched_call(maybe_jit):
    case = _linen()
    x, y = _data()

    def loss(p, x, y):  # the model applied to one example at a time, vmapped
        out = jax.vmap(lambda xi: case.apply(p, xi))(x)
        return jnp.mean(jnp.sum((out - y) ** 2, axis=1))

    expected = jax.grad(loss)(case.params, x, y)
    grads, cap = maybe_jit(vk.grad(loss, capture=["fc1", "fc2"]))(case.params, x, y)
    _close(grads, expected)
    for name in ("fc1", "fc2"):
        rec = cap[name]
        assert "#1" not in " ".join(cap)  # one record per layer: the batched call
        assert rec.input.shape[0] == B
        _close(rec.grad_params, case.sub(expected, name))
        np.testing.assert_allclose(
            rec.grad_params["kernel"], rec.input.T @ rec.grad_output, rtol=1e-5, atol=1e-6
        )


def _check_rnn_records(rec, kernel_t, h0, xs, expected_kernel):
    """Per-iteration records of ``h <- tanh(fc(h) + x_t)``: stacked, each ``dW_t = h_t^T g_t``."""
    steps = xs.shape[0]
    assert rec.input.shape == (steps, *h0.shape)
    np.testing.assert_array_equal(rec.input[0], h0)
    for t in range(steps):
        np.testing.assert_allclose(
            kernel_t(rec, t), rec.input[t].T @ rec.grad_output[t], rtol=1e-5, atol=1e-6
        )
        if t + 1 < steps:  # the next iteration's input is this one's new state
            np.testing.assert_allclose(
                rec.input[t + 1], jnp.tanh(rec.output[t] + xs[t]), rtol=1e-5, atol=1e-6
            )
    total = sum(kernel_t(rec, t) for t in range(steps))
    np.testing.assert_allclose(total, expected_kernel, rtol=1e-5, atol=1e-6)


def test_nnx_module_inside_lax_scan_gives_one_record_per_iteration(maybe_jit):
    pytest.importorskip("flax", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")
    from flax import nnx

    class RNN(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, h, xs):
            return jax.lax.scan(lambda h, x: (jnp.tanh(self.fc(h) + x), None), h, xs)[0]

    graphdef, state = nnx.split(vk.hookable(RNN(nnx.Rngs(0))))
    xs = jax.random.normal(jax.random.key(4), (5, 2, 3))
    h0 = jax.random.normal(jax.random.key(5), (2, 3))
    loss = lambda s, h0, xs: jnp.sum(nnx.merge(graphdef, s)(h0, xs) ** 2)
    expected = jax.grad(loss)(state, h0, xs)
    grads, cap = maybe_jit(vk.grad(loss, capture="fc"))(state, h0, xs)
    _close(nnx.to_pure_dict(grads), nnx.to_pure_dict(expected))
    kernel_t = lambda rec, t: rec.grad_params["kernel"][t]
    _check_rnn_records(cap["fc"], kernel_t, h0, xs, expected["fc"]["kernel"][...])


def test_linen_nn_scan_gives_one_record_per_iteration(maybe_jit):
    nn = pytest.importorskip("flax.linen", reason="Flax is an optional extra: pip install 'vjpkit[flax]'")

    class Step(nn.Module):
        @nn.compact
        def __call__(self, h, x):
            h = jnp.tanh(nn.Dense(3, name="fc")(h) + x)
            return h, None

    class RNN(nn.Module):
        @nn.compact
        def __call__(self, h, xs):
            scan = nn.scan(Step, variable_broadcast="params", split_rngs={"params": False})
            return scan(name="step")(h, xs)[0]

    model = RNN()
    xs = jax.random.normal(jax.random.key(4), (5, 2, 3))
    h0 = jax.random.normal(jax.random.key(5), (2, 3))
    params = model.init(jax.random.key(0), h0, xs)
    loss = lambda p, h0, xs: jnp.sum(model.apply(p, h0, xs) ** 2)
    expected = jax.grad(loss)(params, h0, xs)
    grads, cap = maybe_jit(vk.grad(loss, capture="step/fc"))(params, h0, xs)
    _close(grads, expected)
    kernel_t = lambda rec, t: rec.grad_params["kernel"][t]
    _check_rnn_records(cap["step/fc"], kernel_t, h0, xs, expected["params"]["step"]["fc"]["kernel"])


def test_linen_under_nested_hooked_transforms(maybe_jit):
    """grad of a hooked grad: the interception is installed once, each module call is one call."""
    case = _linen()
    x, y = _data()
    inner = []

    def penalty(p):
        g = vk.grad(case.loss, hooks={"*": vk.on_host(lambda rec: inner.append(rec.name))})(p, x, y)
        return sum(jnp.sum(a**2) for a in jax.tree.leaves(g))

    plain = lambda p: sum(jnp.sum(a**2) for a in jax.tree.leaves(jax.grad(case.loss)(p, x, y)))
    expected = jax.grad(plain)(case.params)
    grads = maybe_jit(vk.grad(penalty, hooks={"fc*": lambda rec: None}))(case.params)
    jax.block_until_ready(grads)
    _close(grads, expected, rtol=1e-4, atol=1e-6)
    assert sorted(inner) == sorted(["fc1", "fc2", case.root])  # once each, no double interception
