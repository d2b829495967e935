"""Captured records of layer calls the loss does not reach: real forward values, zero cotangents.

A frozen teacher under ``stop_gradient``, an aux output and a side branch all run forward; their
records' ``input`` / ``output`` / ``params`` are the values the forward pass computed (checked
against the plain model), and ``grad_output`` / ``grad_input`` / ``grad_params`` are exact zeros
(or ``None`` where no gradient can flow, as for stop_gradient'ed params). Hooks do not run for
them (PyTorch's backward hooks do not fire for modules outside the graph either).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from vjpkit import nn

from .helpers import tree_allclose

TEACHER = nn.serial(t1=nn.dense(4), t2=nn.dense(2))
STUDENT = nn.serial(s1=nn.dense(4), s2=nn.dense(2))
SIDE = nn.dense(3, name="side")
X = jnp.arange(15.0, dtype=jnp.float32).reshape(3, 5) / 10
P = {
    "t": TEACHER.init(jax.random.key(0), X),
    "s": STUDENT.init(jax.random.key(1), X),
    "side": SIDE.init(jax.random.key(2), X),
}


def loss(p, x):
    target = jax.lax.stop_gradient(TEACHER.apply(jax.lax.stop_gradient(p["t"]), x))
    aux = SIDE.apply(p["side"], x)  # returned as aux: not in the loss
    return jnp.mean((STUDENT.apply(p["s"], x) - target) ** 2), aux


def _zero(tree):
    return all(float(jnp.abs(leaf).max()) == 0.0 for leaf in jax.tree.leaves(tree))


def test_unreached_calls_have_forward_values_and_zero_cotangents(maybe_jit):
    seen = []
    g = vk.grad(loss, has_aux=True, capture="*", hooks={"*": vk.on_host(lambda r: seen.append(r.name))})
    (grads, aux), cap = maybe_jit(g)(P, X)
    jax.block_until_ready(grads)
    tree_allclose(grads, jax.grad(lambda p, x: loss(p, x)[0])(P, X))
    tree_allclose(cap["t1"].input, X)
    tree_allclose(cap["t1"].params, P["t"]["t1"])
    tree_allclose(cap["t2"].output, TEACHER.apply(P["t"], X))
    tree_allclose(cap["side"].output, aux)
    tree_allclose(cap["side"].params, P["side"])
    for key in ("t1", "t2", "side"):
        assert _zero(cap[key].grad_output), key
    assert _zero(cap["side"].grad_params)
    assert cap["t1"].grad_params is None  # its params are stop_gradient'ed: no gradient can flow
    assert sorted(seen) == ["s1", "s2"]  # host hooks fire only for the calls the loss reaches


def test_unreached_branch_of_a_side_computation_under_scan(maybe_jit):
    cell = nn.dense(5, name="cell")
    w = cell.init(jax.random.key(3), X)

    def scan_loss(w, x):
        def body(h, _):
            h2 = jnp.tanh(cell.apply(w, h))
            return h2, None

        h, _ = jax.lax.scan(body, x, None, length=3)
        side, _ = jax.lax.scan(body, x * 2, None, length=2)  # computed, never used
        del side
        return jnp.sum(h**2)

    _, cap = maybe_jit(vk.grad(scan_loss, capture="cell*"))(w, X)
    assert sorted(cap) == ["cell", "cell#1"]
    # the unused scan's records: its real inputs per iteration, zero cotangents
    h = X * 2
    for i in range(2):
        np.testing.assert_allclose(cap["cell#1"].input[i], h, rtol=1e-6)
        h = jnp.tanh(cell.apply(w, h))
    assert _zero(cap["cell#1"].grad_output) and _zero(cap["cell#1"].grad_params)
    assert not _zero(cap["cell"].grad_params)


@pytest.mark.parametrize("source", ["linen", "equinox"])
def test_unreached_foreign_layers(source, maybe_jit):
    if source == "linen":
        flax_nn = pytest.importorskip("flax.linen")
        teacher = flax_nn.Dense(3)
        tp = teacher.init(jax.random.key(0), X)

        def run(tp, x):
            return teacher.apply(tp, x)
    else:
        eqx = pytest.importorskip("equinox")
        teacher = vk.hookable(eqx.nn.Linear(5, 3, key=jax.random.key(0)))
        tp = teacher

        def run(tp, x):
            return jax.vmap(tp)(x)

    def floss(s, tp, x):
        frozen = jax.lax.stop_gradient(run(tp, x))
        return jnp.sum((x @ s - frozen) ** 2)

    s = jnp.ones((5, 3)) / 5
    grads, cap = maybe_jit(vk.grad(floss, capture="*"))(s, tp, X)
    tree_allclose(grads, jax.grad(floss)(s, tp, X))
    # x @ s is found by plain-JAX matching (s is a bare array: "arg0"); it is the only use of s
    tree_allclose(cap["arg0"].grad_params["arg0"], grads)
    (key,) = [k for k in cap if k != "arg0"]
    tree_allclose(cap[key].output, run(tp, X), rtol=1e-5)
    assert _zero(cap[key].grad_output)
