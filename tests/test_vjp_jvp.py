"""vk.vjp, vk.jvp, vk.linearize, vk.hvp and vk.jacobian against jax references, with and without hooks."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from vjpkit import nn

from .helpers import tree_allclose
from .models import dense_fn, mlp, mlp_chain, mlp_setup

ROOT = pathlib.Path(__file__).resolve().parents[1]
FC = ("fc1", "fc2", "fc3")


def apply(params, x):
    return mlp.apply(params, x)


def plain_apply(params, x):
    """``mlp.apply`` written with jnp only: the reference for every hooked transform."""
    h = jax.nn.relu(dense_fn(params["fc1"], x))
    h = jax.nn.relu(dense_fn(params["fc2"], h))
    return dense_fn(params["fc3"], h)


def scalar_loss(params, x):
    return jnp.sum(jnp.tanh(apply(params, x)))


def plain_scalar_loss(params, x):
    return jnp.sum(jnp.tanh(plain_apply(params, x)))


def random_like(tree, seed=1):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def observe():
    """A traced no-op hook and a host hook collecting numpy records."""
    seen = []
    return seen, [lambda rec: None, vk.on_host(seen.append)]


def double_grad_params(rec):
    return rec.replace(grad_params=jax.tree.map(lambda g: 2 * g, rec.grad_params))


# --- vk.vjp ------------------------------------------------------------------------------


def test_vjp_without_hooks_is_jax_vjp(maybe_jit):
    params, x, _ = mlp_setup()
    seed = random_like(jax.eval_shape(apply, params, x))

    def run(params, x, seed):
        out, pullback = vk.vjp(apply, params, x)
        return out, pullback(seed)

    out_ref, pullback_ref = jax.vjp(plain_apply, params, x)
    tree_allclose(maybe_jit(run)(params, x, seed), (out_ref, pullback_ref(seed)))


def test_vjp_hook_records_match_hand_chained_vjps(maybe_jit):
    """With the head's cotangent as the seed, vk.vjp's records are those of the scalar loss."""
    params, x, y = mlp_setup()
    chain = mlp_chain(params, x, y)
    seen, hooks = observe()

    def run(params, x, seed):
        _, pullback = vk.vjp(lambda p: apply(p, x), params, hooks={"fc*": hooks})
        return pullback(seed)

    (grads,) = maybe_jit(run)(params, x, chain["fc3"]["grad_output"])
    jax.block_until_ready(grads)
    assert [rec.key for rec in seen] == ["fc3", "fc2", "fc1"]
    for rec in seen:
        ref = chain[rec.name]
        tree_allclose(rec.params, params[rec.name])
        for field in ("input", "output", "grad_output", "grad_input", "grad_params"):
            if ref[field] is None:  # x is data here: fc1 sends no gradient down
                assert getattr(rec, field) is None
            else:
                tree_allclose(getattr(rec, field), ref[field])
    tree_allclose(grads, {name: chain[name]["grad_params"] for name in FC})


def test_vjp_pullback_keeps_hooks_when_called_later_and_under_jit():
    params, x, _ = mlp_setup()
    seed = random_like(jax.eval_shape(apply, params, x))
    seen, hooks = observe()
    _, pullback = vk.vjp(apply, params, x, hooks={"fc*": [*hooks, double_grad_params]})
    ref_params, ref_x = jax.vjp(plain_apply, params, x)[1](seed)
    expected = (jax.tree.map(lambda g: 2 * g, ref_params), ref_x)
    tree_allclose(pullback(seed), expected)
    jitted = jax.jit(lambda pb, s: pb(s))(pullback, seed)  # a pullback is a pytree
    jax.block_until_ready(jitted)
    tree_allclose(jitted, expected)
    assert [rec.key for rec in seen] == ["fc3", "fc2", "fc1"] * 2


def test_vjp_has_aux_matches_jax(maybe_jit):
    params, x, _ = mlp_setup()

    def fun(params, x):
        out = apply(params, x)
        return out, {"mean": jnp.mean(out), "argmax": jnp.argmax(out, axis=1)}

    def ref_fun(params, x):
        out = plain_apply(params, x)
        return out, {"mean": jnp.mean(out), "argmax": jnp.argmax(out, axis=1)}

    seed = random_like(jax.eval_shape(apply, params, x))

    def run(params, x, seed):
        out, pullback, aux = vk.vjp(fun, params, x, has_aux=True, hooks={"fc1": lambda rec: None})
        return out, pullback(seed), aux

    out_ref, pullback_ref, aux_ref = jax.vjp(ref_fun, params, x, has_aux=True)
    tree_allclose(maybe_jit(run)(params, x, seed), (out_ref, pullback_ref(seed), aux_ref))


def test_seed_for_output_independent_of_input_gives_zeros(maybe_jit):
    params, x, _ = mlp_setup()

    def fun(params, x):
        return apply(params, x), jnp.arange(3.0) * 2.0  # the second output ignores params and x

    def ref_fun(params, x):
        return plain_apply(params, x), jnp.arange(3.0) * 2.0

    seed = (jnp.zeros(jax.eval_shape(apply, params, x).shape), jnp.ones(3))

    def run(params, x, seed):
        return vk.vjp(fun, params, x, hooks={"fc*": lambda rec: None})[1](seed)

    grads = maybe_jit(run)(params, x, seed)
    tree_allclose(grads, jax.vjp(ref_fun, params, x)[1](seed))
    tree_allclose(grads, jax.tree.map(jnp.zeros_like, (params, x)))
    _, pullback = vk.vjp(lambda x: jnp.ones(4), x)
    tree_allclose(pullback(jnp.ones(4)), (jnp.zeros_like(x),))


def test_integer_primal_gets_float0_cotangent_as_in_jax(maybe_jit):
    params, x, y = mlp_setup()

    def picked(params, x, y):
        return jnp.take_along_axis(apply(params, x), y[:, None], axis=1)

    def ref(params, x, y):
        return jnp.take_along_axis(plain_apply(params, x), y[:, None], axis=1)

    seed = jnp.ones((x.shape[0], 1))

    def run(params, x, y, seed):
        return vk.vjp(picked, params, x, y, hooks={"fc*": lambda rec: None})[1](seed)

    grads = maybe_jit(run)(params, x, y, seed)
    ref_grads = jax.vjp(ref, params, x, y)[1](seed)
    assert grads[2].dtype == jax.dtypes.float0 and grads[2].shape == y.shape
    tree_allclose(grads[:2], ref_grads[:2])


def test_integer_output_seed_is_float0(maybe_jit):
    x = jnp.arange(6.0).reshape(2, 3)
    fun = lambda x: (2 * x, jnp.argmax(x, axis=1))
    _, pullback = vk.vjp(fun, x)
    float0_seed = np.zeros((2,), jax.dtypes.float0)
    tree_allclose(
        pullback((jnp.ones((2, 3)), float0_seed)), jax.vjp(fun, x)[1]((jnp.ones((2, 3)), float0_seed))
    )
    with pytest.raises(vk.SeedError, match=r"path \[1\]: expected float0\[2\], got int32\[2\].*float0"):
        pullback((jnp.ones((2, 3)), jnp.zeros(2, jnp.int32)))


def test_scalar_seed_rules():
    """Python and weakly typed scalars adopt the output dtype; committed dtypes never change."""
    x = jnp.arange(3.0)
    _, pullback = vk.vjp(lambda x: jnp.sum(x**2), x)
    ref = jax.vjp(lambda x: jnp.sum(x**2), x)[1](jnp.float32(2.0))
    for seed in (2.0, 2, jnp.asarray(2.0), jnp.float32(2.0)):
        tree_allclose(pullback(seed), ref)
    tree_allclose(jax.jit(lambda pb, s: pb(s))(pullback, 2.0), ref)
    for seed, got in ((jnp.float16(2.0), "float16[]"), (True, "bool True")):
        with pytest.raises(vk.SeedError, match=re.escape(f"float32[], got {got}")):
            pullback(seed)


def test_numpy_seeds_have_the_dtype_jax_gives_them(maybe_jit):
    """A float64 numpy seed is float32 to JAX without x64: accepted as jax.vjp accepts it."""
    x = jnp.arange(6.0).reshape(3, 2)
    _, pullback = vk.vjp(lambda x: x**2, x, hooks={})
    _, ref_pullback = jax.vjp(lambda x: x**2, x)
    seed = np.linspace(0.0, 1.0, 6).reshape(3, 2)  # float64
    tree_allclose(maybe_jit(lambda s: pullback(s))(seed), ref_pullback(seed))
    tree_allclose(pullback(np.float64(1.0) * np.ones((3, 2))), ref_pullback(np.ones((3, 2))))


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        (jnp.ones((4, 4)), r"path \(root\): expected float32\[6,2\], got float32\[4,4\]"),
        (jnp.ones((6, 2), jnp.float16), r"path \(root\): expected float32\[6,2\], got float16\[6,2\]"),
        (np.ones((6, 2), np.int32), r"path \(root\): expected float32\[6,2\], got int32\[6,2\]"),
        (1.0, r"path \(root\): expected an array float32\[6,2\], got float 1.0"),
        ((jnp.ones((6, 2)),), r"wrong pytree structure\. Expected float32\[6,2\], got \(float32\[6,2\],\)"),
        ([jnp.ones((6, 2))], r"wrong pytree structure"),
    ],
    ids=["shape", "dtype-f16", "numpy-int", "scalar-for-array", "tuple-for-array", "list-for-array"],
)
def test_bad_seed_raises_seed_error(seed, message):
    params, x, _ = mlp_setup()
    _, pullback = vk.vjp(apply, params, x, hooks={"fc*": lambda rec: None})
    with pytest.raises(vk.SeedError, match=message) as info:
        pullback(seed)
    assert "vk.vjp pullback: the seed" in str(info.value)
    assert "A seed is dL/d(out)" in str(info.value)
    assert isinstance(info.value, TypeError)


def test_wrong_structure_seed_for_two_outputs_names_the_leaf():
    x = jnp.ones(3)
    _, pullback = vk.vjp(lambda x: {"a": x, "b": jnp.sum(x)}, x)
    with pytest.raises(vk.SeedError, match=r"path \['b'\]: expected float32\[\], got float32\[3\]"):
        pullback({"a": jnp.ones(3), "b": jnp.ones(3)})
    with pytest.raises(
        vk.SeedError, match=r"wrong pytree structure\. Expected \{a: float32\[3\], b: float32\[\]\}"
    ):
        pullback(jnp.ones(3))
    with pytest.raises(vk.SeedError, match=r"takes one seed.*pullback\(\(s1, s2\)\)"):
        pullback(jnp.ones(3), 1.0)


def test_has_aux_misuse():
    x = jnp.ones(3)
    with pytest.raises(
        vk.SeedError, match=r"has_aux=True\): fun must return a pair \(out, aux\), got float32\[3\]"
    ):
        vk.vjp(lambda x: 2 * x, x, has_aux=True)
    # has_aux forgotten: the aux becomes an output that wants a seed, and the error says so
    _, pullback = vk.vjp(lambda x: (jnp.sum(x), {"n": jnp.int32(3)}), x)
    with pytest.raises(vk.SeedError, match=r"If fun returns \(out, aux\), pass has_aux=True"):
        pullback(1.0)
    for call in (
        lambda: vk.jvp(lambda x: 2 * x, (x,), (x,), has_aux=True),
        lambda: vk.linearize(lambda x: 2 * x, x, has_aux=True),
        lambda: vk.jacobian(lambda x: 2 * x, has_aux=True)(x),
    ):
        with pytest.raises(vk.SeedError, match="must return a pair"):
            call()


def test_grad_non_scalar_error_line_is_true():
    """vk.grad's non-scalar error shows a vk.vjp line: running it works and is jax.vjp."""
    params, x, _ = mlp_setup()
    with pytest.raises(
        vk.SeedError, match=r"out, pullback = vk\.vjp\(apply, \*args\); grads = pullback\(seed\)"
    ):
        vk.grad(apply)(params, x)
    args = (params, x)
    seed = jnp.ones((6, 2))
    out, pullback = vk.vjp(apply, *args)
    grads = pullback(seed)
    tree_allclose(grads, jax.vjp(plain_apply, *args)[1](seed))
    tree_allclose(grads[0], jax.grad(lambda p: jnp.sum(plain_apply(p, x)))(params))


