"""Unit tests of vjpkit.train._checkpoint: round trips, pruning, mismatch errors, atomicity."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.helpers import tree_allclose
from vjpkit._errors import ConfigError
from vjpkit.train._checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    hook_state: Any
    step: jax.Array
    rng: jax.Array


def make_state(seed: int = 0, width: int = 4, dtype=jnp.float32) -> TrainState:
    """A TrainState after two adamw updates, so every leaf holds non-trivial values."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "fc1": {"weight": jax.random.normal(k1, (3, width), dtype), "bias": jnp.zeros((width,), dtype)},
        "fc2": {"weight": jax.random.normal(k2, (width, 2), dtype), "bias": jnp.ones((2,), dtype)},
    }
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt_state = opt.init(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic is not strict-clean
        for i in range(2):
            grads = jax.tree.map(lambda p, i=i: jnp.sin(p + jnp.asarray(i, p.dtype)), params)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    hook_state = {
        "ema": {"fc1": {"mean": jax.random.normal(k3, (width,)), "count": jnp.float32(7.0)}},
        "block1/fc1": {"var": jnp.arange(3, dtype=jnp.float32)},
    }
    return TrainState(params, opt_state, hook_state, jnp.int32(12), jax.random.PRNGKey(seed + 100))


def zeros_like_state(state):
    return jax.tree.map(jnp.zeros_like, state)


def test_round_trip_is_bit_identical(tmp_path):
    state = make_state()
    meta = {"epoch": 3, "index": 40, "seed": 0, "name": "run", "lr": 0.5, "pos": (1, 2)}
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() is None
    assert ckpt.save(12, state, meta) is True
    assert ckpt.latest_step() == 12
    restored, got_meta = ckpt.restore(zeros_like_state(state))
    tree_allclose(restored, state, rtol=0, atol=0)
    assert type(restored) is TrainState
    assert type(restored.opt_state[1][0]) is type(state.opt_state[1][0])  # optax ScaleByAdamState
    assert restored.rng.dtype == jnp.uint32 and restored.step.dtype == jnp.int32
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(restored))
    assert restored.params["fc1"]["weight"].devices() == {jax.devices()[0]}
    assert got_meta == {**meta, "pos": [1, 2]}  # JSON: tuples come back as lists


def test_restore_into_abstract_target_and_other_leaf_kinds(tmp_path):
    state = {
        "x": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
        "np": np.arange(4, dtype=np.int16),
        "key": jax.random.key(5),
        "keys": jax.random.split(jax.random.key(6), 3),
        "empty": (),
        "none": None,
    }
    ckpt = Checkpointer(tmp_path)
    ckpt.save(0, state, {})
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    restored, meta = ckpt.restore(abstract)
    assert meta == {}
    assert isinstance(restored["np"], jax.Array)  # ShapeDtypeStruct targets give jax arrays
    restored2, _ = ckpt.restore(state)
    assert isinstance(restored2["np"], np.ndarray)  # numpy targets give numpy
    for r in (restored, restored2):
        assert r["empty"] == () and r["none"] is None
        tree_allclose(jax.random.key_data(r["keys"]), jax.random.key_data(state["keys"]), rtol=0, atol=0)
        tree_allclose(jax.random.key_data(r["key"]), jax.random.key_data(state["key"]), rtol=0, atol=0)
        plain = {k: r[k] for k in ("x", "np")}
        tree_allclose(
            jax.tree.map(np.asarray, plain), {k: np.asarray(state[k]) for k in plain}, rtol=0, atol=0
        )


def test_empty_state(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, {}, {"a": 1})
    assert ckpt.restore({}) == ({}, {"a": 1})


