"""A layer called inside ``lax.scan`` in the Recorder and the gradient-flow plot (issue 31): one
series per iteration, keyed ``name[i]``, each equal to that block's slice of ``jax.grad``."""

from __future__ import annotations

import io

import jax
import numpy as np
import pytest

import vjpkit as vk
from tests.test_per_example_structures import L, lm_params, make_lm, tokens
from vjpkit.inspect._plots import gradient_flow_series


@pytest.fixture(scope="module")
def recorded():
    loss, params, tok = make_lm(), lm_params(jax.random.key(0)), tokens()
    spec = vk.capture("*", fields=["grad_params"], reduce="norm")
    step = jax.jit(vk.grad(loss, capture=spec))
    recorder = vk.inspect.Recorder(last=5, spec=spec)
    for t in range(2):
        _, captured = step(params, tok)
        recorder.update(t, captured)
    return recorder, jax.grad(loss)(params, tok)


def test_one_series_per_iteration_equal_to_the_blocks_gradient(recorded):
    recorder, grads = recorded
    for i in range(L):
        for leaf in ("w", "b"):
            steps, values = recorder.series(f"blocks/fc[{i}]", "grad_params", leaf, "norm")
            want = np.linalg.norm(np.asarray(grads["blocks"]["fc"][leaf][i]))
            np.testing.assert_allclose(values, [want, want], rtol=1e-5)
            assert list(steps) == [0, 1]
    assert f"blocks/fc[{L - 1}]" in recorder.summary(file=io.StringIO())
    assert not any(key == "blocks/fc" for key, *_ in recorder.keys)


def test_gradient_flow_has_one_line_per_block(recorded):
    recorder, grads = recorded
    series = gradient_flow_series(recorder)
    for i in range(L):
        _, norms = series[f"blocks/fc[{i}]"]
        w, b = (np.asarray(grads["blocks"]["fc"][k][i]) for k in ("w", "b"))
        np.testing.assert_allclose(norms, np.sqrt(np.sum(w**2) + np.sum(b**2)), rtol=1e-5)
    pytest.importorskip("matplotlib", reason='the plots need matplotlib: pip install -e ".[plot]"')
    fig = vk.inspect.plot_gradient_flow(recorder, layers="blocks/fc*")
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert [f"blocks/fc[{i}]" in labels for i in range(L)] == [True] * L, labels


def test_an_iteration_is_addressable_in_the_plots_layers(recorded):
    recorder, _ = recorded
    pytest.importorskip("matplotlib", reason='the plots need matplotlib: pip install -e ".[plot]"')
    fig = vk.inspect.plot_gradient_flow(recorder, layers=["blocks/fc[1]", "blocks/q[*]"])
    labels = sorted(line.get_label() for line in fig.axes[0].get_lines())
    assert labels == ["blocks/fc[1]", *(f"blocks/q[{i}]" for i in range(L))], labels


def test_explain_shows_each_scanned_layer_and_its_iterations():
    loss, params, tok = make_lm(), lm_params(jax.random.key(0)), tokens()
    out = io.StringIO()
    rows = vk.explain(loss, params, tok, file=out)
    by_key = {r["key"]: r for r in rows}
    assert by_key["blocks/fc"]["iterations"] == (L,) and by_key["embed"]["iterations"] == ()
    assert f"blocks/fc[:{L}] (call 0)" in out.getvalue() and f"blocks/fc x{L}" in out.getvalue()
    assert "blocks/fc[i]" in by_key["blocks/fc"]["meaning"]["iterations"]
    assert "iterations" not in by_key["embed"]["meaning"]
    # the shapes are one iteration's: those of the block's own weight slice
    assert by_key["blocks/fc"]["grad_params"]["w"].shape == params["blocks"]["fc"]["w"].shape[1:]

    def nested(p, x):
        inner = lambda h, w: (jax.numpy.tanh(h @ w), None)
        h, _ = jax.lax.scan(lambda h, ws: (jax.lax.scan(inner, h, ws)[0], None), x, p["w"])
        return jax.numpy.sum(h)

    w = jax.numpy.ones((2, 3, 4, 4)) * 0.1
    (row,) = vk.explain(nested, {"w": w}, jax.numpy.ones((5, 4)), file=io.StringIO())
    assert row["iterations"] == (2, 3) and "[i][j]" in row["meaning"]["iterations"]


@pytest.mark.parametrize("glob", ["blocks/fc[2]", "blocks/*[0][1]"])
def test_iteration_globs_in_curvature_statistics_say_where_they_apply(glob):
    # hooks and capture take them (tests/test_scan_iteration_globs.py); per-layer statistics not
    with pytest.raises(vk.ConfigError, match=r"per layer: ask for 'blocks/"):
        vk.curvature.stats(glob)