# --- vk.jvp ------------------------------------------------------------------------------


def test_jvp_without_hooks_is_jax_jvp(maybe_jit):
    params, x, _ = mlp_setup()
    tangents = (random_like(params), random_like(x, 2))
    run = lambda p, x, t: vk.jvp(apply, (p, x), t)
    tree_allclose(maybe_jit(run)(params, x, tangents), jax.jvp(plain_apply, (params, x), tangents))


def test_jvp_tangent_records_match_hand_chained_jvps(maybe_jit):
    params, x, _ = mlp_setup()
    tp = random_like(params)
    seen, hooks = observe()

    def run(params, x, tp):
        return vk.jvp(lambda p: apply(p, x), (params,), (tp,), hooks={"*": hooks})

    out, t_out = maybe_jit(run)(params, x, tp)
    jax.effects_barrier()
    tree_allclose((out, t_out), jax.jvp(lambda p: plain_apply(p, x), (params,), (tp,)))
    assert [rec.key for rec in seen] == ["fc1", "relu1", "fc2", "relu2", "fc3"]
    assert all(isinstance(rec, vk.Tangents) for rec in seen)
    # hand-chained jvps, layer by layer
    h, t = x, None
    for rec in seen:
        if rec.name.startswith("fc"):
            p, dp = params[rec.name], tp[rec.name]
            if t is None:  # x is data: no tangent enters fc1
                y, ty = jax.jvp(lambda p, h=h: dense_fn(p, h), (p,), (dp,))
            else:
                y, ty = jax.jvp(dense_fn, (p, h), (dp, t))
            tree_allclose(rec.params, p)
            tree_allclose(rec.tangent_params, dp)
        else:
            y, ty = jax.jvp(jax.nn.relu, (h,), (t,))
            assert rec.tangent_params == {}
        tree_allclose(rec.input, h)
        if t is None:
            assert rec.tangent_input is None
        else:
            tree_allclose(rec.tangent_input, t)
        tree_allclose(rec.output, y)
        tree_allclose(rec.tangent_output, ty)
        h, t = y, ty


