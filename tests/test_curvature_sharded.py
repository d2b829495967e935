"""vk.curvature on 4 host devices against 1 (subprocesses): tests/_curvature_sharded_script.py.

Each run checks, itself, that the statistics of a batch sharded over its devices equal those of
the batch on one device, and that per-shard statistics inside ``jax.shard_map`` averaged by the
K-FAC optimizer's ``axis_name`` give the whole batch's update (EKFAC's: the shards' statistics
combined by hand). Here the two runs' ``fit`` with
the K-FAC optimizer on a data mesh must agree.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tests.helpers import run_with_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_curvature_sharded_script.py"


def run(devices: int) -> dict:
    return run_with_devices(SCRIPT, devices)


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
    assert four["ekfac_shard_map"]["update_norm"] > 0  # each run checked EKFAC's sync itself
    np.testing.assert_allclose(four["fit"]["loss"], one["fit"]["loss"], rtol=1e-5)
    for a, b in zip(four["fit"]["params"], one["fit"]["params"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
