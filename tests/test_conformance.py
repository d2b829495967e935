"""One conformance suite for every model source: ``vjpkit.nn``, Flax linen, Flax NNX, Equinox.

Each source builds the same network, dense 3 -> 5, relu, dense 5 -> 4, relu, dense 4 -> 2, in
its own library, with its own parameter tree and its own layer names, and says how to read a
dense layer's ``W`` (in ``(in, out)`` orientation) and ``b`` from a params-like tree (params,
gradients, a record's ``params`` / ``grad_params``). Every check below runs on every source,
eagerly and under ``jax.jit`` (``maybe_jit``), against references that never come from vjpkit:
``jax.grad`` / ``jax.vjp`` of the unchanged model, and a hand-chained ``jax.vjp`` of the same
network written in plain jnp from the ``W``, ``b`` the source reports (whose forward output is
first checked against the source's own). Library-specific behaviour (Flax names, NNX state,
Equinox per-example calls, ...) stays in ``test_flax_linen.py``, ``test_nnx.py`` and
``test_equinox.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

B, T = 6, 3  # batch, scan length
SIZES = (3, 5, 4, 2)
RTOL, ATOL = 1e-5, 1e-6

FLAX_EXTRA = "Flax is an optional extra: pip install 'vjpkit[flax]'"
EQX_EXTRA = "Equinox is an optional extra: pip install 'vjpkit[equinox]'"


# ---------------------------------------------------------------- the model sources


class Source(NamedTuple):
    params: Any  # what is differentiated
    apply: Callable  # apply(params, x (B, 3)) -> (B, 2)
    apply_one: Callable  # apply_one(params, x (3,)) -> (2,): one example
    dense: tuple[str, ...]  # the dense layers' names as vjpkit reports them, input to output
    sub: Callable  # sub(params-like tree, name) -> that layer's subtree
    wb: Callable  # wb(a layer's subtree, or a record's params) -> (W (in, out), b (out,))

    def loss(self, p, x, y):
        return head_loss(self.apply(p, x), y)

    def layer(self, tree, name):
        return self.wb(self.sub(tree, name))

    def layers(self, tree):
        """``[(W, b), ...]`` of every dense layer, input to output."""
        return [self.layer(tree, n) for n in self.dense]


def head_loss(out, y):
    return jnp.mean(jnp.sum((out - y) ** 2, axis=1))


def _path(tree, name):
    for part in name.split("/"):
        if part.isdigit():
            tree = tree[int(part)]
        elif isinstance(tree, dict):
            tree = tree[part]
        else:
            tree = getattr(tree, part)
    return tree


def _perturb(tree, seed=11):
    """Adds small noise to every leaf: no zero biases, so ``y = x W + b`` checks ``b`` too."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [a + 0.1 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def _nn_source() -> Source:
    model = nn.serial(
        fc1=nn.dense(SIZES[1]),
        relu1=nn.relu(),
        fc2=nn.dense(SIZES[2]),
        relu2=nn.relu(),
        fc3=nn.dense(SIZES[3]),
    )
    params = _perturb(model.init(jax.random.key(0), jnp.zeros((1, SIZES[0]))))
    return Source(
        params,
        model.apply,
        model.apply,
        ("fc1", "fc2", "fc3"),
        _path,
        lambda t: (t["weight"], t["bias"]),
    )


def _linen_source() -> Source:
    pytest.importorskip("flax", reason=FLAX_EXTRA)
    import flax.linen as fnn

    class Hidden(fnn.Module):  # a nested module: its dense layer is named "Hidden_0/Dense_0"
        @fnn.compact
        def __call__(self, x):
            return fnn.relu(fnn.Dense(SIZES[2])(x))

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            h = fnn.relu(fnn.Dense(SIZES[1])(x))
            return fnn.Dense(SIZES[3], name="head")(Hidden()(h))

    model = MLP()
    params = _perturb(model.init(jax.random.key(0), jnp.zeros((1, SIZES[0])))["params"])
    apply = lambda p, x: model.apply({"params": p}, x)
    return Source(
        params,
        apply,
        apply,
        ("Dense_0", "Hidden_0/Dense_0", "head"),
        _path,
        lambda t: (t["kernel"], t["bias"]),
    )


