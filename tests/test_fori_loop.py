"""``fori_loop`` over stacked weights (``W[i]`` by the loop counter) is ``lax.scan(body, x, W)``
to vjpkit (``_engine._fori``): records per iteration under the leaf's path, per-example norms on
the fast path, the same program values and gradients. Slices that are not provably iteration
``k``'s row keep their loop as written (exact, with the fallback warning).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.test_per_example_layouts import fast
from tests.test_per_example_scan import assert_matches
from tests.test_per_example_structures import lm_params, make_lm, tokens
from vjpkit import _compat
from vjpkit._engine import _fori

# The default tier runs this test's eager twin (conftest.py): the first one's is slow.
DEFAULT_TIER_EAGER = "test_records_equal_those_of_the_same_scan"

D, L, B = 4, 3, 5


def mlp_params(key, rows=L):
    k1, k2 = jax.random.split(key)
    return {
        "blocks": {
            "w": jax.random.normal(k1, (rows, D, D)) * D**-0.5,
            "b": jax.random.normal(k2, (rows, D)) * 0.1,
        }
    }


def batch(seed=1):
    return jax.random.normal(jax.random.key(seed), (B, D))


def fori_loss(lower=0, upper=L, index=lambda i: i):
    def loss(p, x):
        def body(i, h):
            w, b = p["blocks"]["w"][index(i)], p["blocks"]["b"][index(i)]
            return jnp.tanh(h @ w + b)

        return jnp.mean(jnp.sum(jnp.square(jax.lax.fori_loop(lower, upper, body, x)), -1))

    return loss


def scan_loss(p, x):
    h, _ = jax.lax.scan(lambda h, bp: (jnp.tanh(h @ bp["w"] + bp["b"]), None), x, p["blocks"])
    return jnp.mean(jnp.sum(jnp.square(h), -1))


def scans(closed):
    return [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]


def test_the_lm_under_fori_loop_is_on_the_fast_path(maybe_jit):
    loss, params, tok = make_lm(loop="fori"), lm_params(jax.random.key(2)), tokens(3)
    _, grads, norms = fast(maybe_jit(vk.inspect.per_example_grad_norms(loss)), params, tok)
    assert_matches(norms, loss, params, tok)
    tree_allclose(grads, jax.grad(loss)(params, tok), rtol=1e-5, atol=1e-6)


def test_records_equal_those_of_the_same_scan(maybe_jit):
    params, x = mlp_params(jax.random.key(0)), batch()
    spec = vk.capture("blocks*", fields=["grad_output", "grad_params", "input"])
    got_g, got = maybe_jit(vk.grad(fori_loss(), capture=spec))(params, x)
    want_g, want = maybe_jit(vk.grad(scan_loss, capture=spec))(params, x)
    assert sorted(got) == sorted(want) and got
    tree_allclose(got, want, rtol=1e-6, atol=1e-7)
    tree_allclose(got_g, jax.grad(fori_loss())(params, x), rtol=1e-6, atol=1e-7)
    tree_allclose(want_g, got_g, rtol=1e-6, atol=1e-7)


def nested_loss(inline):
    def loss(p, x):
        def outer(i, h):
            if inline:  # both indices inside the inner loop: W[i] is not one of its consts
                inner = lambda j, h: jnp.tanh(h @ p["blocks"]["w"][i][j] + p["blocks"]["b"][i][j])
            else:  # each loop slices its own level, as nested scans do
                q = jax.tree.map(lambda a: a[i], p["blocks"])
                inner = lambda j, h: jnp.tanh(h @ q["w"][j] + q["b"][j])
            return jax.lax.fori_loop(0, L, inner, h)

        return jnp.mean(jnp.sum(jnp.square(jax.lax.fori_loop(0, 2, outer, x)), -1))

    return loss


@pytest.mark.parametrize("inline", [False, True], ids=["level-by-level", "inline"])
def test_nested_fori_loops(maybe_jit, inline):
    params = mlp_params(jax.random.key(3), rows=2 * L)
    params["blocks"] = jax.tree.map(lambda a: a.reshape(2, L, *a.shape[1:]), params["blocks"])
    loss, x = nested_loss(inline), batch(4)
    fn = maybe_jit(vk.inspect.per_example_grad_norms(loss))
    if inline:
        with pytest.warns(UserWarning, match="blocks"):
            _, grads, norms = fn(params, x)
    else:
        _, grads, norms = fast(fn, params, x)
    assert_matches(norms, loss, params, x)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(lower=1, upper=L), id="starts-at-1"),  # rows 1.. only: not W's stacking
        pytest.param(dict(rows=L + 1), id="fewer-iterations-than-rows"),
        pytest.param(dict(index=lambda i: L - 1 - i), id="reversed-index"),
        pytest.param(dict(index=lambda i: i // 2), id="repeated-rows"),
    ],
)
def test_other_slices_keep_their_loop_and_stay_exact(case):
    """Not provably row k at iteration k: the program is left as written; the per-example norms
    fall back (warned) and are exact."""
    rows = case.pop("rows", L)
    params, x = mlp_params(jax.random.key(5), rows=rows), batch(6)
    loss = fori_loss(**case)
    closed = jax.make_jaxpr(loss)(params, x)
    assert _fori.hoist(closed) is closed
    with pytest.warns(UserWarning, match="blocks"):
        _, grads, norms = jax.jit(vk.inspect.per_example_grad_norms(loss))(params, x)
    assert_matches(norms, loss, params, x)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-6)


def test_hoist_moves_the_consts_and_keeps_the_values():
    """The rewritten program takes the stacked leaves as the scan's xs and computes the same
    values, also with the slice inside an inner jit, a checkpoint and a cond branch, and a
    weight used whole besides its rows (kept as a const too)."""
    params, x = mlp_params(jax.random.key(7)), batch(8)

    def loss(p, x):
        def body(i, h):
            w = p["blocks"]["w"][i]
            h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w)
            h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h + p["blocks"]["b"][i], lambda h: h * 2.0, h)
            return h

        h = jax.jit(lambda x: jax.lax.fori_loop(0, L, body, x))(x)
        return jnp.sum(h**2) + 1e-3 * jnp.sum(p["blocks"]["w"])

    closed = jax.make_jaxpr(loss)(params, x)
    hoisted = _fori.hoist(closed)
    assert hoisted is not closed
    inner = next(e for e in hoisted.jaxpr.eqns if e.primitive.name in ("pjit", "jit"))
    (scan,) = scans(inner.params["jaxpr"])
    nc, ncar = _compat.scan_split(scan.params)
    assert len(scan.invars) - nc - ncar == 1 and scan.params["length"] == L  # w as xs (b in a cond)
    flat = jax.tree.leaves((params, x))
    want = jcore.jaxpr_as_fun(closed)(*flat)
    got = jcore.jaxpr_as_fun(hoisted)(*flat)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    g = jax.grad(lambda *a: jcore.jaxpr_as_fun(hoisted)(*a)[0], argnums=(0, 1))(*flat[:2], flat[2])
    g0 = jax.grad(lambda *a: jcore.jaxpr_as_fun(closed)(*a)[0], argnums=(0, 1))(*flat[:2], flat[2])
    tree_allclose(g, g0, rtol=1e-6, atol=1e-7)
    tree_allclose(vk.grad(loss)(params, x), jax.grad(loss)(params, x), rtol=1e-6, atol=1e-7)


def test_programs_without_counter_slices_are_kept():
    params, x = mlp_params(jax.random.key(9)), batch(10)
    closed = jax.make_jaxpr(scan_loss)(params, x)
    assert _fori.hoist(closed) is closed


def test_grad_of_grad_through_the_rewrite():
    params, x = mlp_params(jax.random.key(11)), batch(12)
    loss = fori_loss()
    f = lambda p: jnp.sum(jax.tree.leaves(vk.grad(loss)(p, x))[1] ** 2)
    g = lambda p: jnp.sum(jax.tree.leaves(jax.grad(loss)(p, x))[1] ** 2)
    tree_allclose(jax.grad(f)(params), jax.grad(g)(params), rtol=1e-5, atol=1e-7)


def test_records_under_vmap_inside_the_loss_and_checkpoint(maybe_jit):
    """The model vmapped over the examples inside the loss, its loop under jax.checkpoint: the
    fori_loop records still equal the same scan's."""
    params, x = mlp_params(jax.random.key(13)), batch(14)

    def model(loop):
        def one(p, xi):
            if loop == "fori":
                f = lambda h: jax.lax.fori_loop(0, L, lambda i, h: jnp.tanh(h @ p["blocks"]["w"][i]), h)
            else:
                f = lambda h: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["blocks"]["w"])[0]
            return jax.checkpoint(f)(xi)

        return lambda p, x: jnp.mean(jax.vmap(one, in_axes=(None, 0))(p, x) ** 2)

    spec = vk.capture("blocks*", fields=["grad_output", "grad_params"])
    got = maybe_jit(vk.grad(model("fori"), capture=spec))(params, x)
    want = maybe_jit(vk.grad(model("scan"), capture=spec))(params, x)
    assert sorted(got[1]) == sorted(want[1]) and got[1]
    tree_allclose(got, want, rtol=1e-6, atol=1e-7)