def test_jvp_hook_replaces_tangent_output(maybe_jit):
    params, x, _ = mlp_setup()
    tangents = (random_like(params), random_like(x, 2))

    def double(rec):
        return rec.replace(tangent_output=2 * rec.tangent_output)

    def run(params, x, tangents):
        return vk.jvp(apply, (params, x), tangents, hooks={"fc2": double})

    def ref(params, x):  # the tangent of fc2's output doubled: a custom_jvp-free hand chain
        tp, tx = tangents
        h1, t1 = jax.jvp(lambda p, x: jax.nn.relu(dense_fn(p, x)), (params["fc1"], x), (tp["fc1"], tx))
        h2, t2 = jax.jvp(dense_fn, (params["fc2"], h1), (tp["fc2"], t1))
        return jax.jvp(lambda p, h: dense_fn(p, jax.nn.relu(h)), (params["fc3"], h2), (tp["fc3"], 2 * t2))

    tree_allclose(maybe_jit(run)(params, x, tangents), ref(params, x))


def test_jvp_weight_sharing_and_dropout_key(maybe_jit):
    block = nn.serial(fc=nn.dense(3), drop=nn.dropout(0.5))
    x = jax.random.normal(jax.random.key(0), (4, 3))
    params = block.init(jax.random.key(1), x)
    keys = jax.random.split(jax.random.key(2), 2)

    def fun(params, x):
        return block.apply(params, block.apply(params, x, key=keys[0]), key=keys[1])

    seen = []
    tangents = (random_like(params), random_like(x, 3))
    run = lambda p, x, t: vk.jvp(fun, (p, x), t, hooks={"*": vk.on_host(lambda rec: seen.append(rec.key))})
    tree_allclose(maybe_jit(run)(params, x, tangents), jax.jvp(fun, (params, x), tangents))
    jax.effects_barrier()
    assert seen == ["fc", "drop", "fc#1", "drop#1"]


