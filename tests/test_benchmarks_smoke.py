"""The benchmark script runs and writes well-formed JSON (timings are never asserted)."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BY_HAND = "raw JAX, the same norms by hand (zero probes)"
JAX_ROWS = [
    "raw JAX",
    BY_HAND,
    "vjpkit, no hooks",
    "vjpkit, capture norms",
    "vjpkit, capture + host every step",
    "vjpkit, traced modifying hook on every layer",
]
FLAX_ROWS = ["Flax NNX", "Flax NNX (split/merge + jax.jit)"]
TORCH_ROWS = ["PyTorch eager", "PyTorch eager + full backward hooks (norms)"]
ALL_ROWS = JAX_ROWS + FLAX_ROWS + ["Equinox"] + TORCH_ROWS


def smoke_env(env=None):
    """The benchmark's environment for a smoke run: XLA:CPU compiles without LLVM's optimization
    passes (about half the compile time, which is most of a quick run). The programs and what
    they compute are the same; only their speed changes, and no timing is asserted here."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    return env


def run_bench(tmp_path, *extra, env=None):
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--models", "mlp_small"]
    proc = subprocess.run(
        [*cmd, *extra, "--out", str(out)], capture_output=True, text=True, timeout=600, env=smoke_env(env)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


STAGES = ("trace_s", "lower_s", "xla_compile_s")


def check_row(row, timed=True):
    if row["status"] == "ok":
        keys = ("first_call_s", "compile_ratio")
        if timed:
            keys += ("median_step_us", "ratio_to_raw", "peak_memory_mb")
        else:
            assert row["median_step_us"] is None and row["peak_memory_mb"] is None
        for k in keys:
            assert row[k] > 0, (row["variant"], k)
    else:
        assert row["status"].startswith("skipped: ")


def check_first_call_split(result, stdout, repeats=1):
    """The staged first call (trace, lower, XLA compile) of raw JAX and the vjpkit rows: structure only."""
    rows = {row["variant"]: row for row in result["rows"]}
    for name in JAX_ROWS:
        split = rows[name]["first_call_split"]
        assert len(split["samples"]) == repeats
        for sample in split["samples"]:
            assert all(sample[k] > 0 for k in STAGES), (name, sample)
            parts = sum(sample[k] for k in STAGES)  # timed back to back: only the clock reads between
            assert parts == pytest.approx(sample["total_s"], rel=0.05, abs=0.01), (name, sample)
        for k in ("trace_ratio", "lower_ratio", "xla_compile_ratio", "total_ratio", "total_s", *STAGES):
            assert split[k] > 0, (name, k)
        if name == "raw JAX":
            assert split["trace_ratio"] == split["xla_compile_ratio"] == 1.0
    for name in set(rows) - set(JAX_ROWS):  # the peers are not staged
        assert rows[name].get("first_call_split") is None
    info = result["first_call_split_info"]
    assert [i["variant"] for i in info] == JAX_ROWS[2:]
    assert all(i["trace_s"] > 0 and i["trace_ratio"] > 0 for i in info)
    first_call = [t for t in result["targets"] if t["target"].startswith("first call: ")]
    assert len(first_call) == 4 and all(t["met"] in (True, False) for t in first_call)
    assert "trace + lower + XLA compile (s)" in stdout
    assert stdout.count("first call in stages, vjpkit") == 4
    assert stdout.count("/ raw JAX <= 1.3: ") == 4
    by_hand = result["by_hand"]
    assert by_hand["first_call_ratio_to_raw"] > 0 and by_hand["capture_first_call_over_by_hand"] > 0
    assert "the same norms by hand in raw JAX" in stdout


@pytest.mark.slow
def test_benchmark_quick_run_writes_json(tmp_path):
    # plain_bench.py's trace part: test_plain_bench_standalone
    # real_models_bench.py: test_real_models_bench_quick
    data, stdout = run_bench(tmp_path, "--plain-parts", "steps,per_example", "--no-real-models")
    meta = data["meta"]
    assert {"date", "machine", "cpu_count", "jax", "backend", "versions"} <= set(meta)
    assert {"jax", "flax", "equinox", "torch"} <= set(meta["versions"])
    (result,) = data["results"]
    assert result["model"] == "mlp_small"
    assert [row["variant"] for row in result["rows"]] == ALL_ROWS
    for row in result["rows"]:
        check_row(row)
    assert all(row["status"] == "ok" for row in result["rows"][: len(JAX_ROWS)])
    check_first_call_split(result, stdout)
    assert all(t["met"] in (True, False, None) for t in result["targets"])
    pex = data["per_example"]
    assert set(pex["median_ms"]) == {"vjpkit", "vmap(grad)", "value_and_grad"}
    eager = data["eager"]
    assert set(eager["median_ms"]) == {
        "vk.grad, hooks, eager",
        "vk.grad, capture norms, eager",
        "vk.grad built per call (hooks + capture), eager",
        "vk.grad and its hooks built per call, eager",
        "jax.grad, eager",
    }
    host = data["host"]  # host_bench.py: it asserts itself that fit delivered every record once
    assert len(host["hooks"]) == 3 and [f["model"] for f in host["fit"]] == ["mlp_small"]
    assert len(host["targets"]) == 4 and all(t["met"] in (True, False) for t in host["targets"])
    assert "on_host(every=100)" in stdout and "fit with records every step" in stdout
    quick_mem = data["quickstart"]  # quickstart_bench.py: both children ran and were measured
    assert all(row["peak_mb"] > 0 and row["seconds"] > 0 for row in quick_mem["rows"].values())
    assert [t["met"] in (True, False) for t in quick_mem["targets"]] == [True]
    assert "quickstart peak memory" in stdout
    assert eager["ratio"] > 0 and eager["inner_jit_traces"] >= 1
    assert [t["met"] in (True, False) for t in eager["targets"]] == [True] * 7
    assert eager["ratio_capture"] > 0 and eager["ratio_per_call"] > 0
    assert all(m["peak_mb"] > 0 for m in pex["xla_memory"].values())
    assert "| raw JAX |" in stdout and "Per-example gradient norms" in stdout
    check_plain(data["plain"], ("steps", "per_example"))
    assert "vjpkit, matched, capture norms" in stdout and "transformer block" in stdout
    curvature = data["curvature"]  # curvature_bench.py: every statistic of every matched layer
    assert [m["model"] for m in curvature["models"]] == ["mlp_mnist", "cnn"]
    assert [m["layers"] for m in curvature["models"]] == [["fc1", "fc2", "fc3"], ["conv1", "conv2", "fc"]]
    assert all(
        r["ratio"] > 0 and r["met"] in (True, False, None) for m in curvature["models"] for r in m["rows"]
    )
    assert "Curvature statistics" in stdout
    side = curvature["kfac_jax"]["status"]  # kfac-jax beside it: ran, or skipped with the reason
    assert side == "ok" or side.startswith("skipped: "), side
    assert data["real_models"] is None


PLAIN_ROWS = ["raw JAX", "vjpkit, matched, no hooks", "vjpkit, matched, capture norms"]
PEX_ROWS = [
    "value_and_grad",
    "vjpkit per_example_grad_norms",
    "vjpkit per_example_grad_norms, check=False",
    "vmap(grad) + norms",
]


def check_plain(plain, parts):
    """plain_bench.py's result (``--quick``): structure, and what does not depend on timing."""
    assert plain["quick"] is True and plain["parts"] == list(parts)
    if "steps" in parts:
        assert [s["model"] for s in plain["steps"]] == ["plain_mlp", "plain_cnn", "plain_transformer"]
        for s in plain["steps"]:
            assert [r["variant"] for r in s["rows"]] == PLAIN_ROWS
            assert all(r["median_step_us"] > 0 and r["peak_memory_mb"] > 0 for r in s["rows"])
            assert s["max_first_loss_diff"] < 1e-5, s["model"]  # the same loss, differentiated 3 ways
            assert s["rows"][1]["xla_flops_ratio_to_raw"] == pytest.approx(1.0, abs=1e-3)  # no hooks: free
            assert len(s["targets"]) == 2
        layers = {s["model"]: s["matched_layers"] for s in plain["steps"]}
        assert layers["plain_mlp"] == ["fc1", "fc2", "fc3"]
        assert layers["plain_cnn"] == ["conv1", "conv2", "fc"]
        assert "embed" in layers["plain_transformer"] and "blocks/attn/wq" in layers["plain_transformer"]
    if "per_example" in parts:
        plain_block, flax_block = plain["per_example"]
        for p in (plain_block, flax_block):
            if p.get("status", "").startswith("skipped: "):  # Flax not installed
                continue
            assert list(p["median_ms"]) == PEX_ROWS and all(t > 0 for t in p["median_ms"].values())
            assert all(p["xla_memory"][v]["temp_mb"] > 0 for v in PEX_ROWS)
            assert p["norms_max_rel_diff_vs_vmap_grad"] < 1e-4, p["model"]
            assert p["fallback_warnings"] == [], p["model"]  # every leaf on a fast path
    if "trace" in parts:
        trace = plain["trace"]
        assert [t["blocks"] for t in trace] == [2, 4, 8]
        for a, b in itertools.pairwise(trace):  # every block adds its 9 layers (ln, q, k, v, o, ln, 3 mlp)
            assert b["matched_layers"] - a["matched_layers"] == 9 * (b["blocks"] - a["blocks"])
            assert b["equations"] > a["equations"]
        assert all(t["other_uses"] == 0 and t["median_s"]["rewrite"] > 0 for t in trace)
        assert len(plain["trace_targets"]) == 2
    assert all(t["met"] in (True, False) for t in plain["targets"])


@pytest.mark.slow
def test_plain_bench_standalone(tmp_path):
    """plain_bench.py alone (its trace-time part: the cheapest) writes its JSON and table."""
    out = tmp_path / "plain.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "plain_bench.py"), "--quick", "--parts", "trace"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600, env=smoke_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    check_plain(data, ("trace",))
    assert data["steps"] == [] and data["per_example"] == []
    assert {"date", "machine", "jax"} <= set(data["meta"])
    assert "Trace-time matching" in proc.stdout and "linear in equations" in proc.stdout


@pytest.mark.slow
def test_benchmark_reports_missing_peers_as_skipped(tmp_path):
    """A peer that fails to import becomes a 'skipped' row; one left out of --peers too."""
    fake = tmp_path / "fake_site"
    for mod in ("torch", "equinox"):
        (fake / mod).mkdir(parents=True)
        (fake / mod / "__init__.py").write_text(f"raise ImportError('simulated: no {mod}')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake), env.get("PYTHONPATH", "")])
    data, stdout = run_bench(
        tmp_path,
        "--peers",
        "equinox,torch",
        "--no-per-example",
        "--no-host",
        "--no-quickstart",
        "--no-plain",
        "--no-eager",
        "--no-curvature",
        "--no-real-models",
        env=env,
    )
    rows = {row["variant"]: row for row in data["results"][0]["rows"]}
    assert list(rows) == ALL_ROWS
    for name in FLAX_ROWS:
        assert rows[name]["status"] == "skipped: not in --peers"
    for name in ["Equinox", *TORCH_ROWS]:
        assert rows[name]["status"].startswith("skipped: ImportError: simulated: no ")
    assert all(rows[name]["status"] == "ok" for name in JAX_ROWS)
    for part in ("per_example", "eager", "host", "quickstart", "plain", "curvature", "real_models"):
        assert data[part] is None, part
    assert "| Equinox | skipped: ImportError" in stdout


@pytest.mark.slow
def test_benchmark_only_first_call(tmp_path):
    """--only-first-call: first calls and their staged split only, no step timing or other benchmarks."""
    data, stdout = run_bench(tmp_path, "--peers", "none", "--only-first-call")
    assert data["meta"]["only_first_call"] is True
    (result,) = data["results"]
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ALL_ROWS
    for row in rows.values():
        check_row(row, timed=False)
    assert all(rows[name]["status"] == "ok" for name in JAX_ROWS)
    for name in TORCH_ROWS:
        assert rows[name]["status"] == "skipped: --only-first-call"
    assert all(t["target"].startswith("first call: ") for t in result["targets"])
    check_first_call_split(result, stdout)
    for part in ("per_example", "eager", "host", "quickstart", "plain", "real_models"):
        assert data[part] is None, part


REAL_ROWS = [
    "value_and_grad",
    "vk.inspect.per_example_grad_norms",
    "vk.inspect.per_example_grad_norms, check=False",
    "vmap(grad) + norms",
    "vk.value_and_grad capture every layer's norms",
    "value_and_grad + a host callback never called",
]


@pytest.mark.slow
def test_real_models_bench_quick(tmp_path):
    """real_models_bench.py --quick on its three models: rows, targets, warnings recorded, norms
    agreeing with vmap(grad)'s; then its docs table fits docs/performance.md's markers."""
    out = tmp_path / "real.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_models_bench.py"), "--quick"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600, env=smoke_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["models"] == ["gpt2", "vit", "resnet"]
    assert [r["model"] for r in data["results"]] == data["models"]
    assert {"date", "machine", "jax", "commit", "vjpkit_uncommitted"} <= set(data["meta"])
    for r in data["results"]:
        assert [row["variant"] for row in r["rows"]] == REAL_ROWS, r["model"]
        for row in r["rows"]:
            assert row["median_ms"] > 0 and row["temp_mb"] > 0 and row["time_ratio"] > 0, row["variant"]
            assert row["xla_fusions"] > 0, row["variant"]
            assert len(row["call_s_per_round"]) == data["rounds"]
            assert all({"category", "message", "source", "phase"} <= set(w) for w in row["warnings"])
        assert r["rows"][0]["time_ratio"] == r["rows"][0]["temp_ratio"] == 1.0
        for variant, diff in r["norms_max_rel_diff_vs_vmap_grad"].items():
            assert diff < 1e-3, (r["model"], variant, diff)
        assert all(d < 1e-4 for d in r["loss_abs_diff_vs_value_and_grad"].values()), r["model"]
        assert r["per_example_layers"] and r["captured_layers"], r["model"]
        assert len(r["targets"]) == 3 and all(t["met"] in (True, False) for t in r["targets"])
    assert len(data["targets"]) == 9
    assert proc.stdout.count("| vmap(grad) + norms |") == 3 and "largest relative difference" in proc.stdout
    # the docs table: run.py --write-docs puts it between its markers in docs/performance.md
    path_before = list(sys.path)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import real_models_bench
        import run
    finally:
        sys.path[:] = path_before
    table = real_models_bench.docs_table(data)
    assert table.count("| vmap(grad) + norms |") == 1 and "| row | gpt2 | vit | resnet |" in table
    page = (ROOT / "docs" / "performance.md").read_text()
    start, end = run.REAL_MODELS_MARKERS
    updated = run.replace_marked(page, table, run.REAL_MODELS_MARKERS)
    assert updated.split(start)[0] == page.split(start)[0] and updated.split(end)[1] == page.split(end)[1]


CNN_PEERS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import peers, run
from models import MODELS, data

_, model, raw, shape, classes = MODELS["cnn"]()
x, y = data(shape, classes)
variants, params = run.jax_variants("cnn", model, raw, x, y)
variants = {run.RAW: variants[run.RAW], **run.jax_peer_variants("cnn", params, x, y, ["flax", "equinox"])}
print(json.dumps({name: [v.first_call()[1] for _ in range(2)] for name, v in variants.items()}))
"""


@pytest.mark.slow
def test_cnn_peers_pool_like_vjpkit_and_also_their_own_way():
    """The CNN's Flax NNX and Equinox rows come twice (reshape-max pool, reduce_window); all train alike."""
    pytest.importorskip("flax")
    pytest.importorskip("equinox")
    proc = subprocess.run(
        [sys.executable, "-c", CNN_PEERS_SCRIPT, str(ROOT / "benchmarks")],
        capture_output=True,
        text=True,
        timeout=600,
        env=smoke_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.splitlines()[-1])
    own = [f"{name}, lax.reduce_window pool" for name in [*FLAX_ROWS, "Equinox"]]
    assert list(losses) == ["raw JAX", *FLAX_ROWS, *own[:2], "Equinox", own[2]]
    for name, two_steps in losses.items():
        assert two_steps == pytest.approx(losses["raw JAX"], abs=1e-5), name


def test_curvature_race_runs_and_writes_its_table(tmp_path):
    """``curvature_race.py --quick``: every problem and optimizer has a row, the target is Adam's
    final loss, and a setting that reaches it says when (no timing asserted); kfac-jax's rows
    come from its side environment where there is one, else say why not."""
    pytest.importorskip("sklearn")
    out = tmp_path / "race.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "curvature_race.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=smoke_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["problem"] for r in res["results"]] == ["mlp", "cnn", "autoencoder", "lm"]
    every = {"Adam", "SGD", "K-FAC", "K-FAC, statistics every 10", "EKFAC", "kfac-jax"}
    for r in res["results"]:
        assert set(r["rows"]) == every
        assert r["target"] == pytest.approx(r["rows"]["Adam"]["final_loss"])
        # kfac-jax runs in its side environment (CI's Python 3.11 stage makes it), never on the LM
        if r["problem"] == "lm" or "note" in r["rows"]["kfac-jax"]:
            assert r["rows"]["kfac-jax"]["note"].startswith("not run"), r["rows"]["kfac-jax"]
        else:
            assert r["rows"]["kfac-jax"]["adam_seconds_to_target_same_process"] > 0
        for row in r["rows"].values():
            if "note" in row:
                continue
            assert len(row["curve"]) == r["steps"]
            if row["steps_to_target"] is not None:
                assert row["curve"][row["steps_to_target"] - 1] <= r["target"]
        assert r["rows"]["K-FAC"]["refresh_step_ms"] > 0 and r["rows"]["EKFAC"]["refresh_step_ms"] > 0
    assert "lax.scan" in res["results"][-1]["rows"]["kfac-jax"]["note"]
    assert "| mlp |" in proc.stdout


