"""Hook semantics: order, count, rewriting, identity with jax.grad, retracing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.models import mlp, mlp_chain, mlp_loss, mlp_setup

BACKWARD = ["fc3", "fc2", "fc1"]


def collector():
    records: list = []
    return records, vk.on_host(records.append)


def test_records_equal_hand_chained_vjps(maybe_jit):
    params, x, y = mlp_setup()
    records, hook = collector()
    grads = maybe_jit(vk.grad(mlp_loss, hooks={"fc*": hook}))(params, x, y)
    jax.block_until_ready(grads)
    assert [r.name for r in records] == BACKWARD
    reference = mlp_chain(params, x, y)
    for rec in records:
        ref = reference[rec.name]
        assert rec.call == 0
        tree_allclose(rec.params, jax.tree.map(np.asarray, params[rec.name]))
        for field, expected in ref.items():
            got = getattr(rec, field)
            if expected is None:
                assert got is None, f"{rec.name}.{field} should be None"
            else:
                tree_allclose(got, jax.tree.map(np.asarray, expected), rtol=1e-5, atol=1e-6)
    tree_allclose(grads, jax.grad(mlp_loss)(params, x, y))


def test_no_hooks_is_exactly_jax_grad(maybe_jit):
    params, x, y = mlp_setup()
    for argnums in (0, 1, (0, 1)):
        got = maybe_jit(vk.grad(mlp_loss, argnums=argnums))(params, x, y)
        want = maybe_jit(jax.grad(mlp_loss, argnums=argnums))(params, x, y)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
    aux_loss = lambda p, x, y: (mlp_loss(p, x, y), {"n": x.shape[0]})
    (value, aux), g = vk.value_and_grad(aux_loss, has_aux=True)(params, x, y)
    (value0, aux0), g0 = jax.value_and_grad(aux_loss, has_aux=True)(params, x, y)
    np.testing.assert_array_equal(value, value0)
    assert aux == aux0
    tree_allclose(g, g0, rtol=0, atol=0)


def test_observing_hooks_leave_gradients_unchanged(maybe_jit):
    params, x, y = mlp_setup()
    hooks = {"*": [lambda rec: None, vk.on_host(lambda rec: None)]}
    value, grads = maybe_jit(vk.value_and_grad(mlp_loss, hooks=hooks))(params, x, y)
    jax.block_until_ready((value, grads))
    v0, g0 = jax.value_and_grad(mlp_loss)(params, x, y)
    tree_allclose(value, v0, rtol=0, atol=0)
    tree_allclose(grads, g0, rtol=1e-6, atol=1e-7)


def test_traced_hook_can_debug_print(capfd):
    params, x, y = mlp_setup()
    hook = lambda rec: jax.debug.print(
        "{n} |grad_output|={v}", n=rec.name, v=jnp.linalg.norm(rec.grad_output)
    )
    jax.jit(vk.grad(mlp_loss, hooks={"fc2": hook}))(params, x, y)
    jax.effects_barrier()
    expected = float(jnp.linalg.norm(mlp_chain(params, x, y)["fc2"]["grad_output"]))
    out = capfd.readouterr().out
    assert "fc2 |grad_output|=" in out
    printed = float(out.split("|grad_output|=")[1].split()[0])
    assert printed == pytest.approx(expected, rel=1e-5)


def test_grad_input_replacement_propagates_upstream(maybe_jit):
    params, x, y = mlp_setup()

    def halve_input(rec):
        return rec.replace(grad_input=0.5 * rec.grad_input)

    grads = maybe_jit(vk.grad(mlp_loss, hooks={"fc2": halve_input}))(params, x, y)
    ref = jax.grad(mlp_loss)(params, x, y)
    # fc2 and fc3 see the original cotangents; everything below fc2 is scaled by exactly 0.5
    tree_allclose(grads["fc3"], ref["fc3"])
    tree_allclose(grads["fc2"], ref["fc2"])
    tree_allclose(grads["fc1"], jax.tree.map(lambda g: 0.5 * g, ref["fc1"]), rtol=1e-6, atol=1e-7)


def test_grad_params_replacement_and_hook_chain_order(maybe_jit):
    params, x, y = mlp_setup()
    seen = []

    def zero_bias(rec):
        gp = dict(rec.grad_params, bias=jnp.zeros_like(rec.grad_params["bias"]))
        return rec.replace(grad_params=gp)

    def double(rec):  # runs second: sees the first hook's replacement
        seen.append(rec.grad_params["bias"])
        return rec.replace(grad_params=jax.tree.map(lambda g: 2.0 * g, rec.grad_params))

    grads = maybe_jit(vk.grad(mlp_loss, hooks={"fc3": [zero_bias, double]}))(params, x, y)
    ref = jax.grad(mlp_loss)(params, x, y)
    np.testing.assert_array_equal(grads["fc3"]["bias"], np.zeros(2, np.float32))
    tree_allclose(grads["fc3"]["weight"], 2.0 * ref["fc3"]["weight"])
    tree_allclose(grads["fc2"], ref["fc2"])  # grad_params changes do not flow upstream
    tree_allclose(grads["fc1"], ref["fc1"])
    assert len(seen) == 1


def test_on_host_order_and_count_under_jit_over_steps():
    params, x, y = mlp_setup()
    records, hook = collector()
    step = jax.jit(vk.grad(mlp_loss, hooks={"fc*": hook}))
    outs = [step(params, x + i, y) for i in range(4)]
    jax.block_until_ready(outs)
    assert [r.key for r in records] == BACKWARD * 4
    for i in range(4):  # each step's records belong to that step
        np.testing.assert_allclose(records[3 * i + 2].input, np.asarray(x + i))


def test_on_host_under_scan_fires_once_per_layer_per_step():
    params, x, y = mlp_setup()
    records, hook = collector()
    g = vk.grad(mlp_loss, hooks={"fc*": hook})

    def body(p, xb):
        grads = g(p, xb, y)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, grads), None

    xs = jnp.stack([x, 2 * x, 3 * x])
    final, _ = jax.jit(lambda p, xs: jax.lax.scan(body, p, xs))(params, xs)
    jax.block_until_ready(final)
    assert [r.key for r in records] == BACKWARD * 3
    # reference: the same three SGD steps with jax.grad
    p = params
    for k in range(3):
        np.testing.assert_allclose(records[3 * k + 2].input, np.asarray(xs[k]), rtol=1e-6)
        p = jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(mlp_loss)(p, xs[k], y))
    tree_allclose(final, p, rtol=1e-5, atol=1e-6)


def test_on_host_under_vmap_is_per_example():
    params, x, y = mlp_setup(batch=4)
    records, hook = collector()
    per_example = lambda p, xi, yi: mlp_loss(p, xi[None], yi[None])
    g = jax.jit(jax.vmap(vk.grad(per_example, hooks={"fc*": hook}), in_axes=(None, 0, 0)))
    grads = g(params, x, y)
    jax.block_until_ready(grads)
    assert len(records) == 3 * 4
    for name in BACKWARD:
        mine = [r for r in records if r.name == name]
        assert len(mine) == 4
        assert all(r.grad_output.shape[0] == 1 for r in mine)
    ref = jax.vmap(jax.grad(per_example), in_axes=(None, 0, 0))(params, x, y)
    tree_allclose(grads, ref, rtol=1e-5, atol=1e-6)


def test_on_host_every_n():
    params, x, y = mlp_setup()
    records, _ = collector()
    hook = vk.on_host(records.append, every=3)
    step = jax.jit(vk.grad(mlp_loss, hooks={"fc1": hook}))
    outs = [step(params, x + i, y) for i in range(7)]
    jax.block_until_ready(outs)
    assert len(records) == 3  # backward passes 0, 3, 6 (one fc1 call each)
    np.testing.assert_allclose(records[1].input, np.asarray(x + 3))


def test_weight_sharing_records_per_call(maybe_jit):
    params, x, y = mlp_setup()
    records, hook = collector()
    twice = lambda p, x: mlp.apply(p, jnp.tanh(mlp.apply(p, x)) @ jnp.ones((2, 3))).sum()
    grads = maybe_jit(vk.grad(twice, hooks={"fc*": hook}))(params, x)
    jax.block_until_ready(grads)
    assert [r.key for r in records] == ["fc3#1", "fc2#1", "fc1#1", "fc3", "fc2", "fc1"]
    summed = {
        name: jax.tree.map(lambda a, b: a + b, *[r.grad_params for r in records if r.name == name])
        for name in ("fc1", "fc2", "fc3")
    }
    tree_allclose(summed, jax.tree.map(np.asarray, jax.grad(twice)(params, x)), rtol=1e-5, atol=1e-6)
    tree_allclose(grads, jax.grad(twice)(params, x), rtol=1e-6, atol=1e-7)


def test_no_retracing_across_steps():
    params, x, y = mlp_setup()
    traces = []

    def counted(p, x, y):
        traces.append(1)
        return mlp_loss(p, x, y)

    step = jax.jit(vk.grad(counted, hooks={"fc*": lambda rec: None}))
    for i in range(5):
        step(params, x + i, y)
    assert len(traces) == 1


def test_hooks_belong_to_the_transformed_function():
    params, x, y = mlp_setup()
    first, hook1 = collector()
    second, hook2 = collector()
    g1 = jax.jit(vk.grad(mlp_loss, hooks={"fc1": hook1}))
    g2 = jax.jit(vk.grad(mlp_loss, hooks={"fc3": hook2}))
    jax.block_until_ready([g1(params, x, y), g2(params, x, y), g1(params, x, y)])
    assert [r.name for r in first] == ["fc1", "fc1"]
    assert [r.name for r in second] == ["fc3"]
    # outside any vjpkit transform, the model is a plain function again
    tree_allclose(jax.grad(mlp_loss)(params, x, y), g1(params, x, y))


def test_grad_input_none_for_data_but_computed_when_asked():
    params, x, y = mlp_setup()
    records, hook = collector()
    gx = vk.grad(mlp_loss, argnums=1, hooks={"fc1": hook})(params, x, y)
    jax.block_until_ready(gx)
    (rec,) = records
    assert rec.grad_params is None  # params were not differentiated
    tree_allclose(rec.grad_input, np.asarray(gx))
    tree_allclose(gx, jax.grad(mlp_loss, argnums=1)(params, x, y))


def test_inner_jit_traces_are_not_shared_between_hooked_and_plain_gradients():
    """An inner jax.jit traced under hooks is not replayed for a plain jax.grad (or another scope)."""
    fc = vk.nn.dense(2)
    params = fc.init(jax.random.key(0), jnp.ones((1, 3)))
    inner = jax.jit(lambda p, x: fc.apply(p, x))
    loss = lambda p, x: (inner(p, x) ** 2).sum()
    double = lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: 2 * g, rec.grad_params))
    x = jnp.arange(12.0).reshape(4, 3)
    reference = jax.grad(lambda p, x: (fc.apply(p, x) ** 2).sum())(params, x)
    hooked = vk.grad(loss, hooks={"dense": double})(params, x)
    tree_allclose(hooked, jax.tree.map(lambda g: 2 * g, reference))
    tree_allclose(jax.grad(loss)(params, x), reference)  # not the doubled, cached trace
    halve = lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: g / 2, rec.grad_params))
    tree_allclose(vk.grad(loss, hooks={"dense": halve})(params, x), jax.tree.map(lambda g: g / 2, reference))
