"""The images in docs/img are made by scripts/make_doc_images.py, and what the docs say of them is true.

The docs' text about the pictures (docs/inspect.md, "Plots") quotes numbers: steps, layers,
ratios, peak steps, a share of exact zeros. They are read from the page and checked against the
run the pictures come from (``examples/plot_gradients.py`` at the arguments in
``scripts/make_doc_images.py``), recomputed here from that run's data, not from its pixels.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import pathlib
import re

import jax
import numpy as np
import pytest

from tests.helpers import load_example

pytest.importorskip("sklearn", reason='the digits examples need scikit-learn: pip install -e ".[examples]"')
pytest.importorskip("matplotlib", reason='the plots need matplotlib: pip install -e ".[examples]"')

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "inspect.md"


def load_maker_script():
    spec = importlib.util.spec_from_file_location("make_doc_images", ROOT / "scripts" / "make_doc_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page_text() -> str:
    return " ".join(PAGE.read_text().split())  # line breaks in a paragraph do not matter


def quoted(pattern: str) -> re.Match:
    match = re.search(pattern, page_text())
    assert match, (
        f"docs/inspect.md does not say {pattern!r}: if its text changed, check the new numbers against"
        " the run (these tests compute them) and read them with a new pattern"
    )
    return match


def test_every_image_in_the_docs_is_made_by_the_script():
    maker = load_maker_script()
    made = {file for m in maker.MAKERS.values() for file in m["files"]}
    shown = maker.referenced_images()
    assert set(shown) == made, (sorted(shown), sorted(made))
    assert {p.name for p in (ROOT / "docs" / "img").iterdir()} == made  # nothing stale
    assert set(maker.MAKERS["plot_gradients"]["files"]) == set(load_example("plot_gradients").FILES)
    assert "inspect.md" in " ".join(shown["gradient_flow.png"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run the pictures come from: plot_gradients.py at the script's arguments."""
    maker = load_maker_script()
    out = tmp_path_factory.mktemp("doc-images")
    with contextlib.redirect_stdout(io.StringIO()):
        result = load_example("plot_gradients").main(
            [*maker.MAKERS["plot_gradients"]["args"], "--out", str(out)]
        )
    assert sorted(p.name for p in out.iterdir()) == sorted(maker.MAKERS["plot_gradients"]["files"])
    return result


def layer_norms(history, name) -> np.ndarray:
    """A layer's parameter-gradient norm per step, as plot_gradient_flow combines its leaves."""
    return np.array(
        [math.sqrt(sum(float(v) ** 2 for v in jax.tree.leaves(c[name].grad_params))) for _, c in history]
    )


