"""Handlers own their probe parts: a handler beside hooks and capture gets its own named part
and result from the same backward pass (under ``lax.scan``, ``lax.cond`` and ``jit``), and
curvature statistics read their records through one (``_engine.records``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vjpkit as vk
from vjpkit import _engine
from vjpkit._capture import CaptureSpec

from . import test_curvature_blocks as cb
from .helpers import tree_allclose
from .models import mlp, mlp_loss, mlp_setup

FIELDS = ("input", "grad_output", "grad_params")


def _pull(loss, args, capture, handlers, hooks=None):
    """``(grads, captured, results)`` of one engine pass of ``loss`` with ``handlers`` added."""
    config = _engine.configure(hooks, capture, "test")
    traced = _engine.trace(config, loss, args, argnums=(0,), handlers=handlers)
    value, _, pull = _engine.linearize(traced)
    grads, captured, _, results = pull([jnp.ones_like(value)])
    return grads[0], captured, results


def _mine(globs, fields=FIELDS):
    spec = CaptureSpec(globs, fields, None)
    return _engine.records("mine", lambda layer, call: spec if spec.matches(layer, call) else None)


def test_a_handler_owns_its_part_beside_hooks_and_capture(maybe_jit):
    """The same calls captured by the user and by another handler: each gets its record, the
    hooks still rewrite the gradient, and the handler's records equal the user's and JAX's."""
    params, x, y = mlp_setup()
    halve = lambda rec: rec.replace(grad_input=rec.grad_input / 2)

    def run(params, x, y):
        return _pull(mlp_loss, (params, x, y), vk.capture("fc*", fields=FIELDS), [_mine(("fc1", "fc3"))],
                     hooks={"relu2": halve})  # fmt: skip

    grads, captured, results = maybe_jit(run)(params, x, y)
    mine = results["mine"]
    assert set(mine) == {"fc1", "fc3"}  # the chosen calls only
    for key in mine:
        tree_allclose(mine[key], captured[key])
    np.testing.assert_array_equal(mine["fc1"].input, x)
    logits = mlp.apply(params, x)
    ce = lambda z: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1))
    tree_allclose(mine["fc3"].grad_output, jax.grad(ce)(logits), rtol=1e-5, atol=1e-7)
    plain = jax.grad(mlp_loss)(params, x, y)
    assert not np.allclose(grads["fc1"]["weight"], plain["fc1"]["weight"])  # the hook took effect
    tree_allclose(grads["fc3"], plain["fc3"], rtol=1e-5, atol=1e-7)  # above the hook: unchanged


def _scanned(params, x, flag):
    """Two stacked ``tanh(h @ W + b)`` blocks under ``lax.scan``, then a head in a ``lax.cond``."""

    def body(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = lax.scan(body, x, params["blocks"])
    return lax.cond(flag, lambda h: h @ params["head"]["w"], lambda h: h * 2.0, h)


def _scan_setup():
    rng = np.random.default_rng(0)
    params = {
        "blocks": {"w": rng.standard_normal((2, 4, 4)) * 0.5, "b": rng.standard_normal((2, 4)) * 0.1},
        "head": {"w": rng.standard_normal((4, 4)) * 0.5},
    }
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    return params, jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)