def test_jvp_on_host_delivers_numpy_tangents_every_call():
    params, x, _ = mlp_setup()
    seen = []
    hook = vk.on_host(lambda rec: seen.append((rec.key, type(rec.tangent_output))))
    run = jax.jit(lambda p, t: vk.jvp(lambda p: apply(p, x), (p,), (t,), hooks={"fc3": hook}))
    for _ in range(3):
        run(params, random_like(params))
    jax.effects_barrier()
    assert seen == [("fc3", np.ndarray)] * 3


def test_bad_tangents():
    params, x, _ = mlp_setup()
    tx = jnp.ones_like(x)
    with pytest.raises(
        vk.SeedError, match=r"vk\.jvp: tangents, path \[1\]: expected float32\[6,3\], got float16\[6,3\]"
    ):
        vk.jvp(apply, (params, x), (params, tx.astype(jnp.float16)))
    with pytest.raises(vk.SeedError, match=r"path \[1\]: expected float32\[6,3\], got float32\[6,2\]"):
        vk.jvp(apply, (params, x), (params, tx[:, :2]))
    with pytest.raises(vk.SeedError, match=r"tangents: wrong pytree structure"):
        vk.jvp(apply, (params, x), (params,))
    with pytest.raises(vk.SeedError, match=r"primals must be a tuple.*vk\.jvp\(f, \(x,\), \(v,\)\)"):
        vk.jvp(jnp.sin, x, tx)
    with pytest.raises(vk.SeedError, match="A tangent is the direction"):
        vk.jvp(jnp.sin, (x,), (np.ones((6, 3), np.int32),))
    # a float64 numpy tangent is float32 to JAX without x64, as in jax.jvp
    tree_allclose(vk.jvp(jnp.sin, (x,), (np.ones(x.shape),)), jax.jvp(jnp.sin, (x,), (np.ones(x.shape),)))


