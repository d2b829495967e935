"""Plots: each writes a valid, non-empty PNG; the numbers drawn equal direct numpy computations.

References: the gradient-flow series against ``np.linalg.norm`` of the gradients ``vk.grad``
returns (and of ``jax.grad``'s), the histogram counts computed here against the in-graph
``vk.histogram`` counts, and the backward-shape rows against the captured arrays' shapes.
"""

from __future__ import annotations

import io
import pathlib
import struct
import sys

import jax
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import load_example
from tests.models import mlp_loss, mlp_setup
from vjpkit.inspect import _plots as plots

pytest.importorskip("matplotlib", reason='the plots need matplotlib: pip install -e ".[plot]"')

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: pathlib.Path) -> tuple[int, int]:
    """Asserts ``path`` is a PNG larger than 1 KB; returns its (width, height) from the IHDR chunk."""
    data = path.read_bytes()
    assert path.stat().st_size > 1024, f"{path}: only {path.stat().st_size} bytes"
    assert data[:8] == PNG_MAGIC, f"{path}: not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def loss(params, batch):
    return mlp_loss(params, *batch)


@pytest.fixture(scope="module")
def setup():
    params, x, y = mlp_setup(batch=16)
    return params, (x, y)


@pytest.fixture(scope="module")
def history(setup):
    """Five steps of fit with norm capture: a list of (step, captured) pairs, as on_records gets them."""
    params, batch = setup
    pairs = []
    vk.train.fit(
        loss,
        optax.sgd(0.1),
        params,
        [batch] * 5,
        capture=vk.capture("*", fields=["grad_output", "grad_params"], reduce="norm"),
        on_records=lambda step, captured: pairs.append((step, captured)),
        progress=False,
    )
    return pairs


@pytest.fixture(scope="module")
def whole(setup):
    """One step's whole records (eager, so in backward order) and the gradients."""
    params, batch = setup
    spec = vk.capture("*", fields=["grad_output", "grad_input", "grad_params"])
    grads, captured = vk.grad(loss, capture=spec)(params, batch)  # eager: backward order
    return grads, captured


# --------------------------------------------------------------------------- gradient flow


def test_gradient_flow_series_is_the_norm_of_each_layers_gradients(setup):
    """sqrt(sum of squared leaf norms) == the norm of the layer's gradients concatenated."""
    params, batch = setup
    steps = []
    p = params
    spec = vk.capture("*", fields=["grad_output", "grad_params"], reduce="norm")
    step = jax.jit(vk.grad(loss, capture=spec))
    for _ in range(3):
        grads, captured = step(p, batch)
        steps.append(captured)
        ref = jax.grad(loss)(p, batch)
        for name in ("fc1", "fc2", "fc3"):
            flat = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(ref[name])])
            series = plots.gradient_flow_series([captured], "grad_params")
            np.testing.assert_allclose(series[name][1], [np.linalg.norm(flat)], rtol=1e-5)
        p = jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
    series = plots.gradient_flow_series(steps, "grad_params")
    assert sorted(series) == ["fc1", "fc2", "fc3"]  # relu layers have no grad_params leaves
    assert series["fc2"][0].tolist() == [0, 1, 2]  # a plain list: steps are the indices
    out = plots.gradient_flow_series(steps, "grad_output")
    assert sorted(out) == ["fc1", "fc2", "fc3", "relu1", "relu2"]


def test_gradient_flow_accepts_pairs_whole_arrays_reduction_lists_and_series(setup, history, whole):
    params, batch = setup
    pairs = plots.gradient_flow_series(history)
    assert pairs["fc1"][0].tolist() == [0, 1, 2, 3, 4]
    # whole arrays (reduce=None) give the same norms as reduce="norm"
    grads, captured = whole
    from_arrays = plots.gradient_flow_series([captured])
    from_norms = plots.gradient_flow_series([history[0][1]])
    for name in from_norms:
        np.testing.assert_allclose(from_arrays[name][1], from_norms[name][1], rtol=1e-5)
    # a list of reductions: the "norm" entry is used
    spec = vk.capture("*", fields=["grad_params"], reduce=["max", "norm"])
    _, multi = jax.jit(vk.grad(loss, capture=spec))(params, batch)
    np.testing.assert_allclose(plots.gradient_flow_series([multi])["fc3"][1], from_norms["fc3"][1], rtol=1e-5)
    # ready series pass through
    ready = {"a": ([0, 1, 2], [1.0, 0.1, 0.01])}
    steps, norms = plots.gradient_flow_series(ready)["a"]
    assert steps.tolist() == [0, 1, 2] and norms.tolist() == [1.0, 0.1, 0.01]


