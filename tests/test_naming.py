"""One naming across every API (issue 31, item 4): globs with ``#k`` choose one layer call, and
plain-JAX single-weight modules are named by their module.

Hooks and capture by ``name#1`` on a layer called twice (a ``vjpkit.nn`` model applied twice, a
plain-JAX weight used twice), against hand-chained ``jax.vjp``s with the rewrite applied by hand
to that call only; the no-match error lists call keys; ``{"fc": {"w": W}}`` is the layer ``fc``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn
from vjpkit._names import matches, matches_key

RTOL, ATOL = 1e-5, 1e-6


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_matcher_rules():
    assert matches("emb", 0, "emb") and matches("emb", 1, "emb") and matches("emb", 7, "e*")
    assert matches("emb", 1, "emb#1") and not matches("emb", 0, "emb#1") and not matches("emb", 2, "emb#1")
    assert matches("emb", 0, "emb#0") and matches("emb", 3, "emb#*") and matches("blk/emb", 1, "*#1")
    assert not matches("emb2", 1, "emb#1") and matches("emb2", 1, "emb?#1")
    assert matches_key("emb#1", "emb#1") and matches_key("emb#1", "emb") and matches_key("emb", "emb#0")
    assert not matches_key("emb", "emb#1") and not matches_key("emb#2", "emb#1")
    # a layer as a whole (per-layer statistics): '#*' or no '#'
    assert matches("emb", None, "emb") and matches("emb", None, "emb#*") and not matches("emb", None, "emb#1")


# -------------------------------------------------------------------------- vjpkit.nn, twice

MODEL = nn.serial(fc=nn.dense(3), act=nn.tanh())


def _nn_setup():
    x = _normal(1, (4, 3))
    params = MODEL.init(jax.random.key(0), x)
    w_out = _normal(2, (4, 3))

    def loss(p, x):
        return jnp.sum(w_out * MODEL.apply(p, MODEL.apply(p, x)))

    def fc(p, h):
        return h @ p["weight"] + p["bias"]

    return params, x, w_out, loss, fc


def _scale(rec):
    """The rewrite: grad_params halved, grad_input tripled."""
    grad_input = None if rec.grad_input is None else rec.grad_input * 3.0  # call 0: x is not differentiated
    return rec.replace(grad_params=jax.tree.map(lambda g: g * 0.5, rec.grad_params), grad_input=grad_input)


def _nn_chain(params, x, w_out, fc, rewrite_call):
    """Hand chain of the model applied twice; the rewrite applied to fc's call ``rewrite_call``."""
    pf = params["fc"]
    z0, vjp_fc0 = jax.vjp(fc, pf, x)
    a0, vjp_act0 = jax.vjp(jnp.tanh, z0)
    z1, vjp_fc1 = jax.vjp(fc, pf, a0)
    _, vjp_act1 = jax.vjp(jnp.tanh, z1)
    (gz1,) = vjp_act1(w_out)
    gp1, ga0 = vjp_fc1(gz1)
    if rewrite_call == 1:
        gp1, ga0 = jax.tree.map(lambda g: g * 0.5, gp1), ga0 * 3.0
    (gz0,) = vjp_act0(ga0)
    gp0, gx = vjp_fc0(gz0)
    if rewrite_call == 0:
        gp0 = jax.tree.map(lambda g: g * 0.5, gp0)
    rec = {
        "fc": dict(input=x, output=z0, grad_output=gz0, grad_params=gp0),
        "fc#1": dict(input=a0, output=z1, grad_output=gz1, grad_params=gp1),
    }
    return {"fc": jax.tree.map(jnp.add, gp0, gp1)}, rec


@pytest.mark.parametrize("glob,call", [("fc#1", 1), ("fc#0", 0)])
def test_nn_hook_by_call_key(maybe_jit, glob, call):
    params, x, w_out, loss, fc = _nn_setup()
    seen = []

    def hook(rec):
        seen.append(rec.key)
        return _scale(rec)

    grads = maybe_jit(vk.grad(loss, hooks={glob: hook}))(params, x)
    assert set(seen) == {"fc#1" if call else "fc"}  # that call only
    ref, _ = _nn_chain(params, x, w_out, fc, call)
    tree_allclose(grads, ref, rtol=RTOL, atol=ATOL)
    # sanity: the rewrite changed the gradient
    assert not np.allclose(grads["fc"]["weight"], jax.grad(loss)(params, x)["fc"]["weight"], rtol=1e-3)


