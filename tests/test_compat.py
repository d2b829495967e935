"""``vjpkit/_compat.py`` against the installed JAX: the jaxpr parameters it reads and claims
unchanged, the one module that touches ``jax._src``, and scans of every shape through the engine
(checked against ``jax.grad`` and hand-unrolled records), jitted and eagerly."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import _compat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _eqn(fn, *args, name):
    found = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == name]
    assert found, f"no {name!r} equation in the program"
    return found[0]


def _files_matching(pattern: str) -> list[str]:
    return [
        str(p.relative_to(ROOT))
        for p in (ROOT / "vjpkit").rglob("*.py")
        if p.name != "_compat.py" and re.search(pattern, p.read_text())
    ]


def test_only_the_compat_module_reads_jax_private_modules():
    assert _files_matching(r"jax\._src") == []


def test_no_version_dependent_scan_param_outside_compat():
    assert _files_matching(r"\"(num_consts|num_carry|ft_in|ft_out)\"") == []


@pytest.mark.parametrize("n_consts,n_carry,n_xs", [(0, 1, 1), (2, 1, 1), (1, 3, 2), (3, 2, 0)])
def test_scan_split_matches_the_equation(n_consts, n_carry, n_xs):
    consts = [jnp.float32(1.0 + k) for k in range(n_consts)]

    def f(carry, xs):
        def body(c, x):
            s = sum(consts, jnp.float32(0.0)) + sum(x, jnp.float32(0.0))
            return [ci * s + 1.0 for ci in c], sum(c, jnp.float32(0.0))

        return jax.lax.scan(body, carry, xs, length=3)

    carry = [jnp.float32(k) for k in range(n_carry)]
    xs = [jnp.arange(3.0, dtype=jnp.float32) + k for k in range(n_xs)]
    eqn = _eqn(f, carry, xs, name="scan")
    nc, ncar = _compat.scan_split(eqn.params)
    body = eqn.params["jaxpr"]
    assert ncar == n_carry
    # the consts are what the body closes over (here: each Python float const, as JAX traced it)
    assert len(eqn.invars) == nc + ncar + n_xs
    assert len(body.jaxpr.invars) == nc + ncar + n_xs
    assert len(eqn.outvars) >= ncar


def test_unchanged_params_are_as_compat_says():
    w = _eqn(lambda x: jax.lax.while_loop(lambda c: c < 3, lambda c: c + x, x), 1.0, name="while")
    assert {"cond_nconsts", "body_nconsts", "cond_jaxpr", "body_jaxpr"} <= set(w.params)
    c = _eqn(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0, name="cond")
    assert "branches" in c.params and len(c.params["branches"]) == 2
    j = _eqn(lambda x: jax.jit(jnp.cos)(x), 1.0, name="jit")
    assert "jaxpr" in j.params
    r = _eqn(lambda x: jax.checkpoint(jnp.sin)(x), 1.0, name="remat2")
    assert "jaxpr" in r.params

    @jax.custom_vjp
    def g(x):
        return x

    g.defvjp(lambda x: (x, None), lambda _, ct: (ct,))
    v = _eqn(g, 1.0, name="custom_vjp_call")
    assert "call_jaxpr" in v.params


def test_closed_jaxpr_round_trip():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
    again = _compat.closed_jaxpr(closed.jaxpr, closed.consts)
    assert list(again.jaxpr.invars) == list(closed.jaxpr.invars)
    np.testing.assert_allclose(
        jax.extend.core.jaxpr_as_fun(again)(np.float32(0.5))[0], np.sin(np.float32(0.5)) * 2.0, rtol=1e-6
    )


def test_hoisted_constvars_stay_constvars():
    """``open_jaxpr`` + ``closed_jaxpr`` keep constvars apart from inputs (jax 0.12 merged
    ``ClosedJaxpr`` into ``Jaxpr``, where unattached constvars become leading inputs)."""
    closed = jax.make_jaxpr(lambda x: x * jnp.arange(3.0))(jnp.ones(3))
    j = closed.jaxpr
    rebuilt = _compat.closed_jaxpr(
        _compat.open_jaxpr(j.constvars, j.invars, j.outvars, j.eqns, j.effects, j.debug_info), closed.consts
    )
    assert len(rebuilt.jaxpr.invars) == 1 and len(rebuilt.jaxpr.constvars) == len(closed.consts)
    out = jax.extend.core.jaxpr_as_fun(rebuilt)(jnp.full(3, 2.0))[0]
    np.testing.assert_allclose(out, 2.0 * np.arange(3.0))


def _scan_loss(params, x):
    """Plain-JAX blocks under ``lax.scan`` over stacked weights, with a carry and a const."""
    scale = params["scale"]

    def block(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]) * scale, jnp.sum(h)

    h, ys = jax.lax.scan(block, x, params["blocks"])
    return jnp.sum(h**2) + jnp.sum(ys)


def _scan_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "blocks": {"w": 0.5 * jax.random.normal(k[0], (3, 4, 4)), "b": 0.1 * jax.random.normal(k[1], (3, 4))},
        "scale": jnp.float32(0.9),
    }


def test_scan_grad_and_records_equal_references(maybe_jit):
    params, x = _scan_params(), jax.random.normal(jax.random.key(2), (5, 4))
    got, captured = maybe_jit(vk.grad(_scan_loss, capture="*"))(params, x)
    tree_allclose(got, jax.grad(_scan_loss)(params, x), rtol=1e-5, atol=1e-6)
    # the per-iteration records of the stacked weight sum to its gradient, iteration by iteration
    rec = next(r for k, r in captured.items() if k.startswith("blocks"))
    assert rec.grad_params["w"].shape == (3, 4, 4)
    tree_allclose(rec.grad_params["w"], jax.grad(_scan_loss)(params, x)["blocks"]["w"], rtol=1e-5, atol=1e-6)
