"""In-graph capture: records as arrays, equal to hand-chained vjps, under jit/scan/vmap/grad-of-grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.models import conv_fn, dense_fn, max_pool_fn, mlp, mlp_chain, mlp_loss, mlp_setup

FIELDS = ("input", "output", "grad_output", "grad_input", "grad_params")


def check_against_chain(captured, reference, rtol=1e-5, atol=1e-6):
    assert sorted(captured) == sorted(reference)
    for key, rec in captured.items():
        assert isinstance(rec, vk.Cotangents) and rec.key == key
        for field in FIELDS:
            expected = reference[key][field]
            got = getattr(rec, field)
            if expected is None:
                assert got is None, f"{key}.{field}"
            else:
                tree_allclose(got, expected, rtol=rtol, atol=atol)


def test_whole_records_equal_hand_chained_vjps(maybe_jit):
    params, x, y = mlp_setup()
    g = maybe_jit(vk.value_and_grad(mlp_loss, capture="fc*"))
    (value, grads), captured = g(params, x, y)
    check_against_chain(captured, mlp_chain(params, x, y))
    for key in captured:
        tree_allclose(captured[key].params, params[key])
    v0, g0 = jax.value_and_grad(mlp_loss)(params, x, y)
    tree_allclose(value, v0)
    tree_allclose(grads, g0, rtol=1e-6, atol=1e-7)


def test_capture_forms_and_return_structure(maybe_jit):
    params, x, y = mlp_setup()
    aux_loss = lambda p, x, y: (mlp_loss(p, x, y), jnp.sum(x))
    (grads, aux), captured = maybe_jit(vk.grad(aux_loss, has_aux=True, capture=["fc1", "fc3"]))(params, x, y)
    assert sorted(captured) == ["fc1", "fc3"]
    tree_allclose(aux, jnp.sum(x))
    (gp, gx), captured = maybe_jit(vk.grad(mlp_loss, argnums=(0, 1), capture="fc1"))(params, x, y)
    tree_allclose((gp, gx), jax.grad(mlp_loss, argnums=(0, 1))(params, x, y), rtol=1e-6, atol=1e-7)
    # x is now differentiated, so fc1's grad_input exists and equals dL/dx
    tree_allclose(captured["fc1"].grad_input, gx, rtol=1e-6, atol=1e-7)


REDUCERS = {
    "norm": lambda a: np.sqrt(np.sum(np.square(a.astype(np.float64)))),
    "mean": lambda a: np.mean(a.astype(np.float64)),
    "var": lambda a: np.var(a.astype(np.float64)),
    "min": np.min,
    "max": np.max,
    "nonfinite_count": lambda a: np.sum(~np.isfinite(a)),
}


def test_reductions_match_numpy(maybe_jit):
    params, x, y = mlp_setup(batch=16)
    spec = vk.capture("fc*", fields=["grad_output", "grad_params"], reduce=list(REDUCERS))
    _, captured = maybe_jit(vk.grad(mlp_loss, capture=spec))(params, x, y)
    reference = mlp_chain(params, x, y)
    for key, rec in captured.items():
        assert rec.input is None and rec.output is None and rec.grad_input is None and rec.params is None
        for field in ("grad_output", "grad_params"):
            ref_leaves = jax.tree.leaves(reference[key][field])
            got_leaves = jax.tree.leaves(
                getattr(rec, field), is_leaf=lambda d: isinstance(d, dict) and "norm" in d
            )
            assert len(ref_leaves) == len(got_leaves)
            for ref, got in zip(ref_leaves, got_leaves):
                assert sorted(got) == sorted(REDUCERS)
                for name, fn in REDUCERS.items():
                    assert got[name].dtype == jnp.float32 and got[name].shape == ()
                    np.testing.assert_allclose(
                        got[name], fn(np.asarray(ref)), rtol=2e-5, atol=1e-8, err_msg=name
                    )


@pytest.mark.parametrize("shape", [(7,), (33,), (37,), (20, 30), (64, 10), (1021,), (1056,), (4096,)])
def test_norm_in_blocks_is_the_norm_and_one_reduction(maybe_jit, shape):
    """``reduce="norm"`` (and ``mean``, ``nonfinite_count``) sums a leaf shorter than 4096 in
    blocks (``_capture._blocks``: exact axes of at most 32, or zero-padded when the length has a
    prime factor above 32): the values are numpy's, the norm's gradient is the norm's, and XLA
    compiles the sum without a tree of ``reduce-window``s."""
    from vjpkit._capture import REDUCTIONS

    norm = REDUCTIONS["norm"]
    a = jax.random.normal(jax.random.key(sum(shape)), shape)
    want = np.sqrt(np.sum(np.square(np.asarray(a, np.float64))))
    np.testing.assert_allclose(maybe_jit(norm)(a), want, rtol=2e-6)
    tree_allclose(maybe_jit(jax.grad(norm))(a), a / jnp.linalg.norm(a), rtol=1e-5)
    np.testing.assert_allclose(
        maybe_jit(REDUCTIONS["mean"])(a), np.mean(np.asarray(a, np.float64)), atol=1e-6
    )
    bad = a.ravel().at[::5].set(jnp.nan).at[1::7].set(-jnp.inf).reshape(shape)
    count = maybe_jit(REDUCTIONS["nonfinite_count"])(bad)
    assert count.dtype == jnp.float32 and float(count) == np.sum(~np.isfinite(np.asarray(bad)))
    if a.size < 4096:
        for name in ("norm", "mean", "nonfinite_count"):
            hlo = jax.jit(lambda a, name=name: REDUCTIONS[name](a * 2.0)).lower(a).compile().as_text()
            assert "reduce-window" not in hlo, name


def test_reductions_of_a_conv_net_match_numpy(maybe_jit):
    """Every reduction of every field of a conv / ReLU / max-pool / flatten / dense net equals
    numpy's on the hand-chained ``jax.vjp`` cotangents. The reductions read each leaf flattened;
    a max-pool's ``grad_input`` is computed in the pool's window shape, and a ReLU's
    ``grad_input`` is the conv's ``grad_output``, so these are the cases the formulation is for."""
    model = vk.nn.serial(
        conv=vk.nn.conv2d(4, 3),
        relu=vk.nn.relu(),
        pool=vk.nn.max_pool(2),
        flat=vk.nn.flatten(),
        fc=vk.nn.dense(3),
    )
    kx, ky = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (5, 8, 8, 2))
    y = jax.random.randint(ky, (5,), 0, 3)
    params = model.init(jax.random.key(4), x)

    def head(logits):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    loss = lambda p, x: head(model.apply(p, x))
    h = conv_fn(params["conv"], x)
    a = jax.nn.relu(h)
    m = max_pool_fn(a)
    f = m.reshape(5, -1)
    g_logits = jax.grad(head)(dense_fn(params["fc"], f))
    g_fc, g_f = jax.vjp(dense_fn, params["fc"], f)[1](g_logits)
    g_m = g_f.reshape(m.shape)
    (g_a,) = jax.vjp(max_pool_fn, a)[1](g_m)
    (g_h,) = jax.vjp(jax.nn.relu, h)[1](g_a)
    g_conv, _ = jax.vjp(conv_fn, params["conv"], x)[1](g_h)
    reference = {
        "conv": dict(grad_output=g_h, grad_input=None, grad_params=g_conv),
        "relu": dict(grad_output=g_a, grad_input=g_h, grad_params={}),
        "pool": dict(grad_output=g_m, grad_input=g_a, grad_params={}),
        "flat": dict(grad_output=g_f, grad_input=g_m, grad_params={}),
        "fc": dict(grad_output=g_logits, grad_input=g_f, grad_params=g_fc),
    }
    fields = ["grad_output", "grad_input", "grad_params"]
    for reduce in ("norm", list(REDUCERS)):
        spec = vk.capture("*", fields=fields, reduce=reduce)
        grads, captured = maybe_jit(vk.grad(loss, capture=spec))(params, x)
        tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-7)
        assert sorted(captured) == sorted(reference)
        for key, ref in reference.items():
            for field in fields:
                got = getattr(captured[key], field)
                if ref[field] is None:
                    assert got is None, (key, field)
                    continue
                ref_leaves = jax.tree.leaves(ref[field])
                got_leaves = jax.tree.leaves(got, is_leaf=lambda d: isinstance(d, dict) and "norm" in d)
                assert len(ref_leaves) == len(got_leaves), (key, field)
                for r, g in zip(ref_leaves, got_leaves):
                    g = g if isinstance(g, dict) else {"norm": g}
                    for name, value in g.items():
                        assert value.dtype == jnp.float32 and value.shape == ()
                        np.testing.assert_allclose(
                            value,
                            REDUCERS[name](np.asarray(r)),
                            rtol=2e-5,
                            atol=1e-7,
                            err_msg=f"{key}.{field}.{name}",
                        )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_reductions_of_low_precision_leaves_are_float32(maybe_jit, dtype):
    """A bfloat16 / float16 leaf is reduced in float32: equal to numpy's on its float32 values
    (under jit too, where XLA may keep the float32 values a leaf was rounded from)."""
    w = jax.random.normal(jax.random.key(5), (6, 4)).astype(dtype)
    x = jax.random.normal(jax.random.key(6), (3, 6)).astype(dtype)
    layer = vk.nn.layer(lambda p, x: x @ p["w"], name="mm")
    loss = lambda p, x: jnp.sum(layer.apply(p, x).astype(jnp.float32) ** 2)
    spec = vk.capture("mm", fields=["input", "output", "grad_output", "grad_params"], reduce=list(REDUCERS))
    _, captured = maybe_jit(vk.grad(loss, capture=spec))({"w": w}, x)
    rec = captured["mm"]
    out, pullback = jax.vjp(lambda w: x @ w, w)
    grad_out = jax.grad(lambda o: jnp.sum(o.astype(jnp.float32) ** 2))(out)
    (grad_w,) = pullback(grad_out)
    assert grad_out.dtype == grad_w.dtype == dtype
    for got, ref in (
        (rec.input, x),
        (rec.output, out),
        (rec.grad_output, grad_out),
        (rec.grad_params["w"], grad_w),
    ):
        ref = np.asarray(ref.astype(jnp.float32))
        for name, fn in REDUCERS.items():
            assert got[name].dtype == jnp.float32
            np.testing.assert_allclose(got[name], fn(ref), rtol=2e-5, atol=1e-7, err_msg=name)


