"""examples/per_example_dp.py: vjpkit's DP gradients equal a vmap(grad) reference, step by step.

The example prints its own comparison with a naive implementation; this test also recomputes
the first step's DP gradient here, independently of the example's code, from
``jax.vmap(jax.grad)`` of the plain loss and the documented noise (``dp_noise``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import tree_allclose
from vjpkit.inspect._per_example import dp_noise

pytest.importorskip("sklearn", reason='the digits examples need scikit-learn: pip install -e ".[examples]"')

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "per_example_dp.py"
STEPS = 4


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("example_per_example_dp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = module.main(["--steps", str(STEPS), "--width", "32", "--batch-size", "16", "--clip", "0.5"])
    return dict(out, printed=printed.getvalue())


def test_same_dp_gradients_as_naive(example):
    assert len(example["grad_diffs"]) == STEPS
    assert max(example["grad_diffs"]) < 1e-6
    assert max(example["param_diffs"]) < 1e-5


def test_first_step_against_independent_reference(example):
    first, args = example["first"], example["args"]
    loss_fn, params, x, y = example["loss_fn"], first["params"], first["x"], first["y"]
    b, clip, sigma = x.shape[0], args["clip"], args["sigma"]

    def single(p, xi, yi):
        return loss_fn(p, xi[None], yi[None])

    grads = jax.jit(jax.vmap(jax.grad(single), in_axes=(None, 0, 0)))(params, x, y)
    g64 = [np.asarray(g, np.float64).reshape(b, -1) for g in jax.tree.leaves(grads)]
    norms = np.sqrt(sum(np.sum(g**2, axis=1) for g in g64))
    factor = np.minimum(1.0, clip / norms)
    assert np.any(factor < 1)  # clipping is active
    noise = dp_noise(example["key"], 0, params, sigma * clip)
    expected = jax.tree.map(
        lambda g, n: ((np.tensordot(factor, np.asarray(g, np.float64), axes=1) + np.asarray(n)) / b).astype(
            np.float32
        ),
        grads,
        noise,
    )
    tree_allclose(first["grads"], jax.tree.map(jnp.asarray, expected), rtol=1e-5, atol=1e-6)


def test_prints_diffs_time_and_memory(example):
    printed = example["printed"]
    for word in ("max |vk - naive| grad", "median step (ms)", "compiled temp memory (MB)", "test accuracy"):
        assert word in printed
    assert example["memory"]["vjpkit"] < example["memory"]["naive"]
    assert set(example["times"]) == {"vjpkit", "naive"}
