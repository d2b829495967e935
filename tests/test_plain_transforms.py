"""Outside vk.grad, ``model.apply`` is plain JAX (README, Layers): every JAX transform works on it.

Each transform of ``model.apply`` is compared with the same transform of a hand-written plain
``jnp`` re-implementation of the model (convolution by shifted multiply-adds, max-pool by
reshape-then-max), which is itself checked against numpy. The second half checks that a
hooked ``vk.grad`` composes with ``jax.vmap`` and ``lax.scan``: hooks that rewrite cotangents
are compared with a plain-JAX reference that rescales the same cotangents with
``stop_gradient`` arithmetic, so a hook that silently did not fire would fail the test.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    data = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(data.astype(np.float32))


def _rand_like(tree: Any, seed: int, scale: float = 0.5) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [_normal(seed + i, leaf.shape, scale) for i, leaf in enumerate(leaves)]
    )


def _scale_grad(tree: Any, c: float) -> Any:
    """Identity forward; multiplies the cotangent by ``c`` (exact: c*a + (1-c)*a == a for c in {0.5, 2})."""
    return jax.tree.map(lambda a: c * a + jax.lax.stop_gradient((1.0 - c) * a), tree)


def _halve_params(rec: vk.Cotangents) -> vk.Cotangents:
    return rec.replace(grad_params=jax.tree.map(lambda g: 0.5 * g, rec.grad_params))


def _double_input(rec: vk.Cotangents) -> vk.Cotangents:
    return rec.replace(grad_input=jax.tree.map(lambda g: 2.0 * g, rec.grad_input))


# --------------------------------------------------------------------- plain references


def _dense(p, x, c_params=1.0):
    p = _scale_grad(p, c_params) if c_params != 1.0 else p
    return jnp.einsum("...i,io->...o", x, p["weight"]) + p["bias"]


def _conv3x3_same(p, x, c_params=1.0):
    """3x3 SAME convolution as nine shifted multiply-adds (not lax.conv)."""
    p = _scale_grad(p, c_params) if c_params != 1.0 else p
    h, w = x.shape[1], x.shape[2]
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    out = p["bias"]
    for i in range(3):
        for j in range(3):
            out = out + jnp.einsum("nhwc,co->nhwo", xp[:, i : i + h, j : j + w, :], p["weight"][i, j])
    return out


def _max_pool2(x):
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def _maybe_scale(x, c):
    return _scale_grad(x, c) if c != 1.0 else x


def _jit_ref(ref: Callable) -> Callable:
    """References run compiled under every transform (op-by-op eager dispatch is slow); the model
    under test still runs both eagerly and under jit (maybe_jit)."""
    return jax.jit(ref, static_argnames="hooked")


@dataclasses.dataclass(frozen=True)
class Spec:
    """A model, its plain reference, the hooks the hooked tests use, and input shapes."""

    name: str
    model: nn.Layer
    ref: Callable  # ref(params, x, hooked=False): hooked applies the rewrite hooks' scalings
    hooks: dict
    example_shape: tuple  # one example, with the batch axis the model needs
    out_dim: int


def _mlp_spec() -> Spec:
    model = nn.serial(fc1=nn.dense(5), act1=nn.tanh(), fc2=nn.dense(4), act2=nn.tanh(), fc3=nn.dense(2))

    def ref(p, x, hooked=False):
        z1 = _dense(p["fc1"], x)
        h1 = jnp.tanh(_maybe_scale(z1, 2.0 if hooked else 1.0))  # act1: grad_input doubled
        h2 = jnp.tanh(_dense(p["fc2"], h1, 0.5 if hooked else 1.0))  # fc2: grad_params halved
        return _dense(p["fc3"], h2)

    return Spec("mlp", model, _jit_ref(ref), {"act1": _double_input, "fc2": _halve_params}, (3,), 2)


def _cnn_spec() -> Spec:
    model = nn.serial(
        conv=nn.conv2d(3, 3), act=nn.tanh(), pool=nn.max_pool(2), flat=nn.flatten(), fc=nn.dense(2)
    )

    def ref(p, x, hooked=False):
        h = _max_pool2(jnp.tanh(_conv3x3_same(p["conv"], x)))
        h = _maybe_scale(h, 2.0 if hooked else 1.0)  # flat: grad_input doubled
        return _dense(p["fc"], h.reshape(h.shape[0], -1), 0.5 if hooked else 1.0)  # fc: grad_params halved

    return Spec("cnn", model, _jit_ref(ref), {"fc": _halve_params, "flat": _double_input}, (1, 6, 6, 2), 2)


SPECS = {"mlp": _mlp_spec, "cnn": _cnn_spec}


@pytest.fixture(params=list(SPECS), scope="module")
def spec(request) -> Spec:
    return SPECS[request.param]()


def _params(spec: Spec, seed: int = 10) -> Any:
    shapes = jax.eval_shape(spec.model.init, jax.random.key(0), jnp.zeros(spec.example_shape))
    return _rand_like(shapes, seed)


def _batch(spec: Spec, n: int, seed: int = 1) -> jax.Array:
    """``n`` examples stacked on a new leading axis (for vmap/scan)."""
    return _normal(seed, (n, *spec.example_shape))


def _np_forward(spec: Spec, p, x) -> np.ndarray:
    """numpy forward of the model, to pin the jnp reference down."""
    f64 = lambda a: np.asarray(a, np.float64)
    x = f64(x)
    if spec.name == "mlp":
        h = np.tanh(x @ f64(p["fc1"]["weight"]) + f64(p["fc1"]["bias"]))
        h = np.tanh(h @ f64(p["fc2"]["weight"]) + f64(p["fc2"]["bias"]))
        return h @ f64(p["fc3"]["weight"]) + f64(p["fc3"]["bias"])
    w, b = f64(p["conv"]["weight"]), f64(p["conv"]["bias"])
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    n, hh, ww, _ = x.shape
    z = np.zeros((n, hh, ww, w.shape[-1]))
    for i in range(hh):
        for j in range(ww):
            z[:, i, j] = np.einsum("nhwc,hwco->no", xp[:, i : i + 3, j : j + 3], w) + b
    h = np.tanh(z)
    h = h.reshape(n, hh // 2, 2, ww // 2, 2, -1).max(axis=(2, 4)).reshape(n, -1)
    return h @ f64(p["fc"]["weight"]) + f64(p["fc"]["bias"])


# --------------------------------------------------------------------- plain transforms


def test_reference_matches_numpy_and_model(spec, maybe_jit):
    p, x = _params(spec), _normal(1, spec.example_shape)
    expected = _np_forward(spec, p, x)
    np.testing.assert_allclose(np.asarray(spec.ref(p, x), np.float64), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(maybe_jit(spec.model.apply)(p, x), np.float64), expected, **TOL)


def test_apply_is_plain_jax(spec):
    """No custom_vjp anywhere in model.apply's jaxpr outside a vjpkit transform."""
    p, x = _params(spec), _normal(1, spec.example_shape)
    text = str(jax.make_jaxpr(spec.model.apply)(p, x))
    assert "custom_vjp" not in text and "custom_jvp" not in text and "callback" not in text


