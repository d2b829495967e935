"""Plain JAX code (issue 22): the layers of the traced program found by dataflow (``_engine._match``).

Each pattern of plain-JAX layer code (dense, einsum, conv, embedding, affine norm, tied weights,
scan, cond, checkpoint, inner jit, vmap, shared use, LoRA, weight decay, bf16 casts) is traced
by ``vk.grad`` with every record captured. References are never constants from a run:

* the gradient equals ``jax.grad`` of the same loss;
* per parameter leaf, the records' ``grad_params`` sum to ``jax.grad`` of the loss (without its
  weight-decay penalty, which ``vk.explain(...).other_uses`` lists instead);
* a dense record equals ``jax.vjp`` of the model split by hand at that layer, and rewriting
  hooks (after and ``vk.before``) equal hand-chained ``jax.vjp`` with the same modification.

Tests of a transformed function run jitted and eagerly (``maybe_jit``); the one that hooks
every pattern and the trace count run jitted. A library bug found here is an
``xfail(strict=True)`` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxpr_as_fun

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn

F32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}  # bf16 has an 8-bit mantissa: relative error ~4e-3 per op


@functools.cache
def jgrad(f: Callable) -> Callable:
    """``jax.grad``, jitted (once per function): a reference computed as one program."""
    return jax.jit(jax.grad(f))


def _normal(seed: int, *shape: int, scale: float = 0.5) -> jax.Array:
    return jnp.asarray((scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32))


# --------------------------------------------------------------------- leaf paths and records


def leaf_paths(tree: Any, arg: int = 0) -> dict[str, Any]:
    """``{path: leaf}`` as vjpkit names the leaves of one differentiated argument: ``/``-joined
    keys, an NNX Variable's trailing ``.value`` dropped, a bare array ``arg{i}``."""
    out = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if len(keys) > 1 and keys[-1] == jax.tree_util.GetAttrKey("value"):
            keys = keys[:-1]
        out[jax.tree_util.keystr(tuple(keys), simple=True, separator="/") or f"arg{arg}"] = leaf
    return out


def record_leaves(rec: vk.Cotangents, field: str, paths: dict) -> dict[str, Any]:
    """A record's ``params``-keyed field by full leaf path: ``name/key``, or ``key`` when the key
    already is a full path (flat dicts, single leaves)."""
    out = {}
    for keys, value in jax.tree_util.tree_flatten_with_path(getattr(rec, field))[0]:
        key = jax.tree_util.keystr(tuple(keys), simple=True, separator="/")
        full = f"{rec.name}/{key}" if f"{rec.name}/{key}" in paths else key
        assert full in paths, f"{rec.key}: {field} key {key!r} is no parameter leaf ({sorted(paths)})"
        assert full not in out
        out[full] = value
    return out


def summed_grad_params(captured: dict, paths: dict) -> dict[str, Any]:
    sums: dict[str, Any] = {}
    for rec in captured.values():
        for full, g in record_leaves(rec, "grad_params", paths).items():
            sums[full] = g if full not in sums else sums[full] + g
    return sums


def check_sums(captured: dict, params: Any, reference: Any, tol: dict, absent: tuple = ()) -> None:
    """Per leaf: the records' grad_params sum to the reference gradient; every leaf is covered
    but those ``absent`` (read only by a record left out), whose reference gradient is zero."""
    paths = leaf_paths(params)
    want = leaf_paths(reference)
    got = summed_grad_params(captured, paths)
    missing = sorted(set(paths) - set(got))
    assert missing == sorted(absent), f"leaves without a record: {missing}"
    for path in paths:
        tree_allclose(got[path] if path in got else jnp.zeros_like(want[path]), want[path], **tol)


def check_record_shapes(captured: dict, params: Any) -> None:
    """Each record's params are the leaves it read (stacked under scan); cotangents mirror values."""
    paths = leaf_paths(params)
    for key, rec in captured.items():
        assert isinstance(rec, vk.Cotangents) and rec.key == key
        for full, value in record_leaves(rec, "params", paths).items():
            tree_allclose(value, paths[full])
        assert jax.tree.structure(rec.grad_params) == jax.tree.structure(rec.params)
        assert jax.tree.map(jnp.shape, rec.grad_output) == jax.tree.map(jnp.shape, rec.output)


# --------------------------------------------------------------------- the patterns


@dataclasses.dataclass(frozen=True)
class Case:
    loss: Callable
    params: Callable[[], Any]
    data: Callable[[], tuple]
    spans: dict  # {call key: the layer as a function of the record's params and input}
    clean: Callable | None = None  # the loss without what is no layer (weight decay)
    tol: dict = dataclasses.field(default_factory=lambda: F32)
    stacked: bool = False  # under scan: records stacked over iterations
    other: tuple = ()  # the leaves vk.explain lists as used outside any layer
    untaken: str | None = None  # a cond branch's call not taken: its captured record is NaN


def _dense_bias(p, x, y):
    h = jnp.tanh(x @ p["fc"]["w"] + p["fc"]["b"])
    return jnp.mean((h @ p["out"]["w"] + p["out"]["b"] - y) ** 2)


def _dense_nobias(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["fc"]["w"]) @ p["out"]["w"] - y) ** 2)


def _einsum(p, x):
    q = jnp.einsum("btd,dhk->bthk", x, p["proj"]["w"])  # contracts d; out (b, t, h, k)
    return jnp.sum(jnp.einsum("bthk,hkd->btd", jnp.tanh(q), p["out"]["w"]) ** 2)  # contracts h and k


def _conv(p, x):
    y = lax.conv_general_dilated(
        x, p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.sum(jnp.tanh(y + p["conv"]["b"]) ** 2)


def _embed(p, ids):
    return jnp.sum(jnp.tanh(p["embed"]["table"][ids] @ p["head"]["w"]) ** 2)


def _layer_norm(p, x):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    h = (x - m) / jnp.sqrt(v + 1e-5) * p["ln"]["scale"] + p["ln"]["bias"]
    return jnp.sum(jnp.tanh(h @ p["fc"]["w"]) ** 2)


def _tied(p, ids):
    table = p["embed"]["table"]
    logits = jnp.tanh(table[ids]) @ table.T
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(ids.shape[0]), ids])