def test_gradient_flow_writes_a_png(tmp_path, history):
    path = tmp_path / "sub" / "flow.png"
    fig = plots.plot_gradient_flow(history, layers=["fc3", "fc2", "fc1"], path=path)
    width, height = png_size(path)
    assert width > 600 and height > 300
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fc3", "fc2", "fc1"]
    assert [line.get_label() for line in ax.get_lines()] == ["fc3", "fc2", "fc1"]


def test_gradient_flow_of_a_generator_and_into_given_axes(tmp_path, history):
    from matplotlib.figure import Figure

    fig = Figure()
    ax1, ax2 = fig.subplots(1, 2)
    got = plots.plot_gradient_flow((pair for pair in history), ax=ax1)
    plots.plot_gradient_flow(history, field="grad_output", layers="relu*", ax=ax2)
    assert got is fig
    assert len(ax1.get_lines()) == 3
    assert [line.get_label() for line in ax2.get_lines()] == ["relu1", "relu2"]
    png_size(plots.save(fig, tmp_path / "two.png"))


def test_gradient_flow_from_a_recorder(tmp_path, history):
    recorder = vk.inspect.Recorder(last=10)
    for step, captured in history:
        recorder.update(step, captured)
    got = plots.gradient_flow_series(recorder)
    want = plots.gradient_flow_series(history)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name][0], want[name][0])
        np.testing.assert_allclose(got[name][1], want[name][1], rtol=1e-6)
    plots.plot_gradient_flow(recorder, path=tmp_path / "r.png")
    png_size(tmp_path / "r.png")


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "empty"),
        ({}, "empty"),
        ("fc1", "must be a list"),
        ([1, 2], "entry 0 is a int"),
        ([{"fc1": 3.0}], "not a vk.Cotangents"),
    ],
)
def test_gradient_flow_bad_input(bad, match):
    with pytest.raises(vk.ConfigError, match=match):
        plots.plot_gradient_flow(bad)


def test_gradient_flow_bad_fields_and_layers(history, whole):
    with pytest.raises(vk.ConfigError, match="one step's captured dict"):
        plots.plot_gradient_flow(history[0][1])
    with pytest.raises(vk.ConfigError, match="no record holds 'grad_input'"):
        plots.plot_gradient_flow(history, field="grad_input")
    with pytest.raises(vk.ConfigError, match="unknown record field"):
        plots.plot_gradient_flow(history, field="grads")
    with pytest.raises(vk.ConfigError, match="'conv\\*' matches no layer"):
        plots.plot_gradient_flow(history, layers="conv*")
    with pytest.raises(vk.ConfigError, match="selects no layer"):
        plots.plot_gradient_flow(history, layers="relu*")  # relus have no grad_params
    with pytest.raises(vk.ConfigError, match="steps and norms"):
        plots.plot_gradient_flow({"a": ([0, 1], [1.0])})


# --------------------------------------------------------------------------- histograms


def test_histograms_of_whole_arrays_write_a_png(tmp_path, whole):
    _, captured = whole
    fig = plots.plot_histograms(captured, path=tmp_path / "h.png")
    width, height = png_size(tmp_path / "h.png")
    assert height > width / 2  # one row per layer: 5 rows, 2 columns
    assert len(fig.axes) == 5 * 2


