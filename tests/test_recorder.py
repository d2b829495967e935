"""Recorder: running moments vs numpy, ring buffers, exports round trip, summary, host, TensorBoard."""

from __future__ import annotations

import csv
import io
import json
import pathlib
import sys

import jax
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.models import mlp_loss, mlp_setup
from vjpkit.inspect._recorder import Recorder, Series

SPEC = vk.capture("fc*", fields=["grad_output", "grad_params"], reduce=["norm", "max"])


def fake_step(rng, nan=False):
    """One step's captured dict, shaped like a capture of SPEC, with random numpy leaves."""

    def red():
        return {"norm": np.float32(rng.normal()), "max": np.float32(rng.normal())}

    out = {}
    for key, name, call in (("fc1", "fc1", 0), ("fc1#1", "fc1", 1)):
        out[key] = vk.Cotangents(
            name=name,
            call=call,
            grad_output=red(),
            grad_params={"weight": red(), "bias": red()},
        )
    if nan:
        out["fc1"] = out["fc1"].replace(grad_output={"norm": np.float32(np.nan), "max": np.float32(np.inf)})
    return out


def test_moments_and_ring_buffer_match_numpy_over_a_stream():
    rng = np.random.default_rng(0)
    steps = [fake_step(rng, nan=(t == 7)) for t in range(40)]
    recorder = Recorder(last=10)
    for t, captured in enumerate(steps):
        recorder.update(t, captured)
    assert len(recorder.keys) == 2 * 3 * 2  # 2 calls x (grad_output, weight, bias) x 2 reductions
    for s in recorder.keys:
        rec = [c[s.key] for c in steps]
        field = [getattr(r, s.field) for r in rec]
        values = np.array([(f[s.path] if s.path else f)[s.reduction] for f in field], np.float64)
        finite = values[np.isfinite(values)]
        st = recorder.stats(*s)
        assert st["count"] == finite.size and st["nonfinite"] == values.size - finite.size
        assert st["updates"] == values.size
        np.testing.assert_allclose(st["mean"], finite.mean(), rtol=1e-12)
        np.testing.assert_allclose(st["var"], finite.var(), rtol=1e-10)
        np.testing.assert_allclose(st["std"], finite.std(), rtol=1e-10)
        assert st["min"] == finite.min() and st["max"] == finite.max()
        got_steps, got_values = recorder.series(*s)
        np.testing.assert_array_equal(got_steps, np.arange(30, 40))  # only the last 10 are kept
        np.testing.assert_array_equal(got_values, values[-10:])
    nan_series = recorder.stats("fc1", "grad_output", "", "norm")
    assert nan_series["nonfinite"] == 1 and np.isfinite(nan_series["mean"])


def test_ring_buffer_is_bounded():
    rng = np.random.default_rng(1)
    recorder = Recorder(last=3)
    for t in range(100):
        recorder.update(t, fake_step(rng))
    for s in recorder.keys:
        assert len(recorder._stats[s].buffer) == 3
    steps, _ = recorder.series("fc1#1", "grad_params", "weight", "max")
    np.testing.assert_array_equal(steps, [97, 98, 99])
    assert recorder.steps_seen == 100 and (recorder.first_step, recorder.last_step) == (0, 99)


@pytest.mark.slow
def test_fit_on_records_real_captures_and_histograms():
    params, x, y = mlp_setup(batch=24)
    spec = vk.capture(
        "*", fields=["grad_output", "grad_params"], reduce=["norm", vk.histogram(8, (-0.5, 0.5))]
    )
    recorder, kept = Recorder(last=4), []

    def both(step, captured):
        recorder.update(step, captured)
        kept.append((step, captured))

    vk.train.fit(
        lambda p, b: mlp_loss(p, *b),
        optax.sgd(0.1),
        params,
        (x, y),
        batch_size=6,
        steps=6,
        capture=spec,
        on_records=both,
        progress=False,
    )
    assert [s for s, _ in kept] == list(range(6))
    norms = np.array([float(c["fc2"].grad_params["weight"]["norm"]) for _, c in kept])
    st = recorder.stats("fc2", "grad_params", "weight", "norm")
    np.testing.assert_allclose([st["mean"], st["var"]], [norms.mean(), norms.var()], rtol=1e-6)
    # histograms are vectors: ring buffer only, no moments
    steps, hists = recorder.series("fc2", "grad_output", "", "histogram")
    np.testing.assert_array_equal(steps, [2, 3, 4, 5])
    np.testing.assert_array_equal(hists, [np.asarray(c["fc2"].grad_output["histogram"]) for _, c in kept[2:]])
    assert recorder.stats("fc2", "grad_output", reduction="histogram")["mean"] is None
    assert {s.key for s in recorder.keys} == {"fc1", "relu1", "fc2", "relu2", "fc3"}


