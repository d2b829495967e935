"""Records, hooks and hook state under JAX's own transformations inside the loss.

Every test compares with a reference computed without vjpkit (``jax.grad``, hand-chained
``jax.vjp`` of an unrolled loop, numpy), under ``jit`` and eagerly (``maybe_jit``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vjpkit as vk
from vjpkit import nn

from .helpers import tree_allclose

STEPS = 3


def _cell():
    return nn.layer(
        lambda p, h: jnp.tanh(h @ p["w"]),
        lambda key, h: {"w": 0.5 * jax.random.normal(key, (4, 4))},
        name="cell",
    )


CELL = _cell()
W = {"w": 0.5 * jax.random.normal(jax.random.key(0), (4, 4))}
H0 = jax.random.normal(jax.random.key(1), (2, 4))


def scan_loss(p, h0):
    def body(h, _):
        return CELL.apply(p, h), None

    h, _ = lax.scan(body, h0, None, length=STEPS)
    return jnp.sum(h**2)


def fori_loss(p, h0):
    return jnp.sum(lax.fori_loop(0, STEPS, lambda i, h: CELL.apply(p, h), h0) ** 2)


def _unrolled(ws, h):
    for w in ws:
        h = jnp.tanh(h @ w["w"])
    return jnp.sum(h**2)


def _per_iteration():
    """Hand-unrolled reference: one weight copy per iteration, its gradient and its input."""
    grads = jax.grad(_unrolled)([W] * STEPS, H0)
    inputs, h = [], H0
    for _ in range(STEPS):
        inputs.append(h)
        h = jnp.tanh(h @ W["w"])
    return grads, inputs


@pytest.mark.parametrize("loss", [scan_loss, fori_loss], ids=["scan", "fori_loop"])
def test_scan_records_one_per_iteration(maybe_jit, loss):
    grads, inputs = _per_iteration()
    g, captured = maybe_jit(vk.grad(loss, capture=vk.capture("cell")))(W, H0)
    rec = captured["cell"]
    tree_allclose(g, jax.grad(loss)(W, H0), rtol=1e-5)
    tree_allclose(rec.grad_params["w"], jnp.stack([gi["w"] for gi in grads]), rtol=1e-5, atol=1e-6)
    tree_allclose(rec.input, jnp.stack(inputs), rtol=1e-6)
    norms = maybe_jit(vk.grad(loss, capture=vk.capture("cell", fields=["grad_params"], reduce="norm")))
    _, captured = norms(W, H0)
    expected = jnp.stack([jnp.linalg.norm(gi["w"]) for gi in grads])
    tree_allclose(captured["cell"].grad_params["w"], expected, rtol=1e-5)


def test_scan_host_hooks_fire_per_iteration_in_backward_order(maybe_jit):
    grads, _ = _per_iteration()
    seen = []
    g = vk.grad(scan_loss, hooks={"cell": vk.on_host(lambda rec: seen.append(rec.grad_params["w"]))})
    jax.block_until_ready(maybe_jit(g)(W, H0))
    assert len(seen) == STEPS
    for got, ref in zip(seen, reversed(grads)):  # backward order: last iteration first
        np.testing.assert_allclose(got, ref["w"], rtol=1e-5, atol=1e-6)


def test_scan_hook_state_advances_once_per_iteration_in_order(maybe_jit):
    grads, _ = _per_iteration()
    g = vk.value_and_grad(scan_loss, hooks={"cell": vk.accumulate_stats()})
    state = vk.init_hook_state(g, W, H0)
    for _ in range(2):
        _, state = maybe_jit(g)(W, H0, hook_state=state)
    seq = np.stack([np.asarray(gi["w"]) for gi in reversed(grads)] * 2)
    assert float(state["cell"].count) == 2 * STEPS
    np.testing.assert_allclose(state["cell"].mean["w"], seq.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["cell"].m2["w"], ((seq - seq.mean(0)) ** 2).sum(0), rtol=1e-4, atol=1e-6)


def test_scan_rewriting_hook_applies_per_iteration(maybe_jit):
    """A hook scaling grad_input by 0.5 in each iteration equals the hand-chained vjps."""
    half = lambda rec: rec.replace(grad_input=rec.grad_input * 0.5)
    got = maybe_jit(vk.grad(scan_loss, argnums=1, hooks={"cell": half}))(W, H0)
    hs = [H0]
    for _ in range(STEPS):
        hs.append(jnp.tanh(hs[-1] @ W["w"]))
    ct = 2 * hs[-1]
    for h in reversed(hs[:-1]):
        _, pull = jax.vjp(lambda h: jnp.tanh(h @ W["w"]), h)
        ct = 0.5 * pull(ct)[0]
    tree_allclose(got, ct, rtol=1e-5, atol=1e-6)


def test_nested_scan_records_stack_both_axes(maybe_jit):
    def loss(p, h0):
        def outer(h, _):
            h, _ = lax.scan(lambda h, _: (CELL.apply(p, h), None), h, None, length=2)
            return h, None

        h, _ = lax.scan(outer, h0, None, length=3)
        return jnp.sum(h**2)

    g, captured = maybe_jit(vk.grad(loss, capture=vk.capture("cell", fields=["grad_params"])))(W, H0)
    per = jax.grad(_unrolled)([W] * 6, H0)
    stacked = jnp.stack([p["w"] for p in per]).reshape(3, 2, 4, 4)
    tree_allclose(captured["cell"].grad_params["w"], stacked, rtol=1e-5, atol=1e-6)
    tree_allclose(g, jax.grad(loss)(W, H0), rtol=1e-5)


A = nn.layer(lambda p, x: x @ p["w"], lambda k, x: {"w": jnp.ones((4, 4))}, name="a")
B = nn.layer(lambda p, x: jnp.sin(x @ p["w"]), lambda k, x: {"w": jnp.ones((4, 4))}, name="b")
P2 = {"a": W, "b": {"w": -W["w"]}}


def cond_loss(p, x, pred):
    y = lax.cond(pred, lambda x: A.apply(p["a"], x), lambda x: B.apply(p["b"], x), x)
    return jnp.sum(y**2)


@pytest.mark.parametrize("pred", [True, False])
def test_cond_only_the_taken_branch_records(maybe_jit, pred):
    seen = []
    spec = vk.capture("*", fields=["grad_params"], reduce="norm")
    hooks = {"*": vk.on_host(lambda rec: seen.append(rec.name))}
    g, captured = maybe_jit(vk.grad(cond_loss, capture=spec, hooks=hooks))(P2, H0, pred)
    jax.block_until_ready((g, captured))
    ref = jax.grad(cond_loss)(P2, H0, pred)
    tree_allclose(g, ref, rtol=1e-5)
    taken, other = ("a", "b") if pred else ("b", "a")
    assert seen == [taken]
    np.testing.assert_allclose(captured[taken].grad_params["w"], jnp.linalg.norm(ref[taken]["w"]), rtol=1e-5)
    assert np.isnan(captured[other].grad_params["w"])  # no record: NaN, never a plausible zero


def test_cond_branch_functions_applied_twice(maybe_jit):
    def branch_a(p, x):
        return A.apply(p["a"], x)

    def branch_b(p, x):
        return B.apply(p["b"], x)

    def loss(p, x, pred):
        y = lax.cond(pred, branch_a, branch_b, p, x)
        y = lax.cond(pred, branch_a, branch_b, p, y)
        return jnp.sum(y**2)

    for pred in (True, False):
        spec = vk.capture("*", fields=["grad_params"])
        g, captured = maybe_jit(vk.grad(loss, capture=spec))(P2, H0, pred)
        ref = jax.grad(loss)(P2, H0, pred)
        tree_allclose(g, ref, rtol=1e-5)
        taken = "a" if pred else "b"
        assert set(captured) == {"a", "a#1", "b", "b#1"}
        total = captured[taken].grad_params["w"] + captured[f"{taken}#1"].grad_params["w"]
        tree_allclose(total, ref[taken]["w"], rtol=1e-5, atol=1e-6)


def test_switch_state_advances_only_in_the_taken_branch(maybe_jit):
    def loss(p, x, i):
        y = lax.switch(i, [lambda x: A.apply(p["a"], x), lambda x: B.apply(p["b"], x)], x)
        return jnp.sum(y**2)

    g = vk.value_and_grad(loss, hooks={"*": vk.accumulate_stats()})
    state = vk.init_hook_state(g, P2, H0, 0)
    for i in (0, 0, 1):
        _, state = maybe_jit(g)(P2, H0, i, hook_state=state)
    assert float(state["a"].count) == 2.0 and float(state["b"].count) == 1.0


BLOCK = nn.serial(fc=nn.dense(4), act=nn.tanh())


def _scanned(fn):
    return lambda p, x: lax.scan(lambda c, _: (fn(p, c), None), x, None, length=1)[0]


@pytest.mark.parametrize("wrap", [jax.checkpoint, jax.jit, _scanned], ids=["checkpoint", "jit", "scan"])
def test_wrapped_blocks_keep_full_names(maybe_jit, wrap):
    """A block wrapped with nn.layer(...) around checkpoint / jit / scan: hooks see full paths."""
    blk = nn.layer(lambda p, x: wrap(BLOCK.apply)(p, x), BLOCK.init, name="blk")
    model = nn.serial(blk=blk, fc=nn.dense(4))
    params = model.init(jax.random.key(2), H0)

    def loss(p, x):
        x = model.apply(p, x)
        return jnp.sum(model.apply(p, x) ** 2)  # the model twice: every call gets "#1"

    seen = []
    hooks = {"blk/fc": vk.on_host(lambda rec: seen.append(rec.key)), "fc": lambda rec: None}
    g, captured = maybe_jit(vk.grad(loss, hooks=hooks, capture="*"))(params, H0)
    jax.block_until_ready((g, captured))
    assert sorted(seen) == ["blk/fc", "blk/fc#1"]  # the "fc" glob does not reach blk/fc
    names = {"blk", "blk/fc", "blk/act", "fc"}
    assert set(captured) == names | {f"{n}#1" for n in names}
    tree_allclose(g, jax.grad(loss)(params, H0), rtol=1e-5)


def nn_scope(name):
    from vjpkit._context import name_scope

    return name_scope(name)


def test_inner_jit_applied_twice_and_prefix_hooks(maybe_jit):
    """An inner jit function called under two name prefixes is traced per prefix."""
    outer = nn.serial(one=BLOCK, two=BLOCK)
    params = outer.init(jax.random.key(3), H0)
    jitted = jax.jit(lambda p, x: BLOCK.apply(p, x))

    def loss(p, x):
        with nn_scope("one"):
            x = jitted(p["one"], x)
        with nn_scope("two"):
            x = jitted(p["two"], x)
        x = jitted(p["two"], x)  # no prefix: plain "fc"
        return jnp.sum(x**2)

    g, captured = maybe_jit(vk.grad(loss, capture=vk.capture(["one/fc", "two/fc", "fc"])))(params, H0)
    assert set(captured) == {"one/fc", "two/fc", "fc"}
    tree_allclose(g, jax.grad(loss)(params, H0), rtol=1e-5)


def test_vmap_inside_the_loss_records_the_batched_call(maybe_jit):
    params = BLOCK.init(jax.random.key(4), H0)
    x = jax.random.normal(jax.random.key(5), (8, 4))

    def loss(p, x):
        return jnp.sum(jax.vmap(lambda xi: BLOCK.apply(p, xi))(x) ** 2)

    ref = jax.grad(loss)(params, x)
    spec = vk.capture("fc", fields=["grad_params", "input"])
    _, captured = maybe_jit(vk.grad(loss, capture=spec))(params, x)
    assert captured["fc"].input.shape == (8, 4)  # the batched call, batch axis kept
    tree_allclose(captured["fc"].grad_params, ref["fc"], rtol=1e-5)
    spec = vk.capture("fc", fields=["grad_params"], reduce="norm")
    _, captured = maybe_jit(vk.grad(loss, capture=spec))(params, x)
    np.testing.assert_allclose(
        captured["fc"].grad_params["weight"], jnp.linalg.norm(ref["fc"]["weight"]), rtol=1e-5
    )
    clipped = maybe_jit(vk.grad(loss, hooks={"fc": vk.clip_by_norm(0.1)}))(params, x)
    total = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(clipped["fc"])))
    np.testing.assert_allclose(total, 0.1, rtol=1e-5)  # the whole call's gradient, not per example
    g = vk.grad(loss, hooks={"fc": vk.ema_normalize(0.9)})
    normalized, _ = maybe_jit(g)(params, x, hook_state=vk.init_hook_state(g, params, x))
    w = ref["fc"]["weight"]  # first step: (g - mean) / std of the whole call's gradient
    tree_allclose(normalized["fc"]["weight"], (w - w.mean()) / (w.std() + 1e-8), rtol=1e-4, atol=1e-5)


def test_nested_hooked_transforms_run_both_levels(maybe_jit):
    model = nn.serial(fc1=nn.dense(5), act=nn.tanh(), fc2=nn.dense(1))
    params = model.init(jax.random.key(6), H0)

    def inner_loss(p, x):
        return jnp.sum(model.apply(p, x) ** 2)

    seen = []

    def penalty(p, x):
        g = vk.grad(inner_loss, hooks={"fc*": vk.on_host(lambda r: seen.append(("inner", r.key)))})(p, x)
        return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)) + inner_loss(p, x)

    def plain(p, x):
        g = jax.grad(inner_loss)(p, x)
        return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)) + inner_loss(p, x)

    outer = vk.grad(penalty, hooks={"fc*": vk.on_host(lambda r: seen.append(("outer", r.key)))})
    got = maybe_jit(outer)(params, H0)
    jax.block_until_ready(got)
    tree_allclose(got, jax.grad(plain)(params, H0), rtol=1e-5, atol=1e-6)
    assert [k for lvl, k in seen if lvl == "inner"] == ["fc2", "fc1"]
    # the outer program also holds the inner backward pass, where fc2's weight meets data in
    # dL/dh = g @ W.T: plain-JAX matching makes that use a call of its own, fc2/weight
    outer_keys = sorted(k for lvl, k in seen if lvl == "outer")
    assert outer_keys == ["fc1", "fc1#1", "fc2", "fc2#1", "fc2/weight"]


def test_keyword_arrays_get_gradients(maybe_jit):
    scaled = nn.layer(lambda p, x, *, scale: x * scale * p["a"], lambda k, x: {"a": jnp.ones(())}, name="sc")

    def loss(p, x):
        return jnp.sum(scaled.apply(p["sc"], x, scale=p["s"]) ** 2)

    params = {"sc": {"a": jnp.array(1.5)}, "s": jnp.array(2.0)}
    got = maybe_jit(vk.grad(loss, hooks={"sc": lambda rec: None}))(params, H0)
    tree_allclose(got, jax.grad(loss)(params, H0), rtol=1e-6)


def test_integer_outputs_and_inputs_are_exact(maybe_jit):
    both = nn.layer(
        lambda p, x, ids: (x * p["a"], ids + 1), lambda k, x, ids: {"a": jnp.ones(())}, name="both"
    )
    ids = jnp.array([16777217, -3], jnp.int32)

    def loss(p, x):
        y, out_ids = both.apply(p, x, ids)
        return jnp.sum(y**2) + 0.0 * jnp.sum(out_ids.astype(jnp.float32))

    g, captured = maybe_jit(vk.grad(loss, capture="both"))({"a": jnp.array(2.0)}, H0)
    rec = captured["both"]
    assert rec.input[1].dtype == jnp.int32 and rec.output[1].dtype == jnp.int32
    np.testing.assert_array_equal(rec.input[1], ids)
    np.testing.assert_array_equal(rec.output[1], ids + 1)
    assert rec.grad_output[1] is None  # an integer output has no cotangent
    tree_allclose(g, jax.grad(loss)({"a": jnp.array(2.0)}, H0), rtol=1e-6)


def test_complex_records_are_exact(maybe_jit):
    layer = nn.layer(lambda p, x: x * p["z"], lambda k, x: {"z": jnp.ones((), jnp.complex64)}, name="cz")
    p = {"z": jnp.array(1.0 + 2.0j, jnp.complex64)}
    x = jnp.array([1.0 - 1.0j, 0.5j], jnp.complex64)

    def loss(p, x):
        return jnp.sum(jnp.abs(layer.apply(p, x)) ** 2)

    g, captured = maybe_jit(vk.grad(loss, capture="cz"))(p, x)
    ref = jax.grad(loss)(p, x)
    tree_allclose(g, ref, rtol=1e-6)
    tree_allclose(captured["cz"].grad_params, ref, rtol=1e-6)
    _, norms = maybe_jit(vk.grad(loss, capture=vk.capture("cz", fields=["grad_params"], reduce="norm")))(p, x)
    np.testing.assert_allclose(norms["cz"].grad_params["z"], jnp.abs(ref["z"]), rtol=1e-6)
    clipped = maybe_jit(vk.grad(loss, hooks={"cz": vk.clip_by_norm(0.5)}))(p, x)
    np.testing.assert_allclose(jnp.abs(clipped["z"]), 0.5, rtol=1e-6)
    np.testing.assert_allclose(jnp.angle(clipped["z"]), jnp.angle(ref["z"]), rtol=1e-6)
    g = vk.value_and_grad(loss, hooks={"cz": vk.ema_normalize(0.9)})
    with pytest.raises(vk.HookError, match=r"'cz'.*complex"):
        g(p, x, hook_state=vk.init_hook_state(g, p, x))


def test_in_place_writes_to_records_are_refused():
    def sneaky(rec):
        rec.grad_params["w"] = rec.grad_params["w"].astype(jnp.float16)

    with pytest.raises(vk.HookError, match=r"'cell'.*in place.*rec\.replace"):
        vk.grad(scan_loss, hooks={"cell": sneaky})(W, H0)


def test_eager_loss_may_read_concrete_non_differentiated_args():
    def loss(p, h0, n):
        steps = int(n.max())  # concrete: n is not differentiated
        h = h0
        for _ in range(steps):
            h = CELL.apply(p, h)
        return jnp.sum(h**2)

    n = jnp.array([1, 2])
    g, captured = vk.grad(loss, capture=vk.capture("cell", reduce="norm"))(W, H0, n)
    assert set(captured) == {"cell", "cell#1"}
    tree_allclose(g, jax.grad(loss)(W, H0, n), rtol=1e-6)
    g, captured = vk.grad(loss, argnums=-3, capture="cell")(W, H0, n)
    tree_allclose(g, jax.grad(loss)(W, H0, n), rtol=1e-6)


def test_same_configuration_reuses_traces_and_others_never_replay():
    traces = []
    inner = jax.jit(lambda p, h: (traces.append(1), CELL.apply(p, h))[1])

    def loss(p, h):
        return jnp.sum(inner(p, h) ** 2)

    hooked = vk.grad(loss, capture=vk.capture("cell", reduce="norm"))
    for _ in range(5):
        hooked(W, H0)
    assert len(traces) == 1  # eager calls of one configuration reuse the inner trace
    tree_allclose(jax.grad(loss)(W, H0), hooked(W, H0)[0], rtol=1e-6)
    assert len(traces) == 2  # the plain trace is its own: no layer marks in plain JAX
    seen = []
    jax.block_until_ready(vk.grad(loss, hooks={"cell": vk.on_host(lambda rec: seen.append(rec.key))})(W, H0))
    assert seen == ["cell"]


def test_gru_cell_records_one_per_time_step(maybe_jit):
    """nn.rnn scans its cell: one record per time step, equal to the hand-unrolled loop's."""
    model = nn.serial(enc=nn.rnn(nn.gru(5), 5, return_sequences=False))
    xs = jax.random.normal(jax.random.key(7), (2, 4, 3))
    params = model.init(jax.random.key(8), xs)
    cell = nn.gru(5)

    def loss(p, xs):
        return jnp.sum(model.apply(p, xs) ** 2)

    g, captured = maybe_jit(vk.grad(loss, capture="*"))(params, xs)
    (key,) = captured
    rec = captured[key]
    hs, h = [], jnp.zeros((2, 5))
    for t in range(4):
        hs.append(h)
        h = cell.apply(params["enc"], h, xs[:, t])
    tree_allclose(rec.input[0], jnp.stack(hs), rtol=1e-5, atol=1e-6)  # per step: h_t, then x_t
    tree_allclose(rec.input[1], jnp.swapaxes(xs, 0, 1), rtol=1e-6)
    tree_allclose(jax.tree.map(lambda a: a.sum(0), rec.grad_params), g["enc"], rtol=1e-5, atol=1e-6)
    tree_allclose(g, jax.grad(loss)(params, xs), rtol=1e-5)


def test_prng_key_inputs_are_captured_exactly(maybe_jit):
    noisy = nn.layer(
        lambda p, x, key: x * p["a"] + jax.random.normal(key, x.shape),
        lambda k, x, key: {"a": jnp.ones(())},
        name="noisy",
    )
    key = jax.random.key(11)

    def loss(p, x):
        return jnp.sum(noisy.apply(p, x, key) ** 2)

    p = {"a": jnp.array(0.5)}
    g, captured = maybe_jit(vk.grad(loss, capture="noisy"))(p, H0)
    got_key = captured["noisy"].input[1]
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(key))
    tree_allclose(g, jax.grad(loss)(p, H0), rtol=1e-6)