def test_histogram_counts_match_numpy_and_the_in_graph_histogram(setup, whole):
    """Whole-array panels are np.histogram over +-max|x|; vk.histogram counts drawn as given."""
    params, batch = setup
    grads, captured = whole
    parts, note = plots._panel_data(captured["fc2"], "grad_params", "fc2", None)
    labels = [label for label, _, _ in parts]
    assert labels == ["bias", "weight"]
    w = np.asarray(grads["fc2"]["weight"], np.float64).ravel()
    b = np.asarray(grads["fc2"]["bias"], np.float64).ravel()
    bound = max(np.abs(w).max(), np.abs(b).max())
    _, counts, edges = parts[1]
    np.testing.assert_array_equal(counts, np.histogram(w, bins=edges)[0])
    np.testing.assert_allclose(edges[[0, -1]], [-bound, bound])
    assert counts.sum() == w.size and note.startswith("std")
    # in-graph counts over a fixed range equal numpy's over the clipped values
    lo, hi = -0.05, 0.05
    spec = vk.capture("*", fields=["grad_output", "grad_params"], reduce=vk.histogram(20, (lo, hi)))
    _, counted = jax.jit(vk.grad(loss, capture=spec))(params, batch)
    parts, _ = plots._panel_data(counted["fc2"], "grad_params", "fc2", (lo, hi))
    _, counts, edges = parts[1]
    np.testing.assert_allclose(edges, np.linspace(lo, hi, 21))
    clipped = np.clip(w, lo, hi - 1e-12)
    np.testing.assert_array_equal(counts, np.histogram(clipped, bins=edges)[0])


def test_histograms_of_counts_write_a_png(tmp_path, setup):
    params, batch = setup
    h = vk.histogram(16, (-0.1, 0.1))
    spec = vk.capture("fc*", fields=["grad_output", "grad_params"], reduce=[h, "norm"])
    _, counted = jax.jit(vk.grad(loss, capture=spec))(params, batch)
    plots.plot_histograms(counted, bins_range=h, path=tmp_path / "c1.png")  # the vk.histogram itself
    plots.plot_histograms(counted, fields="grad_output", bins_range=(-0.1, 0.1), path=tmp_path / "c2.png")
    png_size(tmp_path / "c1.png")
    png_size(tmp_path / "c2.png")


def test_histograms_note_zeros_and_nonfinite():
    rec = vk.Cotangents(name="bad", call=0, grad_output=np.array([0.0, 0.0, 1.0, np.nan, -2.0]))
    (part,), note = plots._panel_data(rec, "grad_output", "bad", None)
    assert part[1].sum() == 4  # the NaN is left out
    assert "50% exactly 0" in note and "1 NaN/Inf not shown" in note


def test_histograms_bad_input(setup, history, whole):
    params, batch = setup
    _, captured = whole
    with pytest.raises(vk.ConfigError, match="empty"):
        plots.plot_histograms({})
    with pytest.raises(vk.ConfigError, match="one step's dict"):
        plots.plot_histograms(history)
    with pytest.raises(vk.ConfigError, match="scalar, so the records were reduced"):
        plots.plot_histograms(history[0][1])
    with pytest.raises(vk.ConfigError, match="no record holds 'output'"):
        plots.plot_histograms(captured, fields=["output"])
    with pytest.raises(vk.ConfigError, match="not a 1-D vector of counts"):
        plots.plot_histograms(captured, bins_range=(-1, 1))  # whole arrays are not counts
    with pytest.raises(vk.ConfigError, match="lo < hi"):
        plots.plot_histograms(captured, bins_range=(1, -1))
    spec = vk.capture("*", fields=["grad_output"], reduce=[vk.histogram(8, (-1, 1)), "norm"])
    _, counted = jax.jit(vk.grad(loss, capture=spec))(params, batch)
    with pytest.raises(vk.ConfigError, match="pass the range"):
        plots.plot_histograms(counted, fields=["grad_output"])


# --------------------------------------------------------------------------- backward shapes


def test_backward_shapes_of_captured_records(tmp_path, whole):
    _, captured = whole
    rows = plots._shape_rows(captured)
    assert [r["name"] for r in rows] == ["fc3", "relu2", "fc2", "relu1", "fc1"]  # backward order
    fc2 = captured["fc2"]
    assert plots._shapes_text(rows[2]["grad_output"]) == [
        f"float32[{','.join(map(str, fc2.grad_output.shape))}]"
    ]
    assert plots._shapes_text(rows[2]["grad_params"]) == ["bias  float32[4]", "weight  float32[5,4]"]
    assert rows[4]["grad_input"] is None  # fc1's input is the data batch
    plots.plot_backward_shapes(captured, path=tmp_path / "b.png")
    width, height = png_size(tmp_path / "b.png")
    assert width > height