def test_histogram_and_nonfinite_counts(maybe_jit):
    params, x, y = mlp_setup(batch=32)
    hist = vk.histogram(8, (-0.05, 0.05))
    spec = vk.capture("fc2", fields=["grad_output"], reduce=hist)
    _, captured = maybe_jit(vk.grad(mlp_loss, capture=spec))(params, x, y)
    ref = np.asarray(mlp_chain(params, x, y)["fc2"]["grad_output"]).ravel()
    edges = np.linspace(-0.05, 0.05, 9)
    expected, _ = np.histogram(np.clip(ref, -0.05, 0.05 - 1e-12), bins=edges)
    np.testing.assert_array_equal(captured["fc2"].grad_output, expected.astype(np.float32))
    assert captured["fc2"].grad_output.sum() == ref.size

    # a log of a negative number in the middle of the net: NaNs counted in-graph
    bad = vk.nn.serial(
        fc=vk.nn.dense(3), log=vk.nn.layer(lambda p, h: jnp.log(h), name="log"), out=vk.nn.dense(1)
    )
    p = bad.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.sum(bad.apply(p, x))
    spec = vk.capture("*", fields=["output", "grad_output"], reduce="nonfinite_count")
    _, captured = maybe_jit(vk.grad(loss, capture=spec))(p, x)
    h = np.asarray(dense_fn(p["fc"], x)).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected_bad = np.sum(~np.isfinite(np.log(h)))
    assert expected_bad > 0
    np.testing.assert_array_equal(captured["log"].output, expected_bad)
    assert float(captured["fc"].output) == 0.0