def test_latest_step_steps_and_keep(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    states = {s: make_state(seed=s) for s in (1, 2, 5, 9)}
    for s, st in states.items():
        ckpt.save(s, st, {"s": s})
        assert ckpt.latest_step() == s
    assert ckpt.all_steps() == [5, 9]
    assert sorted(os.listdir(tmp_path)) == ["5", "9"]
    other = Checkpointer(tmp_path, keep=2)  # a fresh process's view
    assert other.latest_step() == 9
    for s in (5, 9):
        restored, meta = other.restore(zeros_like_state(states[s]), step=s)
        tree_allclose(restored, states[s], rtol=0, atol=0)
        assert meta == {"s": s}


def test_save_existing_step_is_kept_and_older_step_refused(tmp_path):
    ckpt = Checkpointer(tmp_path)
    first = make_state(seed=1)
    assert ckpt.save(4, first, {"v": 1})
    assert ckpt.save(4, make_state(seed=2), {"v": 2}) is False
    restored, meta = ckpt.restore(first)
    tree_allclose(restored, first, rtol=0, atol=0)
    assert meta == {"v": 1}
    with pytest.raises(ConfigError, match=r"step 3 .* newer step 4"):
        ckpt.save(3, first, {})


@pytest.mark.parametrize(
    "bad, message",
    [
        (-1, "step must be an int >= 0"),
        (1.5, "step must be an int >= 0"),
        (True, "step must be an int >= 0"),
    ],
)
def test_bad_step(tmp_path, bad, message):
    with pytest.raises(ConfigError, match=message):
        Checkpointer(tmp_path).save(bad, {"a": jnp.zeros(2)}, {})


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="keep must be an int >= 1"):
        Checkpointer(tmp_path, keep=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        Checkpointer(tmp_path / "file")
    ckpt = Checkpointer(tmp_path / "c")
    with pytest.raises(ConfigError, match="JSON-serialisable"):
        ckpt.save(0, {"a": jnp.zeros(2)}, {"x": jnp.zeros(2)})
    with pytest.raises(ConfigError, match="must be a dict"):
        ckpt.save(0, {"a": jnp.zeros(2)}, [1])
    assert ckpt.latest_step() is None  # nothing was written
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        ckpt.restore({"a": jnp.zeros(2)})
    ckpt.save(0, {"a": jnp.zeros(2)}, {})
    with pytest.raises(ConfigError, match=r"no checkpoint step 7 .* \[0\]"):
        ckpt.restore({"a": jnp.zeros(2)}, step=7)


def _replace_leaf(state: TrainState, value) -> TrainState:
    return state._replace(params={**state.params, "fc1": {**state.params["fc1"], "weight": value}})


@pytest.mark.parametrize(
    "change, pattern",
    [
        (
            lambda s: _replace_leaf(s, jnp.zeros((3, 5), jnp.float32)),
            r"at state\.params\['fc1'\]\['weight'\] the target expects shape \(3, 5\) dtype float32 "
            r"but the checkpoint has shape \(3, 4\) dtype float32",
        ),
        (
            lambda s: _replace_leaf(s, jnp.zeros((3, 4), jnp.bfloat16)),
            r"at state\.params\['fc1'\]\['weight'\] the target expects shape \(3, 4\) dtype bfloat16 "
            r"but the checkpoint has shape \(3, 4\) dtype float32",
        ),
        (
            lambda s: s._replace(rng=jax.random.key(0)),
            r"at state\.rng the target expects shape \(\) dtype key<fry> but the checkpoint has "
            r"shape \(2,\) dtype uint32",
        ),
        (
            lambda s: s._replace(params={**s.params, "fc3": {"weight": jnp.zeros((2, 2))}}),
            r"the target has a leaf at state\.params\['fc3'\]\['weight'\] \(shape \(2, 2\) dtype float32\) "
            r"that the checkpoint lacks",
        ),
        (
            lambda s: s._replace(hook_state={}),
            r"it has a leaf at state\.hook_state\['block1/fc1'\]\['var'\] \(shape \(3,\) dtype float32\) "
            r"that the target lacks",
        ),
        (
            lambda s: s._replace(opt_state=optax.sgd(0.1).init(s.params)),
            r"holds another model's state: it has a leaf at state\.opt_state",
        ),
    ],
    ids=["shape", "dtype", "key-kind", "extra-in-target", "missing-in-target", "other-optimizer"],
)
def test_mismatched_tree_is_a_clear_error(tmp_path, change, pattern):
    state = make_state()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state, {})
    with pytest.raises(ConfigError, match=pattern) as info:
        ckpt.restore(change(state))
    message = str(info.value)
    assert f"checkpoint step 1 in {tmp_path}" in message
    assert "Use another checkpoint_dir, or delete this one" in message