def _scan(p, x):
    def body(h, blk):
        return jnp.tanh(h @ blk["w"] + blk["b"]), None

    h, _ = lax.scan(body, x, p["blocks"])
    return jnp.sum(h**2)


def _cond(p, x, flag):
    h = lax.cond(flag, lambda h: jnp.tanh(h @ p["a"]["w"]), lambda h: jnp.sin(h @ p["b"]["w"]), x)
    return jnp.sum(h**2)


def _checkpoint(p, x):
    block = jax.checkpoint(lambda q, h: jnp.tanh(h @ q["w"] + q["b"]))
    return jnp.sum(jnp.tanh(block(p["blk"], x) @ p["out"]["w"]) ** 2)


def _inner_jit(p, x):
    block = jax.jit(lambda q, h: jnp.tanh(h @ q["w"] + q["b"]))
    return jnp.sum(block(p["blk"], block(p["blk2"], x)) ** 2)


def _vmap(p, x):
    y = jax.vmap(lambda xi: p["lin"]["w"] @ xi + p["lin"]["b"])(x)  # Equinox style
    return jnp.sum(jnp.tanh(y) ** 2)


def _shared(p, x):
    fc = lambda h: jnp.tanh(h @ p["fc"]["w"] + p["fc"]["b"])
    return jnp.sum(fc(fc(x)) ** 2)


def _lora(p, x):
    q = p["fc"]
    return jnp.sum(jnp.tanh(x @ (q["w"] + q["A"] @ q["B"])) ** 2)


def _weight_decay_clean(p, x):
    return jnp.sum(jnp.tanh(x @ p["fc"]["w"]) ** 2)


def _weight_decay(p, x):
    return _weight_decay_clean(p, x) + 0.1 * jnp.sum(p["fc"]["w"] ** 2)


def _bf16(p, x):
    h = x.astype(jnp.bfloat16) @ p["fc"]["w"].astype(jnp.bfloat16)
    return jnp.sum(jnp.tanh(h.astype(jnp.float32)) ** 2)


# each layer as a function of its record's params (keyed as the record keys them) and input


def _bias_dense(q, x):
    return x @ q["w"] + q["b"]


def _leaf_dense(path):
    return functools.partial(_leaf_dense_apply, path)


def _leaf_dense_apply(path, q, x):
    return x @ q[path]


def _einsum_span(spec, path):
    return functools.partial(_einsum_apply, spec, path)


def _einsum_apply(spec, path, q, x):
    return jnp.einsum(spec, x, q[path])