def _nnx_source() -> Source:
    pytest.importorskip("flax", reason=FLAX_EXTRA)
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(SIZES[0], SIZES[1], rngs=rngs)
            self.hidden = nnx.List([nnx.Linear(SIZES[1], SIZES[2], rngs=rngs)])
            self.head = nnx.Linear(SIZES[2], SIZES[3], rngs=rngs)

        def __call__(self, x):
            x = jax.nn.relu(self.fc1(x))
            x = jax.nn.relu(self.hidden[0](x))
            return self.head(x)

    graphdef, state = nnx.split(vk.hookable(MLP(nnx.Rngs(0))))
    state = _perturb(state)
    apply = lambda s, x: nnx.merge(graphdef, s)(x)

    def sub(tree, name):
        return _path(nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree, name)

    return Source(
        state,
        apply,
        apply,
        ("fc1", "hidden/0", "head"),
        sub,
        lambda t: (jnp.asarray(t["kernel"]), jnp.asarray(t["bias"])),
    )


def _equinox_source() -> Source:
    eqx = pytest.importorskip("equinox", reason=EQX_EXTRA)

    class MLP(eqx.Module):
        layers: list

        def __init__(self, key):
            keys = jax.random.split(key, 3)
            self.layers = [eqx.nn.Linear(i, o, key=k) for i, o, k in zip(SIZES[:-1], SIZES[1:], keys)]

        def __call__(self, x):  # one example, as Equinox models are written
            for layer in self.layers[:-1]:
                x = jax.nn.relu(layer(x))
            return self.layers[-1](x)

    params, static = eqx.partition(vk.hookable(MLP(jax.random.key(0))), eqx.is_array)
    params = _perturb(params)
    apply_one = lambda p, x: eqx.combine(p, static)(x)
    return Source(
        params,
        lambda p, x: jax.vmap(lambda xi: apply_one(p, xi))(x),  # a batch: vmap inside the loss
        apply_one,
        ("layers/0", "layers/1", "layers/2"),
        _path,
        lambda t: (t.weight.T, t.bias),
    )


SOURCES = {"nn": _nn_source, "linen": _linen_source, "nnx": _nnx_source, "equinox": _equinox_source}


@pytest.fixture(params=list(SOURCES))
def src(request) -> Source:
    return SOURCES[request.param]()


# ---------------------------------------------------------------- references in plain jnp


def _data(seed=1, lead=(B,)):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (*lead, SIZES[0])), jax.random.normal(ky, (*lead, SIZES[-1]))


def plain_forward(layers, x, taps=None):
    """The network in plain jnp; ``taps[i]`` (an identity) wraps dense layer ``i``'s output."""
    h = x
    for i, (w, b) in enumerate(layers):
        z = h @ w + b
        if taps and i in taps:
            z = taps[i](z)
        h = jax.nn.relu(z) if i + 1 < len(layers) else z
    return h


def chain(layers, x, y, *, grad_input_scale=None, grad_output_scale=None):
    """Hand-chained ``jax.vjp`` s of the network: one reference record per dense layer.

    ``grad_input_scale[i]`` multiplies what layer ``i`` sends down (a rewritten ``grad_input``);
    ``grad_output_scale[i]`` multiplies what layer ``i`` receives before its own VJP (a backward
    pre-hook). Returns ``[dict(input, output, grad_output, grad_input, grad_params=(dW, db))]``.
    """
    grad_input_scale, grad_output_scale = grad_input_scale or {}, grad_output_scale or {}
    dense = lambda w, b, h: h @ w + b
    inputs, outputs, h = [], [], x
    for i, (w, b) in enumerate(layers):
        inputs.append(h)
        outputs.append(dense(w, b, h))
        h = jax.nn.relu(outputs[-1]) if i + 1 < len(layers) else outputs[-1]
    g = jax.grad(head_loss)(outputs[-1], y)
    records = [None] * len(layers)
    for i in reversed(range(len(layers))):
        if i in grad_output_scale:
            g = g * grad_output_scale[i]
        dw, db, gx = jax.vjp(dense, *layers[i], inputs[i])[1](g)
        if i in grad_input_scale:
            gx = gx * grad_input_scale[i]
        records[i] = dict(
            input=inputs[i],
            output=outputs[i],
            grad_output=g,
            grad_input=gx if i > 0 else None,  # the data batch needs no gradient
            grad_params=(dw, db),
        )
        if i > 0:
            g = jax.vjp(jax.nn.relu, outputs[i - 1])[1](gx)[0]
    return records


