"""Host delivery on a mesh: once per layer call per step, whatever the number of devices.

Runs tests/_mesh_script.py in a subprocess with 4 forced host devices and with 1, and compares
the delivery counts of every path (``vk.on_host`` hooks, ``every=N`` in the graph, capture
``host=``, ``fit`` hooks and ``on_records``) with the single-device run and with the number of
steps. Inside ``jax.shard_map`` a hooked ``vk.grad`` gives per-shard records.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_mesh_script.py"


def _run(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def runs():
    return {1: _run(1), 4: _run(4)}


@pytest.mark.slow
def test_on_host_runs_once_per_layer_call_per_step(runs):
    one, four = runs[1], runs[4]
    assert four["devices"] == 4 and one["devices"] == 1
    # 2 steps x 2 layers, in backward order, each the global array (batch 16), not a shard
    assert four["on_host"] == [["fc2", [16, 8]], ["fc1", [16, 4]]] * 2
    assert four["on_host"] == one["on_host"]
    assert four["grads_equal"] and one["grads_equal"]


@pytest.mark.slow
def test_every_n_counts_steps_not_devices(runs):
    for run in runs.values():
        assert run["every2_calls"] == 2  # steps 1 and 3 of 4
        assert run["every2_counter"] == [4.0]


@pytest.mark.slow
def test_capture_host_and_fit_deliver_once_per_step(runs):
    for run in runs.values():
        assert run["capture_host"] == [["fc1", "fc2"]] * 2
        assert run["fit_hooks"] == [[16, 8]] * 2
        assert run["fit_records"] == [0, 1]


@pytest.mark.slow
def test_shard_map_gives_per_shard_records(runs):
    # one record per shard: (shards, in, out) for fc1's weight, never an empty dict
    assert runs[4]["shard_map"] == {"fc1": [4, 4, 8]}
    assert runs[1]["shard_map"] == {"fc1": [1, 4, 8]}
