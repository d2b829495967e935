"""Backward pre-hooks (``vk.before``): grad_output rewritten before a layer's own VJP.

The reference for "scale layer L's grad_output by c" is the plain loss with L's output passed
through an identity whose custom VJP scales its cotangent by c: the layers below then receive
exactly what a pre-hook makes them receive. Every test runs jitted and eagerly (``maybe_jit``).
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


@jax.custom_vjp
def _scale_ct(y, c):
    return y


def _scale_fwd(y, c):
    return y, c


def _scale_bwd(c, g):
    return (jax.tree.map(lambda t: (c * t).astype(t.dtype), g), None)


_scale_ct.defvjp(_scale_fwd, _scale_bwd)

FC1, FC2, FC3 = nn.dense(8), nn.dense(6), nn.dense(3)
MODEL = nn.serial(fc1=FC1, act1=nn.tanh(), fc2=FC2, act2=nn.tanh(), fc3=FC3)
X = jax.random.normal(jax.random.key(0), (5, 4))
Y = jax.random.normal(jax.random.key(1), (5, 3))
PARAMS = MODEL.init(jax.random.key(2), X)


def loss(p, x, y):
    return jnp.mean((MODEL.apply(p, x) - y) ** 2)


def ref_loss(scales):
    """The plain MLP with each named layer's output cotangent scaled by ``scales[name]``."""

    def f(p, x, y):
        h = x
        for name, layer, act in (("fc1", FC1, jnp.tanh), ("fc2", FC2, jnp.tanh), ("fc3", FC3, None)):
            h = layer.apply(p[name], h)
            if name in scales:
                h = _scale_ct(h, scales[name])
            if act is not None:
                h = act(h)
        return jnp.mean((h - y) ** 2)

    return f


def reverse(rec):
    return rec.replace(grad_output=-rec.grad_output)


def test_gradient_reversal_matches_a_scaled_cotangent(maybe_jit):
    g = vk.grad(loss, hooks={"fc2": vk.before(reverse)})
    tree_allclose(maybe_jit(g)(PARAMS, X, Y), jax.grad(ref_loss({"fc2": -1.0}))(PARAMS, X, Y))


def test_pre_record_fields_and_after_hooks_see_the_new_grad_output(maybe_jit):
    seen = {}

    def pre(rec):
        seen["pre"] = (rec.grad_input, rec.grad_params, rec.grad_output.shape, rec.input.shape)
        return rec.replace(grad_output=0.5 * rec.grad_output)

    g = vk.grad(loss, hooks={"fc2": [vk.before(pre)]}, capture="fc2")
    grads, captured = maybe_jit(g)(PARAMS, X, Y)
    assert seen["pre"][:2] == (None, None)
    assert seen["pre"][2:] == ((5, 6), (5, 8))
    tree_allclose(grads, jax.grad(ref_loss({"fc2": 0.5}))(PARAMS, X, Y))
    # the plain record's cotangent, then the captured one: halved, and the VJP computed from it
    _, plain = vk.grad(loss, capture="fc2")(PARAMS, X, Y)
    rec = captured["fc2"]
    tree_allclose(rec.grad_output, 0.5 * plain["fc2"].grad_output)
    tree_allclose(rec.grad_params["weight"], rec.input.T @ rec.grad_output, rtol=1e-5)
    tree_allclose(rec.grad_params["bias"], rec.grad_output.sum(0), rtol=1e-5)
    tree_allclose(rec.grad_input, rec.grad_output @ rec.params["weight"].T, rtol=1e-5)


def test_before_combines_with_plain_hooks_in_order(maybe_jit):
    """A list runs the pre-hook before the VJP and the plain hook after it, whatever their order."""
    halve_params = lambda rec: rec.replace(grad_params=jax.tree.map(lambda t: t / 2, rec.grad_params))
    g = vk.grad(loss, hooks={"fc2": [halve_params, vk.before(reverse)]})
    got = maybe_jit(g)(PARAMS, X, Y)
    want = jax.grad(ref_loss({"fc2": -1.0}))(PARAMS, X, Y)
    want = {**want, "fc2": jax.tree.map(lambda t: t / 2, want["fc2"])}
    tree_allclose(got, want)


def test_stateful_before_hook_threads_its_state(maybe_jit):
    def init(params):
        return {"count": jnp.zeros(())}

    def update(rec, state):
        scale = 1.0 / (state["count"] + 1.0)
        return rec.replace(grad_output=scale * rec.grad_output), {"count": state["count"] + 1}

    g = vk.grad(loss, hooks={"fc*": vk.before(vk.HookTransform(init, update))})
    state = vk.init_hook_state(g, PARAMS, X, Y)
    step = maybe_jit(g)
    grads, state = step(PARAMS, X, Y, hook_state=state)
    tree_allclose(grads, jax.grad(loss)(PARAMS, X, Y))  # count 0: scale 1
    grads, state = step(PARAMS, X, Y, hook_state=state)
    want = jax.grad(ref_loss({"fc1": 0.5, "fc2": 0.5, "fc3": 0.5}))(PARAMS, X, Y)
    tree_allclose(grads, want)
    assert [float(state[k]["count"]) for k in ("fc1", "fc2", "fc3")] == [2.0, 2.0, 2.0]