def test_non_vjpkit_checkpoint_is_refused(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path, item_names=("tree",)) as mngr:
        mngr.save(1, args=ocp.args.Composite(tree=ocp.args.JsonSave({"hello": 1})))
        mngr.wait_until_finished()
    with pytest.raises(ConfigError, match="not a vjpkit checkpoint"):
        Checkpointer(tmp_path).restore({"a": jnp.zeros(2)})


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from vjpkit.train._checkpoint import Checkpointer

    def big_state(step):
        rng = np.random.default_rng(step)
        return {f"w{i}": rng.standard_normal((512, 4096), dtype=np.float32) for i in range(8)}

    ckpt = Checkpointer(sys.argv[1], keep=2)
    for step in (1, 2):
        state = big_state(step)
        t = time.perf_counter()
        ckpt.save(step, state, {"step": step})
        print("saved", step, time.perf_counter() - t, flush=True)
    state = big_state(3)
    print("saving 3", flush=True)
    ckpt.save(3, state, {"step": 3})
    print("saved 3", flush=True)
    time.sleep(60)
    """
)


def _big_state(step):
    rng = np.random.default_rng(step)
    return {f"w{i}": rng.standard_normal((512, 4096), dtype=np.float32) for i in range(8)}


@pytest.mark.slow
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    """SIGKILL during a 64 MB save: latest_step() is the last complete one and restores exactly."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rnd = random.Random(0)
    interrupted = 0
    for trial in range(4):
        directory = tmp_path / f"run{trial}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILL_SCRIPT, str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            save_seconds = None
            for line in proc.stdout:
                if line.startswith("saved 2"):
                    save_seconds = float(line.split()[2])
                if line.startswith("saving 3"):
                    break
            assert save_seconds is not None, "the child did not reach step 3"
            time.sleep(rnd.uniform(0.0, 0.8) * save_seconds)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        ckpt = Checkpointer(directory, keep=2)
        latest = ckpt.latest_step()
        assert latest in (2, 3)
        interrupted += latest == 2
        expected = _big_state(latest)
        restored, meta = ckpt.restore(jax.tree.map(np.zeros_like, expected))
        assert meta == {"step": latest}
        tree_allclose(restored, expected, rtol=0, atol=0)
        # The directory stays usable, even for the step whose save was interrupted (as on resume).
        small = {"w": np.arange(3, dtype=np.float32)}
        assert ckpt.save(latest + 1, small, {"step": latest + 1})
        assert ckpt.latest_step() == latest + 1
        tree_allclose(Checkpointer(directory).restore(small)[0], small, rtol=0, atol=0)
        ckpt.close()
    assert interrupted >= 1, "no trial was killed mid-save; the test did not exercise atomicity"


_RESHARD_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from vjpkit.train._checkpoint import Checkpointer

    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("data",))
    target = {
        "replicated": jax.device_put(jnp.zeros((4, 3)), NamedSharding(mesh, P())),
        "sharded": jax.device_put(jnp.zeros((4, 3)), NamedSharding(mesh, P("data"))),
        "rng": jnp.zeros((2,), jnp.uint32),
    }
    state, meta = Checkpointer(sys.argv[1]).restore(target)
    for name in ("replicated", "sharded"):
        assert state[name].sharding == target[name].sharding, (name, state[name].sharding)
    print(meta["tag"], *(np.asarray(state[k]).tobytes().hex() for k in sorted(state)))
    """
)


def test_restore_onto_another_device_count(tmp_path):
    """Saved on one device, restored onto a 4-device mesh with the target's shardings."""
    state = {
        "replicated": jnp.arange(12, dtype=jnp.float32).reshape(4, 3),
        "sharded": -jnp.arange(12, dtype=jnp.float32).reshape(4, 3),
        "rng": jax.random.PRNGKey(3),
    }
    Checkpointer(tmp_path).save(5, state, {"tag": "ok"})
    env = {
        **os.environ,
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", _RESHARD_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    expected = ["ok", *(np.asarray(state[k]).tobytes().hex() for k in sorted(state))]
    assert out.stdout.split() == expected
