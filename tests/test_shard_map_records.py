"""Layer calls inside a ``jax.shard_map`` of the differentiated function get records (issue 33).

Runs tests/_shard_map_records_script.py in a subprocess with 4 forced host devices. The script
reports, per check, the largest absolute difference from its oracle (``jax.grad``, the plain
forward pass per shard, ``jax.vjp`` of the function at each layer's output, the records of
``vk.grad`` inside the shard_map body, the same hook on the function without shard_map); see its
docstring. Here each must be within float32 rounding, and the shapes and calls as documented:
one record per shard on a leading axis (after the axes of scans around it, before those inside).
"""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import assert_small, run_with_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_shard_map_records_script.py"
TOL = 1e-5  # values of order 1: float32 rounding of sums in another order


def _assert_small(diffs, where: str) -> None:
    assert_small(diffs, where, TOL)


@pytest.fixture(scope="module")
def run():
    return run_with_devices(SCRIPT, 4)


@pytest.mark.slow
def test_records_per_shard_eager_and_jitted(run):
    assert run["devices"] == 4
    for how in ("eager", "jit"):
        mlp = run["mlp"][how]
        assert mlp["keys"] == ["fc1", "fc2"]  # matched inside the shard_map body
        assert mlp["leading"] == {"fc1": [4], "fc2": [4]}  # one record per shard
        _assert_small(mlp["grads"], f"{how}/grads")  # == jax.grad
        _assert_small(mlp["per_shard"], f"{how}/per_shard")  # each shard's rows and cotangents
        _assert_small(mlp["grad_params"], f"{how}/grad_params")  # replicated params: jax.grad's
        _assert_small(mlp["as_inside_body"], f"{how}/as_inside_body")  # == vk.grad in the body


@pytest.mark.slow
def test_scan_inside_shard_map_stacks_shards_then_iterations(run):
    scan = run["scan"]
    assert scan["keys"] == ["blocks"]
    assert scan["shape"] == [4, 3, 4, 4]  # (shards, iterations, rows per shard, features)
    _assert_small({k: v for k, v in scan.items() if k not in ("keys", "shape")}, "scan")


@pytest.mark.slow
def test_shard_map_under_inner_jit_and_checkpoint(run):
    _assert_small(run["nested"], "nested")


@pytest.mark.slow
def test_hooks_state_host_and_reductions(run):
    hooks = run["hooks"]
    _assert_small(hooks["scale"], "scale")  # an in-graph rewrite: jax.grad halved below fc2
    assert hooks["state_leading"] == [4]  # each shard keeps its own hook state
    for step in range(2):
        _assert_small(hooks[f"ema_step{step}"], f"ema_step{step}")
        _assert_small(hooks[f"ema_state{step}"], f"ema_state{step}")
    # vk.on_host: once per step per layer call (backward order), the shards on the leading axis
    assert hooks["host_calls"] == ["fc2", "fc1", "fc2", "fc1"]
    _assert_small(hooks["host_values"], "host_values")
    _assert_small(hooks["norm"], "norm")  # reduce="norm": one norm per shard


@pytest.mark.slow
def test_whole_batch_statistics_refuse_shard_map_clearly(run):
    errors = run["errors"]
    assert errors["per_example"].startswith("ConfigError:") and "shard_map" in errors["per_example"]
    for key in ("curvature_loss_inside", "curvature_layers_inside"):
        assert errors[key].startswith("ConfigError:") and "axis_name=" in errors[key], errors[key]
    assert "['fc1', 'fc2']" in errors["curvature_layers_inside"]  # names the layer calls


@pytest.mark.slow
def test_explain_lists_the_shards(run):
    assert run["explain"] == [[4], [4]]


@pytest.mark.slow
def test_structures_inside_the_shard_map_body(run):
    cases = run["structures"]
    for name in ("cond", "vmap", "check_vma_false", "flax", "equinox"):
        if name not in cases:  # Flax or Equinox not installed
            continue
        case = cases[name]
        assert case["leading"] == [4] and case["layers"] >= 2, (name, case)  # every record per shard
        _assert_small(case["grads"], f"{name}/grads")
    _assert_small(cases["grad_of_grad"], "grad_of_grad")
