"""examples/backward_seed.py: each seed scenario against a jax reference, and the script's output."""

from __future__ import annotations

import pathlib
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import tree_allclose

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "backward_seed.py"


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(SCRIPT), run_name="backward_seed")


def test_matmul_seed_003(example):
    r = example["matmul_seed"]()
    x, a = jnp.ones((2, 3)), jnp.ones((3, 4))
    seed = jnp.array([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    tree_allclose((r["grad_x"], r["grad_a"]), jax.vjp(jnp.matmul, x, a)[1](seed))
    # the thread's numbers: row i of the seed dotted with d out[i, :]/d x[i, j] = a[j, :] = ones
    tree_allclose(r["grad_x"], jnp.broadcast_to((seed @ a.T)[:, :1], (2, 3)))
    np.testing.assert_array_equal(np.asarray(r["grad_x"]), [[10, 10, 10], [26, 26, 26]])
    assert "expected float32[2,4], got float32[4,4]" in r["error"]


def test_two_losses_004(example):
    r = example["two_losses"]()
    inp = jnp.array([0.5, -1.0, 2.0])
    ref = jax.grad(lambda inp: jnp.sum(jnp.sin(inp)) + 2 * jnp.sum(inp**2))(inp)
    tree_allclose(r["seeded"], ref)
    tree_allclose(r["summed"], ref)


def test_vector_jacobian_product(example):
    r = example["vector_jacobian"]()
    assert r["jacobian"].shape == (5, 3)
    tree_allclose(r["vJ"], r["v"] @ r["jacobian"])
    params, x, v = example["_model_setup"]()
    f = lambda x: example["_model"].apply(params, x)
    tree_allclose(r["vJ"], jax.vjp(f, x)[1](v)[0])


def test_default_seed_of_ones(example):
    r = example["default_seed"]()
    w, x = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.1, 0.2, 0.3])
    tree_allclose(r["grad_single"], jax.grad(lambda w: jnp.tanh(w @ x))(w))
    tree_allclose(r["grad_scalar"], r["grad_single"])
    tree_allclose(r["ones_many"], jax.grad(lambda w: jnp.sum(jnp.tanh(w * x)))(w))
    tree_allclose(r["grad_sum_many"], r["ones_many"])
    assert "vk.vjp" in r["grad_error"] and "shape (1,)" in r["grad_error"]


def test_seed_is_last_grad_output(example):
    r = example["seed_is_grad_output"]()
    assert r["records"] == 1
    tree_allclose(r["grad_output"], np.asarray(r["v"]))


def test_script_prints_each_scenario(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--steps", "2"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert "grad_x = pullback(seed)[0] = [[10., 10., 10.], [26., 26., 26.]]" in out
    assert "row i of the seed dotted with dout/dx" in out and "1+2+3+4 = 10" in out
    for number in ("1.", "2.", "3.", "4.", "5."):
        assert f"\n{number} " in f"\n{out}"
    assert "equal to the seed: True" in out
