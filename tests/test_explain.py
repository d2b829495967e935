"""vk.explain: shapes of every record field against jax.vjp references, order, sharing, output, errors."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.models import mlp, mlp_chain, mlp_loss, mlp_setup
from vjpkit import nn
from vjpkit.inspect._explain import explain

GRAD_FIELDS = ("input", "output", "grad_output", "grad_input", "grad_params")


def shapes(tree):
    """``(shape, dtype)`` per leaf, ``None`` kept: comparable across arrays and ShapeDtypeStructs."""
    return jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), tree)


def quiet(fun, *args, **kwargs):
    buf = io.StringIO()
    rows = explain(fun, *args, file=buf, **kwargs)
    return rows, buf.getvalue()


def test_mlp_rows_match_hand_chained_vjps():
    params, x, y = mlp_setup()
    rows, _ = quiet(mlp_loss, params, x, y)
    by_key = {r["key"]: r for r in rows}
    reference = mlp_chain(params, x, y)  # jax.vjp of the plain layer functions, chained by hand
    for key, ref in reference.items():
        for field in GRAD_FIELDS:
            assert shapes(by_key[key][field]) == shapes(ref[field]), (key, field)
        assert shapes(by_key[key]["params"]) == shapes(params[key])
    assert by_key["fc1"]["grad_input"] is None  # the data batch needs no gradient
    assert "needs no gradient" in by_key["fc1"]["meaning"]["grad_input"]
    # relu layers: no params, and what fc2 sends down is what relu1 receives
    assert by_key["relu1"]["grad_params"] == {} and by_key["relu1"]["params"] == {}
    assert shapes(by_key["relu1"]["grad_output"]) == shapes(by_key["fc2"]["grad_input"])


def test_rows_match_records_captured_on_data_in_forward_and_backward_order(maybe_jit):
    params, x, y = mlp_setup()
    rows, _ = quiet(mlp_loss, params, x, y)
    _, captured = maybe_jit(vk.grad(mlp_loss, capture="*"))(params, x, y)
    assert sorted(r["key"] for r in rows) == sorted(captured)
    for row in rows:
        rec = captured[row["key"]]
        assert (row["name"], row["call"]) == (rec.name, rec.call)
        for field in ("params", *GRAD_FIELDS):
            assert shapes(row[field]) == shapes(getattr(rec, field)), (row["key"], field)
    # forward order is the model's; backward order is the order host hooks see records
    assert [r["key"] for r in rows] == ["fc1", "relu1", "fc2", "relu2", "fc3"]
    seen = []
    jax.block_until_ready(
        jax.jit(vk.grad(mlp_loss, hooks={"*": vk.on_host(lambda rec: seen.append(rec.key))}))(params, x, y)
    )
    assert [r["key"] for r in sorted(rows, key=lambda r: r["backward"])] == seen
    assert [r["forward"] for r in rows] == list(range(5))


def test_cnn_with_pool_and_flatten_against_captured_records():
    model = nn.serial(
        conv=nn.conv2d(4, 3), act=nn.relu(), pool=nn.max_pool(2), flat=nn.flatten(), fc=nn.dense(3)
    )
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
    params = model.init(jax.random.key(1), x)
    loss = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
    rows, _ = quiet(loss, params, x)
    _, captured = vk.grad(loss, capture="*")(params, x)
    for row in rows:
        for field in ("params", *GRAD_FIELDS):
            assert shapes(row[field]) == shapes(getattr(captured[row["key"]], field)), (row["key"], field)
    assert rows[0]["grad_input"] is None and rows[0]["grad_params"]["weight"].shape == (3, 3, 1, 4)


def test_non_scalar_output_is_explained_as_a_vjp():
    params, x, _ = mlp_setup()
    rows, text = quiet(mlp.apply, params, x)
    out, pullback = vk.vjp(mlp.apply, params, x, capture="*")
    _, captured = pullback(jnp.ones_like(out))
    for row in rows:
        for field in ("params", *GRAD_FIELDS):
            got = getattr(captured[row["key"]], field)
            if field == "grad_input" and row["forward"] == 0:
                assert row[field] is None  # vk.vjp differentiates x too; explain, like training, args[0]
                continue
            assert shapes(row[field]) == shapes(got), (row["key"], field)
    assert "not a scalar" in text and "vk.vjp" in text
    assert rows[-1]["grad_output"].shape == out.shape


def test_argnums_differentiates_the_input_too():
    params, x, y = mlp_setup()
    rows, _ = quiet(mlp_loss, params, x, y, argnums=(0, 1))
    assert shapes(rows[0]["grad_input"]) == shapes(x)
    rows, _ = quiet(mlp_loss, params, x, y, argnums=1)
    assert shapes(rows[0]["grad_input"]) == shapes(x)
    assert all(r["grad_params"] is None for r in rows if r["key"].startswith("fc"))


def test_weight_sharing_rows():
    fc = nn.dense(5, name="fc")
    x = jax.random.normal(jax.random.key(1), (3, 5))
    p = fc.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.sum(fc.apply(p, jnp.tanh(fc.apply(p, x))) ** 2)
    rows, text = quiet(loss, p, x)
    assert [(r["key"], r["call"], r["forward"], r["backward"]) for r in rows] == [
        ("fc", 0, 0, 1),
        ("fc#1", 1, 1, 0),
    ]
    _, captured = vk.grad(loss, capture="fc")(p, x)
    for row in rows:
        assert shapes(row["grad_params"]) == shapes(captured[row["key"]].grad_params) == shapes(p)
    assert "sum" in rows[1]["meaning"]["grad_params"]
    assert "fc (call 0)" in text and "fc#1 (call 1)" in text


def test_dtypes_are_kept_and_integer_inputs_need_no_gradient():
    model = nn.serial(emb=nn.embedding(10, 4, dtype=jnp.bfloat16), fc=nn.dense(2))
    ids = jnp.array([[1, 2], [3, 4]])
    params = model.init(jax.random.key(0), ids)
    loss = lambda p, ids: jnp.sum(model.apply(p, ids).astype(jnp.float32))
    rows, _ = quiet(loss, params, ids)
    emb, fc = rows
    assert emb["input"].dtype == jnp.int32 and emb["grad_input"] is None
    assert fc["grad_params"]["weight"].dtype == jnp.bfloat16
    _, captured = vk.grad(loss, capture="*")(params, ids)
    for row in rows:
        for field in ("params", *GRAD_FIELDS):
            assert shapes(row[field]) == shapes(getattr(captured[row["key"]], field)), (row["key"], field)


def test_shape_only_arguments_and_unreached_calls():
    side = nn.dense(3, name="side")
    params, x, y = mlp_setup()
    p_side = side.init(jax.random.key(2), x)
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)

    def loss(pp, x, y):
        _ = side.apply(pp[1], x)  # its output is unused: the backward pass never reaches it
        return mlp_loss(pp[0], x, y)

    rows, text = quiet(loss, jax.tree.map(spec, (params, p_side)), spec(x), spec(y))
    assert rows[0]["key"] == "side" and rows[0]["backward"] is None and rows[0]["grad_output"] is None
    assert "never reached" in text and "side" in text
    assert [r["key"] for r in rows[1:]] == ["fc1", "relu1", "fc2", "relu2", "fc3"]


def test_plain_text_lists_every_layer_and_field():
    params, x, y = mlp_setup()
    rows, text = quiet(mlp_loss, params, x, y)
    for key in ("fc1", "relu1", "fc2", "relu2", "fc3"):
        assert key in text
    for word in ("grad_output", "grad_input", "grad_params", "None: needs no gradient", "backward order"):
        assert word in text
    assert "float32[6,5]" in text  # fc1's output at batch 6
    assert "\x1b[" not in text  # no terminal codes when the file is not a TTY


def test_rich_table_on_a_terminal():
    pytest.importorskip("rich", reason='rich tables need rich: pip install -e ".[pretty]"')

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    params, x, y = mlp_setup()
    buf = Terminal()
    explain(mlp_loss, params, x, y, file=buf)
    text = buf.getvalue()
    assert "┃" in text or "│" in text  # drawn by rich
    for key in ("fc1", "relu2", "fc3"):
        assert key in text


def test_no_layer_is_a_clear_error():
    def plain(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    # plain-JAX matching finds x @ w, named by the argument (a bare array: arg0)
    rows = explain(plain, jnp.ones((3, 2)), jnp.ones((4, 3)), file=io.StringIO())
    assert [r["key"] for r in rows] == ["arg0"]
    with pytest.raises(vk.ConfigError) as err:
        explain(plain, jnp.ones((3, 2)), jnp.ones((4, 3)), file=io.StringIO(), match=False)
    message = str(err.value)
    assert "calls no vjpkit layer" in message and "nn.layer" in message and "nn.serial" in message
    assert "matched no layer" not in message
    with pytest.raises(vk.ConfigError, match="example arguments"):
        explain(mlp_loss)


def test_nothing_runs_on_data():
    calls = []

    @jax.custom_vjp
    def spy(x):
        return x

    def spy_fwd(x):
        jax.debug.callback(lambda: calls.append("forward"))
        return x, None

    def spy_bwd(_, g):
        jax.debug.callback(lambda: calls.append("backward"))
        return (g,)

    spy.defvjp(spy_fwd, spy_bwd)
    model = nn.serial(fc=nn.dense(3), spy=nn.layer(lambda p, h: spy(h), name="spy"), out=nn.dense(1))
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.sum(model.apply(p, x))
    rows, _ = quiet(loss, params, x)
    jax.effects_barrier()
    assert calls == [] and [r["key"] for r in rows] == ["fc", "spy", "out"]
    vk.grad(loss, capture="*")(params, x)  # the control: on data, both callbacks fire
    jax.effects_barrier()
    assert calls == ["forward", "backward"]