def test_weight_sharing_gets_one_slot_per_call(maybe_jit):
    params, x, y = mlp_setup()
    proj = jnp.ones((2, 3)) / 3

    def twice(p, x, y):
        return mlp_loss(p, mlp.apply(p, x) @ proj, y)

    _, captured = maybe_jit(vk.grad(twice, capture="fc3"))(params, x, y)
    assert sorted(captured) == ["fc3", "fc3#1"]
    # hand-chained: the second application's fc3 sees h = first output @ proj as its input chain
    first_out = mlp.apply(params, x)
    ref_second = mlp_chain(params, first_out @ proj, y)["fc3"]
    tree_allclose(captured["fc3#1"].grad_output, ref_second["grad_output"], rtol=1e-5, atol=1e-7)
    tree_allclose(captured["fc3#1"].input, ref_second["input"])
    # the first call's cotangent is what flows back through proj and the second pass
    g_first_out = jax.grad(lambda o: mlp_loss(params, o @ proj, y))(first_out)
    tree_allclose(captured["fc3"].grad_output, g_first_out, rtol=1e-5, atol=1e-7)
    summed = jax.tree.map(jnp.add, captured["fc3"].grad_params, captured["fc3#1"].grad_params)
    tree_allclose(summed, jax.grad(twice)(params, x, y)["fc3"], rtol=1e-5, atol=1e-7)