def test_integer_primal_tangent_is_float0(maybe_jit):
    x = jnp.arange(6.0).reshape(3, 2)
    ids = jnp.array([2, 0])
    fun = lambda x, ids: jnp.take(x, ids, axis=0)
    t0 = np.zeros(ids.shape, jax.dtypes.float0)
    run = lambda x, t: vk.jvp(fun, (x, ids), (t, t0))
    tree_allclose(maybe_jit(run)(x, jnp.ones_like(x)), jax.jvp(fun, (x, ids), (jnp.ones_like(x), t0)))
    with pytest.raises(
        vk.SeedError, match=r"path \[1\]: expected float0\[2\], got int32\[2\].*jax\.dtypes\.float0"
    ):
        vk.jvp(fun, (x, ids), (x, jnp.zeros(2, jnp.int32)))
    with pytest.raises(vk.SeedError, match=r"vk\.hvp: primals\[0\], path \(root\), has dtype int32"):
        vk.hvp(lambda ids: jnp.sum(ids), (ids,), ids)
    with pytest.raises(vk.SeedError, match=r"vk\.jacobian: argument 1, path \(root\), has dtype int32"):
        vk.jacobian(fun, argnums=1)(x, ids)


@pytest.mark.parametrize(
    ("hook", "error"),
    [
        (
            lambda rec: rec.replace(tangent_output=rec.tangent_output.astype(jnp.float16)),
            r"expected float32\[6,4\], got float16\[6,4\]",
        ),
        (
            lambda rec: rec.replace(tangent_output=rec.tangent_output[:, :2]),
            r"expected float32\[6,4\], got float32\[6,2\]",
        ),
        (
            lambda rec: rec.replace(tangent_input=2 * rec.tangent_input),
            "changed field 'tangent_input', which is read-only",
        ),
        (lambda rec: rec.tangent_output, "not a Tangents record"),
    ],
    ids=["dtype", "shape", "read-only", "not-a-record"],
)
def test_bad_tangent_hook_replacement(hook, error):
    params, x, _ = mlp_setup()
    with pytest.raises(vk.HookError, match=error) as info:
        vk.jvp(apply, (params, x), (params, x), hooks={"fc2": hook})
    assert "layer 'fc2' (call 0)" in str(info.value)