def _conv_span(q, x):
    y = lax.conv_general_dilated(x, q["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + q["b"]


def _lookup(path):
    return functools.partial(_lookup_apply, path)


def _lookup_apply(path, q, ids):
    # the record's input is the ids as indexed (test_plain_embedding_record_equals_nn_embedding)
    return q[path][ids]


def _affine(q, x):
    return x * q["scale"] + q["bias"]


def _tied_head(q, h):
    return h @ q["table"].T


def _vmapped_dense(q, x):
    return jax.vmap(lambda xi: q["w"] @ xi + q["b"])(x)


def _lora_span(q, x):
    return x @ (q["w"] + q["A"] @ q["B"])


def _bf16_span(q, x):
    return x @ q["w"].astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=0)
def span_vjp(span, params, x, grad_output):
    """``(output, grad_params, grad_input)`` of one layer call; no grad_input for integer input."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        y, pull = jax.vjp(lambda q: span(q, x), params)
        return y, pull(grad_output)[0], None
    y, pull = jax.vjp(span, params, x)
    return (y, *pull(grad_output))


def check_spans(captured: dict, spans: dict, stacked: bool, tol: dict) -> None:
    """Each record is its layer's own vjp: output, grad_params and grad_input from its params,
    input and grad_output (per iteration under scan), exactly as for a vjpkit.nn layer."""
    for key, rec in captured.items():
        vjp = functools.partial(span_vjp, spans[key])
        y, gp, gx = (
            jax.vmap(vjp)(rec.params, rec.input, rec.grad_output)
            if stacked
            else vjp(rec.params, rec.input, rec.grad_output)
        )
        tree_allclose(rec.output, y, **tol)
        tree_allclose(rec.grad_params, gp, **tol)
        if rec.grad_input is not None:
            tree_allclose(rec.grad_input, gx, **tol)


def _ids():
    return (jnp.array([[0, 3, 6], [1, 1, 2]], jnp.int32),)


CASES = {
    "dense_bias": Case(
        _dense_bias,
        lambda: {
            "fc": {"w": _normal(0, 3, 4), "b": _normal(1, 4)},
            "out": {"w": _normal(2, 4, 2), "b": _normal(3, 2)},
        },
        lambda: (_normal(10, 5, 3), _normal(11, 5, 2)),
        {"fc": _bias_dense, "out": _bias_dense},
    ),
    "dense_nobias": Case(
        _dense_nobias,
        lambda: {"fc": {"w": _normal(0, 3, 4)}, "out": {"w": _normal(2, 4, 2)}},
        lambda: (_normal(10, 5, 3), _normal(11, 5, 2)),
        {"fc": _leaf_dense("w"), "out": _leaf_dense("w")},
    ),
    "einsum": Case(
        _einsum,
        lambda: {"proj": {"w": _normal(0, 4, 2, 3)}, "out": {"w": _normal(1, 2, 3, 4)}},
        lambda: (_normal(10, 2, 3, 4),),
        {"proj": _einsum_span("btd,dhk->bthk", "w"), "out": _einsum_span("bthk,hkd->btd", "w")},
    ),
    "conv": Case(
        _conv,
        lambda: {"conv": {"w": _normal(0, 3, 3, 2, 4), "b": _normal(1, 4)}},
        lambda: (_normal(10, 2, 5, 5, 2),),
        {"conv": _conv_span},
    ),
    "embedding": Case(
        _embed,
        lambda: {"embed": {"table": _normal(0, 7, 4)}, "head": {"w": _normal(1, 4, 3)}},
        _ids,
        {"embed": _lookup("table"), "head": _leaf_dense("w")},
    ),
    "layer_norm": Case(
        _layer_norm,
        lambda: {"ln": {"scale": 1.0 + _normal(0, 4), "bias": _normal(1, 4)}, "fc": {"w": _normal(2, 4, 3)}},
        lambda: (_normal(10, 5, 4),),
        {"ln": _affine, "fc": _leaf_dense("w")},
    ),
    "tied": Case(
        _tied,
        lambda: {"embed": {"table": _normal(0, 7, 4)}},
        lambda: (jnp.array([0, 3, 6, 2], jnp.int32),),
        {"embed": _lookup("table"), "embed#1": _tied_head},
    ),
    "scan": Case(
        _scan,
        lambda: {"blocks": {"w": _normal(0, 3, 4, 4), "b": _normal(1, 3, 4)}},
        lambda: (_normal(10, 5, 4),),
        {"blocks": _bias_dense},
        stacked=True,
    ),
    "cond_true": Case(
        _cond,
        lambda: {"a": {"w": _normal(0, 4, 4)}, "b": {"w": _normal(1, 4, 4)}},
        lambda: (_normal(10, 5, 4), jnp.array(True)),
        {"a": _leaf_dense("w"), "b": _leaf_dense("w")},
        untaken="b",
    ),
    "cond_false": Case(
        _cond,
        lambda: {"a": {"w": _normal(0, 4, 4)}, "b": {"w": _normal(1, 4, 4)}},
        lambda: (_normal(10, 5, 4), jnp.array(False)),
        {"a": _leaf_dense("w"), "b": _leaf_dense("w")},
        untaken="a",
    ),
    "checkpoint": Case(
        _checkpoint,
        lambda: {"blk": {"w": _normal(0, 4, 4), "b": _normal(1, 4)}, "out": {"w": _normal(2, 4, 2)}},
        lambda: (_normal(10, 5, 4),),
        {"blk": _bias_dense, "out": _leaf_dense("w")},
    ),
    "inner_jit": Case(
        _inner_jit,
        lambda: {
            "blk": {"w": _normal(0, 4, 4), "b": _normal(1, 4)},
            "blk2": {"w": _normal(2, 4, 4), "b": _normal(3, 4)},
        },
        lambda: (_normal(10, 5, 4),),
        {"blk": _bias_dense, "blk2": _bias_dense},
    ),
    "vmap": Case(
        _vmap,
        lambda: {"lin": {"w": _normal(0, 3, 4), "b": _normal(1, 3)}},
        lambda: (_normal(10, 5, 4),),
        {"lin": _vmapped_dense},
    ),
    "shared": Case(
        _shared,
        lambda: {"fc": {"w": _normal(0, 4, 4), "b": _normal(1, 4)}},
        lambda: (_normal(10, 5, 4),),
        {"fc": _bias_dense, "fc#1": _bias_dense},
    ),
    "lora": Case(
        _lora,
        lambda: {"fc": {"w": _normal(0, 4, 3), "A": _normal(1, 4, 2), "B": _normal(2, 2, 3)}},
        lambda: (_normal(10, 5, 4),),
        {"fc": _lora_span},
    ),
    "weight_decay": Case(
        _weight_decay,
        lambda: {"fc": {"w": _normal(0, 4, 3)}},
        lambda: (_normal(10, 5, 4),),
        {"fc": _leaf_dense("w")},
        clean=_weight_decay_clean,
        other=(("fc/w",),),
    ),
    "bf16": Case(
        _bf16,
        lambda: {"fc": {"w": _normal(0, 4, 3)}},
        lambda: (_normal(10, 5, 4),),
        {"fc": _bf16_span},
        tol=BF16,
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_gradient_and_per_leaf_records_equal_jax_grad(case, maybe_jit):
    c = CASES[case]
    params, data = c.params(), c.data()
    reference = jgrad(c.loss)(params, *data)
    grads, captured = maybe_jit(vk.grad(c.loss, capture="*"))(params, *data)
    tree_allclose(grads, reference, **c.tol)
    assert set(captured) == set(c.spans)
    absent: tuple = ()  # the leaves read only by the untaken call
    if c.untaken is not None:  # docs/hooks.md: a captured record of a branch not taken is NaN
        untaken = captured.pop(c.untaken)
        assert all(bool(jnp.isnan(leaf).all()) for leaf in jax.tree.leaves(untaken))
        absent = tuple(record_leaves(untaken, "params", leaf_paths(params)))
    check_record_shapes(captured, params)
    check_sums(captured, params, jgrad(c.clean or c.loss)(params, *data), c.tol, absent)
    check_spans(captured, c.spans, c.stacked, c.tol)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_explain_rows_and_other_uses(case):
    c = CASES[case]
    rows = vk.explain(c.loss, c.params(), *c.data(), file=io.StringIO())
    assert {row["key"] for row in rows} == set(c.spans)
    assert tuple(use.leaves for use in rows.other_uses) == c.other
    for use in rows.other_uses:
        assert isinstance(use.primitive, str) and use.primitive and use.where == ""


def test_scan_records_are_stacked_per_iteration(maybe_jit):
    """One record per iteration, stacked: iteration i's slice is that block's own vjp."""
    c = CASES["scan"]
    params, (x,) = c.params(), c.data()
    _, captured = maybe_jit(vk.grad(c.loss, capture="blocks"))(params, x)
    rec = captured["blocks"]
    n = params["blocks"]["w"].shape[0]
    assert rec.input.shape == (n, *x.shape) and rec.output.shape == (n, *x.shape)
    ref = unrolled_scan_reference(params, x)
    for field in ("input", "output", "grad_output", "grad_input", "grad_params"):
        tree_allclose(getattr(rec, field), ref[field], **F32)
    for i in range(n):
        w, b = rec.grad_params["w"][i], rec.grad_params["b"][i]
        tree_allclose(w, rec.input[i].T @ rec.grad_output[i], **F32)
        tree_allclose(b, rec.grad_output[i].sum(0), **F32)


@jax.jit
def unrolled_scan_reference(params, x):
    """The scan unrolled: per block, its input, output, and from ``jax.vjp`` of the blocks above
    it the cotangent of its output, then the block's own vjp; stacked over blocks."""
    blocks = params["blocks"]
    n = blocks["w"].shape[0]
    block = lambda q, h: h @ q["w"] + q["b"]

    def above(i, y):  # the loss as a function of block i's output
        h = jnp.tanh(y)
        for j in range(i + 1, n):
            h = jnp.tanh(block(jax.tree.map(lambda a, j=j: a[j], blocks), h))
        return jnp.sum(h**2)

    recs, h = [], x
    for i in range(n):
        q = jax.tree.map(lambda a, i=i: a[i], blocks)
        y = block(q, h)
        g = jax.grad(functools.partial(above, i))(y)
        gp, gx = jax.vjp(block, q, h)[1](g)
        recs.append(dict(input=h, output=y, grad_output=g, grad_input=gx, grad_params=gp))
        h = jnp.tanh(y)
    return jax.tree.map(lambda *a: jnp.stack(a), *recs)


def _halve_params(rec: vk.Cotangents) -> vk.Cotangents:
    return rec.replace(grad_params=jax.tree.map(lambda g: 0.5 * g, rec.grad_params))


def _zero_grad_output(rec: vk.Cotangents) -> vk.Cotangents:
    return rec.replace(grad_output=jax.tree.map(jnp.zeros_like, rec.grad_output))


_ZERO_GRAD_OUTPUT = vk.before(_zero_grad_output)


_BEFORE_CASES = ("scan", "cond_true", "checkpoint", "inner_jit", "vmap")


@pytest.mark.parametrize(
    "case, hook",
    [(c, "halve_grad_params") for c in CASES] + [(c, "before_zero_grad_output") for c in _BEFORE_CASES],
)
def test_a_hook_on_every_record_rewrites_its_share_of_the_gradient(case, hook):
    """Halving every record's grad_params halves the gradient, and zeroing every record's
    grad_output before its vjp zeroes it, but for other uses (weight decay) in both cases.
    Jitted only (the eager variants above run each pattern eagerly); no capture: the plain path."""
    c = CASES[case]
    params, data = c.params(), c.data()
    full, clean = jgrad(c.loss)(params, *data), jgrad(c.clean or c.loss)(params, *data)
    kept = 0.5 if hook == "halve_grad_params" else 0.0
    want = jax.tree.map(lambda f, g: f - (1.0 - kept) * g, full, clean)
    fn = _halve_params if hook == "halve_grad_params" else _ZERO_GRAD_OUTPUT
    tree_allclose(jax.jit(vk.grad(c.loss, hooks={"*": fn}))(params, *data), want, **c.tol)


EMBED = nn.embedding(7, 4)


def test_plain_embedding_record_equals_nn_embedding(maybe_jit):
    """``table[ids]`` in plain JAX gives the record vjpkit.nn.embedding gives for the same lookup."""
    ids = jnp.array([[0, -1, 6], [1, 1, 2]], jnp.int32)  # a negative id: jnp wraps it
    table = _normal(0, 7, 4)
    plain = lambda t, ids: jnp.sum(jnp.tanh(t[ids]) ** 2)
    layer = lambda t, ids: jnp.sum(jnp.tanh(EMBED.apply({"weight": t}, ids)) ** 2)
    _, captured = maybe_jit(vk.grad(plain, capture="*"))(table, ids)
    _, explicit = maybe_jit(vk.grad(layer, capture="*"))(table, ids)
    got, want = captured["arg0"], explicit["embedding"]
    tree_allclose(got.output, want.output)
    tree_allclose(got.grad_output, want.grad_output, **F32)
    tree_allclose(got.grad_params["arg0"], want.grad_params["weight"], **F32)
    assert got.grad_input is None and want.grad_input is None
    tree_allclose(got.input, want.input)  # the ids, shape (2, 3)


# --------------------------------------------------------------------- a dense record, by hand

DIMS = (("fc1", 4, 6), ("fc2", 6, 5), ("fc3", 5, 3))


def mlp_params() -> dict:
    return {name: {"w": _normal(i, m, n), "b": _normal(10 + i, n)} for i, (name, m, n) in enumerate(DIMS)}


def _dense(p, x):
    return x @ p["w"] + p["b"]


def _head(h, y):
    return jnp.mean((h - y) ** 2)


def mlp_loss(p, x, y):
    h = x
    for name, _, _ in DIMS:
        h = _dense(p[name], h)
        if name != "fc3":
            h = jnp.tanh(h)
    return _head(h, y)


X3 = _normal(20, 2, 3, 4)  # (batch, time, features): a dense layer over leading axes
Y3 = _normal(21, 2, 3, 3)


@functools.partial(jax.jit, static_argnames=("scale_out", "scale_in"))
def chained(p, x, y, scale_out: tuple = (), scale_in: tuple = ()):
    """Hand-chained ``jax.vjp`` of ``mlp_loss``, layer by layer: ``scale_out``'s ``(name, c)``
    multiplies the layer's grad_output by c before its vjp, ``scale_in``'s its grad_input after.
    Returns ``(grads, {name: dict(input, output, grad_output, grad_input)})``."""
    scale_out, scale_in = dict(scale_out), dict(scale_in)
    inputs, outputs, h = {}, {}, x
    for name, _, _ in DIMS:
        inputs[name] = h
        outputs[name] = h = _dense(p[name], h)
        if name != "fc3":
            h = jnp.tanh(h)
    g = jax.grad(_head)(outputs["fc3"], y)
    grads, recs = {}, {}
    for name, _, _ in reversed(DIMS):
        g = scale_out.get(name, 1.0) * g
        gp, gx = jax.vjp(_dense, p[name], inputs[name])[1](g)
        gx = scale_in.get(name, 1.0) * gx
        grads[name] = gp
        recs[name] = dict(input=inputs[name], output=outputs[name], grad_output=g, grad_input=gx)
        if name != "fc1":
            below = {"fc3": "fc2", "fc2": "fc1"}[name]
            g = jax.vjp(jnp.tanh, outputs[below])[1](gx)[0]
    return grads, recs


def _above(p, y, name: str, h):
    """The part of ``mlp_loss`` above layer ``name``, as a function of that layer's output."""
    below = [n for n, _, _ in DIMS]
    for later in below[below.index(name) + 1 :]:
        h = _dense(p[later], jnp.tanh(h))
    return _head(h, y)


@jax.jit
def split_reference(p, x, y):
    """fc1 and fc2's outputs, and the cotangent of each from ``jax.vjp`` of the part above it."""
    h1 = _dense(p["fc1"], x)
    h2 = _dense(p["fc2"], jnp.tanh(h1))
    out = {}
    for name, h in (("fc1", h1), ("fc2", h2)):
        value, pull = jax.vjp(functools.partial(_above, p, y, name), h)
        (g,) = pull(jnp.ones_like(value))
        out[name] = dict(value=value, output=h, grad_output=g)
    gp2, ga1 = jax.vjp(_dense, p["fc2"], jnp.tanh(h1))[1](out["fc2"]["grad_output"])
    out["fc2"].update(input=jnp.tanh(h1), grad_input=ga1, grad_params=gp2)
    return out


def test_dense_record_equals_vjp_of_the_model_above(maybe_jit):
    p = mlp_params()
    grads, captured = maybe_jit(vk.grad(mlp_loss, capture=vk.capture("fc*")))(p, X3, Y3)
    tree_allclose(grads, jgrad(mlp_loss)(p, X3, Y3), **F32)
    assert set(captured) == {"fc1", "fc2", "fc3"}
    ref = split_reference(p, X3, Y3)
    tree_allclose(ref["fc1"]["value"], mlp_loss(p, X3, Y3), **F32)  # the split is the model
    rec = captured["fc1"]
    tree_allclose(rec.input, X3, **F32)
    tree_allclose(rec.output, ref["fc1"]["output"], **F32)
    tree_allclose(rec.grad_output, ref["fc1"]["grad_output"], **F32)
    assert rec.grad_input is None  # the data batch needs no gradient
    gw = np.asarray(rec.input).reshape(-1, 4).T @ np.asarray(rec.grad_output).reshape(-1, 6)
    tree_allclose(rec.grad_params["w"], gw, **F32)
    tree_allclose(rec.grad_params["b"], np.asarray(rec.grad_output).reshape(-1, 6).sum(0), **F32)
    rec = captured["fc2"]
    for field in ("input", "output", "grad_output", "grad_input", "grad_params"):
        tree_allclose(getattr(rec, field), ref["fc2"][field], **F32)
    gw = np.asarray(rec.input).reshape(-1, 6).T @ np.asarray(rec.grad_output).reshape(-1, 5)
    tree_allclose(rec.grad_params["w"], gw, **F32)


def test_records_equal_the_hand_chained_vjps(maybe_jit):
    p = mlp_params()
    _, captured = maybe_jit(vk.grad(mlp_loss, capture="*"))(p, X3, Y3)
    grads, recs = chained(p, X3, Y3)
    for name, want in recs.items():
        rec = captured[name]
        for field in ("input", "output", "grad_output"):
            tree_allclose(getattr(rec, field), want[field], **F32)
        if name != "fc1":
            tree_allclose(rec.grad_input, want["grad_input"], **F32)
        tree_allclose(rec.grad_params, grads[name], **F32)


# --------------------------------------------------------------------- rewriting hooks


def _double_input(rec: vk.Cotangents) -> vk.Cotangents:
    return rec.replace(grad_input=jax.tree.map(lambda g: 2.0 * g, rec.grad_input))


def test_hook_doubling_grad_input_equals_the_hand_chain(maybe_jit):
    p = mlp_params()
    got = maybe_jit(vk.grad(mlp_loss, hooks={"fc2": _double_input}))(p, X3, Y3)
    want, _ = chained(p, X3, Y3, scale_in=(("fc2", 2.0),))
    tree_allclose(got, want, **F32)
    assert not np.allclose(want["fc1"]["w"], jgrad(mlp_loss)(p, X3, Y3)["fc1"]["w"])  # it bites


@pytest.mark.parametrize("factor", [0.0, -3.0], ids=["zero", "scale"])
def test_before_hook_rewriting_grad_output_equals_the_hand_chain(factor, maybe_jit):
    p = mlp_params()
    pre = vk.before(lambda rec: rec.replace(grad_output=factor * rec.grad_output))
    got, captured = maybe_jit(vk.grad(mlp_loss, hooks={"fc2": pre}, capture="fc2"))(p, X3, Y3)
    want, recs = chained(p, X3, Y3, scale_out=(("fc2", factor),))
    tree_allclose(got, want, **F32)
    tree_allclose(captured["fc2"].grad_output, recs["fc2"]["grad_output"], **F32)
    tree_allclose(captured["fc2"].grad_input, recs["fc2"]["grad_input"], **F32)


def test_hook_on_a_scanned_layer_runs_per_iteration(maybe_jit):
    c = CASES["scan"]
    params, (x,) = c.params(), c.data()
    got = maybe_jit(vk.grad(c.loss, hooks={"blocks": _halve_params}))(params, x)
    tree_allclose(got, jax.tree.map(lambda g: 0.5 * g, jgrad(c.loss)(params, x)), **F32)


# --------------------------------------------------------------------- names


def _two_dense(fc1, fc2, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ fc1[0] + fc1[1]) @ fc2[0] + fc2[1]))