@pytest.mark.parametrize("key", ["mlp_small", "mlp_mnist", "cnn"])
def test_the_norms_by_hand_are_the_captured_norms(key):
    """run.py's by-hand row (zero probes in raw JAX) computes what ``vk.capture`` records, and the
    raw model's loss and gradients: the floor it stands for is of the same numbers."""
    import jax

    import vjpkit as vk

    from .helpers import tree_allclose

    path_before = list(sys.path)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import models
    finally:
        sys.path[:] = path_before
    _, model, raw, shape, classes = models.MODELS[key]()
    x, y = models.data(shape, classes)
    x, y = x[:16], y[:16]
    params = model.init(jax.random.key(0), x)
    fields = ["grad_output", "grad_input", "grad_params"]
    capture = vk.capture("*", fields=fields, reduce="norm")
    (loss, grads), captured = jax.jit(vk.value_and_grad(models.loss_of(model.apply), capture=capture))(
        params, x, y
    )
    (value, by_grads), norms = jax.jit(models.probed_norms_loss(raw))(params, x, y)
    want_loss, want_grads = jax.value_and_grad(models.loss_of(raw))(params, x, y)
    tree_allclose((value, by_grads), (want_loss, want_grads))
    tree_allclose((loss, grads), (want_loss, want_grads))
    assert sorted(norms) == sorted(captured)
    for name, rec in norms.items():
        got = captured[name]
        for field in fields:
            want = getattr(got, field)
            if field not in rec:  # the first layer's input is the data: no grad_input
                assert want is None, (name, field)
                continue
            tree_allclose(rec[field], want, rtol=1e-5)
