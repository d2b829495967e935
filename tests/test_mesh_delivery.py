"""Host delivery on a mesh: once per layer call per step, whatever the number of devices.

Runs tests/_mesh_script.py in a subprocess with 4 forced host devices and with 1, and compares
the delivery counts of every path (``vk.on_host`` hooks, ``every=N`` in the graph, capture
``host=``, ``fit`` hooks and ``on_records``) with the single-device run and with the number of
steps. Inside ``jax.shard_map`` a hooked ``vk.grad`` gives per-shard records. Inside ``jax.pmap``
each device runs its own program on its shard, so each device delivers its own records, once per
layer call per step: every delivery is matched against its shard's oracle (the shard's rows, the
plain forward pass and ``jax.grad`` of the plain loss on them).
"""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import run_with_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_mesh_script.py"


def _run(devices: int) -> dict:
    return run_with_devices(SCRIPT, devices)


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


def _by_shard(deliveries) -> list:
    return sorted([name, shard] for name, shard, _ in deliveries)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pmap", "jit_pmap"])
def test_pmap_on_host_runs_once_per_device_per_layer_call_per_step(runs, how):
    for run in runs.values():
        pm, n = run["pmap"], run["devices"]
        assert pm["shards"] == n
        everyone = sorted([name, k] for k in range(n) for name in ("fc1", "fc2"))
        steps = pm[f"{how}_on_host"]
        assert len(steps) == 2
        for deliveries in steps:
            # each device's own records, once each: its shard's input and jax.grad on its shard
            assert _by_shard(deliveries) == everyone
            # one device's records arrive together, in backward order, from the thread running it
            per_thread = {}
            for name, shard, thread in deliveries:
                per_thread.setdefault(thread, []).append([name, shard])
            for seq in per_thread.values():
                assert [name for name, _ in seq] == ["fc2", "fc1"] * (len(seq) // 2)
                assert all(seq[i][1] == seq[i + 1][1] for i in range(0, len(seq), 2))
        assert pm[f"{how}_losses"] == [True, True]  # each device's value: its shard's loss
        assert pm[f"{how}_grads_equal"]  # pmean of the shards' gradients == jax.grad on the batch


@pytest.mark.slow
def test_pmap_every_n_with_hook_state_counts_steps_on_each_device(runs):
    for run in runs.values():
        n = run["devices"]
        shards = [str(k) for k in range(n)]
        assert run["pmap"]["every2_state"] == [shards, [], shards, []]  # steps 1 and 3 of 4
        assert run["pmap"]["every2_state_counter"] == [[4.0] * n]  # one counter per device


@pytest.mark.slow
def test_pmap_every_n_counted_on_the_host_one_device(runs):
    assert runs[1]["pmap"]["every2_host"] == [["0"], [], ["0"], []]


@pytest.mark.slow
def test_pmap_every_n_counted_on_the_host_counts_steps(runs):
    # without hook_state the host keeps one count per device: all four deliver on steps 1 and 3
    shards = [str(k) for k in range(4)]
    assert runs[4]["pmap"]["every2_host"] == [shards, [], shards, []]


@pytest.mark.slow
def test_shard_map_every_n_counted_on_the_host_counts_steps_on_each_device(runs):
    for run in runs.values():
        shards = [str(k) for k in range(run["devices"])]
        assert run["shard_map_every2_host"] == [shards, [], shards, []]  # steps 1 and 3 of 4


@pytest.mark.slow
def test_pmap_capture_host_delivers_each_devices_records(runs):
    for run in runs.values():
        n = run["devices"]
        one_per_device = [[["fc1", k], ["fc2", k]] for k in range(n)]
        assert run["pmap"]["capture_host"] == [one_per_device] * 2
        # the records returned out of pmap stack the devices on axis 0, in pmap order
        assert run["pmap"]["capture_returned"] == {"fc1": list(range(n)), "fc2": list(range(n))}
