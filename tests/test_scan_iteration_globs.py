"""Hooks and capture on some iterations of a layer called inside ``lax.scan`` (issue 31, item 4):
a glob ``blocks[2]`` (``[i][j]`` under nested scans, ``[*]`` for every iteration).

Oracles: ``jax.grad`` of the same model unrolled by hand, with a gradient-halving identity
(``jax.custom_vjp``) at the chosen block's input, for ``vk.scale(0.5, "grad_input")`` there; the
records of a capture of every iteration, indexed, for a capture or ``vk.on_host`` of one; a
counter ``HookTransform`` for the state (advanced once per step, not once per iteration).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose

L, D = 3, 4
RNG = np.random.default_rng(0)
PARAMS = {
    "blocks": {
        "w": (0.5 * RNG.standard_normal((L, D, D))).astype(np.float32),
        "b": (0.1 * RNG.standard_normal((L, D))).astype(np.float32),
    }
}
X = RNG.standard_normal((5, D)).astype(np.float32)


def block(h, w, b):
    return jnp.tanh(h @ w + b)


def scanned(p, x):
    h, _ = jax.lax.scan(lambda h, wb: (block(h, *wb), None), x, (p["blocks"]["w"], p["blocks"]["b"]))
    return jnp.mean(h**2)


def looped(p, x):
    h = jax.lax.fori_loop(0, L, lambda i, h: block(h, p["blocks"]["w"][i], p["blocks"]["b"][i]), x)
    return jnp.mean(h**2)


def remat_body(p, x):
    step = jax.checkpoint(lambda h, wb: (block(h, *wb), None))
    h, _ = jax.lax.scan(step, x, (p["blocks"]["w"], p["blocks"]["b"]))
    return jnp.mean(h**2)


@jax.custom_vjp
def _half(h):
    return h


_half.defvjp(lambda h: (h, None), lambda _, g: (0.5 * g,))


def unrolled(p, x, halved_at):
    """The model by hand, the cotangent entering block ``halved_at``'s input halved."""
    h = x
    for i in range(L):
        h = block(_half(h) if i == halved_at else h, p["blocks"]["w"][i], p["blocks"]["b"][i])
    return jnp.mean(h**2)