def test_jvp(spec, maybe_jit):
    p, x = _params(spec), _normal(1, spec.example_shape)
    tp, tx = _rand_like(p, 50), _normal(2, spec.example_shape)
    out, tangent = maybe_jit(lambda p, x, tp, tx: jax.jvp(spec.model.apply, (p, x), (tp, tx)))(p, x, tp, tx)
    ref_out, ref_tangent = jax.jvp(spec.ref, (p, x), (tp, tx))
    tree_allclose(out, ref_out, **TOL)
    tree_allclose(tangent, ref_tangent, **TOL)
    # a tangent in x only
    _, tangent_x = maybe_jit(lambda x, tx: jax.jvp(lambda x: spec.model.apply(p, x), (x,), (tx,)))(x, tx)
    _, ref_tangent_x = jax.jvp(lambda x: spec.ref(p, x), (x,), (tx,))
    tree_allclose(tangent_x, ref_tangent_x, **TOL)


def test_linearize(spec, maybe_jit):
    p, x = _params(spec), _normal(1, spec.example_shape)
    tx = _normal(2, spec.example_shape)

    def tangent_at(x, tx):
        _, f_lin = jax.linearize(lambda x: spec.model.apply(p, x), x)
        return f_lin(tx)

    _, ref = jax.jvp(lambda x: spec.ref(p, x), (x,), (tx,))
    tree_allclose(maybe_jit(tangent_at)(x, tx), ref, **TOL)