def _offset_by_a_carry(outer: bool):
    """``W[i + k]`` where ``k`` is a carry that starts at a literal 0 and steps by 2: not row ``i``
    (clamped past the end). ``outer``: ``k`` is the carry of a scan around the loop instead, its
    start value known there, and the loop slices by ``i + k`` inside."""

    def row(w, i, k):
        return jax.lax.squeeze(jax.lax.dynamic_slice(w, (i + k, 0, 0), (1, D, D)), (0,))

    def loss(p, x):
        def body(c, _):
            i, k, h = c
            return (i + 1, k + 2, jnp.tanh(h @ row(p["blocks"]["w"], i, k))), None

        if not outer:
            (_, _, h), _ = jax.lax.scan(body, (0, 0, x), None, length=L)
            return jnp.mean(jnp.sum(h**2, -1))

        def step(c, _):
            k, h = c
            (_, _, h), _ = jax.lax.scan(lambda c, u: body((c[0], k, c[2]), u), (0, k, h), None, length=L)
            return (k + 2, h), None

        (_, h), _ = jax.lax.scan(step, (0, x), None, length=2)
        return jnp.mean(jnp.sum(h**2, -1))

    return loss


@pytest.mark.parametrize("outer", [False, True], ids=["own-carry", "outer-carry"])
def test_a_carry_start_value_is_not_its_value(maybe_jit, outer):
    """Only a literal or a const is the same integer in every iteration: an index offset by a
    carry whose start value is known (0) is not the counter's row. Before, it was hoisted as
    ``W[i]`` and the gradient was silently wrong (1.17 off on the own-carry case)."""
    params, x = mlp_params(jax.random.key(11)), batch(12)
    loss = _offset_by_a_carry(outer)
    closed = jax.make_jaxpr(loss)(params, x)
    assert _fori.hoist(closed) is closed
    grads, cap = maybe_jit(vk.grad(loss, capture="*"))(params, x)
    tree_allclose(grads, jax.grad(loss)(params, x), rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match="blocks"):
        _, _, norms = maybe_jit(vk.inspect.per_example_grad_norms(loss))(params, x)
    assert_matches(norms, loss, params, x)
