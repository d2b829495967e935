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


# --- nested: every program of an equation, with the operands it receives (issue 31, item 3) --------

custom_jvp_fn = jax.nn.relu  # a custom_jvp function


@jax.custom_vjp
def custom_vjp_fn(x, w):
    return jnp.sin(x) * w


custom_vjp_fn.defvjp(lambda x, w: (custom_vjp_fn(x, w), (x, w)), lambda r, g: (g * r[1], g * r[0]))


def _everything(w, x, xs, k):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    a = jax.jit(lambda u, v: jnp.sin(u) * v)(x, w)
    b = jax.checkpoint(lambda u: jnp.cos(u) * w)(a)
    (c, n), ys = jax.lax.scan(lambda cn, s: ((cn[0] * w + s, cn[1] + 1), cn[0] * 2.0), (b, 0), xs)
    d = jax.lax.cond(k > 0, lambda u, v: u * v, lambda u, v: u - v, c, w)
    e, _ = jax.lax.while_loop(lambda v: v[1] < k, lambda v: (v[0] * w, v[1] + n), (d, 0))
    f = jax.shard_map(
        lambda u, v: u * v,
        mesh=mesh,
        in_specs=(jax.sharding.PartitionSpec("d"), jax.sharding.PartitionSpec()),
        out_specs=jax.sharding.PartitionSpec("d"),
    )(e, w)
    (g,) = my_call_p.bind(f, program=jax.make_jaxpr(jnp.tanh)(f))
    return jnp.sum(custom_vjp_fn(custom_jvp_fn(g), w)) + jnp.sum(ys)


ARGS = (jnp.float32(0.5), jnp.ones((4,), jnp.float32), jnp.ones((3, 4), jnp.float32), jnp.int32(2))
KINDS = {
    "jit": {"call"},
    "pjit": {"call"},
    "checkpoint": {"call"},
    "remat2": {"call"},
    "scan": {"scan"},
    "cond": {"branch"},
    "while": {"loop"},
    "shard_map": {"call"},
    "some_library_call": {"call"},
    "custom_jvp_call": {"opaque"},
    "custom_vjp_call": {"opaque"},
    "custom_vjp_call_jaxpr": {"opaque"},
}


def _slice(aval):
    return jax.core.ShapedArray(aval.shape[1:], aval.dtype)


def test_nested_gives_each_program_the_operands_it_receives():
    eqns = jax.make_jaxpr(_everything)(*ARGS).jaxpr.eqns
    seen = set()
    for eqn in eqns:
        nest = _engine.nested(eqn)
        name = eqn.primitive.name
        # every program in the params is found, in order
        assert [n.jaxpr for n in nest] == _engine.sub_programs(eqn.params), name
        if not nest:
            continue
        seen.add(name)
        assert {n.kind for n in nest} == KINDS[name], name
        for n in nest:
            assert n.ins is not None and len(n.ins) == len(n.roles) == len(n.jaxpr.invars), name
            for i, role, var in zip(n.ins, n.roles, n.jaxpr.invars):
                outer = eqn.invars[i].aval
                want = _slice(outer) if role == "s" else outer
                if role == "p":  # split over the one shard here: the same shape
                    assert var.aval.dtype == outer.dtype, name
                else:
                    assert (var.aval.shape, var.aval.dtype) == (want.shape, want.dtype), (name, i, role)
    assert {"scan", "cond", "while", "shard_map", "some_library_call", "custom_vjp_call"} <= seen
    assert seen & {"jit", "pjit"} and seen & {"checkpoint", "remat2"} and "custom_jvp_call" in seen