def test_bare_leaves_are_named_by_the_spec():
    params, x, y = mlp_setup()
    spec = vk.capture("fc*", fields=["grad_params"], reduce="norm")
    _, captured = vk.grad(mlp_loss, capture=spec)(params, x, y)
    named, unnamed = Recorder(spec=spec), Recorder()
    named.update(0, captured)
    unnamed.update(0, captured)
    assert Series("fc1", "grad_params", "weight", "norm") in named.keys
    assert Series("fc1", "grad_params", "weight", "value") in unnamed.keys
    _, v = named.series("fc3", "grad_params", "bias")  # the only reduction: may be left out
    np.testing.assert_allclose(v, [float(captured["fc3"].grad_params["bias"])])
    with pytest.raises(vk.ConfigError, match="no series"):
        named.series("fc9", "grad_params", "weight")


def test_csv_and_jsonl_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    recorder = Recorder(last=5)
    for t in range(8):
        captured = fake_step(rng, nan=(t == 6))
        captured["fc1"] = captured["fc1"].replace(grad_input=np.arange(3.0) + t)  # a vector leaf
        recorder.update(t, captured)
    expected = {
        (step, *s): value
        for s in recorder.keys
        for step, value in zip(*(a.tolist() for a in recorder.series(*s)))
    }
    with open(recorder.to_csv(str(tmp_path / "r.csv")), newline="") as f:
        rows = list(csv.DictReader(f))
    parsed = {
        (int(r["step"]), r["key"], r["field"], r["path"], r["reduction"]): (
            json.loads(r["value"]) if r["value"].startswith("[") else float(r["value"])
        )
        for r in rows
    }
    with open(recorder.to_jsonl(str(tmp_path / "r.jsonl"))) as f:
        objs = [json.loads(line) for line in f]
    from_jsonl = {(o["step"], o["key"], o["field"], o["path"], o["reduction"]): o["value"] for o in objs}
    for table in (parsed, from_jsonl):
        assert len(table) == len(expected) == 5 * len(recorder.keys)
        for k, v in expected.items():
            np.testing.assert_array_equal(np.asarray(table[k], np.float64), np.asarray(v, np.float64))
    assert [int(r["step"]) for r in rows] == sorted(int(r["step"]) for r in rows)
    d = recorder.to_dict()
    json.dumps(d)  # JSON-ready
    assert d["last"] == 5 and len(d["series"]) == len(recorder.keys)
    vector = next(s for s in d["series"] if s["field"] == "grad_input")
    assert vector["values"][-1] == [7.0, 8.0, 9.0] and vector["mean"] is None


def test_summary_has_a_table_per_layer():
    rng = np.random.default_rng(3)
    recorder = Recorder()
    for t in range(3):
        recorder.update(t, fake_step(rng))
    buf = io.StringIO()
    text = recorder.summary(file=buf)
    assert buf.getvalue().strip() == text.strip()
    for word in ("fc1", "fc1#1", "grad_output", "grad_params", "weight", "norm", "max", "3 update(s)"):
        assert word in text
    mean = recorder.stats("fc1", "grad_params", "weight", "norm")["mean"]
    assert f"{mean:.4g}" in text


def test_host_delivery_counts_steps():
    params, x, y = mlp_setup()
    recorder = Recorder()
    spec = vk.capture("fc*", fields=["grad_output"], reduce="norm", host=vk.on_host(recorder.update_host))
    g = jax.jit(vk.value_and_grad(mlp_loss, capture=spec))
    captured = [g(params, x * (1.0 + t), y)[1] for t in range(3)]
    jax.block_until_ready(captured)
    steps, values = recorder.series("fc2", "grad_output")
    np.testing.assert_array_equal(steps, [0, 1, 2])
    np.testing.assert_allclose(values, [float(c["fc2"].grad_output) for c in captured], rtol=1e-6)

    every2 = Recorder()
    spec = vk.capture("fc*", fields=["grad_output"], reduce="norm", host=every2.host(every=2))
    g = jax.jit(vk.value_and_grad(mlp_loss, capture=spec))
    state = vk.init_hook_state(g, params, x, y)
    for _ in range(5):
        out = g(params, x, y, hook_state=state)
        state = out[-1]
    jax.block_until_ready(out)  # each step uses the previous one's state: the last waits for all
    np.testing.assert_array_equal(every2.series("fc1", "grad_output")[0], [0, 2, 4])


def read_events(directory: pathlib.Path):
    """TensorBoard's own reader of the event files in ``directory``, loaded."""
    pytest.importorskip("tensorboardX", reason='writing events needs tensorboardX: pip install -e ".[log]"')
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason='reading events back needs tensorboard: pip install -e ".[log]"',
    )
    events = accumulator.EventAccumulator(
        str(directory), size_guidance={accumulator.SCALARS: 0, accumulator.HISTOGRAMS: 0}
    )
    events.Reload()
    return events


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboardX", reason='writing events needs tensorboardX: pip install -e ".[log]"')
    rng = np.random.default_rng(4)
    with Recorder(tensorboard_dir=str(tmp_path)) as recorder:
        for t in range(4):
            recorder.update(10 + t, fake_step(rng))
    events = read_events(tmp_path)
    steps, values = recorder.series("fc1#1", "grad_params", "weight", "norm")
    tb = events.Scalars("fc1.call1/grad_params/weight/norm")
    assert [e.step for e in tb] == steps.tolist()
    np.testing.assert_allclose([e.value for e in tb], values, rtol=1e-6)
    assert "fc1/grad_output/max" in events.Tags()["scalars"]


