"""Plain-JAX matching on a mesh (issue 22, item 3): a batch sharded over 4 devices, and shard_map.

Runs tests/_plain_sharded_script.py in a subprocess with 4 forced host devices. The model is a
plain-jnp MLP (a nested dict of arrays, no vjpkit layers), so its layers ``fc1`` and ``fc2`` are
found by matching. The script reports, per check, the largest absolute difference from its
oracle: ``jax.grad`` by path, the plain forward pass and ``jax.vjp`` of the rest of the model
(see the script's docstring); here every one must be within float32 rounding.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import assert_small, run_with_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_plain_sharded_script.py"
TOL = 1e-5  # the values are of order 1: float32 rounding of sums in another order


def _run(devices: int) -> dict:
    return run_with_devices(SCRIPT, devices)


def _assert_small(diffs, where: str) -> None:
    assert_small(diffs, where, TOL)


@pytest.fixture(scope="module")
def run():
    return _run(4)


@pytest.mark.slow
def test_jit_on_a_batch_sharded_over_four_devices(run):
    assert run["devices"] == 4
    jit = run["jit"]
    assert jit["shards"] == 4  # the batch really is split over the devices
    assert jit["keys"] == ["fc1", "fc2"]  # both matched layers have records
    _assert_small(jit["value"], "value")
    _assert_small(jit["grads"], "grads")
    for name in ("fc1", "fc2"):
        # grad_params == jax.grad by path; input, output and grad_output are the global arrays,
        # equal to the plain forward pass and the hand-computed cotangent (jax.vjp)
        _assert_small(jit[name], name)


@pytest.mark.slow
def test_inside_shard_map_records_per_shard(run):
    sm = run["shard_map"]
    assert sm["shards"] == 4 and sm["keys"] == ["fc1", "fc2"]
    _assert_small(sm["grads"], "grads")  # == jax.grad inside the same shard_map
    for name in ("fc1", "fc2"):
        assert sm[name]["leading"] == 4  # one record per shard
        assert len(sm[name]["per_shard"]) == 4
        for k, shard in enumerate(sm[name]["per_shard"]):
            # the shard's own rows and cotangents; grad_params of the replicated params are
            # jax.grad's inside shard_map (summed over the shards)
            _assert_small(shard, f"{name}[{k}]")