# --- vk.linearize ------------------------------------------------------------------------


def test_linearize_matches_jax_and_hooks_fire_per_call(maybe_jit):
    params, x, _ = mlp_setup()
    seen = []
    out, f_jvp = vk.linearize(apply, params, x, hooks={"fc*": vk.on_host(lambda rec: seen.append(rec.key))})
    jax.effects_barrier()
    assert seen == []  # tangent hooks belong to f_jvp
    tree_allclose(out, plain_apply(params, x))
    for seed in (1, 2):
        tangents = (random_like(params, seed), random_like(x, seed + 10))
        got = maybe_jit(lambda f, t: f(*t))(f_jvp, tangents)
        tree_allclose(got, jax.jvp(plain_apply, (params, x), tangents)[1])
    jax.effects_barrier()
    assert seen == ["fc1", "fc2", "fc3"] * 2
    with pytest.raises(
        vk.SeedError, match=r"vk\.linearize f_jvp: tangents, path \[1\]: expected float32\[6,3\]"
    ):
        f_jvp(params, x.astype(jnp.float16))


# --- vk.hvp ------------------------------------------------------------------------------


def test_hvp_matches_hessian_for_a_vector(maybe_jit):
    w = jax.random.normal(jax.random.key(0), (4, 3))
    f = lambda v, w: jnp.sum(jnp.tanh(w @ v) ** 2)
    v, t = jnp.array([0.3, -0.2, 0.5]), jnp.array([1.0, 2.0, -1.0])
    got = maybe_jit(lambda v, w, t: vk.hvp(f, (v, w), t))(v, w, t)
    tree_allclose(got, jax.hessian(f)(v, w) @ t, rtol=1e-5)


def test_hvp_through_hooked_layers(maybe_jit):
    params, x, _ = mlp_setup()
    tp = random_like(params)
    seen, hooks = observe()

    def run(params, x, tp):
        return vk.hvp(scalar_loss, (params, x), tp, hooks={"fc*": hooks})

    ref = jax.jvp(lambda p: jax.grad(plain_scalar_loss)(p, x), (params,), (tp,))[1]
    hv = maybe_jit(run)(params, x, tp)
    jax.block_until_ready(hv)
    tree_allclose(hv, ref)
    assert [rec.key for rec in seen] == ["fc3", "fc2", "fc1"]
    # a hook that doubles every grad_params doubles the gradient, hence H @ v
    doubled = vk.hvp(scalar_loss, (params, x), tp, hooks={"fc*": double_grad_params})
    tree_allclose(doubled, jax.tree.map(lambda h: 2 * h, ref), rtol=1e-5)