NAME_CASES = {
    "nested": (
        lambda p, x: _two_dense((p["fc1"]["w"], p["fc1"]["b"]), (p["fc2"]["w"], p["fc2"]["b"]), x),
        lambda: {
            "fc1": {"w": _normal(0, 4, 3), "b": _normal(1, 3)},
            "fc2": {"w": _normal(2, 3, 2), "b": _normal(3, 2)},
        },
        {"fc1": {"w", "b"}, "fc2": {"w", "b"}},
    ),
    "deep": (
        lambda p, x: _two_dense(
            (p["enc"]["l1"]["w"], p["enc"]["l1"]["b"]), (p["dec"]["w"], p["dec"]["b"]), x
        ),
        lambda: {
            "enc": {"l1": {"w": _normal(0, 4, 3), "b": _normal(1, 3)}},
            "dec": {"w": _normal(2, 3, 2), "b": _normal(3, 2)},
        },
        {"enc/l1": {"w", "b"}, "dec": {"w", "b"}},
    ),
    "flat": (
        lambda p, x: _two_dense((p["w1"], p["b1"]), (p["w2"], p["b2"]), x),
        lambda: {"w1": _normal(0, 4, 3), "b1": _normal(1, 3), "w2": _normal(2, 3, 2), "b2": _normal(3, 2)},
        {"w1": {"w1", "b1"}, "w2": {"w2", "b2"}},
    ),
    "no_common_path": (  # a bias from another subtree: the weight's path, params by full path
        lambda p, x: jnp.sum(jnp.tanh(x @ p["enc"]["w"] + p["dec"]["b"])),
        lambda: {"enc": {"w": _normal(0, 4, 3)}, "dec": {"b": _normal(1, 3)}},
        {"enc/w": {"enc/w", "dec/b"}},
    ),
    "single_leaf": (
        lambda p, x: jnp.sum(jnp.tanh(x @ p["head"]["w"])),
        lambda: {"head": {"w": _normal(0, 4, 3)}},
        {"head": {"w"}},
    ),
    "bare_array": (
        lambda w, x: jnp.sum(jnp.tanh(x @ w)),
        lambda: _normal(0, 4, 3),
        {"arg0": {"arg0"}},
    ),
    "shared": (
        lambda p, x: jnp.sum(
            jnp.tanh(jnp.tanh(x @ p["fc"]["w"] + p["fc"]["b"]) @ p["fc"]["w"] + p["fc"]["b"])
        ),
        lambda: {"fc": {"w": _normal(0, 4, 4), "b": _normal(1, 4)}},
        {"fc": {"w", "b"}, "fc#1": {"w", "b"}},
    ),
}


