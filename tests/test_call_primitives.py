"""Sub-programs found generically (issue 31, item 3): every walker descends into the programs of
an equation through ``_engine.sub_programs`` and ``_engine.call_program``, never by its own list
of primitives, so a call primitive vjpkit has never heard of is walked like ``jax.jit``.

Oracles: ``jax.grad`` of the same model called directly, and the primitives' own structure.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import _engine, nn

MODEL = nn.serial(fc1=nn.dense(4), act=nn.relu(), fc2=nn.dense(2))
X = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
PARAMS = MODEL.init(jax.random.key(0), X)

# a call primitive of some other library: one program, run on the operands as they are
my_call_p = jcore.Primitive("some_library_call")
my_call_p.multiple_results = True
my_call_p.def_impl(lambda *args, program: jcore.jaxpr_as_fun(program)(*args))
my_call_p.def_abstract_eval(lambda *args, program: list(program.out_avals))


def direct(p, x):
    return jnp.sum(MODEL.apply(p, x) ** 2)


def through_call(p, x):
    flat, tree = jax.tree.flatten((p, x))
    program = jax.make_jaxpr(lambda *leaves: MODEL.apply(*jax.tree.unflatten(tree, leaves)))(*flat)
    (out,) = my_call_p.bind(*flat, program=program)
    return jnp.sum(out**2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_layers_inside_an_unknown_call_primitive_get_records(jit):
    g = vk.grad(through_call, capture="*")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "run inside ... vjpkit does not rewrite" warning
        grads, cap = (jax.jit(g) if jit else g)(PARAMS, X)
    tree_allclose(grads, jax.grad(direct)(PARAMS, X))
    assert sorted(cap) == ["act", "fc1", "fc2"]
    _, want = vk.grad(direct, capture="*")(PARAMS, X)
    tree_allclose(cap, want)


def _eqns(fun, *args):
    return {e.primitive.name: e for e in jax.make_jaxpr(fun)(*args).jaxpr.eqns}


def test_call_program_tells_calls_from_other_programs():
    x = jnp.ones((3,))
    relu = jax.nn.relu  # a custom_jvp function

    def many(x):
        a = jax.jit(jnp.sin)(x)
        b = jax.checkpoint(jnp.cos)(a)
        c, _ = jax.lax.scan(lambda c, _: (c * 2, None), b, None, length=2)
        d = jax.lax.cond(True, jnp.sin, jnp.cos, c)
        e = jax.lax.while_loop(lambda v: v[0] < 1, lambda v: v + 1, d)
        return relu(e)

    eqns = _eqns(many, x)
    jit = "jit" if "jit" in eqns else "pjit"
    assert _engine.call_program(eqns[jit])[0] == "jaxpr"
    remat = "checkpoint" if "checkpoint" in eqns else "remat2"
    assert _engine.call_program(eqns[remat])[0] == "jaxpr"
    for name in ("scan", "cond", "while", "custom_jvp_call"):  # their rules treat them apart
        assert _engine.call_program(eqns[name]) is None, name
    # what runs forward of a custom_jvp function, for a forward dataflow
    assert _engine.call_program(eqns["custom_jvp_call"], forward=True) is not None
    programs = _engine.sub_programs(eqns["cond"].params)
    assert len(programs) == 2 and all(hasattr(p, "eqns") for p in programs)  # both branches


def test_plain_jax_layers_inside_an_unknown_call_primitive_are_matched():
    rng = np.random.default_rng(1)
    params = {
        "fc1": {"w": rng.standard_normal((5, 4)).astype(np.float32)},
        "fc2": {"w": rng.standard_normal((4, 2)).astype(np.float32)},
    }

    def model(p, x):
        return jnp.tanh(x @ p["fc1"]["w"]) @ p["fc2"]["w"]

    def loss(p, x):
        flat, tree = jax.tree.flatten((p, x))
        program = jax.make_jaxpr(lambda *leaves: model(*jax.tree.unflatten(tree, leaves)))(*flat)
        (out,) = my_call_p.bind(*flat, program=program)
        return jnp.sum(out**2)

    grads, cap = jax.jit(vk.grad(loss, capture="*"))(params, X)
    tree_allclose(grads, jax.grad(lambda p, x: jnp.sum(model(p, x) ** 2))(params, X))
    assert sorted(cap) == ["fc1", "fc2"]
    _, want = vk.grad(lambda p, x: jnp.sum(model(p, x) ** 2), capture="*")(params, X)
    tree_allclose(cap, want)