def test_before_with_on_host_and_capture(maybe_jit):
    seen = []
    g = vk.grad(loss, hooks={"fc3": [vk.before(reverse), vk.on_host(lambda r: seen.append(r.grad_output))]})
    grads = jax.block_until_ready(maybe_jit(g)(PARAMS, X, Y))
    tree_allclose(grads, jax.grad(ref_loss({"fc3": -1.0}))(PARAMS, X, Y))
    _, plain = vk.grad(loss, capture="fc3")(PARAMS, X, Y)
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], -np.asarray(plain["fc3"].grad_output), rtol=1e-6)


STEP = nn.dense(4)
W = STEP.init(jax.random.key(3), jnp.ones((2, 4)))
H0 = jax.random.normal(jax.random.key(4), (2, 4))


def scan_loss(p, h0):
    def body(h, _):
        return jnp.tanh(STEP.apply(p, h)), None

    h, _ = lax.scan(body, h0, None, length=3)
    return jnp.sum(h**2)


def test_before_under_scan_runs_per_iteration(maybe_jit):
    calls = []

    def pre(rec):
        calls.append(1)
        return rec.replace(grad_output=0.5 * rec.grad_output)

    def ref(p, h):
        for _ in range(3):
            h = jnp.tanh(_scale_ct(STEP.apply(p, h), 0.5))
        return jnp.sum(h**2)

    got = maybe_jit(vk.grad(scan_loss, hooks={"dense": vk.before(pre)}))(W, H0)
    tree_allclose(got, jax.grad(ref)(W, H0), rtol=1e-5)


def test_before_under_vmap_in_the_loss(maybe_jit):
    def vloss(p, x, y):
        per = jax.vmap(lambda xi, yi: jnp.sum((MODEL.apply(p, xi[None]) - yi) ** 2))(x, y)
        return per.mean()

    def vref(p, x, y):
        f = ref_loss({"fc2": -1.0})
        return jax.vmap(lambda xi, yi: f(p, xi[None], yi[None]) * 3)(x, y).mean()

    got = maybe_jit(vk.grad(vloss, hooks={"fc2": vk.before(reverse)}))(PARAMS, X, Y)
    tree_allclose(got, jax.grad(vref)(PARAMS, X, Y), rtol=1e-5)


def test_before_under_cond_and_checkpoint(maybe_jit):
    def closs(p, x, y, flag):
        h = lax.cond(
            flag, lambda h: jax.checkpoint(lambda h: MODEL.apply(p, h))(h), lambda h: 2.0 * h[:, :3], x
        )
        return jnp.mean((h - y) ** 2)

    g = maybe_jit(vk.grad(closs, hooks={"fc1": vk.before(reverse)}))
    tree_allclose(g(PARAMS, X, Y, True), jax.grad(ref_loss({"fc1": -1.0}))(PARAMS, X, Y), rtol=1e-5)
    tree_allclose(g(PARAMS, X, Y, False), jax.grad(closs)(PARAMS, X, Y, False))


def test_before_under_grad_of_grad():
    """The pre-hook is part of the gradient function, so its second derivative follows."""

    def inner(p):
        return vk.grad(loss, hooks={"fc2": vk.before(reverse)})(p, X, Y)["fc1"]["weight"].sum()

    def ref(p):
        return jax.grad(ref_loss({"fc2": -1.0}))(p, X, Y)["fc1"]["weight"].sum()

    tree_allclose(jax.grad(inner)(PARAMS), jax.grad(ref)(PARAMS), rtol=1e-5)


def test_vjp_with_before_hook(maybe_jit):
    out, pull = vk.vjp(lambda p: MODEL.apply(p, X), PARAMS, hooks={"fc3": vk.before(reverse)})
    seed = jnp.ones_like(out)
    _, ref_pull = jax.vjp(lambda p: -MODEL.apply(p, X), PARAMS)  # fc3 is linear: reversing it negates all
    tree_allclose(maybe_jit(pull)(seed)[0], ref_pull(seed)[0], rtol=1e-5)


# --- errors ---------------------------------------------------------------------------------------


def test_plain_hook_changing_grad_output_points_to_before():
    g = vk.grad(loss, hooks={"fc2": reverse})
    with pytest.raises(vk.HookError, match=r"grad_output.*vk\.before"):
        g(PARAMS, X, Y)


def test_before_hook_may_not_set_grad_params():
    bad = vk.before(lambda rec: rec.replace(grad_params={"weight": jnp.zeros((8, 6)), "bias": jnp.zeros(6)}))
    with pytest.raises(vk.HookError, match=r"pre-hook .* 'fc2'.*grad_params.*not computed yet"):
        vk.grad(loss, hooks={"fc2": bad})(PARAMS, X, Y)


def test_before_hook_wrong_dtype_names_layer_and_field():
    bad = vk.before(lambda rec: rec.replace(grad_output=rec.grad_output.astype(jnp.float16)))
    with pytest.raises(
        vk.HookError, match=r"'fc2'.*grad_output.*float32.*float16|'fc2'.*grad_output.*float16"
    ):
        vk.grad(loss, hooks={"fc2": bad})(PARAMS, X, Y)


def test_before_is_refused_in_forward_mode_and_in_hook_chain():
    with pytest.raises(vk.ConfigError, match=r"vk\.before"):
        vk.jvp(lambda p: MODEL.apply(p, X), (PARAMS,), (PARAMS,), hooks={"fc1": vk.before(reverse)})
    with pytest.raises(vk.ConfigError, match=r"vk\.before"):
        vk.hook_chain(vk.before(reverse), vk.clip_by_norm(1.0))
