"""Plain JAX (issue 31): a parameter transformed outside a nested program and used inside it.

``W.T``, a bf16 cast, a slice ``Ws[i]`` or LoRA's ``W + A @ B`` computed at one level and passed
into ``jax.checkpoint``, an inner ``jax.jit``, a ``lax.cond`` branch or a ``lax.scan``, and a
weight decayed in a scan's carry, is a copy of the leaf inside that program, not the leaf. The
records plus the other uses ``vk.explain`` lists must account for each leaf's gradient exactly:
either a record holds exactly the leaf's gradient through that use, or the use is listed as an
other use and no record claims its gradient under the leaf's path (before the fix, the record of
``x @ Wt`` inside a checkpoint held the transposed gradient under ``W``'s path).

Each case is a loss ``body(p_layer, p_other, *data)`` evaluated at ``body(p, p, *data)``: the
transformed-outside use reads ``p_other``, every other use ``p_layer``. References are
``jax.grad`` of the loss and of ``body`` in each of its two arguments, never constants from a run:

* ``vk.grad``'s gradient equals ``jax.grad``'s;
* per leaf, the records' ``grad_params`` (summed over calls and scan iterations) plus, when an
  other use lists the leaf, its gradient through ``p_other`` equal ``jax.grad``'s gradient.

The controls pass a leaf into the same nested programs as it is (or compute the copy inside, or
return it from the nested program): their records alone account for every gradient, as before.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vjpkit as vk
from tests.helpers import tree_allclose
from tests.test_plain_jax import BF16, F32, _normal, leaf_paths, record_leaves


def _xent(h):
    return jnp.sum(jnp.tanh(h) ** 2)


# --------------------------------------------------------------------- a copy made outside, used inside


def _transpose_checkpoint(p, q, x):
    h = jax.checkpoint(lambda x, wt: jnp.tanh(x @ wt))(x, q["fc"]["w"].T)
    return _xent(h @ p["out"]["w"])


def _transpose_inner_jit(p, q, x):
    h = jax.jit(lambda x, wt: jnp.tanh(x @ wt))(x, q["fc"]["w"].T)
    return _xent(h @ p["out"]["w"])


def _transpose_cond(p, q, x, flag):
    h = lax.cond(flag, lambda x, wt: jnp.tanh(x @ wt), lambda x, wt: jnp.sin(x @ wt), x, q["fc"]["w"].T)
    return _xent(h @ p["out"]["w"])


def _transpose_scan_const(p, q, x):
    wt = q["fc"]["w"].T
    h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ wt), None), x, None, length=3)
    return _xent(h @ p["out"]["w"])


def _bf16_checkpoint(p, q, x):
    block = jax.checkpoint(lambda x, w: jnp.tanh(x.astype(jnp.bfloat16) @ w).astype(jnp.float32))
    return _xent(block(x, q["fc"]["w"].astype(jnp.bfloat16)) @ p["out"]["w"])


def _slice_checkpoint(p, q, x):
    h = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, q["blocks"]["w"][1])
    return _xent(h @ p["blocks"]["w"][0])


def _carry_decay(p, q, x):
    def body(carry, _):
        h, w = carry
        return (jnp.tanh(h @ w), w * 0.99), None

    (h, _), _ = lax.scan(body, (x, q["fc"]["w"]), None, length=3)
    return _xent(h @ p["out"]["w"])


def _lora_checkpoint(p, q, x):
    d = q["fc"]
    h = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, d["w"] + d["A"] @ d["B"])
    return _xent(h @ p["out"]["w"])


def _leaf_and_copy_checkpoint(p, q, x):
    """The leaf itself and its transpose enter one checkpoint: the first use is a layer."""
    block = jax.checkpoint(lambda x, w, wt: jnp.tanh(jnp.tanh(x @ w) @ wt))
    return _xent(block(x, p["fc"]["w"], q["fc"]["w"].T) @ p["out"]["w"])


def _copy_returned_with_data(p, q, x):
    """An inner jit returns data and a copy of a leaf; the copy is a layer's weight outside."""
    h, wt = jax.jit(lambda x, w, wo: (jnp.tanh(x @ w), wo.T))(x, p["fc"]["w"], q["fc"]["w"])
    return _xent(h @ wt)