def test_hvp_bad_input():
    params, x, _ = mlp_setup()
    with pytest.raises(vk.SeedError, match=r"structure of primals\[0\] alone"):
        vk.hvp(scalar_loss, (params, x), (params,))
    with pytest.raises(vk.SeedError, match=r"vk\.hvp needs fun to return a float scalar, got float32\[6,2\]"):
        vk.hvp(apply, (params, x), params)


# --- vk.jacobian -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_jacobian_matches_jax_through_hooked_layers(mode, maybe_jit):
    params, x, _ = mlp_setup(batch=2)
    jac = vk.jacobian(apply, argnums=(0, 1), mode=mode, hooks={"fc*": lambda rec: None})
    tree_allclose(maybe_jit(jac)(params, x), jax.jacrev(plain_apply, argnums=(0, 1))(params, x))


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_jacobian_hooks_fire_once_per_row_or_column(mode):
    params, x, _ = mlp_setup(batch=2)
    seen = []
    jac = vk.jacobian(apply, argnums=1, mode=mode, hooks={"fc*": vk.on_host(seen.append)})
    out = jax.jit(jac)(params, x)
    jax.block_until_ready(out)  # mode="rev": the host functions have run once out is ready
    jax.effects_barrier()  # mode="fwd": tangent hooks are ordered effects
    tree_allclose(out, jax.jacfwd(plain_apply, argnums=1)(params, x))
    record_type = vk.Cotangents if mode == "rev" else vk.Tangents
    assert all(isinstance(rec, record_type) for rec in seen)
    # vmapped products: one record per layer per row of J (rev, 2*2 outputs) or column (fwd, 2*3 inputs)
    assert sorted(rec.key for rec in seen) == sorted(FC * (4 if mode == "rev" else 6))


def test_jacobian_has_aux_and_mode_error():
    x = jnp.array([1.0, 2.0])
    fun = lambda x: (x**2, jnp.sum(x))
    for mode, ref in (("rev", jax.jacrev), ("fwd", jax.jacfwd)):
        tree_allclose(vk.jacobian(fun, mode=mode, has_aux=True)(x), ref(fun, has_aux=True)(x))
    with pytest.raises(vk.ConfigError, match=r"mode must be 'rev'.*or 'fwd'.*got 'forward'"):
        vk.jacobian(fun, mode="forward")


# --- forward mode inside a reverse-mode hook scope ---------------------------------------


def _inner_jvp(params, x):
    return jax.jvp(lambda p: scalar_loss(p, x), (params,), (params,))[1]


def _plain_inner_jvp(params, x):
    return jax.jvp(lambda p: plain_scalar_loss(p, x), (params,), (params,))[1]


def test_jax_jvp_inside_hooked_vjp_matches_jax(maybe_jit):
    """Forward mode inside a hooked vk.vjp: the layers' primal calls stay marked, the JVP is plain."""
    params, x, _ = mlp_setup()
    out, pullback = vk.vjp(_inner_jvp, params, x, hooks={"fc*": lambda rec: None})
    ref_out, ref_pullback = jax.vjp(_plain_inner_jvp, params, x)
    tree_allclose(out, ref_out, rtol=1e-5)
    tree_allclose(
        maybe_jit(lambda s: pullback(s))(jnp.ones_like(out)), ref_pullback(jnp.ones_like(out)), rtol=1e-5
    )


def test_jax_jvp_inside_hooked_grad_matches_jax(maybe_jit):
    params, x, _ = mlp_setup()
    got = maybe_jit(vk.grad(_inner_jvp, hooks={"fc*": lambda rec: None}))(params, x)
    tree_allclose(got, jax.grad(_plain_inner_jvp)(params, x), rtol=1e-5)