def test_nn_capture_by_call_key(maybe_jit):
    params, x, w_out, loss, fc = _nn_setup()
    _, records = _nn_chain(params, x, w_out, fc, None)
    grads, captured = maybe_jit(vk.grad(loss, capture="fc#1"))(params, x)
    assert sorted(captured) == ["fc#1"]
    for field, value in records["fc#1"].items():
        tree_allclose(getattr(captured["fc#1"], field), value, rtol=RTOL, atol=ATOL)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=RTOL, atol=ATOL)
    for glob, keys in [
        ("fc", ["fc", "fc#1"]),
        ("fc#*", ["fc", "fc#1"]),
        ("fc#0", ["fc"]),
        ("*#1", ["act#1", "fc#1"]),
    ]:
        _, captured = maybe_jit(vk.grad(loss, capture=glob))(params, x)
        assert sorted(captured) == keys, glob
    # a capture spec with a host delivery gets that call only
    got = []
    spec = vk.capture("fc#1", fields=["grad_params"], host=vk.on_host(got.append))
    maybe_jit(vk.grad(loss, capture=spec))(params, x)
    jax.effects_barrier()
    assert got and sorted(got[-1]) == ["fc#1"]


def test_no_match_error_lists_call_keys():
    params, x, _, loss, _ = _nn_setup()
    with pytest.raises(vk.ConfigError, match="matched no layer") as err:
        vk.grad(loss, hooks={"fc#5": lambda rec: None})(params, x)
    msg = str(err.value)
    assert "'fc#5'" in msg and "'fc', 'fc#1'" in msg and "'act#1'" in msg
    with pytest.raises(vk.ConfigError, match=r"'fc#2'.*'fc#1'"):
        vk.grad(loss, capture="fc#2")(params, x)
    vk.grad(loss, hooks={"fc#1": lambda rec: None}, capture="act#1")(params, x)  # accepted


def test_jvp_hook_by_call_key():
    params, x, _, loss, _ = _nn_setup()
    seen = []
    tangents = jax.tree.map(jnp.ones_like, params)
    vk.jvp(lambda p: loss(p, x), (params,), (tangents,), hooks={"fc#1": lambda rec: seen.append(rec.key)})
    assert set(seen) == {"fc#1"}


# -------------------------------------------------------------------------- plain JAX, twice


def _plain_setup():
    params = {"fc": {"w": _normal(3, (3, 3)) * 0.5, "b": _normal(4, (3,)) * 0.1}}
    x = _normal(5, (4, 3))
    w_out = _normal(6, (4, 3))

    def fc(p, h):
        return h @ p["w"] + p["b"]

    def loss(p, x):
        return jnp.sum(w_out * fc(p["fc"], jnp.tanh(fc(p["fc"], x))))

    return params, x, w_out, fc, loss


def test_plain_weight_used_twice_hook_and_capture(maybe_jit):
    params, x, w_out, fc, loss = _plain_setup()
    pf = params["fc"]
    z0, vjp0 = jax.vjp(fc, pf, x)
    a0, vjp_act = jax.vjp(jnp.tanh, z0)
    z1, vjp1 = jax.vjp(fc, pf, a0)
    gp1, ga0 = vjp1(w_out)
    gp1, ga0 = jax.tree.map(lambda g: g * 0.5, gp1), ga0 * 3.0  # the rewrite, on call 1 only
    (gz0,) = vjp_act(ga0)
    gp0, _ = vjp0(gz0)

    seen = []

    def hook(rec):
        seen.append(rec.key)
        return _scale(rec)

    grads, captured = maybe_jit(vk.grad(loss, hooks={"fc#1": hook}, capture="fc#1"))(params, x)
    assert set(seen) == {"fc#1"} and sorted(captured) == ["fc#1"]
    rec = captured["fc#1"]
    tree_allclose(rec.input, a0, rtol=RTOL, atol=ATOL)
    tree_allclose(rec.output, z1, rtol=RTOL, atol=ATOL)
    tree_allclose(rec.grad_params, gp1, rtol=RTOL, atol=ATOL)  # as rewritten
    tree_allclose(grads, {"fc": jax.tree.map(jnp.add, gp0, gp1)}, rtol=RTOL, atol=ATOL)


# -------------------------------------------------------------------------- plain-JAX names


def _captured_names(loss, params, *args, maybe_jit=lambda f: f):
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(params, *args)
    tree_allclose(grads, jax.grad(loss)(params, *args), rtol=RTOL, atol=ATOL)
    return captured


def test_single_weight_module_is_named_by_module(maybe_jit):
    """``{"fc": {"w": W}}`` is the layer ``fc`` with params ``{"w"}``, as ``{"fc": {"w", "b"}}`` is."""
    params = {
        "fc": {"w": _normal(7, (3, 5))},
        "out": {"w": _normal(8, (5, 2))},
        "Dense_0": {"kernel": _normal(9, (2, 2))},
    }
    x = _normal(10, (4, 3))

    def loss(p, x):
        h = jnp.tanh(x @ p["fc"]["w"])
        return jnp.sum((jnp.tanh(h @ p["out"]["w"]) @ p["Dense_0"]["kernel"]) ** 2)

    captured = _captured_names(loss, params, x, maybe_jit=maybe_jit)
    assert sorted(captured) == ["Dense_0", "fc", "out"]
    ref = jax.grad(loss)(params, x)
    for name, rec in captured.items():
        tree_allclose(rec.params, params[name])
        tree_allclose(rec.grad_params, ref[name], rtol=RTOL, atol=ATOL)
    x_fc = captured["out"].input
    tree_allclose(x_fc, jnp.tanh(x @ params["fc"]["w"]), rtol=RTOL, atol=ATOL)