def test_nested_roles_of_scan_while_and_shard_map():
    jaxpr = jax.make_jaxpr(_everything)(*ARGS).jaxpr
    eqns = {e.primitive.name: e for e in jaxpr.eqns}
    (scan,) = _engine.nested(eqns["scan"])
    assert scan.roles == "c" + "rr" + "s"  # w closed over; (c, n) carried; xs sliced
    assert scan.ins == (0, 1, 2, 3)
    cond_, body = _engine.nested(eqns["while"])
    w, k, n = jaxpr.invars[0], jaxpr.invars[3], eqns["scan"].outvars[1]
    ops = eqns["while"].invars
    # the condition reads k, the body w and n (its consts); each gets the carry (two values)
    assert [ops[i] for i, r in zip(cond_.ins, cond_.roles) if r == "c"] == [k]
    assert [ops[i] for i, r in zip(body.ins, body.roles) if r == "c"] == [w, n]
    assert cond_.roles.endswith("rr") and body.roles.endswith("rr")
    assert cond_.ins[-2:] == body.ins[-2:] == (len(ops) - 2, len(ops) - 1)
    (shard,) = _engine.nested(eqns["shard_map"])
    assert shard.roles == "p="
    branches = _engine.nested(eqns["cond"])
    assert [b.index for b in branches] == [0, 1] and all(b.ins == (1, 2) for b in branches)


def test_with_programs_replaces_one_branch():
    eqns = {e.primitive.name: e for e in jax.make_jaxpr(_everything)(*ARGS).jaxpr.eqns}
    eqn = eqns["cond"]
    b0, b1 = _engine.nested(eqn)
    assert _engine.with_programs(eqn, {b1: b1.program}) is eqn  # nothing new: the same equation
    new = _engine.with_programs(eqn, {b1: b0.program})
    assert new.params["branches"] == (b0.program, b0.program)
    assert eqn.params["branches"] == (b0.program, b1.program)  # the old equation unchanged
    u, v = jnp.arange(4.0, dtype=jnp.float32), jnp.float32(2.0)
    for k in (0, 1):  # either index now runs branch 0
        (out,) = new.primitive.bind(jnp.int32(k), u, v, **new.params)
        np.testing.assert_allclose(out, u - v)  # branch 0: cond's false branch


def test_no_walker_reads_program_structure_by_primitive_name():
    """Outside ``_engine/_rules.py`` (and ``_compat``, which reads scan params for every JAX),
    no module compares a primitive's name with one that holds programs, reads a program or
    its operand counts out of ``params``, or splits a scan itself: they ask ``nested``."""
    import ast
    import pathlib

    names = set(KINDS) | {"closed_call", "core_call", "while"}
    keys = {"jaxpr", "branches", "cond_jaxpr", "body_jaxpr", "call_jaxpr", "fun_jaxpr"}
    keys |= {"num_consts", "num_carry", "ft_in", "cond_nconsts", "body_nconsts"}
    root = pathlib.Path(vk.__file__).parent
    found = []

    def by_name(c):
        return "primitive.name" in ast.unparse(c) or (isinstance(c, ast.Name) and c.id in ("name", "prim"))

    def items(c):
        return c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]

    for path in sorted(root.rglob("*.py")):
        if path.name in ("_rules.py", "_compat.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = [k.value for c in sides for k in items(c) if isinstance(k, ast.Constant)]
                if any(map(by_name, sides)) and set(named) & names:
                    found.append(f"{where}: {ast.unparse(node)}")
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value in keys
                and ast.unparse(node.value).endswith("params")
            ):
                found.append(f"{where}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("scan_split"):
                found.append(f"{where}: {ast.unparse(node)}")
    assert not found, found


def test_programs_in_a_tuple_param_are_not_guessed_calls():
    """``custom_linear_solve`` holds its matvec, vecmat, solve and transpose solve in one
    (named)tuple param: none of them is the equation's call (vecmat has the equation's arity),
    so no walker follows one as if it ran on the operands; replacing one keeps the namedtuple."""

    def solve(mv, b):
        return b - jnp.mean(b, axis=0)  # mixes the examples

    def f(h):
        return jax.lax.custom_linear_solve(lambda v: v * 2.0, h, solve=solve, transpose_solve=solve)

    (eqn,) = [
        e for e in jax.make_jaxpr(f)(jnp.ones((4, 3))).jaxpr.eqns if e.primitive.name == "custom_linear_solve"
    ]
    nest = _engine.nested(eqn)
    assert nest and {n.kind for n in nest} == {"opaque"} and all(n.ins is None for n in nest)
    assert _engine.call_program(eqn) is None and _engine.call_program(eqn, forward=True) is None
    first = nest[0]
    new = _engine.with_programs(eqn, {first: nest[1].program})
    assert type(new.params[first.key]) is type(eqn.params[first.key])
    assert new.params[first.key][first.index] is nest[1].program