def _close(a, b, rtol=RTOL, atol=ATOL):
    tree_allclose(jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b), rtol=rtol, atol=atol)


def _check_reference_forward(src, x):
    """The plain network built from the source's ``W``, ``b`` is the source's model."""
    _close(plain_forward(src.layers(src.params), x), src.apply(src.params, x))


def _check_grads(src, grads, expected_layers):
    """``grads`` has ``jax.grad``'s structure and the expected ``(dW, db)`` per dense layer."""
    assert jax.tree.structure(grads) == jax.tree.structure(src.params)
    _close(src.layers(grads), expected_layers)


def _check_record(src, rec, ref, name):
    """One record: the reference's fields, and the dense algebra read off the record itself."""
    w, b = src.wb(rec.params)
    dw, db = src.wb(rec.grad_params)
    xin, g = rec.input, rec.grad_output
    _close((w, b), src.layer(src.params, name))
    _close(xin, ref["input"])
    _close(rec.output, ref["output"])
    _close(g, ref["grad_output"])
    _close((dw, db), ref["grad_params"])
    np.testing.assert_allclose(rec.output, xin @ w + b, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dw, xin.T @ g, rtol=RTOL, atol=ATOL)  # dW = x^T g
    np.testing.assert_allclose(db, g.sum(0), rtol=RTOL, atol=ATOL)  # db = sum g
    if ref["grad_input"] is None:
        assert rec.grad_input is None, f"{name}: the data batch needs no gradient"
    else:
        np.testing.assert_allclose(rec.grad_input, g @ w.T, rtol=RTOL, atol=ATOL)  # dx = g W^T
        _close(rec.grad_input, ref["grad_input"])


def _scaled_cotangent(s):
    """An identity whose VJP multiplies the cotangent by ``s``."""

    @jax.custom_vjp
    def tap(z):
        return z

    tap.defvjp(lambda z: (z, None), lambda _, g: (g * s,))
    return tap


def counter():
    """A stateful hook: counts its calls and sums ``|grad_output|^2`` over them."""

    def init(params):
        return {"count": jnp.zeros((), jnp.float32), "sq": jnp.zeros((), jnp.float32)}

    def update(rec, state):
        sq = state["sq"] + jnp.sum(jnp.square(rec.grad_output))
        return rec, {"count": state["count"] + 1.0, "sq": sq}

    return vk.HookTransform(init, update)


# ---------------------------------------------------------------- (1) gradients


def test_grads_equal_jax_grad(src, maybe_jit):
    x, y = _data()
    _check_reference_forward(src, x)
    expected = jax.grad(src.loss)(src.params, x, y)
    tree_allclose(maybe_jit(vk.grad(src.loss))(src.params, x, y), expected)
    observed = maybe_jit(vk.grad(src.loss, hooks={"*": lambda rec: None}))(src.params, x, y)
    tree_allclose(observed, expected)
    _close(src.layers(expected), [r["grad_params"] for r in chain(src.layers(src.params), x, y)])


# ---------------------------------------------------------------- (2) records


def test_captured_records_are_dense_algebra(src, maybe_jit):
    x, y = _data()
    grads, captured = maybe_jit(vk.grad(src.loss, capture=list(src.dense)))(src.params, x, y)
    tree_allclose(grads, jax.grad(src.loss)(src.params, x, y))
    assert sorted(captured) == sorted(src.dense)
    for name, ref in zip(src.dense, chain(src.layers(src.params), x, y)):
        _check_record(src, captured[name], ref, name)


# ---------------------------------------------------------------- (3) rewriting hooks


def test_rewriting_hooks_equal_hand_chain(src, maybe_jit):
    """The middle layer sends 3x its ``grad_input`` down; the last layer's ``grad_params`` halve."""
    x, y = _data()
    _, middle, last = src.dense
    hooks = {
        middle: lambda rec: rec.replace(grad_input=3.0 * rec.grad_input),
        last: lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: 0.5 * g, rec.grad_params)),
    }
    grads = maybe_jit(vk.grad(src.loss, hooks=hooks))(src.params, x, y)
    ref = [r["grad_params"] for r in chain(src.layers(src.params), x, y, grad_input_scale={1: 3.0})]
    ref[2] = jax.tree.map(lambda g: 0.5 * g, ref[2])  # its grad_input is unchanged: only its own
    _check_grads(src, grads, ref)
    # exactly what lies below the middle layer changed, and the last layer's own gradient
    plain = src.layers(jax.grad(src.loss)(src.params, x, y))
    got = src.layers(grads)
    assert not np.allclose(got[0][0], plain[0][0])
    _close(got[1], plain[1])
    assert not np.allclose(got[2][0], plain[2][0])