def test_vk_jvp_inside_hooked_grad():
    params, x, _ = mlp_setup()
    inner = lambda p: vk.jvp(lambda q: scalar_loss(q, x), (p,), (p,))[1]
    got = vk.grad(inner, hooks={"fc*": lambda rec: None})(params)
    tree_allclose(got, jax.grad(lambda p: _plain_inner_jvp(p, x))(params), rtol=1e-5)
    nested = lambda p: vk.jvp(lambda q: scalar_loss(q, x), (p,), (p,), hooks={"fc1": lambda rec: None})[1]
    with pytest.raises(vk.ConfigError, match=r"vk\.jvp with hooks was called inside a vjpkit reverse-mode"):
        vk.grad(nested, hooks={"fc*": lambda rec: None})(params)


def test_suggested_alternatives_work(maybe_jit):
    """Reverse mode inside a hooked vk.grad, and forward mode outside it, both match jax."""
    params, x, _ = mlp_setup(batch=2)

    def penalty(params, x, loss):  # a Jacobian penalty, computed with jax.jacrev instead of jacfwd
        return jnp.sum(jax.jacrev(loss, argnums=1)(params, x) ** 2)

    got = maybe_jit(vk.grad(lambda p: penalty(p, x, scalar_loss), hooks={"fc*": lambda rec: None}))(params)
    tree_allclose(got, jax.grad(lambda p: penalty(p, x, plain_scalar_loss))(params), rtol=1e-5)
    tp = random_like(params)
    outer = maybe_jit(
        lambda p, t: jax.jvp(
            vk.grad(scalar_loss, hooks={"fc*": lambda rec: None}), (p, x), (t, jnp.zeros_like(x))
        )
    )
    tree_allclose(
        outer(params, tp), jax.jvp(jax.grad(plain_scalar_loss), (params, x), (tp, jnp.zeros_like(x)))
    )


def test_hessian_inside_hooked_grad_works(maybe_jit):
    """jax.hessian is forward over reverse, so it goes through hooked layers even inside vk.grad."""
    params, x, _ = mlp_setup(batch=2)

    def curvature(loss):
        return lambda p: jnp.sum(jax.hessian(lambda x: loss(p, x))(x) ** 2)

    got = maybe_jit(vk.grad(curvature(scalar_loss), hooks={"fc*": lambda rec: None}))(params)
    tree_allclose(got, jax.grad(curvature(plain_scalar_loss))(params), rtol=1e-5)


def test_hook_transforms_in_explicit_transforms():
    params, x, _ = mlp_setup()
    seed = random_like(jax.eval_shape(apply, params, x))
    _, pullback = vk.vjp(apply, params, x, hooks={"fc*": vk.scale(0.5)})
    ref_params, ref_x = jax.vjp(plain_apply, params, x)[1](seed)
    tree_allclose(pullback(seed), (jax.tree.map(lambda g: g / 2, ref_params), ref_x))
    with pytest.raises(
        vk.ConfigError, match=r"keeps state .* vk\.vjp does not thread hook state.*hook_state="
    ):
        vk.vjp(apply, params, x, hooks={"fc*": vk.ema_normalize(0.9)})
    with pytest.raises(vk.ConfigError, match=r"vk\.hvp does not thread hook state"):
        vk.hvp(scalar_loss, (params, x), params, hooks={"fc*": vk.ema_normalize(0.9)})
    with pytest.raises(vk.ConfigError, match=r"vk\.jvp: the hook for glob 'fc\*' is a vk\.HookTransform"):
        vk.jvp(apply, (params, x), (params, x), hooks={"fc*": vk.scale(0.5)})


def test_hook_glob_must_match():
    params, x, _ = mlp_setup()
    for call in (
        lambda: vk.vjp(apply, params, x, hooks={"conv*": lambda rec: None}),
        lambda: vk.jvp(apply, (params, x), (params, x), hooks={"conv*": lambda rec: None}),
        lambda: vk.linearize(apply, params, x, hooks={"conv*": lambda rec: None}),
        lambda: vk.jacobian(apply, hooks={"conv*": lambda rec: None})(params, x),
    ):
        with pytest.raises(vk.ConfigError, match="'conv\\*' matched no layer"):
            call()