@pytest.mark.parametrize("case", list(NAME_CASES), ids=list(NAME_CASES))
def test_names(case, maybe_jit):
    loss, make, expected = NAME_CASES[case]
    params, x = make(), _normal(10, 5, 4)
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(params, x)
    tree_allclose(grads, jgrad(loss)(params, x), **F32)
    assert {k: set(r.params) for k, r in captured.items()} == expected
    for key, rec in captured.items():
        name, _, call = key.partition("#")
        assert (rec.name, rec.call) == (name, int(call or 0))
    rows = vk.explain(loss, params, x, file=io.StringIO())
    assert [row["key"] for row in rows] == list(expected)  # forward order
    assert rows.other_uses == ()
    check_sums(captured, params, jgrad(loss)(params, x), F32)


def test_names_with_several_differentiated_arguments(maybe_jit):
    """Several argnums: each leaf's path starts with its argument, ``arg{i}``."""

    def loss(enc, head, x):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ enc["fc"]["w"] + enc["fc"]["b"]) @ head))

    enc, head, x = {"fc": {"w": _normal(0, 4, 3), "b": _normal(1, 3)}}, _normal(2, 3, 2), _normal(10, 5, 4)
    grads, captured = maybe_jit(vk.grad(loss, argnums=(0, 1), capture="*"))(enc, head, x)
    tree_allclose(grads, jax.jit(jax.grad(loss, argnums=(0, 1)))(enc, head, x), **F32)
    assert {k: set(r.params) for k, r in captured.items()} == {"arg0/fc": {"w", "b"}, "arg1": {"arg1"}}
    tree_allclose(captured["arg0/fc"].grad_params, grads[0]["fc"], **F32)
    tree_allclose(captured["arg1"].grad_params["arg1"], grads[1], **F32)


