"""examples/explain_shapes.py: its tables against jax.eval_shape / jax.vjp references, and its text."""

from __future__ import annotations

import pathlib
import re
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "explain_shapes.py"


def shapes(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), tree)


@pytest.fixture(scope="module")
def run():
    module = runpy.run_path(str(SCRIPT), run_name="explain_shapes")
    return module, module["main"]([])


def vjp_shapes(apply, params, x):
    """``(out, (grad_params, grad_x))`` shapes of ``jax.vjp(apply, params, x)``, computing nothing."""

    def f(params, x):
        out, pullback = jax.vjp(apply, params, x)
        return out, pullback(jnp.zeros(out.shape, out.dtype))

    return jax.eval_shape(f, params, x)


@pytest.mark.parametrize("which", ["conv", "fc"])
def test_single_layers_match_jax_vjp(run, which):
    _, results = run
    r = results[which]
    out, (grad_params, grad_x) = vjp_shapes(r["model"].apply, r["params"], r["x"])
    rows = [r["first"], r["inner"]] if which == "conv" else [r["rows"]]
    for table in rows:
        (row,) = table
        assert shapes(row["output"]) == shapes(row["grad_output"]) == shapes(out)
        assert shapes(row["grad_params"]) == shapes(grad_params) == shapes(r["params"])
        assert shapes(row["input"]) == shapes(r["x"])
    assert rows[0][0]["grad_input"] is None  # a first layer: x is data
    if which == "conv":
        assert shapes(r["inner"][0]["grad_input"]) == shapes(grad_x)
        assert out.shape == (64, 16, 16, 32) and r["params"]["weight"].shape == (3, 3, 16, 32)  # the forum's
    else:
        assert out.shape == (64, 10) and r["params"]["weight"].shape == (84, 10)


def test_net_matches_records_traced_by_vk_grad(run):
    module, results = run
    r = results["net"]
    args = (r["params"], r["x"], r["labels"])
    _, captured = jax.eval_shape(vk.grad(module["net_loss"], capture="*"), *args)
    grads = jax.eval_shape(jax.grad(module["net_loss"]), *args)
    order = [
        "conv1",
        "relu1",
        "pool1",
        "conv2",
        "relu2",
        "pool2",
        "flat",
        "fc1",
        "relu3",
        "fc2",
        "relu4",
        "fc3",
    ]
    assert [row["key"] for row in r["rows"]] == order  # the model's children, in forward order
    assert [row["backward"] for row in r["rows"]] == list(range(11, -1, -1))
    assert sorted(order) == sorted(captured)
    for row in r["rows"]:
        rec = captured[row["key"]]
        for field in ("params", "input", "output", "grad_output", "grad_input", "grad_params"):
            assert shapes(row[field]) == shapes(getattr(rec, field)), (row["key"], field)
        if row["key"] in grads:
            assert shapes(row["grad_params"]) == shapes(grads[row["key"]])
    by_key = {row["key"]: row for row in r["rows"]}
    # the net contains the forum's two layers exactly: conv2 is layer 1 (with x differentiated), fc3 layer 2
    for field in ("input", "output", "grad_output", "grad_input", "grad_params"):
        assert shapes(by_key["conv2"][field]) == shapes(results["conv"]["inner"][0][field])
    for field in ("input", "output", "grad_output", "grad_params"):
        assert shapes(by_key["fc3"][field]) == shapes(results["fc"]["rows"][0][field])
    assert by_key["conv1"]["grad_input"] is None and by_key["conv2"]["grad_input"] is not None


def test_legacy_hook_shapes_are_the_forum_ones(run):
    _, results = run
    legacy = results["legacy"]
    # thread 001's shapes: Linear (bias, data, weights) = [10], [64, 84], [84, 10];
    # Conv2d (data, kernels, bias) = [64, 16, 16, 16], [32, 16, 3, 3], [32]
    assert [shape for _, shape in legacy["linear"]] == [(10,), (64, 84), (84, 10)]
    assert [shape for _, shape in legacy["conv"]] == [(64, 16, 16, 16), (32, 16, 3, 3), (32,)]
    assert legacy["grad_output"] == {"linear": (64, 10), "conv": (64, 32, 16, 16)}
    assert legacy["first_conv_input"] is None


def test_output_and_no_torch(run, capsys):
    module, _ = run
    module["main"](["--steps", "3"])
    text = capsys.readouterr().out
    for word in ("addmm", "None: needs no gradient", "conv1", "fc3", "backward order", "weight.t()"):
        assert word in text
    source = SCRIPT.read_text()
    assert not re.search(r"^\s*(import|from)\s+torch\b", source, re.MULTILINE)