# --------------------------------------------------------------------- controls: records as before


def _leaf_into_checkpoint_jit_cond(p, q, x, flag):
    del q
    h = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, p["a"]["w"])
    h = jax.jit(lambda x, w: jnp.tanh(x @ w.T))(h, p["b"]["w"])  # the transpose inside: in the span
    return _xent(lax.cond(flag, lambda h, w: h @ w, lambda h, w: -(h @ w), h, p["out"]["w"]))


def _stacked_scan_xs_and_const(p, q, x):
    del q

    def body(h, w):
        return jnp.tanh(h @ w + p["shared"]["b"]), None

    h, _ = lax.scan(body, x, p["blocks"]["w"])
    return _xent(h)


def _copy_made_by_inner_jit(p, q, x):
    del q
    wt = jax.jit(lambda w: w.T)(p["fc"]["w"])  # returned by the inner program: the span holds it
    return _xent(jnp.tanh(x @ wt) @ p["out"]["w"])


def _fori_indexed(p, q, x):
    del q  # a stacked leaf closed over by a fori_loop body (literal bounds) and indexed there
    return _xent(lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ p["blocks"]["w"][i]), x))


def _identity_carry(p, q, x):
    del q

    def body(carry, _):
        h, w = carry
        return (jnp.tanh(h @ w), w), None

    (h, _), _ = lax.scan(body, (x, p["fc"]["w"]), None, length=3)
    return _xent(h)


# --------------------------------------------------------------------- cases


def _square():
    return {"fc": {"w": _normal(0, 4, 4)}, "out": {"w": _normal(1, 4, 3)}}


def _x():
    return (_normal(10, 5, 4),)


def _out():
    return {"out": {"w": _normal(1, 4, 3)}}


@dataclasses.dataclass(frozen=True)
class Case:
    body: Callable  # body(p_layer, p_other, *data)
    params: Callable
    data: Callable = _x
    tol: dict = dataclasses.field(default_factory=lambda: F32)
    # where the copy is used, as the other use says it; None: a control (every use is a layer)
    where: str | None = None


CASES = {
    "transpose_checkpoint": Case(_transpose_checkpoint, _square, where="checkpoint"),
    "transpose_inner_jit": Case(_transpose_inner_jit, _square, where="jit"),
    "transpose_cond_true": Case(_transpose_cond, _square, lambda: (*_x(), jnp.array(True)), where="cond"),
    "transpose_cond_false": Case(_transpose_cond, _square, lambda: (*_x(), jnp.array(False)), where="cond"),
    "transpose_scan_const": Case(_transpose_scan_const, _square, where="scan"),
    "bf16_checkpoint": Case(_bf16_checkpoint, _square, tol=BF16, where="checkpoint"),
    "slice_checkpoint": Case(
        _slice_checkpoint, lambda: {"blocks": {"w": _normal(2, 3, 4, 4)}}, where="checkpoint"
    ),
    "carry_decay": Case(_carry_decay, _square, where="scan"),
    "lora_checkpoint": Case(
        _lora_checkpoint,
        lambda: {"fc": {"w": _normal(0, 4, 4), "A": _normal(3, 4, 2), "B": _normal(4, 2, 4)}, **_out()},
        where="checkpoint",
    ),
    "leaf_and_copy_checkpoint": Case(_leaf_and_copy_checkpoint, _square, where="checkpoint"),
    "copy_returned_with_data": Case(
        _copy_returned_with_data, lambda: {"fc": {"w": _normal(0, 4, 4)}}, where=""
    ),  # the copy's use is at the top level, with data the inner jit computed
    # controls
    "leaf_into_checkpoint_jit_cond": Case(
        _leaf_into_checkpoint_jit_cond,
        lambda: {"a": {"w": _normal(0, 4, 4)}, "b": {"w": _normal(5, 4, 4)}, **_out()},
        lambda: (*_x(), jnp.array(True)),
    ),
    "stacked_scan_xs_and_const": Case(
        _stacked_scan_xs_and_const,
        lambda: {"blocks": {"w": _normal(2, 3, 4, 4)}, "shared": {"b": _normal(6, 4)}},
    ),
    "fori_indexed": Case(_fori_indexed, lambda: {"blocks": {"w": _normal(2, 3, 4, 4)}}),
    "copy_made_by_inner_jit": Case(_copy_made_by_inner_jit, _square),
    "identity_carry": Case(_identity_carry, lambda: {"fc": {"w": _normal(0, 4, 4)}}),
}