def test_capture_under_scan_stacks_steps():
    params, x, y = mlp_setup()
    g = vk.grad(mlp_loss, capture="fc*")

    def body(p, xb):
        grads, captured = g(p, xb, y)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, grads), captured

    xs = jnp.stack([x, 0.5 * x, -x])
    _, stacked = jax.jit(lambda p, xs: jax.lax.scan(body, p, xs))(params, xs)
    p = params
    for k in range(3):
        check_against_chain(jax.tree.map(lambda a, k=k: a[k], stacked), mlp_chain(p, xs[k], y))
        p = jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(mlp_loss)(p, xs[k], y))


def test_capture_under_vmap_is_per_example(maybe_jit):
    params, x, y = mlp_setup(batch=4)
    per_example = lambda p, xi, yi: mlp_loss(p, xi[None], yi[None])
    g = maybe_jit(jax.vmap(vk.grad(per_example, capture="fc*"), in_axes=(None, 0, 0)))
    grads, captured = g(params, x, y)
    for i in range(4):
        check_against_chain(
            jax.tree.map(lambda a, i=i: a[i], captured), mlp_chain(params, x[i : i + 1], y[i : i + 1])
        )
    tree_allclose(
        grads, jax.vmap(jax.grad(per_example), in_axes=(None, 0, 0))(params, x, y), rtol=1e-5, atol=1e-7
    )


def test_grad_of_captured_statistics(maybe_jit):
    """Differentiating through captured values equals differentiating the hand-chained reference."""
    params, x, y = mlp_setup()
    spec = vk.capture("fc2", fields=["grad_output"], reduce="norm")

    def captured_norm(p):
        _, captured = vk.grad(mlp_loss, capture=spec)(p, x, y)
        return captured["fc2"].grad_output

    def reference_norm(p):
        return jnp.linalg.norm(mlp_chain(p, x, y)["fc2"]["grad_output"])

    tree_allclose(maybe_jit(captured_norm)(params), reference_norm(params), rtol=1e-5)
    tree_allclose(
        maybe_jit(jax.grad(captured_norm))(params), jax.grad(reference_norm)(params), rtol=1e-4, atol=1e-7
    )


def test_captured_record_is_after_hooks(maybe_jit):
    params, x, y = mlp_setup()
    halve = lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: g / 2, rec.grad_params))
    _, captured = maybe_jit(vk.grad(mlp_loss, hooks={"fc2": halve}, capture="fc2"))(params, x, y)
    ref = mlp_chain(params, x, y)["fc2"]["grad_params"]
    tree_allclose(captured["fc2"].grad_params, jax.tree.map(lambda g: g / 2, ref), rtol=1e-5, atol=1e-7)