def test_tensorboard_histograms_loss_and_eval_from_fit(tmp_path):
    pytest.importorskip("tensorboardX", reason='writing events needs tensorboardX: pip install -e ".[log]"')
    params, x, y = mlp_setup()
    bins, lo, hi = 8, -0.05, 0.05
    spec = vk.capture("fc*", fields=["grad_params"], reduce=vk.histogram(bins, (lo, hi)))
    with Recorder(spec=spec, tensorboard_dir=str(tmp_path)) as recorder:
        state, history = vk.train.fit(
            lambda p, b: mlp_loss(p, *b),
            optax.sgd(0.1),
            params,
            (x, y),
            batch_size=2,
            steps=6,
            capture=spec,
            on_records=recorder.update,
            eval_fn=lambda p: {"loss": float(mlp_loss(p, x, y))},
            eval_every=3,
            on_metrics=recorder.log_metrics,
        )
    events = read_events(tmp_path)
    tags = events.Tags()
    # the training loss of every step and each evaluation, as fit's history has them
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == history["step"]
    np.testing.assert_allclose([e.value for e in loss], history["loss"], rtol=1e-6)
    evals = events.Scalars("eval/loss")
    assert [e.step for e in evals] == [e["step"] for e in history["eval"]] == [3, 6]
    np.testing.assert_allclose([e.value for e in evals], [e["loss"] for e in history["eval"]], rtol=1e-6)
    # one histogram per layer and parameter: the recorded counts, over the spec's bins
    assert "fc1/grad_params/weight/histogram" in tags["histograms"]
    for tag in tags["histograms"]:
        key, _, path, _ = tag.split("/")
        steps, counts = recorder.series(key, "grad_params", path, "histogram")
        hist = events.Histograms(tag)
        assert [h.step for h in hist] == steps.tolist() == list(range(6))
        for h, expected in zip(hist, counts):
            np.testing.assert_allclose(h.histogram_value.bucket_limit, np.linspace(lo, hi, bins + 1)[1:])
            np.testing.assert_array_equal(h.histogram_value.bucket, expected)
            assert h.histogram_value.num == expected.sum()


LAYER_PATHS = (("norm_layer", ("mean", "var")), ("stats", ("min", "max")), ("fc", ("weight", "bias")))


def params_named_like_reductions(rng, reduce):
    """A step of a layer whose parameters are named mean/var/min/max, beside a dense layer."""

    def red():
        return {r: np.float32(rng.normal()) for r in reduce} if len(reduce) > 1 else np.float32(rng.normal())

    return {
        "norm_layer": vk.Cotangents(
            name="norm_layer", call=0, grad_params={k: red() for k in ("mean", "var")}
        ),
        "stats": vk.Cotangents(name="stats", call=0, grad_params={k: red() for k in ("min", "max")}),
        "fc": vk.Cotangents(name="fc", call=0, grad_params={"weight": red(), "bias": red()}),
    }


@pytest.mark.parametrize("with_spec", [True, False], ids=["spec", "no-spec"])
@pytest.mark.parametrize("reduce", [["norm"], ["norm", "max"]], ids=["one", "two"])
def test_parameters_named_like_reductions_stay_apart(reduce, with_spec):
    spec = vk.capture("*", fields=["grad_params"], reduce=reduce if len(reduce) > 1 else reduce[0])
    recorder = Recorder(spec=spec if with_spec else None)
    rng = np.random.default_rng(0)
    steps = [params_named_like_reductions(rng, reduce) for _ in range(3)]
    for t, captured in enumerate(steps):
        recorder.update(t, captured)
    single = reduce[0] if with_spec else "value"
    expected = {
        Series(key, "grad_params", path, r if len(reduce) > 1 else single)
        for key, paths in (
            ("norm_layer", ("mean", "var")),
            ("stats", ("min", "max")),
            ("fc", ("weight", "bias")),
        )
        for path in paths
        for r in reduce
    }
    assert set(recorder.keys) == expected
    got = recorder.series("norm_layer", "grad_params", "var", reduce[-1] if len(reduce) > 1 else None)[1]
    leaf = lambda c: c["norm_layer"].grad_params["var"]
    want = [leaf(c)[reduce[-1]] if len(reduce) > 1 else leaf(c) for c in steps]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_tensorboard_missing_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes the import fail
    with pytest.raises(vk.ConfigError, match=r"vjpkit\[log\]"):
        Recorder(tensorboard_dir=str(tmp_path))


def test_bad_arguments():
    with pytest.raises(vk.ConfigError, match="last"):
        Recorder(last=0)
    with pytest.raises(vk.ConfigError, match="captured"):
        Recorder().update(0, [1.0])
