"""Data parallelism: mesh helpers in-process (1 device), and 1 device vs 4 devices in subprocesses."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

import vjpkit as vk
from vjpkit.train import _sharding
from vjpkit.train._sharding import (
    batch_sharding,
    check_mesh,
    data_mesh,
    replicate,
    replicated,
    shard_batch,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_sharded_script.py"


# ---------------------------------------------------------------------------- data_mesh
def test_data_mesh_spans_jax_devices_by_default():
    mesh = data_mesh()
    assert mesh.axis_names == ("data",)
    assert mesh.shape["data"] == jax.device_count()
    assert list(mesh.devices.flat) == jax.devices()


def test_data_mesh_takes_devices_and_axis_name():
    mesh = data_mesh(jax.devices()[:1], axis="batch")
    assert dict(mesh.shape) == {"batch": 1}
    assert list(mesh.devices.flat) == jax.devices()[:1]


def test_data_mesh_axes_are_auto_so_jit_propagates_shardings():
    assert all(t == jax.sharding.AxisType.Auto for t in data_mesh().axis_types)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"devices": []}, "devices is empty"), ({"axis": ""}, "non-empty string"), ({"axis": 3}, "got 3")],
)
def test_data_mesh_rejects_bad_arguments(kwargs, match):
    with pytest.raises(vk.ConfigError, match=match):
        data_mesh(**kwargs)


# --------------------------------------------------------------------------- check_mesh
def test_check_mesh_accepts_a_divisible_batch():
    check_mesh(data_mesh(), 8 * jax.device_count())
    check_mesh(AbstractMesh((4,), ("data",)), 12)
    check_mesh(AbstractMesh((2, 4), ("model", "data")), 8)
    check_mesh(AbstractMesh((4,), ("data",)), np.int64(16))


def test_check_mesh_batch_10_over_4_devices_names_both_numbers_and_suggests_sizes():
    with pytest.raises(vk.ConfigError) as info:
        check_mesh(AbstractMesh((4,), ("data",)), 10)
    message = str(info.value)
    assert "4 devices" in message and "batch size 10" in message
    assert "multiple of 4" in message and "8 or 12" in message
    assert isinstance(info.value, ValueError)


def test_check_mesh_suggests_the_axis_size_when_the_batch_is_smaller():
    with pytest.raises(vk.ConfigError, match=r"\(for example 4\)"):
        check_mesh(AbstractMesh((4,), ("data",)), 2)


def test_check_mesh_missing_axis_lists_the_mesh_axes():
    with pytest.raises(vk.ConfigError, match=r"no axis 'data'; its axes are \['batch'\]"):
        check_mesh(data_mesh(axis="batch"), 8)


@pytest.mark.parametrize("batch_size", [0, -4, 2.0, True, "8"])
def test_check_mesh_rejects_a_batch_size_that_is_not_a_positive_int(batch_size):
    with pytest.raises(vk.ConfigError, match="positive integer"):
        check_mesh(data_mesh(), batch_size)


def test_check_mesh_rejects_a_non_mesh():
    with pytest.raises(vk.ConfigError, match=r"expected a jax\.sharding\.Mesh, got list"):
        check_mesh(jax.devices(), 8)


# ---------------------------------------------------------------- shardings and transfers
def test_batch_sharding_splits_the_leading_dimension_and_replicated_copies():
    mesh = data_mesh()
    assert batch_sharding(mesh) == NamedSharding(mesh, PartitionSpec("data"))
    assert replicated(mesh) == NamedSharding(mesh, PartitionSpec())
    assert replicated(mesh).is_fully_replicated
    with pytest.raises(vk.ConfigError, match="no axis 'data'"):
        batch_sharding(data_mesh(axis="batch"))


def test_shard_batch_puts_every_leaf_with_the_batch_sharding():
    mesh = data_mesh()
    n = 4 * jax.device_count()
    batch = {"x": np.arange(n * 3, dtype=np.float32).reshape(n, 3), "y": np.arange(n, dtype=np.int32)}
    out = shard_batch(batch, mesh)
    for key in batch:
        assert isinstance(out[key], jax.Array)
        assert out[key].sharding == batch_sharding(mesh)
        np.testing.assert_array_equal(np.asarray(out[key]), batch[key])
    assert shard_batch(out, mesh)["x"] is out["x"]  # already placed: returned as is


def test_shard_batch_splits_a_stack_of_batches_along_batch_dim_1():
    mesh = data_mesh()
    n = 4 * jax.device_count()
    stacked = shard_batch({"x": np.zeros((3, n, 2), np.float32)}, mesh, batch_dim=1)
    assert stacked["x"].sharding.spec == PartitionSpec(None, "data")
    assert batch_sharding(mesh, batch_dim=1) == NamedSharding(mesh, PartitionSpec(None, "data"))
    with pytest.raises(
        vk.ConfigError, match=r"batch leaf \['y'\] has shape \(3,\) and has no batch dimension 1"
    ):
        shard_batch({"x": np.zeros((3, n, 2), np.float32), "y": np.zeros(3, np.int32)}, mesh, batch_dim=1)
    with pytest.raises(vk.ConfigError, match="batch_dim must be an int >= 0"):
        batch_sharding(mesh, batch_dim=-1)


def test_shard_batch_rejects_a_scalar_leaf_by_path():
    with pytest.raises(vk.ConfigError, match=r"batch leaf \['lr'\] is a scalar"):
        shard_batch({"x": np.zeros((4, 2), np.float32), "lr": np.float32(0.1)}, data_mesh())


def test_shard_batch_checks_the_mesh_before_transferring():
    with pytest.raises(vk.ConfigError, match="no axis 'data'"):
        shard_batch(np.zeros((4, 2), np.float32), data_mesh(axis="batch"))


def test_replicate_puts_params_and_optimizer_state_on_every_device():
    mesh = data_mesh()
    params = {"w": np.ones((3, 2), np.float32), "b": np.zeros((2,), np.float32)}
    opt_state = optax.adam(1e-3).init(params)
    params_r, opt_state_r = replicate((params, opt_state), mesh)
    for leaf in jax.tree.leaves((params_r, opt_state_r)):
        assert leaf.sharding == replicated(mesh)
    np.testing.assert_array_equal(np.asarray(params_r["w"]), params["w"])


def test_a_jitted_step_on_sharded_inputs_matches_the_plain_step():
    mesh = data_mesh()
    n = 4 * jax.device_count()
    x = np.linspace(-1, 1, n * 3, dtype=np.float32).reshape(n, 3)
    w = np.full((3, 2), 0.5, np.float32)
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
    step = jax.jit(jax.value_and_grad(loss))
    expected = step(w, x)
    got = step(replicate(w, mesh), shard_batch(x, mesh))
    for e, g in zip(expected, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6)


def test_no_backend_is_hard_coded():
    source = inspect.getsource(_sharding)
    assert not re.search(r"""["'](cpu|gpu|cuda|tpu|rocm)["']""", source, re.I)
    assert {d.platform for d in data_mesh().devices.flat} == {jax.default_backend()}


# ------------------------------------------------------------ subprocess: 1 vs 4 devices
def _env(devices: int, **extra: str) -> dict:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _result(scenario: str, where: str, returncode: int, stdout: str, stderr: str) -> dict:
    if returncode != 0:
        pytest.fail(f"{SCRIPT.name} {scenario} ({where}) exited {returncode}:\n{stderr[-5000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len("RESULT ") :])


def run_scenario(scenario: str, devices: int) -> dict:
    """Runs tests/_sharded_script.py SCENARIO in one process with ``devices`` forced host (CPU) devices."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), scenario],
        capture_output=True,
        text=True,
        env=_env(devices),
        cwd=ROOT,
        timeout=600,
    )
    return _result(scenario, f"{devices} devices", proc.returncode, proc.stdout, proc.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_multiprocess(processes: int, devices_per_process: int) -> list[dict]:
    """The 'multiprocess' scenario as one multi-controller run of ``processes`` local processes."""
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "multiprocess"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_env(
                devices_per_process,
                VJPKIT_COORDINATOR=coordinator,
                VJPKIT_NUM_PROCESSES=str(processes),
                VJPKIT_PROCESS_ID=str(i),
            ),
        )
        for i in range(processes)
    ]
    outputs = []
    deadline = time.monotonic() + 300
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for proc in procs:  # one failed process leaves the others waiting: end them
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [
        _result("multiprocess", f"process {i} of {processes}", proc.returncode, out, err)
        for i, (proc, (out, err)) in enumerate(zip(procs, outputs))
    ]


@pytest.fixture(scope="module")
def step_runs():
    """The 'step' scenario on 1 device and on 4 devices (each in its own process)."""
    return {1: run_scenario("step", 1), 4: run_scenario("step", 4)}


def assert_same_training(got: dict, expected: dict, what: str):
    assert got["params"].keys() == expected["params"].keys(), what
    for key in expected["params"]:
        np.testing.assert_allclose(
            got["params"][key], expected["params"][key], rtol=1e-5, atol=1e-7, err_msg=f"{what}: params {key}"
        )
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5, err_msg=f"{what}: losses")
    assert got["captured_keys"] == expected["captured_keys"] == ["act", "fc1", "fc2"], what
    assert len(got["norms"]) == len(expected["norms"]) == 5, what
    for step, (g, e) in enumerate(zip(got["norms"], expected["norms"])):
        assert g.keys() == e.keys(), what
        assert "['fc1'].grad_params['weight']" in e and "['fc2'].grad_output" in e
        for key in e:
            np.testing.assert_allclose(
                g[key], e[key], rtol=1e-5, err_msg=f"{what}: step {step} captured norm {key}"
            )


@pytest.mark.slow
def test_four_devices_really_shard_the_batch_and_replicate_the_params(step_runs):
    run = step_runs[4]
    for name in ("sharded", "sharded_in_shardings"):
        assert run[name]["devices"] == 4, name  # jax.device_count() in that process
        assert run[name]["input_devices"] == [4], name  # x.sharding spans all 4 devices
        assert run[name]["input_shard_rows"] == [8], name  # 32 rows / 4 devices
        assert run[name]["param_devices"] == [4], name
        assert run[name]["params_replicated"], name
    assert step_runs[1]["sharded"]["devices"] == 1
    assert step_runs[1]["sharded"]["input_devices"] == [1]


@pytest.mark.slow
def test_four_devices_give_the_params_and_captured_norms_of_one_device(step_runs):
    one_device = step_runs[1]["single"]
    for name in ("sharded", "sharded_in_shardings"):
        assert_same_training(step_runs[4][name], one_device, f"4-device {name} vs 1-device process")
        assert_same_training(step_runs[4][name], step_runs[4]["single"], f"4-device {name} vs unsharded")
    assert_same_training(step_runs[1]["sharded"], one_device, "1-device mesh vs no mesh")


@pytest.mark.slow
def test_batch_10_over_4_devices_raises_config_error():
    result = run_scenario("uneven", 4)
    assert result["devices"] == 4
    assert result["error"] == "ConfigError"
    assert "4 devices" in result["message"] and "batch size 10" in result["message"]
    assert "8 or 12" in result["message"]
    assert result["stacked_shard_shapes"] == [[3, 8, 4]]  # (steps, batch / 4 devices, features)


@pytest.mark.slow
def test_two_processes_of_two_devices_give_the_params_and_norms_of_one_device(step_runs):
    """The documented multi-host recipe, run as 2 local processes: initialize, data_mesh, local feed."""
    runs = run_multiprocess(processes=2, devices_per_process=2)
    assert [r["process_index"] for r in runs] == [0, 1]
    for run in runs:
        assert (run["processes"], run["devices"], run["local_devices"]) == (2, 4, 2)
        assert run["input_devices"] == [4]  # the global batch spans both processes' devices
        assert run["input_shard_rows"] == [8]
        assert run["params_replicated"]
        assert_same_training(run, step_runs[1]["single"], f"process {run['process_index']} vs 1 device")


@pytest.mark.slow
def test_fit_with_a_mesh_matches_one_device():
    """fit(mesh=data_mesh()) on 4 devices (scan_steps=2: stacked batches split on dim 1) vs 1 device."""
    one, four = run_scenario("fit", 1), run_scenario("fit", 4)
    assert four["devices"] == 4 and four["param_devices"] == [4]
    for key in one["params"]:
        np.testing.assert_allclose(four["params"][key], one["params"][key], rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-5)
    assert len(four["norms"]) == len(one["norms"]) == 5
    for g, e in zip(four["norms"], one["norms"]):
        for key in e:
            np.testing.assert_allclose(g[key], e[key], rtol=1e-5, err_msg=key)