@pytest.mark.parametrize("flag", [True, False], ids=["branch-taken", "branch-not-taken"])
def test_a_handler_part_under_scan_and_cond(maybe_jit, flag):
    """Per-iteration records stacked on the scan's axis, equal to the user's capture of the same
    calls and to a hand-chained vjp of the unrolled blocks; a branch not taken gives NaN."""
    params, x = _scan_setup()
    loss = lambda p, x, flag: jnp.sum(_scanned(p, x, flag) ** 2)

    def run(params, x, flag):
        return _pull(loss, (params, x, flag), vk.capture("*", fields=FIELDS), [_mine(("blocks", "head"))])

    _, captured, results = maybe_jit(run)(params, x, jnp.asarray(flag))
    mine = results["mine"]
    assert set(mine) == {"blocks", "head"}
    tree_allclose(mine["blocks"], captured["blocks"])
    # the reference: the unrolled blocks' output cotangents by jax.vjp
    p = params["blocks"]
    h1 = jnp.tanh(x @ p["w"][0] + p["b"][0])
    z2 = h1 @ p["w"][1] + p["b"][1]
    head = (lambda h: h @ params["head"]["w"]) if flag else (lambda h: h * 2.0)
    g2 = jax.grad(lambda z: jnp.sum(head(jnp.tanh(z)) ** 2))(z2)
    g1 = jax.vjp(lambda z: jnp.tanh(z) @ p["w"][1] + p["b"][1], x @ p["w"][0] + p["b"][0])[1](g2)[0]
    tree_allclose(mine["blocks"].grad_output, jnp.stack([g1, g2]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(mine["blocks"].input[0], x)
    if flag:
        tree_allclose(mine["head"], captured["head"])
    else:  # no record of a branch not taken: NaN, never plausible zeros
        assert all(np.isnan(a).all() for a in jax.tree.leaves((mine["head"].input, mine["head"].grad_output)))


def test_two_handlers_cannot_own_one_part():
    params, x, y = mlp_setup()
    with pytest.raises(ValueError, match="two handlers own the probe part 'mine'"):
        _pull(mlp_loss, (params, x, y), None, [_mine(("fc1",)), _mine(("fc1",))])
    with pytest.raises(ValueError, match="'captured'"):  # the user's capture's part
        _pull(
            mlp_loss,
            (params, x, y),
            vk.capture("fc1"),
            [_engine.records("captured", lambda layer, call: CaptureSpec(("*",), FIELDS, None))],
        )


def test_curvature_and_capture_of_the_same_layer_is_an_error_not_a_lost_record():
    """``captured[name]`` holds one entry per call: a layer chosen by both the statistics and a
    capture spec is a ConfigError naming it (its capture was silently dropped before), with and
    without hooks; capture of other layers sits beside the statistics."""
    params, x, y = cb.problem()
    loss = cb.loss
    spec = vk.curvature.stats("blocks/fc", ["kflr"])
    for hooks in (None, {"blocks/proj/w": lambda rec: rec}):
        with pytest.raises(vk.ConfigError, match=r"\['blocks/fc'\] are chosen both by vk.curvature.stats"):
            vk.value_and_grad(loss, hooks=hooks, capture=[spec, vk.capture("blocks/*")])(params, x, y)
    _, captured = vk.value_and_grad(loss, capture=[spec, vk.capture("embed")])(params, x, y)
    _, alone = vk.value_and_grad(loss, capture=vk.capture("embed"))(params, x, y)
    _, stats = vk.value_and_grad(loss, capture=spec)(params, x, y)
    assert set(captured) == {*alone, *stats}
    for field in ("params", "input", "grad_params", "grad_output", "output"):  # input: the ids
        tree_allclose(getattr(captured["embed"], field), getattr(alone["embed"], field), rtol=1e-5, atol=1e-6)
    tree_allclose(captured["blocks/fc"], stats["blocks/fc"], rtol=1e-5, atol=1e-6)


def test_a_lookup_closed_over_by_a_scan_records_its_ids(maybe_jit):
    """A lookup inside a scan body, of ids the body closes over, beside curvature statistics:
    its record's ``input`` is the ids at every iteration, eagerly as under ``jax.jit`` (eagerly,
    jnp's index array was built at trace time and recorded instead, with a trailing axis)."""
    v, d, b, t, n = 11, 4, 3, 5, 2
    k = jax.random.split(jax.random.key(0), 4)
    params = {"embed": jax.random.normal(k[0], (v, d)), "w": jax.random.normal(k[1], (n, d, d))}
    tok, y = jax.random.randint(k[2], (b, t), -v, v), jax.random.randint(k[3], (b, t), 0, v)

    def loss(p, tok, y):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w + p["embed"][tok]), None), jnp.zeros((b, t, d)), p["w"])
        return vk.curvature.softmax_cross_entropy((h @ p["embed"].T).reshape(-1, v), y.reshape(-1))

    spec = [vk.curvature.stats("w", ["kflr"]), vk.capture("embed", fields=["input", "output"])]
    _, captured = maybe_jit(vk.value_and_grad(loss, capture=spec))(params, tok, y)
    np.testing.assert_array_equal(captured["embed"].input, jnp.broadcast_to(tok, (n, b, t)))
    tree_allclose(captured["embed"].output, jnp.broadcast_to(params["embed"][tok], (n, b, t, d)))