@pytest.mark.parametrize("model", [scanned, looped, remat_body], ids=["scan", "fori_loop", "checkpoint"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("i", [0, 1, 2])
def test_a_hook_rewrites_one_iteration_only(model, jit, i):
    g = vk.grad(model, hooks={f"blocks[{i}]": vk.scale(0.5, "grad_input")})
    got = (jax.jit(g) if jit else g)(PARAMS, X)
    want = jax.grad(lambda p: unrolled(p, X, i))(PARAMS)
    tree_allclose(got, want)
    if i > 0:  # the oracle differs from the plain gradient: the test can fail
        plain = jax.grad(model)(PARAMS, X)
        assert not np.allclose(plain["blocks"]["w"][i - 1], want["blocks"]["w"][i - 1])


def test_every_iteration_glob_is_the_plain_glob():
    g_all = vk.grad(scanned, hooks={"blocks[*]": vk.scale(0.5)})(PARAMS, X)
    g_plain = vk.grad(scanned, hooks={"blocks": vk.scale(0.5)})(PARAMS, X)
    tree_allclose(g_all, g_plain)


def test_nested_scans_take_one_index_per_scan():
    w = (0.3 * RNG.standard_normal((2, 3, D, D))).astype(np.float32)

    def nested(p, x):
        inner = lambda h, w: (jnp.tanh(h @ w), None)
        h, _ = jax.lax.scan(lambda h, ws: (jax.lax.scan(inner, h, ws)[0], None), x, p["w"])
        return jnp.sum(h)

    def by_hand(p, x):
        h = x
        for a in range(2):
            for b in range(3):
                h = jnp.tanh((_half(h) if (a, b) == (1, 2) else h) @ p["w"][a, b])
        return jnp.sum(h)

    got = jax.jit(vk.grad(nested, hooks={"w[1][2]": vk.scale(0.5, "grad_input")}))({"w": w}, X)
    tree_allclose(got, jax.grad(by_hand)({"w": w}, X))
    _, every = vk.grad(nested, capture="w")({"w": w}, X)
    _, some = vk.grad(nested, capture=vk.capture(["w[1][*]", "w[0][2]"]))({"w": w}, X)
    assert sorted(some) == ["w[0][2]", "w[1][*]"]
    tree_allclose(some["w[1][*]"], jax.tree.map(lambda a: a[1], every["w"]))
    tree_allclose(some["w[0][2]"], jax.tree.map(lambda a: a[0, 2], every["w"]))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_capture_and_on_host_of_one_iteration(jit):
    seen = []
    host = vk.on_host(lambda rec: seen.append(rec))
    g = vk.grad(scanned, capture=["blocks[2]", "blocks[0]"], hooks={"blocks[1]": host})
    _, cap = jax.block_until_ready((jax.jit(g) if jit else g)(PARAMS, X))
    _, every = vk.grad(scanned, capture="blocks")(PARAMS, X)
    assert sorted(cap) == ["blocks[0]", "blocks[2]"]
    for i in (0, 2):
        tree_allclose(cap[f"blocks[{i}]"], jax.tree.map(lambda a, i=i: a[i], every["blocks"]))
    assert len(seen) == 1  # one iteration, one step
    tree_allclose(
        jax.tree.map(np.asarray, seen[0]),
        jax.tree.map(lambda a: np.asarray(a[1]), every["blocks"]),
        rtol=1e-6,
    )


def test_a_stateful_hook_on_one_iteration_advances_once_per_step():
    count = vk.HookTransform(lambda p: {"n": jnp.zeros(())}, lambda rec, s: (rec, {"n": s["n"] + 1}))
    for glob, per_step in (("blocks[1]", 1), ("blocks", L)):
        g = jax.jit(vk.grad(scanned, hooks={glob: count}))
        state = vk.init_hook_state(g, PARAMS, X)
        for _ in range(2):
            _, state = g(PARAMS, X, hook_state=state)
        assert float(state["blocks"]["n"]) == 2 * per_step


@pytest.mark.parametrize(
    ("glob", "match"),
    [
        (
            "blocks[3]",
            r"iteration \[3\] of layer call 'blocks'.*1 lax.scan\(s\) of 3 iterations.*blocks\[0\.\.2\]",
        ),
        ("blocks[0][1]", r"iteration \[0\]\[1\].*one index per scan"),
    ],
)
def test_an_iteration_outside_the_scan_is_a_config_error(glob, match):
    with pytest.raises(vk.ConfigError, match=match):
        vk.grad(scanned, hooks={glob: vk.scale(0.5)})(PARAMS, X)
    with pytest.raises(vk.ConfigError, match=match):
        vk.grad(scanned, capture=glob)(PARAMS, X)


def test_an_iteration_of_a_layer_outside_any_scan_is_a_config_error():
    def flat(p, x):
        return jnp.mean(block(x, p["blocks"]["w"][0], p["blocks"]["b"][0]) ** 2)

    with pytest.raises(vk.ConfigError, match=r"not called inside lax.scan.*Drop the \[0\]"):
        vk.grad(flat, hooks={"blocks[0]": vk.scale(0.5)})(PARAMS, X)


def test_one_host_hook_under_two_globs_counts_each_step_once():
    """``every=2`` counts backward passes: the same ``vk.on_host`` given for one iteration and
    for the whole layer is counted once per step, not once per glob."""
    seen = []
    host = vk.on_host(lambda rec: seen.append(np.shape(rec.grad_output)), every=2)
    g = jax.jit(vk.grad(scanned, hooks={"blocks[1]": host, "blocks": host}))
    for _ in range(4):
        jax.block_until_ready(g(PARAMS, X))
    # steps 1 and 3 deliver: each time iteration 1 once (its glob) and all L iterations (the other)
    assert len(seen) == 2 * (1 + L)