def _loss(body):
    return functools.partial(_same_params, body)


def _same_params(body, p, *data):
    return body(p, p, *data)


def _record_sums(captured: dict, params) -> dict:
    """Per leaf path, the records' ``grad_params`` summed over calls and over scan iterations (a
    leaf closed over by a scan body has one record per iteration, stacked on a leading axis). A
    record of a ``cond`` branch not taken is NaN (docs/hooks.md) and holds no gradient."""
    paths = leaf_paths(params)
    sums: dict = {}
    for rec in captured.values():
        if all(bool(jnp.isnan(leaf).all()) for leaf in jax.tree.leaves(rec.grad_params)):
            continue
        for path, g in record_leaves(rec, "grad_params", paths).items():
            if g.shape != paths[path].shape and g.shape[1:] == paths[path].shape:
                g = g.sum(0)
            assert g.shape == paths[path].shape and g.dtype == paths[path].dtype, (rec.key, path)
            sums[path] = g if path not in sums else sums[path] + g
    return sums


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_records_and_other_uses_account_for_each_leaf(case, maybe_jit):
    c = CASES[case]
    params, data = c.params(), c.data()
    loss = _loss(c.body)
    reference = jax.grad(loss)(params, *data)
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(params, *data)
    tree_allclose(grads, reference, **c.tol)

    rows = vk.explain(loss, params, *data, file=io.StringIO())
    listed = {leaf for use in rows.other_uses for leaf in use.leaves}
    if c.where is None:
        assert rows.other_uses == ()
    through_other = leaf_paths(jax.grad(c.body, argnums=1)(params, params, *data))
    sums = _record_sums(captured, params)
    for path, want in leaf_paths(reference).items():
        got = sums.get(path, jnp.zeros_like(want))
        if path in listed:  # that use has no record: its gradient flows as plain JAX
            got = got + through_other[path]
        tree_allclose(got, want, **c.tol)


@pytest.mark.parametrize("case", [k for k, c in CASES.items() if c.where is not None])
def test_a_copy_used_in_a_nested_program_is_an_other_use(case):
    """What vjpkit does today (either way above is exact): the use of the copy is listed, with
    the nested program it is in, and the records hold exactly the gradient through the layers
    that read the leaves themselves (``jax.grad`` of the body in its first argument)."""
    c = CASES[case]
    params, data = c.params(), c.data()
    loss = _loss(c.body)
    rows = vk.explain(loss, params, *data, file=io.StringIO())
    through_layers = leaf_paths(jax.grad(c.body, argnums=0)(params, params, *data))
    through_other = leaf_paths(jax.grad(c.body, argnums=1)(params, params, *data))
    copied = {path for path, g in through_other.items() if bool(np.any(np.asarray(g) != 0))}
    assert {leaf for use in rows.other_uses for leaf in use.leaves} == copied
    assert {(use.primitive, use.where) for use in rows.other_uses} == {("dot_general", c.where)}
    text = io.StringIO()
    vk.explain(loss, params, *data, file=text)
    assert f"used by dot_general{f' inside {c.where}' if c.where else ''}" in text.getvalue()
    _, captured = jax.jit(vk.grad(loss, capture="*"))(params, *data)
    sums = _record_sums(captured, params)
    for path, want in through_layers.items():
        tree_allclose(sums.get(path, jnp.zeros_like(want)), want, **c.tol)
