"""vk.curvature on 4 host devices against 1 (subprocesses): tests/_curvature_sharded_script.py.

Each run checks, itself, that the statistics of a batch sharded over its devices equal those of
the batch on one device, and that per-shard statistics inside ``jax.shard_map`` averaged by the
K-FAC optimizer's ``axis_name`` give the whole batch's update. Here the two runs' ``fit`` with
the K-FAC optimizer on a data mesh must agree.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_curvature_sharded_script.py"


def run(devices: int) -> dict:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def runs():
    return {n: run(n) for n in (1, 4)}


@pytest.mark.slow
def test_statistics_and_kfac_agree_on_1_and_4_devices(runs):
    one, four = runs[1], runs[4]
    assert (one["devices"], four["devices"]) == (1, 4)
    assert one["sharded"]["layers"] == four["sharded"]["layers"] == ["fc1", "fc2"]
    np.testing.assert_allclose(four["sharded"]["loss"], one["sharded"]["loss"], rtol=1e-6)
    np.testing.assert_allclose(four["shard_map"]["update_norm"], one["shard_map"]["update_norm"], rtol=1e-5)
    np.testing.assert_allclose(four["fit"]["loss"], one["fit"]["loss"], rtol=1e-5)
    for a, b in zip(four["fit"]["params"], one["fit"]["params"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