def test_a_glob_matching_nothing_lists_the_layers_found():
    loss, make, _ = NAME_CASES["nested"]
    params, x = make(), _normal(10, 5, 4)
    with pytest.raises(vk.ConfigError, match="matched no layer") as err:
        vk.grad(loss, hooks={"decoder*": _double_input})(params, x)
    assert "'fc1'" in str(err.value) and "'fc2'" in str(err.value)
    with pytest.raises(vk.ConfigError, match="'fc1', 'fc2'"):
        vk.value_and_grad(loss, capture=vk.capture("head*", ["grad_output"]))(params, x)


# --------------------------------------------------------------------- match=False


def test_match_false_finds_no_layer_and_keeps_the_gradient(maybe_jit):
    params = CASES["dense_bias"].params()
    data = CASES["dense_bias"].data()
    loss = CASES["dense_bias"].loss
    reference = jgrad(loss)(params, *data)
    tree_allclose(maybe_jit(vk.grad(loss, match=False))(params, *data), reference, **F32)
    value, grads = maybe_jit(vk.value_and_grad(loss, match=False))(params, *data)
    tree_allclose((value, grads), (loss(params, *data), reference), **F32)
    with pytest.raises(vk.ConfigError, match="matched no layer"):
        maybe_jit(vk.grad(loss, capture="fc*", match=False))(params, *data)
    with pytest.raises(vk.ConfigError, match="none: no vjpkit layer ran"):
        maybe_jit(vk.grad(loss, hooks={"*": _double_input}, match=False))(params, *data)
    with pytest.raises(vk.ConfigError):
        vk.explain(loss, params, *data, file=io.StringIO(), match=False)
    with pytest.raises(vk.ConfigError, match="match= takes True or False"):
        vk.grad(loss, match="yes")(params, *data)
    # match=True is the default
    _, captured = maybe_jit(vk.grad(loss, capture="fc*", match=True))(params, *data)
    assert set(captured) == {"fc"}


# --------------------------------------------------------------------- foreign models, not hookable


