"""``vk.train.fit`` across processes (``jax.distributed``, gloo on CPU): 2 processes x 2 devices
and 4 processes x 1 device, each against one process of 4 devices.

The runs are launched with ``python -m vjpkit.train.launch`` (tests/_multiprocess_fit_script.py
has the scenarios). The rule for records: process 0 receives the global records, gathered
inside the step; the other processes receive none. ``on_host`` hooks and ``on_metrics`` run on
process 0 only, once per step per record.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import optax
import pytest

import vjpkit as vk
from vjpkit.train import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_multiprocess_fit_script.py"
LAYOUTS = [(2, 2), (4, 1)]  # (processes, CPU devices per process)
STEPS = 6


_CACHE = tempfile.mkdtemp(prefix="vjpkit-multiprocess-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, True)


def _env() -> dict:
    """This environment for the launched processes, sharing one XLA compilation cache: the
    killed run, the rerun and the runs of one launch compile the same steps."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def _launch(processes: int, devices: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "vjpkit.train.launch", "-n", str(processes)]
    command += ["--cpu-devices", str(devices), "--timeout", "240", str(SCRIPT), *args]
    return subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)


def _results(proc: subprocess.CompletedProcess, processes: int, prefixed: bool = True) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():
        prefix, sep, payload = line.partition("RESULT ")
        if sep:
            result = json.loads(payload)
            assert prefix == (f"[{result['process']}] " if prefixed else "")  # the launcher's prefix
            found[result["process"]] = result
    assert sorted(found) == list(range(processes)), proc.stdout[-3000:]
    return [found[i] for i in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference (1 process, 4 devices), then per layout: the killed launch and the rest."""
    root = tmp_path_factory.mktemp("multiprocess_fit")
    env = {**_env(), "JAX_NUM_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}
    ref = subprocess.run(
        [sys.executable, str(SCRIPT), "all", "--dir", str(root)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    out = {"ref": _results(ref, 1, prefixed=False)[0]}
    for processes, devices in LAYOUTS:
        killed = _launch(processes, devices, "kill", "--dir", str(root))
        out[processes, "killed"] = killed
        out[processes] = _results(_launch(processes, devices, "all", "--dir", str(root)), processes)
    return out


def close(got: dict, expected: dict, rtol: float = 1e-6, atol: float = 0.0) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=rtol, atol=atol, err_msg=key)


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_fit_equals_one_process_of_four_devices(runs, processes, devices):
    ref = runs["ref"]["train"]
    for run in runs[processes]:
        assert (run["processes"], run["devices"]) == (processes, 4)
        close(run["train"]["params"], ref["params"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(run["train"]["losses"], ref["losses"], rtol=1e-6)
        np.testing.assert_allclose(run["train"]["make_step"], ref["losses"][:2], rtol=1e-6)


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_process_0_receives_the_global_unreduced_records(runs, processes, devices):
    ref = runs["ref"]["train"]["records"]
    first, *others = runs[processes]
    records = first["train"]["records"]
    assert [step for step, _ in records] == list(range(STEPS))
    for (_, got), (_, expected) in zip(records, ref):
        assert "['fc1'].input" in expected and "['fc2'].grad_output" in expected
        assert np.shape(got["['fc1'].input"]) == (16, 16)  # the whole batch, every process's rows
        close(got, expected, rtol=1e-6, atol=1e-7)
    assert all(run["train"]["records"] == [] for run in others)


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_records_inside_shard_map_equal_one_process(runs, processes, devices):
    """The model inside a shard_map of the loss: one record per shard (4 shards over every
    process's devices) on the leading axis, delivered to process 0, equal to one process's."""
    ref = runs["ref"]["train"]["shard_map"]
    assert len(ref["records"]) == 2
    np.testing.assert_allclose(ref["losses"], runs["ref"]["train"]["losses"][:2], rtol=1e-6)  # the same loss
    first, *others = runs[processes]
    got = first["train"]["shard_map"]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6)
    for (step, g), (ref_step, e) in zip(got["records"], ref["records"]):
        assert step == ref_step
        assert np.shape(g["['fc1'].input"]) == (4, 4, 16)  # (shards, rows per shard, features)
        close(g, e, rtol=1e-6, atol=1e-7)
    assert all(run["train"]["shard_map"]["records"] == [] for run in others)


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_on_host_and_metrics_once_per_step_per_record_on_process_0(runs, processes, devices):
    first, *others = runs[processes]
    on_host = first["train"]["on_host"]
    assert on_host["1"] == ["fc1"] * STEPS  # every step
    assert on_host["2"] == ["fc2", "fc1"] * (STEPS // 2)  # every=2: steps 0, 2, 4, backward order
    assert first["train"]["metrics"] == list(range(STEPS))
    for run in others:
        assert run["train"]["on_host"] == {"1": [], "2": []} and run["train"]["metrics"] == []


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_curvature_statistics_equal_one_process(runs, processes, devices):
    ref = runs["ref"]["train"]["curvature"]
    got = runs[processes][0]["train"]["curvature"]
    assert len(got) == len(ref) == 3
    for g, e in zip(got, ref):
        close(g, e, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_killed_process_then_rerun_is_bitwise_an_uninterrupted_run(runs, processes, devices):
    killed = runs[processes, "killed"]
    assert killed.returncode != 0
    assert f"process {processes - 1} exited with code -9" in killed.stderr
    for run in runs[processes]:
        assert run["resumed"]["first_step"] == 4  # the newest checkpoint before the kill
        assert run["resumed"]["state"] == run["straight"]["state"]  # bit for bit


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_damaged_checkpoint_files_are_detected_and_the_run_falls_back(runs, processes, devices):
    first, *others = runs[processes]
    assert f"state/ocdbt.process_{processes - 1}/d/" in " ".join(first["damaged_files"])
    (warning,) = first["after_damage"]["warnings"]  # process 0 warns, once
    assert "checkpoint step 8" in warning and "Resuming from checkpoint step 4" in warning
    for run in runs[processes]:
        assert run["after_damage"]["first_step"] == 4
        assert run["after_damage"]["state"] == run["straight"]["state"]
    assert all(run["after_damage"]["warnings"] == [] for run in others)


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_checksums_per_shard_of_an_array_split_over_processes(runs, processes, devices):
    """Each process checks the shards it reads; a shard only the last process holds is found
    there, and every process raises the same error."""
    first = runs[processes][0]["sharded"]
    assert first["shard_keys"] == [f"{16 * i}:{16 * (i + 1)},0:32" for i in range(4)]
    for run in runs[processes]:
        assert run["sharded"]["intact"]
        assert "state['w'] does not match its checksum" in run["sharded"]["error"]
        assert f"found by process {processes - 1}" in run["sharded"]["error"]


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_process_local_data_equals_the_global_data(runs, processes, devices):
    ref = runs["ref"]["train"]
    for run in runs[processes]:
        params, losses = run["local"]["iterable"]  # each process: its rows of every global batch
        close(params, ref["params"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(losses, ref["losses"], rtol=1e-6)
        local, local_losses, glued, glued_losses = run["local"]["arrays"]
        assert local == glued and local_losses == glued_losses  # the documented global batch


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_mismatched_local_data_is_a_config_error_naming_the_process(runs, processes, devices):
    last = processes - 1
    for run in runs[processes]:
        _, rows, dtype = run["local"]["errors"]
        assert f"process {last}'s data gives" in rows and "process 0's gives" in rows
        assert f"process {last}'s local batch differs from process 0's" in dtype


@pytest.mark.parametrize(("processes", "devices"), LAYOUTS)
def test_a_non_finite_step_stops_every_process_at_the_same_step(runs, processes, devices):
    stops = {run["local"]["errors"][0] for run in runs[processes]}
    assert len(stops) == 1 and next(iter(stops)).startswith("NonFiniteError at step "), stops


def test_the_docs_recipe_runs_as_two_processes(tmp_path):
    """docs/training-scale.md's train_multihost.py, launched as the page says, then rerun (resume)."""
    page = (ROOT / "docs" / "training-scale.md").read_text()
    (block,) = re.findall(r"```text\n(# train_multihost\.py\n.*?)```", page, re.S)
    (tmp_path / "train_multihost.py").write_text(block)
    command = [sys.executable, "-m", "vjpkit.train.launch", "-n", "2", "--cpu-devices", "2"]
    command += ["--timeout", "200", "train_multihost.py"]
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[0] 2 processes 4 devices 20 (64, 4)\n" in proc.stdout
    assert re.search(r"^\[0\] final loss \d", proc.stdout, re.M)
    assert "[1] final loss" not in proc.stdout and "[1] 2 processes" not in proc.stdout
    assert {"10", "20"} <= set(os.listdir(tmp_path / "ckpt"))


def test_the_example_starts_itself_as_two_processes():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multiprocess_fit.py"), "--steps", "6"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[0] 2 processes, 4 devices, 6 steps" in proc.stdout
    assert "[0] on_records calls on process 0: 6;" in proc.stdout
    assert "[0] every process holds the same parameters: True" in proc.stdout
    assert "[1] every process" not in proc.stdout


# ----------------------------------------------------------------- one process, in this one
def test_an_uneven_local_batch_is_a_config_error_naming_the_process():
    x = np.zeros((8, 2), np.float32)
    batches = [(x,), (x,), (x[:5],)]
    with pytest.raises(vk.ConfigError, match=r"process 0's local batch 2 has 5 rows, its first had 8"):
        vk.train.fit(
            lambda p, b: (p["w"] * b[0]).sum(),
            optax.sgd(0.1),
            {"w": np.ones(2, np.float32)},
            batches,
            steps=3,
            local_data=True,
            mesh=vk.train.data_mesh(jax.devices()[:1]),
            progress=False,
        )


def test_local_data_needs_a_mesh():
    with pytest.raises(vk.ConfigError, match=r"local_data=True .* pass mesh="):
        vk.train.fit(
            lambda p, b: (p["w"] * b).sum(),
            optax.sgd(0.1),
            {"w": np.ones(2, np.float32)},
            np.zeros((8, 2), np.float32),
            batch_size=4,
            steps=1,
            local_data=True,
        )


def test_launch_prefixes_output_and_fails_when_a_process_fails(tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "i = int(os.environ['VJPKIT_PROCESS_ID'])\n"
        "print('hello', i, os.environ['VJPKIT_NUM_PROCESSES'], os.environ.get('JAX_NUM_CPU_DEVICES'))\n"
        "sys.exit(3 if i == 1 and '--fail' in sys.argv else 0)\n"
    )
    assert launch.main(["-n", "2", "--cpu-devices", "3", str(script)]) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == ["[0] hello 0 2 3", "[1] hello 1 2 3"]
    assert launch.main(["-n", "2", str(script), "--fail"]) == 3
    assert "process 1 exited with code 3" in capsys.readouterr().err