def test_host_delivery_one_transfer_per_step():
    params, x, y = mlp_setup()
    steps = []
    spec = vk.capture("fc*", fields=["grad_params"], reduce="norm", host=vk.on_host(steps.append))
    g = jax.jit(vk.grad(mlp_loss, capture=spec))
    outs = [g(params, x + i, y) for i in range(3)]
    jax.block_until_ready(outs)
    _, captured = outs[-1]
    assert len(steps) == 3 and all(sorted(s) == ["fc1", "fc2", "fc3"] for s in steps)
    tree_allclose(steps[-1], jax.tree.map(np.asarray, captured))


def test_host_delivery_every_n_is_gated_in_graph():
    params, x, y = mlp_setup()
    steps = []
    spec = vk.capture("fc1", fields=["grad_params"], reduce="norm", host=vk.on_host(steps.append, every=3))
    g = vk.grad(mlp_loss, capture=spec)
    with pytest.raises(vk.ConfigError, match="hook_state"):
        g(params, x, y)
    state = vk.init_hook_state(g, params, x, y)
    step = jax.jit(g)
    norms = []
    for i in range(7):
        grads, captured, state = step(params, x + i, y, hook_state=state)
        norms.append(captured["fc1"].grad_params["weight"])
    jax.block_until_ready((grads, captured, state))  # each step uses the previous one's state
    assert len(steps) == 3  # steps 0, 3, 6
    np.testing.assert_allclose(steps[1]["fc1"].grad_params["weight"], norms[3])
    assert float(state.host["capture[0]"]["count"]) == 7.0  # the counter lives apart from the layers' states
    assert list(state) == []


def test_capture_errors():
    params, x, y = mlp_setup()
    with pytest.raises(vk.ConfigError, match=r"'conv\*'.*matched no layer.*'fc1'"):
        jax.jit(vk.grad(mlp_loss, capture="conv*")).lower(params, x, y)
    with pytest.raises(vk.ConfigError, match=r"unknown reduction 'median'.*norm"):
        vk.capture("fc*", reduce="median")
    with pytest.raises(vk.ConfigError, match=r"unknown field"):
        vk.capture("fc*", fields=["grad_weight"])
    with pytest.raises(vk.ConfigError, match=r"capture="):
        vk.grad(mlp_loss, capture=3)
    with pytest.raises(vk.ConfigError, match=r"histogram"):
        vk.capture("fc*", reduce=vk.histogram(0, (0, 1)))


def test_no_retracing_with_capture():
    params, x, y = mlp_setup()
    traces = []

    def counted(p, x, y):
        traces.append(1)
        return mlp_loss(p, x, y)

    step = jax.jit(vk.grad(counted, capture=vk.capture("fc*", reduce="norm")))
    for i in range(4):
        step(params, x + i, y)
    assert len(traces) == 1  # one trace serves discovery, capture and the gradient, once


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "complex64"])
@pytest.mark.parametrize(
    "reduce", [None, "norm", ["mean", "var", "min", "max", "nonfinite_count"], "histogram"]
)
def test_reduced_shapes_without_tracing_equal_eval_shape(dtype, reduce):
    """The plan reads a captured record's reduced shapes without tracing the reduction
    (``reduce_record(..., shapes=True)``): they are what ``jax.eval_shape`` of it gives."""
    from vjpkit._capture import reduce_record
    from vjpkit._records import Cotangents

    if reduce == "histogram":
        reduce = vk.histogram(8, (-1.0, 1.0))
    if dtype == "complex64" and reduce not in (None, "norm"):
        return  # only norm and whole arrays are defined for complex leaves
    sds = jax.ShapeDtypeStruct
    rec = Cotangents(
        name="fc",
        call=0,
        params={"w": sds((3, 4), dtype), "b": sds((4,), dtype)},
        input=sds((5, 3), dtype),
        output=sds((5, 4), dtype),
        grad_output=sds((5, 4), dtype),
        grad_input=None,
        grad_params={"w": sds((3, 4), dtype), "b": sds((4,), dtype)},
    )
    spec = vk.capture("fc", fields=["input", "grad_output", "grad_params"], reduce=reduce)
    want = jax.eval_shape(lambda r: reduce_record(r, spec), rec)
    got = reduce_record(rec, spec, shapes=True)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