def _in_a_fresh_process_if_patched(request, classes) -> bool:
    """``vk.hookable`` patches a class's ``__call__`` for the whole process (its instances are then
    explicit layer calls): when another test did, run this test again in a fresh process."""
    from vjpkit._foreign import _patch

    if not any(_patch.is_patched(c) for c in classes):
        return False
    root = pathlib.Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-o", "addopts=", request.node.nodeid]
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return True


def test_equinox_mlp_without_hookable(maybe_jit, request):
    eqx = pytest.importorskip("equinox")
    if _in_a_fresh_process_if_patched(request, [eqx.nn.Linear, eqx.nn.MLP]):
        return
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    x = _normal(10, 5, 3)

    def loss(p, x):
        return jnp.sum(jnp.tanh(jax.vmap(eqx.combine(p, static))(x)) ** 2)

    reference = jgrad(loss)(params, x)
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(params, x)
    tree_allclose(grads, reference, **F32)
    assert {k: set(r.params) for k, r in captured.items()} == {
        f"layers/{i}": {"weight", "bias"} for i in range(2)
    }
    check_record_shapes(captured, params)
    check_sums(captured, params, reference, F32)


def test_nnx_linear_stack_without_hookable(maybe_jit, request):
    nnx = pytest.importorskip("flax.nnx")
    if _in_a_fresh_process_if_patched(request, [nnx.Linear]):
        return

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs)
            self.l2 = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    graphdef, state = nnx.split(Stack(nnx.Rngs(0)))
    x = _normal(10, 5, 3)

    def loss(s, x):
        return jnp.sum(nnx.merge(graphdef, s)(x) ** 2)

    reference = jgrad(loss)(state, x)
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(state, x)
    tree_allclose(grads, reference, **F32)
    assert {k: set(r.params) for k, r in captured.items()} == {
        "l1": {"kernel", "bias"},
        "l2": {"kernel", "bias"},
    }
    check_record_shapes(captured, state)
    check_sums(captured, state, reference, F32)