def _hessian_loss(spec: Spec, p, x) -> Callable:
    w = _normal(3, spec.ref(p, x).shape)
    return lambda apply: lambda p, x: jnp.sum(w * jnp.tanh(apply(p, x)))


def test_jacfwd_jacrev_input(spec, maybe_jit):
    p, x = _params(spec), _normal(1, spec.example_shape)
    ref_jac = jax.jit(jax.jacrev(spec.ref, argnums=1))(p, x)  # references: jitted (plain JAX)
    assert float(jnp.abs(ref_jac).max()) > 0
    tree_allclose(maybe_jit(jax.jacfwd(spec.model.apply, argnums=1))(p, x), ref_jac, **TOL)
    tree_allclose(maybe_jit(jax.jacrev(spec.model.apply, argnums=1))(p, x), ref_jac, **TOL)


def test_hessian_input(spec, maybe_jit):
    p, x = _params(spec), _normal(1, spec.example_shape)
    loss = _hessian_loss(spec, p, x)
    hess = maybe_jit(jax.hessian(loss(spec.model.apply), argnums=1))(p, x)
    tree_allclose(hess, jax.jit(jax.hessian(loss(spec.ref), argnums=1))(p, x), **TOL)
    flat = np.asarray(hess).reshape(x.size, x.size)
    assert np.abs(flat).max() > 1e-3  # non-trivial, thanks to tanh
    np.testing.assert_allclose(flat, flat.T, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # eager jacfwd/hessian over ~100 parameters dispatches op by op: several seconds
def test_jacobians_and_hessian_params(spec, maybe_jit):
    p, x = _params(spec), _normal(1, spec.example_shape)
    ref_jac = jax.jit(jax.jacrev(spec.ref, argnums=0))(p, x)
    tree_allclose(maybe_jit(jax.jacfwd(spec.model.apply, argnums=0))(p, x), ref_jac, **TOL)
    tree_allclose(maybe_jit(jax.jacrev(spec.model.apply, argnums=0))(p, x), ref_jac, **TOL)
    loss = _hessian_loss(spec, p, x)
    hess = maybe_jit(jax.hessian(loss(spec.model.apply), argnums=0))(p, x)
    tree_allclose(hess, jax.jit(jax.hessian(loss(spec.ref), argnums=0))(p, x), **TOL)


def test_vmap(spec, maybe_jit):
    p, xs = _params(spec), _batch(spec, 3)
    ref = jax.jit(jax.vmap(spec.ref, in_axes=(None, 0)))(p, xs)
    tree_allclose(maybe_jit(jax.vmap(spec.model.apply, in_axes=(None, 0)))(p, xs), ref, **TOL)
    # over a stack of parameter sets (an ensemble)
    ps = jax.tree.map(lambda *a: jnp.stack(a), *[_params(spec, seed) for seed in (10, 30, 60)])
    x = xs[0]
    ens = maybe_jit(jax.vmap(spec.model.apply, in_axes=(0, None)))(ps, x)
    tree_allclose(ens, jax.jit(jax.vmap(spec.ref, in_axes=(0, None)))(ps, x), **TOL)
    # per-example gradients
    ys = _normal(4, (3, *ref.shape[1:]))

    def loss(apply):
        return lambda p, x, y: jnp.sum((apply(p, x) - y) ** 2)

    per_example = maybe_jit(jax.vmap(jax.grad(loss(spec.model.apply)), in_axes=(None, 0, 0)))(p, xs, ys)
    ref_grads = jax.jit(jax.vmap(jax.grad(loss(spec.ref)), in_axes=(None, 0, 0)))(p, xs, ys)
    tree_allclose(per_example, ref_grads, **TOL)


def test_scan(spec, maybe_jit):
    """A loss accumulated over a sequence of batches with lax.scan, and its gradient."""
    p, xs = _params(spec), _batch(spec, 3)

    def total(apply):
        def run(p, xs):
            def step(acc, x):
                y = apply(p, x)
                return acc + jnp.sum(jnp.tanh(y)), y

            return jax.lax.scan(step, jnp.zeros((), jnp.float32), xs)

        return run

    out = maybe_jit(total(spec.model.apply))(p, xs)
    tree_allclose(out, total(spec.ref)(p, xs), **TOL)
    grads = maybe_jit(jax.grad(lambda p, xs: total(spec.model.apply)(p, xs)[0]))(p, xs)
    tree_allclose(grads, jax.grad(lambda p, xs: total(spec.ref)(p, xs)[0])(p, xs), **TOL)


def _cell_and_ref():
    """A 3 -> 3 recurrent cell h' = tanh(fc(h + x)), for scans that carry the layer output."""
    cell = nn.serial(fc=nn.dense(3), act=nn.tanh())

    def ref(p, h, hooked=False):
        z = _dense(p["fc"], h, 0.5 if hooked else 1.0)  # fc: grad_params halved
        return jnp.tanh(_maybe_scale(z, 2.0 if hooked else 1.0))  # act: grad_input doubled

    return cell, _jit_ref(ref), {"fc": _halve_params, "act": _double_input}


def _rnn(apply):
    def run(p, h0, xs):
        def step(h, x):
            h = apply(p, h + x)
            return h, h

        return jax.lax.scan(step, h0, xs)

    return run


def test_scan_recurrent_cell(maybe_jit):
    cell, ref, _ = _cell_and_ref()
    h0, xs = _normal(1, (2, 3)), _normal(2, (4, 2, 3))
    p = _rand_like(jax.eval_shape(cell.init, jax.random.key(0), h0), 10)
    tree_allclose(maybe_jit(_rnn(cell.apply))(p, h0, xs), _rnn(ref)(p, h0, xs), **TOL)

    def loss(apply):
        return lambda p, h0, xs: jnp.sum(_rnn(apply)(p, h0, xs)[1] ** 2)

    g = maybe_jit(jax.grad(loss(cell.apply), argnums=(0, 1)))(p, h0, xs)
    tree_allclose(g, jax.grad(loss(ref), argnums=(0, 1))(p, h0, xs), **TOL)
    # jvp through the scan
    tp = _rand_like(p, 40)
    _, t = maybe_jit(lambda p, tp: jax.jvp(lambda p: _rnn(cell.apply)(p, h0, xs), (p,), (tp,)))(p, tp)
    _, t_ref = jax.jvp(lambda p: _rnn(ref)(p, h0, xs), (p,), (tp,))
    tree_allclose(t, t_ref, **TOL)


# ------------------------------------------------------- hooked vk.grad under vmap and scan


def _sq_loss(apply):
    def loss(p, x, y):
        return jnp.sum((apply(p, x) - y) ** 2)

    return loss


def _hooked_ref(spec_or_ref):
    """The reference with the rewrite hooks' cotangent scalings applied."""
    ref = spec_or_ref.ref if isinstance(spec_or_ref, Spec) else spec_or_ref
    return functools.partial(ref, hooked=True)


def test_hooked_grad_rewrites_differ_from_plain(spec):
    """Guard: each rewrite hook changes the gradient, so the tests below can tell if it fires."""
    p, x = _params(spec), _normal(1, spec.example_shape)
    y = _normal(2, spec.ref(p, x).shape)
    plain = jax.grad(_sq_loss(spec.ref))(p, x, y)
    scaled = jax.grad(_sq_loss(_hooked_ref(spec)))(p, x, y)
    hooked = vk.grad(_sq_loss(spec.model.apply), hooks=spec.hooks)(p, x, y)
    tree_allclose(hooked, scaled, **TOL)
    changed = {
        name
        for name in plain
        if not all(
            np.allclose(np.asarray(u), np.asarray(v), rtol=1e-3)
            for u, v in zip(jax.tree.leaves(plain[name]), jax.tree.leaves(scaled[name]))
        )
    }
    # both rewrites show (one halves a layer's grads, the other doubles all grads below it)
    assert changed == {"mlp": {"fc1", "fc2"}, "cnn": {"conv", "fc"}}[spec.name]
    tree_allclose(vk.grad(_sq_loss(spec.model.apply), hooks={"*": lambda rec: None})(p, x, y), plain, **TOL)


def test_vmap_of_hooked_grad(spec, maybe_jit):
    """Per-example gradients: jax.vmap(vk.grad(..., hooks)) == jax.vmap(jax.grad(reference))."""
    p, xs = _params(spec), _batch(spec, 3)
    ys = _normal(2, (3, *spec.ref(p, xs[0]).shape))
    hooked = maybe_jit(jax.vmap(vk.grad(_sq_loss(spec.model.apply), hooks=spec.hooks), in_axes=(None, 0, 0)))
    expected = jax.vmap(jax.grad(_sq_loss(_hooked_ref(spec))), in_axes=(None, 0, 0))(p, xs, ys)
    tree_allclose(hooked(p, xs, ys), expected, **TOL)

    observed = maybe_jit(
        jax.vmap(vk.grad(_sq_loss(spec.model.apply), hooks={"*": lambda rec: None}), in_axes=(None, 0, 0))
    )
    tree_allclose(
        observed(p, xs, ys), jax.vmap(jax.grad(_sq_loss(spec.ref)), in_axes=(None, 0, 0))(p, xs, ys), **TOL
    )


def test_vmap_of_hooked_grad_host_records(maybe_jit):
    """Under vmap, on_host delivers one record per example per layer call, each per-example."""
    spec = _mlp_spec()
    p, xs = _params(spec), _batch(spec, 3)
    ys = _normal(2, (3, 2))
    records = []
    g = jax.vmap(vk.grad(_sq_loss(spec.model.apply), hooks={"fc*": vk.on_host(records.append)}), (None, 0, 0))
    jax.block_until_ready(maybe_jit(g)(p, xs, ys))
    assert sorted(r.key for r in records) == sorted(["fc1", "fc2", "fc3"] * 3)
    per_key = {k: [r for r in records if r.key == k] for k in ("fc1", "fc2", "fc3")}
    expected = jax.vmap(jax.grad(_sq_loss(spec.ref)), in_axes=(None, 0, 0))(p, xs, ys)
    for key, recs in per_key.items():
        assert all(r.grad_output.shape == (p[key]["bias"].shape[0],) for r in recs)
        # the examples arrive in some order: match them as a set
        got = sorted(np.asarray(r.grad_params["bias"]).tolist() for r in recs)
        want = sorted(np.asarray(expected[key]["bias"]).tolist())
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_hooked_grad_of_loss_with_vmap_inside(spec, maybe_jit):
    """vk.grad of a loss that vmaps model.apply over examples: hooks still rewrite."""
    p, xs = _params(spec), _batch(spec, 3)
    ys = _normal(2, (3, *spec.ref(p, xs[0]).shape))

    def loss(apply):
        def batch_loss(p, xs, ys):
            return jnp.mean(jax.vmap(lambda x, y: _sq_loss(apply)(p, x, y))(xs, ys))

        return batch_loss

    got = maybe_jit(vk.grad(loss(spec.model.apply), hooks=spec.hooks))(p, xs, ys)
    tree_allclose(got, jax.grad(loss(_hooked_ref(spec)))(p, xs, ys), **TOL)
    observed = maybe_jit(vk.grad(loss(spec.model.apply), hooks={"*": lambda rec: None}))(p, xs, ys)
    tree_allclose(observed, jax.grad(loss(spec.ref))(p, xs, ys), **TOL)


def test_hooked_grad_of_loss_with_scan_inside(maybe_jit):
    """Hooks on layers called inside a lax.scan body fire once per iteration, rewriting each call."""
    cell, ref, hooks = _cell_and_ref()
    h0, xs = _normal(1, (2, 3)), _normal(2, (4, 2, 3))
    p = _rand_like(jax.eval_shape(cell.init, jax.random.key(0), h0), 10)

    def loss(apply):
        return lambda p, h0, xs: jnp.sum(_rnn(apply)(p, h0, xs)[1] ** 2)

    got = maybe_jit(vk.grad(loss(cell.apply), argnums=(0, 1), hooks=hooks))(p, h0, xs)
    expected = jax.grad(loss(_hooked_ref(ref)), argnums=(0, 1))(p, h0, xs)
    tree_allclose(got, expected, **TOL)
    plain = jax.grad(loss(ref), argnums=(0, 1))(p, h0, xs)
    observed = maybe_jit(vk.grad(loss(cell.apply), argnums=(0, 1), hooks={"*": lambda rec: None}))(p, h0, xs)
    tree_allclose(observed, plain, **TOL)

    records = []
    g = vk.grad(loss(cell.apply), hooks={"fc": vk.on_host(records.append)})
    jax.block_until_ready(maybe_jit(g)(p, h0, xs))
    assert len(records) == xs.shape[0]
    summed = jax.tree.map(lambda *a: sum(a), *[r.grad_params for r in records])
    tree_allclose(jax.tree.map(jnp.asarray, summed), plain[0]["fc"], rtol=1e-5, atol=1e-5)


def test_scan_of_hooked_training_steps(spec, maybe_jit):
    """SGD steps in lax.scan, each taking vk.grad with rewrite hooks, equal the reference loop."""
    p, xs = _params(spec), _batch(spec, 3)
    ys = _normal(2, (3, *spec.ref(p, xs[0]).shape))
    lr = 0.1

    def train(grad_fn):
        def run(p, xs, ys):
            def step(p, batch):
                g = grad_fn(p, *batch)
                return jax.tree.map(lambda a, b: a - lr * b, p, g), None

            return jax.lax.scan(step, p, (xs, ys))[0]

        return run

    got = maybe_jit(train(vk.grad(_sq_loss(spec.model.apply), hooks=spec.hooks)))(p, xs, ys)
    expected = train(jax.grad(_sq_loss(_hooked_ref(spec))))(p, xs, ys)
    tree_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert not np.allclose(np.asarray(jax.tree.leaves(got)[0]), np.asarray(jax.tree.leaves(p)[0]))


def test_hooked_value_and_grad_under_vmap(maybe_jit):
    spec = _mlp_spec()
    p, xs = _params(spec), _batch(spec, 3)
    ys = _normal(2, (3, 2))
    f = maybe_jit(jax.vmap(vk.value_and_grad(_sq_loss(spec.model.apply), hooks=spec.hooks), (None, 0, 0)))
    value, grads = f(p, xs, ys)
    ref_value, ref_grads = jax.vmap(jax.value_and_grad(_sq_loss(_hooked_ref(spec))), (None, 0, 0))(p, xs, ys)
    tree_allclose(value, ref_value, **TOL)
    tree_allclose(grads, ref_grads, **TOL)