# ---------------------------------------------------------------- (4) host hooks


def test_on_host_one_record_per_call_in_backward_order(src, maybe_jit):
    x, y = _data()
    seen = []
    collect = vk.on_host(seen.append)
    grads = maybe_jit(vk.grad(src.loss, hooks={n: collect for n in src.dense}))(src.params, x, y)
    jax.block_until_ready(grads)
    jax.effects_barrier()
    tree_allclose(grads, jax.grad(src.loss)(src.params, x, y))
    assert [(r.name, r.call) for r in seen] == [(n, 0) for n in reversed(src.dense)]
    refs = dict(zip(src.dense, chain(src.layers(src.params), x, y)))
    for rec in seen:
        assert isinstance(rec.grad_output, np.ndarray)
        _check_record(src, rec, refs[rec.name], rec.name)


# ---------------------------------------------------------------- (5) hook state


def test_stateful_counter_advances(src, maybe_jit):
    g = vk.grad(src.loss, hooks={n: counter() for n in src.dense})
    state = vk.init_hook_state(g, src.params, *_data())
    assert sorted(state) == sorted(src.dense)
    step = maybe_jit(g)
    sq = np.zeros(len(src.dense))
    for t in range(3):
        x, y = _data(seed=10 + t)
        grads, state = step(src.params, x, y, hook_state=state)
        tree_allclose(grads, jax.grad(src.loss)(src.params, x, y))
        refs = chain(src.layers(src.params), x, y)
        sq += [np.sum(np.square(np.asarray(r["grad_output"], np.float64))) for r in refs]
    for i, name in enumerate(src.dense):
        assert float(state[name]["count"]) == 3.0
        np.testing.assert_allclose(state[name]["sq"], sq[i], rtol=RTOL)


# ---------------------------------------------------------------- (6) vmap and scan in the loss


def test_vmap_inside_the_loss_records_the_batched_call(src, maybe_jit):
    x, y = _data()

    def loss(p, x, y):  # the model applied to one example at a time, vmapped
        return head_loss(jax.vmap(lambda xi: src.apply_one(p, xi))(x), y)

    expected = jax.grad(loss)(src.params, x, y)
    grads, captured = maybe_jit(vk.grad(loss, capture=list(src.dense)))(src.params, x, y)
    tree_allclose(grads, expected)
    assert sorted(captured) == sorted(src.dense)  # one record per layer: the batched call, no "#1"
    layers = src.layers(src.params)
    for name, ref in zip(src.dense, chain(layers, x, y)):
        assert captured[name].input.shape[0] == B
        _check_record(src, captured[name], ref, name)
    hooks = {src.dense[-1]: lambda rec: rec.replace(grad_input=3.0 * rec.grad_input)}
    grads = maybe_jit(vk.grad(loss, hooks=hooks))(src.params, x, y)
    _check_grads(src, grads, [r["grad_params"] for r in chain(layers, x, y, grad_input_scale={2: 3.0})])


def _scan_loss(src):
    def loss(p, xs, ys):
        def body(total, xy):
            return total + src.loss(p, *xy), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ys))[0]

    return loss


def test_lax_scan_gives_one_record_per_iteration(src, maybe_jit):
    xs, ys = _data(lead=(T, B))
    loss = _scan_loss(src)
    expected = jax.grad(loss)(src.params, xs, ys)
    grads, captured = maybe_jit(vk.grad(loss, capture=list(src.dense)))(src.params, xs, ys)
    tree_allclose(grads, expected)
    assert sorted(captured) == sorted(src.dense)
    layers = src.layers(src.params)
    per_step = [chain(layers, xs[t], ys[t]) for t in range(T)]
    for i, name in enumerate(src.dense):
        rec = jax.tree.map(np.asarray, captured[name])
        assert rec.input.shape == (T, B, SIZES[i])  # leaves stacked on the iteration axis
        for t in range(T):
            at_t = jax.tree.map(lambda a, t=t: a[t], rec)
            _check_record(src, at_t, per_step[t][i], name)
    # hook state advances once per iteration
    g = vk.grad(loss, hooks={n: counter() for n in src.dense})
    state = vk.init_hook_state(g, src.params, xs, ys)
    grads, state = maybe_jit(g)(src.params, xs, ys, hook_state=state)
    tree_allclose(grads, expected)
    for i, name in enumerate(src.dense):
        assert float(state[name]["count"]) == T
        sq = sum(np.sum(np.square(np.asarray(per_step[t][i]["grad_output"], np.float64))) for t in range(T))
        np.testing.assert_allclose(state[name]["sq"], sq, rtol=RTOL)