def _linen_model():
    linen = pytest.importorskip("flax.linen")

    class Model(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(2, name="out")(jnp.tanh(linen.Dense(4, name="hidden")(x)))

    model = Model()
    x = _normal(10, 5, 3)
    return model, model.init(jax.random.key(0), x), x


def test_flax_linen_applied_plainly_is_matched(maybe_jit):
    """The linen apply as a plain function (its jaxpr, made outside vjpkit: no interception)."""
    model, variables, x = _linen_model()
    closed, shape = jax.make_jaxpr(model.apply, return_shape=True)(variables, x)
    program = jaxpr_as_fun(closed)

    def loss(v, x):
        (y,) = program(*jax.tree.leaves((v, x)))
        assert y.shape == shape.shape
        return jnp.sum(jnp.tanh(y) ** 2)

    reference = jgrad(loss)(variables, x)
    applied = lambda v, x: jnp.sum(jnp.tanh(model.apply(v, x)) ** 2)  # the program is the model
    tree_allclose(reference, jgrad(applied)(variables, x), **F32)
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(variables, x)
    tree_allclose(grads, reference, **F32)
    assert {k: set(r.params) for k, r in captured.items()} == {
        "params/hidden": {"kernel", "bias"},
        "params/out": {"kernel", "bias"},
    }
    check_sums(captured, variables, reference, F32)


def test_flax_linen_intercepted_is_not_matched_again(maybe_jit):
    """Intercepted linen calls are explicit layer calls: matching adds no record for them."""
    model, variables, x = _linen_model()
    loss = lambda v, x: jnp.sum(jnp.tanh(model.apply(v, x)) ** 2)
    _, without = maybe_jit(vk.grad(loss, capture="*", match=False))(variables, x)
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(variables, x)
    tree_allclose(grads, jgrad(loss)(variables, x), **F32)
    assert set(captured) == set(without) and "hidden" in captured and "out" in captured
    tree_allclose(captured, without, **F32)


# --------------------------------------------------------------------- explicit layers beside plain code


FC = nn.dense(4)


def test_explicit_layer_mixed_with_plain_code(maybe_jit):
    x = _normal(10, 5, 3)
    params = {"fc": FC.init(jax.random.key(0), x), "head": {"w": _normal(1, 4, 2), "b": _normal(2, 2)}}

    def loss(p, x):
        h = jnp.tanh(FC.apply(p["fc"], x))
        return jnp.sum(jnp.tanh(h @ p["head"]["w"] + p["head"]["b"]) ** 2)

    _, explicit_only = maybe_jit(vk.grad(loss, capture="*", match=False))(params, x)
    (explicit_name,) = explicit_only  # the explicit layer's usual name
    reference = jgrad(loss)(params, x)
    grads, captured = maybe_jit(vk.grad(loss, capture="*"))(params, x)
    tree_allclose(grads, reference, **F32)
    assert set(captured) == {explicit_name, "head"}  # nothing recorded twice
    tree_allclose(captured[explicit_name], explicit_only[explicit_name], **F32)
    tree_allclose(captured[explicit_name].params, params["fc"])
    tree_allclose(captured[explicit_name].grad_params, reference["fc"], **F32)
    tree_allclose(captured["head"].params, params["head"])
    tree_allclose(captured["head"].grad_params, reference["head"], **F32)
    rows = vk.explain(loss, params, x, file=io.StringIO())
    assert [row["key"] for row in rows] == [explicit_name, "head"] and rows.other_uses == ()


# --------------------------------------------------------------------- tracing


def test_jitted_grad_with_capture_traces_the_loss_once():
    traces = []

    def loss(p, x, y):
        traces.append(1)
        return mlp_loss(p, x, y)

    g = jax.jit(vk.grad(loss, capture=vk.capture("fc*", ["grad_params"])))
    p = mlp_params()
    for i in range(3):
        x = X3 + float(i)
        grads, captured = g(p, x, Y3)
        tree_allclose(grads, jgrad(mlp_loss)(p, x, Y3), **F32)
        assert set(captured) == {"fc1", "fc2", "fc3"}
    assert len(traces) == 1


# --------------------------------------------------------------------- per-example norms: no fast path


def _grouped_conv_loss(p, x):
    h = lax.conv_general_dilated(
        x, p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
    )
    h = jnp.tanh(h + p["conv"]["b"]).reshape(x.shape[0], -1)
    return jnp.mean(jnp.sum(jnp.tanh(h @ p["head"]["w"] + p["head"]["b"]) ** 2, axis=1))


def _batch_dim_loss(p, x):
    h = jnp.einsum("bhd,hde->bhe", x.reshape(x.shape[0], 2, 3), p["heads"]["w"]) + p["heads"]["b"]
    h = jnp.tanh(h).reshape(x.shape[0], -1)
    return jnp.mean(jnp.sum(jnp.tanh(h @ p["head"]["w"] + p["head"]["b"]) ** 2, axis=1))


def _head_params(seed: int, n_in: int) -> dict:
    return {"w": _normal(seed, n_in, 2), "b": _normal(seed + 1, 2)}


# name: (loss, params, batch, the warning's text for the layer without a fast path)
NO_FAST_PATH = {
    "grouped_conv": (
        _grouped_conv_loss,
        lambda: {
            "conv": {"w": _normal(0, 3, 3, 2, 4), "b": _normal(1, 4)},
            "head": _head_params(2, 4 * 4 * 4),
        },
        lambda: _normal(10, 5, 4, 4, 4),
        # in the per-example program (vmapped over the examples) the conv's batching rule puts a
        # reshape between it and the bias add, so the bias is a shift layer of its own there
        r"'conv/w' \(a conv_general_dilated with feature_group_count=2; params \['conv/w'\]\)",
    ),
    "batch_dim_on_weight": (
        _batch_dim_loss,
        lambda: {"heads": {"w": _normal(0, 2, 3, 4), "b": _normal(1, 2, 4)}, "head": _head_params(2, 8)},
        lambda: _normal(10, 5, 6),
        r"'heads' \(a dot_general [^;]*with batch dimensions \(\d+,\) on the input and \(0,\) on the weight; "
        r"params \['heads/b', 'heads/w'\]\)",
    ),
}


def per_example_norm_reference(loss: Callable, params: Any, x: jax.Array) -> dict[str, np.ndarray]:
    """``{leaf path: ||g_i||}`` and ``"total"`` from ``jax.vmap(jax.grad)`` of the one-example loss."""
    per = jax.jit(jax.vmap(jax.grad(lambda p, xi: loss(p, xi[None])), in_axes=(None, 0)))(params, x)
    sq = {
        k: np.sum(np.square(np.asarray(g, np.float64)).reshape(len(x), -1), 1)
        for k, g in leaf_paths(per).items()
    }
    return {"total": np.sqrt(sum(sq.values())), **{k: np.sqrt(v) for k, v in sq.items()}}


@pytest.mark.parametrize("case", list(NO_FAST_PATH), ids=list(NO_FAST_PATH))
def test_per_example_norms_of_a_layer_with_no_fast_path_name_it_and_stay_exact(case, maybe_jit):
    """A plain-JAX layer found but with no dense/conv fast path (a grouped conv, batch dimensions on
    the weight; a transposed weight has one, tests/test_per_example_structures.py): per-example
    norms warn with its name (the parameter path),
    its equation and the path taken instead (a vmapped vjp of that layer alone), and stay equal to
    ``vmap(grad)``. The dense head keeps its fast path: nothing falls back to ``vmap(grad)``."""
    loss, make_params, make_x, named = NO_FAST_PATH[case]
    params, x = make_params(), make_x()
    _, captured = jax.jit(vk.grad(loss, capture="*"))(params, x)
    assert "head" in captured and len(captured) == 2  # both layers are found
    with pytest.warns(UserWarning, match="no dense or conv fast path") as record:
        loss_value, grads, norms = maybe_jit(vk.inspect.per_example_grad_norms(loss))(params, x)
    messages = [str(w.message) for w in record]
    (message,) = [m for m in messages if "fast path" in m]
    assert re.search(named, message), message
    assert "vmapped vjp of that layer's own computation" in message and "'head'" not in message
    assert not any("fall back to jax.vmap(jax.grad)" in m for m in messages)
    tree_allclose((loss_value, grads), (loss(params, x), jgrad(loss)(params, x)), **F32)
    want = per_example_norm_reference(loss, params, x)
    np.testing.assert_allclose(norms.total, want["total"], rtol=1e-5, atol=1e-6)
    got = leaf_paths(norms.params)
    assert sorted(got) == sorted(k for k in want if k != "total")
    for path, value in got.items():
        np.testing.assert_allclose(value, want[path], rtol=1e-5, atol=1e-6, err_msg=path)


def test_a_layer_with_no_fast_path_that_falls_back_names_its_equation(maybe_jit):
    """When the layer-local path is not possible either (the grouped conv's kernel is masked by a
    constant array, an operand other than its params and input), the leaves fall back to
    ``vmap(grad)``, and the warning still names the layer and its equation."""
    mask = np.tril(np.ones((9, 8), bool)).reshape(3, 3, 2, 4)

    def loss(p, x):  # jnp.where(mask, w, 0): a select_n with a constant operand, hoisted
        masked = {"conv": {"w": jnp.where(mask, p["conv"]["w"], 0.0), "b": p["conv"]["b"]}, "head": p["head"]}
        return _grouped_conv_loss(masked, x)

    params, x = NO_FAST_PATH["grouped_conv"][1](), NO_FAST_PATH["grouped_conv"][2]()
    with pytest.warns(UserWarning, match="fall back to jax.vmap") as record:
        _, _, norms = maybe_jit(vk.inspect.per_example_grad_norms(loss))(params, x)
    (message,) = [str(w.message) for w in record if "fall back" in str(w.message)]
    assert "'conv/w' (" in message and "feature_group_count=2" in message, message
    want = per_example_norm_reference(loss, params, x)
    np.testing.assert_allclose(norms.total, want["total"], rtol=1e-5, atol=1e-6)
    for path, value in leaf_paths(norms.params).items():
        np.testing.assert_allclose(value, want[path], rtol=1e-5, atol=1e-6, err_msg=path)