def test_single_weight_used_twice_hook_by_call_key(maybe_jit):
    """An embedding table looked up twice: ``emb`` and ``emb#1``; a hook on ``emb#1`` rewrites
    that call's gradient only (hand chain: jax.vjp of each lookup)."""
    table = _normal(11, (6, 3))
    params = {"emb": {"table": table}}
    ids0, ids1 = jnp.array([0, 1, 2, 1]), jnp.array([3, 3, 5, 0])
    w_out = _normal(12, (4, 3))

    def loss(p, a, b):
        t = p["emb"]["table"]
        return jnp.sum(w_out * jnp.tanh(t[a] * t[b]))

    e0, vjp0 = jax.vjp(lambda t: t[ids0], table)
    e1, vjp1 = jax.vjp(lambda t: t[ids1], table)
    _, vjp_out = jax.vjp(lambda u, v: jnp.tanh(u * v), e0, e1)
    g0, g1 = vjp_out(w_out)
    (gt0,) = vjp0(g0)
    (gt1,) = vjp1(g1)
    seen = []

    def hook(rec):
        seen.append(rec.key)
        return rec.replace(grad_params=jax.tree.map(lambda g: g * 0.5, rec.grad_params))

    grads, captured = maybe_jit(vk.grad(loss, hooks={"emb#1": hook}, capture="emb*"))(params, ids0, ids1)
    assert set(seen) == {"emb#1"} and sorted(captured) == ["emb", "emb#1"]
    tree_allclose(captured["emb"].grad_params, {"table": gt0}, rtol=RTOL, atol=ATOL)
    tree_allclose(captured["emb#1"].grad_params, {"table": gt1 * 0.5}, rtol=RTOL, atol=ATOL)
    tree_allclose(grads, {"emb": {"table": gt0 + 0.5 * gt1}}, rtol=RTOL, atol=ATOL)
    with pytest.raises(vk.ConfigError, match=r"'emb#5'.*'emb', 'emb#1'"):
        vk.grad(loss, hooks={"emb#5": hook})(params, ids0, ids1)


def test_single_weight_name_kept_when_module_name_collides(maybe_jit):
    """Two layers with other params would both be ``fc``: they keep their leaf paths."""
    x = _normal(13, (4, 3))
    two = {"fc": {"w": _normal(14, (3, 3)), "v": _normal(15, (3, 3))}}

    def apart(p, x):  # fc/w and fc/v are separate layers
        return jnp.sum(jnp.tanh(x @ p["fc"]["w"]) * (x @ p["fc"]["v"]))

    captured = _captured_names(apart, two, x, maybe_jit=maybe_jit)
    assert sorted(captured) == ["fc/v", "fc/w"]
    ref = jax.grad(apart)(two, x)
    tree_allclose(captured["fc/w"].grad_params, {"fc/w": ref["fc"]["w"]}, rtol=RTOL, atol=ATOL)
    tree_allclose(captured["fc/v"].grad_params, {"fc/v": ref["fc"]["v"]}, rtol=RTOL, atol=ATOL)

    stacked = {"layers": [_normal(16, (3, 3)), _normal(17, (3, 3))]}
    captured = _captured_names(
        lambda p, x: jnp.sum(jnp.tanh(x @ p["layers"][0]) @ p["layers"][1]), stacked, x
    )
    assert sorted(captured) == ["layers/0", "layers/1"]

    biased = {"fc": {"w": _normal(18, (3, 3)), "b": _normal(19, (3,))}}

    def reuse(p, x):  # fc is x @ w + b; the second use of w alone is another layer
        h = jnp.tanh(x @ p["fc"]["w"] + p["fc"]["b"])
        return jnp.sum(jnp.tanh(h @ p["fc"]["w"]))

    captured = _captured_names(reuse, biased, x, maybe_jit=maybe_jit)
    assert sorted(captured) == ["fc", "fc/w"]
    assert sorted(captured["fc"].params) == ["b", "w"] and sorted(captured["fc/w"].params) == ["fc/w"]
    summed = captured["fc"].grad_params["w"] + captured["fc/w"].grad_params["fc/w"]
    tree_allclose(summed, jax.grad(reuse)(biased, x)["fc"]["w"], rtol=RTOL, atol=ATOL)