@pytest.mark.slow
def test_the_run_is_the_one_described(run):
    m = quoted(
        r"a small CNN \(conv (\d+), conv (\d+), average pool, dense (\d+), dense (\d+)\) trained for"
        r" (\d+) SGD steps on scikit-learn's 8\S8 digits"
    )
    conv1, conv2, fc1, fc2, steps = map(int, m.groups())
    params = run["state"].params
    assert params["conv1"]["weight"].shape[-1] == conv1 and params["conv2"]["weight"].shape[-1] == conv2
    assert params["fc1"]["weight"].shape[-1] == fc1 and params["fc2"]["weight"].shape[-1] == fc2
    assert [s for s, _ in run["history"]] == list(range(steps))
    assert len(run["metrics"]["loss"]) == steps
    assert int(quoted(r"norm over (\d+) steps, log scale")[1]) == steps
    # an average pool: each input of a 2x2 window receives a quarter of the window's cotangent
    pool = run["captured"]["pool"]
    spread = np.repeat(np.repeat(np.asarray(pool.grad_output), 2, axis=1), 2, axis=2) / 4
    np.testing.assert_allclose(np.asarray(pool.grad_input), spread, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_gradient_flow_figure_and_what_the_text_says_of_it(run):
    history, loss = run["history"], np.asarray(run["metrics"]["loss"])
    shown = quoted(r"parameter-gradient norm over \d+ steps, log scale: ([\w, ]+)\]")[1].split(", ")
    ax = run["figures"]["gradient_flow.png"].axes[0]
    assert sorted(line.get_label() for line in ax.get_lines()) == sorted(shown) == sorted(run["with_params"])
    assert ax.get_yscale() == "log"
    norms = {name: layer_norms(history, name) for name in shown}
    for name in shown:  # the figure draws these numbers
        line = next(line for line in ax.get_lines() if line.get_label() == name)
        np.testing.assert_allclose(line.get_ydata(), norms[name], rtol=1e-5)

    m = quoted(
        r"for the first (\d+) steps the loss stays within ([\d.]+) of ln 10 ≈ 2\.3 \(chance on 10"
        r" classes\) and the gradients are small, smallest in the first conv layer, (\d+) to (\d+) times"
        r" below the dense layers\. They all grow as the loss falls \(below 1 by step (\d+)\); the dense"
        r" layers and conv2 peak between steps (\d+) and (\d+), and all of them settle after that\. The"
        r" layers stay within a factor of (\d+) of each other at every step"
    )
    first, near, low, high, below_one, peak_from, peak_to, factor = (float(v) for v in m.groups())
    first = int(first)
    assert np.all(np.abs(loss[:first] - np.log(10)) <= near), loss[:first]
    stacked = np.stack([norms[name] for name in shown])
    assert np.all(norms["conv1"][:first] == stacked[:, :first].min(axis=0))  # smallest, every step
    for dense in ("fc1", "fc2"):
        ratio = norms[dense][:first].mean() / norms["conv1"][:first].mean()
        assert low <= ratio <= high, (dense, ratio)
    falls = int(np.argmax(loss < 1))
    assert loss[falls] < 1 and first <= falls <= below_one, falls
    for name in ("fc1", "fc2", "conv2"):
        assert peak_from <= int(np.argmax(norms[name])) <= peak_to, (name, int(np.argmax(norms[name])))
    for name in shown:  # settle: the last third averages well below the peak
        assert norms[name][-len(loss) // 3 :].mean() < 0.5 * norms[name][: int(peak_to) + 1].max(), name
    spread = stacked.max(axis=0) / stacked.min(axis=0)
    assert spread.max() <= factor, spread.max()


@pytest.mark.slow
def test_histograms_figure_and_what_the_text_says_of_it(run):
    order = re.split(
        r", | and ", quoted(r"Histograms of grad_output and grad_params for ([\w, ]+), log counts")[1]
    )
    fig = run["figures"]["histograms.png"]
    rows = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
    assert rows == order == run["with_params"]
    assert [ax.get_title().split()[0] for ax in fig.axes if ax.get_title()] == ["grad_output", "grad_params"]

    m = quoted(r"so (\d+)% of the `grad_output` of `conv2` \(the cotangent `relu2` sends down\) is exactly 0")
    captured = run["captured"]
    grad = np.asarray(captured["conv2"].grad_output)
    np.testing.assert_array_equal(grad, np.asarray(captured["relu2"].grad_input))  # the same cotangent
    share = 100 * np.mean(grad == 0)
    assert abs(share - int(m[1])) <= 0.5, share
    panel = fig.axes[2 * order.index("conv2")]  # conv2's grad_output panel: its corner note
    assert any(f"{int(m[1])}% exactly 0" in t.get_text() for t in panel.texts)


@pytest.mark.slow
def test_backward_shapes_figure_and_what_the_text_says_of_it(run):
    first, last = quoted(
        r"The backward pass of the digits CNN: (\w+) down to (\w+), with the shapes"
    ).groups()
    captured = run["captured"]
    assert [*captured][:: len(captured) - 1] == [first, last]
    texts = [t.get_text() for ax in run["figures"]["backward_shapes.png"].axes for t in ax.texts]
    rows = [t for t in texts if t in captured]  # the layer boxes, top to bottom
    assert rows == list(captured)
    # "why is grad_input None for the first conv?": the bottom row, and only it
    quoted(r"The bottom row is the forum's \"why is `grad_input` `None` for the first conv\?\"")
    assert [k for k, rec in captured.items() if rec.grad_input is None] == [last] == ["conv1"]
    assert sum(t.startswith("None: needs no gradient") for t in texts) == 1


@pytest.mark.slow
def test_plot_gradients_run_is_deterministic(run, tmp_path):
    """plot_gradients.py's docstring: "the same numbers every time". A second run, equal to the bit."""
    maker = load_maker_script()
    with contextlib.redirect_stdout(io.StringIO()):
        again = load_example("plot_gradients").main(
            [*maker.MAKERS["plot_gradients"]["args"], "--out", str(tmp_path)]
        )
    a, b = (jax.tree.map(np.asarray, [r["history"], r["captured"], r["state"].params]) for r in (run, again))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