# ---------------------------------------------------------------- (7) grad of grad


def test_grad_of_hooked_grad_equals_jax(src, maybe_jit):
    """A gradient penalty through a hooked inner ``vk.grad`` that halves the middle layer's grads."""
    x, y = _data()
    middle = src.dense[1]
    halve = lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: 0.5 * g, rec.grad_params))
    inner_seen = []

    def sq(layer_grads):
        return sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(layer_grads))

    def penalty(p):
        hooks = {middle: halve, "*": vk.on_host(lambda rec: inner_seen.append(rec.name))}
        return sq(vk.grad(src.loss, hooks=hooks)(p, x, y))

    def reference(p):  # the same penalty from jax.grad: the middle layer's share is 0.25x
        g = jax.grad(src.loss)(p, x, y)
        return sq(g) - 0.75 * sq(src.layer(g, middle))

    np.testing.assert_allclose(penalty(src.params), reference(src.params), rtol=RTOL)
    expected = jax.grad(reference)(src.params)
    inner_seen.clear()
    grads = maybe_jit(vk.grad(penalty, hooks={n: lambda rec: None for n in src.dense}))(src.params)
    jax.block_until_ready(grads)
    jax.effects_barrier()
    tree_allclose(grads, expected, rtol=1e-4, atol=1e-6)
    assert set(src.dense) <= set(inner_seen)
    assert len(inner_seen) == len(set(inner_seen))  # each inner layer call once


# ---------------------------------------------------------------- backward pre-hooks

needs_before = pytest.mark.skipif(not hasattr(vk, "before"), reason="vk.before not landed yet")

MASK = jnp.array([1.0, 0.0, 1.0, 0.0], jnp.float32)  # the middle layer's output features kept


def _before_hooks(src):
    reverse = vk.before(lambda rec: rec.replace(grad_output=-rec.grad_output))
    mask = vk.before(lambda rec: rec.replace(grad_output=rec.grad_output * MASK))
    return {src.dense[-1]: reverse, src.dense[1]: mask}


def _before_reference(src, x, y):
    """``jax.grad`` of the plain network with cotangent-scaling identities on two outputs."""
    taps = {2: _scaled_cotangent(-1.0), 1: _scaled_cotangent(MASK)}
    ref = jax.grad(lambda layers: head_loss(plain_forward(layers, x, taps), y))(src.layers(src.params))
    chained = chain(src.layers(src.params), x, y, grad_output_scale={2: -1.0, 1: MASK})
    _close(ref, [r["grad_params"] for r in chained])  # the two references agree
    return ref


@needs_before
def test_before_hook_gradient_reversal_and_mask(src, maybe_jit):
    x, y = _data()
    seen = []
    collect = vk.on_host(seen.append)  # runs after the VJP: sees the new grad_output
    hooks = {name: [pre, collect] for name, pre in _before_hooks(src).items()}
    grads = maybe_jit(vk.grad(src.loss, hooks=hooks))(src.params, x, y)
    jax.block_until_ready(grads)
    jax.effects_barrier()
    _check_grads(src, grads, _before_reference(src, x, y))
    refs = chain(src.layers(src.params), x, y, grad_output_scale={2: -1.0, 1: MASK})
    assert [r.name for r in seen] == [src.dense[2], src.dense[1]]
    for rec, ref in zip(seen, [refs[2], refs[1]]):
        _check_record(src, rec, ref, rec.name)


@needs_before
def test_before_hook_under_vmap_in_the_loss(src, maybe_jit):
    x, y = _data()

    def loss(p, x, y):
        return head_loss(jax.vmap(lambda xi: src.apply_one(p, xi))(x), y)

    grads = maybe_jit(vk.grad(loss, hooks=_before_hooks(src)))(src.params, x, y)
    _check_grads(src, grads, _before_reference(src, x, y))