def test_backward_shapes_of_plain_rows_and_explain_rows(tmp_path, setup):
    rows = [
        dict(name="fc", call=1, grad_output="float32[8,2]", grad_input=(8, 4), grad_params={"w": (4, 2)}),
        dict(key="fc", grad_output="float32[8,4]", grad_input="None: needs no gradient", grad_params={}),
    ]
    table = plots._shape_rows(rows)
    assert [r["name"] for r in table] == ["fc#1", "fc"]
    assert plots._shapes_text(table[0]["grad_input"]) == ["(8, 4)"]
    assert plots._is_none(table[1]["grad_input"])
    plots.plot_backward_shapes(rows, path=tmp_path / "p.png")
    png_size(tmp_path / "p.png")

    params, (x, y) = setup
    explained = vk.explain(mlp_loss, params, x, y, file=io.StringIO())
    table = plots._shape_rows(explained)  # explain's rows come in forward order
    assert [r["name"] for r in table] == ["fc3", "relu2", "fc2", "relu1", "fc1"]
    plots.plot_backward_shapes(explained, path=tmp_path / "e.png")
    png_size(tmp_path / "e.png")


def test_backward_shapes_bad_input(history):
    with pytest.raises(vk.ConfigError, match="empty"):
        plots.plot_backward_shapes([])
    with pytest.raises(vk.ConfigError, match="empty"):
        plots.plot_backward_shapes({})
    with pytest.raises(vk.ConfigError, match="neither 'key' nor 'name'"):
        plots.plot_backward_shapes([{"grad_output": "f32[2]"}])
    with pytest.raises(vk.ConfigError, match="has no 'grad_output'"):
        plots.plot_backward_shapes([{"name": "fc"}])
    with pytest.raises(vk.ConfigError, match="hold reductions"):
        plots.plot_backward_shapes(history[0][1])


# --------------------------------------------------------------------------- saving, matplotlib


def test_save_palette_and_full_color(tmp_path, history):
    from PIL import Image

    fig = plots.plot_gradient_flow(history)
    small = plots.save(fig, tmp_path / "small.png")
    full = plots.save(fig, tmp_path / "full.png", palette=False)
    with Image.open(small) as a, Image.open(full) as b:
        assert a.mode == "P" and b.mode in ("RGB", "RGBA")
        assert a.size == b.size
    assert small.stat().st_size < full.stat().st_size
    assert plots.save(fig, tmp_path / "fig.svg").read_text().lstrip().startswith("<?xml")


def test_no_pyplot_and_a_clear_error_without_matplotlib(monkeypatch, history):
    had_pyplot = "matplotlib.pyplot" in sys.modules
    plots.plot_gradient_flow(history)
    if not had_pyplot:
        assert "matplotlib.pyplot" not in sys.modules  # standalone figures, no backend chosen
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError, match=r'pip install "vjpkit\[plot\]"'):
        plots.plot_gradient_flow(history)


def test_plotting_uses_pyplot_when_the_caller_does(history):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = plots.plot_gradient_flow(history)
    assert plt.fignum_exists(fig.number)
    plt.close(fig)


# --------------------------------------------------------------------------- the example


def load_plot_example():
    return load_example("plot_gradients")


@pytest.mark.slow
def test_example_writes_its_three_pngs(tmp_path, capsys):
    pytest.importorskip("sklearn", reason='the example needs scikit-learn: pip install -e ".[examples]"')
    example = load_plot_example()
    out = example.main(["--steps", "12", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(example.FILES)
    for path in out["paths"]:
        png_size(path)
        assert str(path) in printed
    assert [step for step, _ in out["history"]] == list(range(12))
    assert list(out["captured"])[:3] == ["fc2", "relu3", "fc1"]  # backward order


def test_gradient_flow_marks_nonfinite_steps(tmp_path):
    series = {"fc1": ([0, 1, 2, 3], [1.0, np.nan, 0.5, np.inf]), "fc2": ([0, 1, 2, 3], [0.1, 0.2, 0.0, 0.3])}
    fig = plots.plot_gradient_flow(series, path=tmp_path / "nan.png")
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["fc1", "fc1: NaN/Inf", "fc2"]
    marks = fig.axes[0].get_lines()[1]
    assert marks.get_xdata().tolist() == [1, 3]
    png_size(tmp_path / "nan.png")
