"""Checkpoints that survive damage, in the standard layout, and ``vk.train.restore``.

The newest checkpoint is damaged three ways (bytes changed, a data file truncated, a data file
missing); ``fit`` must warn naming the step and what is wrong, resume from the previous
complete checkpoint, and end bit-identical to an uninterrupted run. The runs are separate
processes (``tests/_resume_script.py``), as a restart after damage is; the reference is the same
run without checkpoints, which is a pure function of ``(params, data, seed)``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn
from vjpkit.train._checkpoint import Checkpointer

SCRIPT = pathlib.Path(__file__).resolve().parent / "_resume_script.py"

model = nn.serial(fc1=nn.dense(16), act=nn.tanh(), fc2=nn.dense(2))
OPT = optax.sgd(0.1, momentum=0.9)
HOOKS = {"fc1": vk.ema_normalize(0.9)}


def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(200, 3)).astype(np.float32)
    y = (x.sum(axis=1) > 1.5).astype(np.int32)
    params = model.init(jax.random.key(0), x[:2])
    return (x, y), params


def run(setup, directory, steps, **kwargs):
    data, params = setup
    return vk.train.fit(
        loss_fn,
        OPT,
        params,
        data,
        batch_size=20,
        steps=steps,
        hooks=HOOKS,
        seed=3,
        checkpoint_dir=str(directory),
        checkpoint_every=10,
        **kwargs,
    )


def steps_in(directory) -> list[int]:
    with Checkpointer(directory) as ckpt:  # closed: orbax's manager holds threads and a loop
        return ckpt.all_steps()


def array_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The largest data file of each of a checkpoint's OCDBT data directories: each process
    writes a store of its own, and orbax merges them into one at the top; whichever a read
    goes through, it meets a damaged file."""
    stores = sorted(
        {p.parent for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"}
    )
    assert stores, sorted(str(p) for p in (step_dir / "state").rglob("*"))
    return [max((p for p in d.iterdir() if p.is_file()), key=lambda p: p.stat().st_size) for d in stores]


def change_bytes(step_dir):
    # One bit in the middle of the compressed array data: the file still decodes, to other values,
    # so only the checksum can tell.
    for path in array_files(step_dir):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))


def truncate(step_dir):
    for path in array_files(step_dir):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete(step_dir):
    for path in array_files(step_dir):
        path.unlink()


def script(ckpt: str, out: pathlib.Path, steps: int) -> subprocess.CompletedProcess:
    """``tests/_resume_script.py``: a fit run (dropout, an ema_normalize hook, adam), checkpoints
    every 4 steps, final state to ``out``. A fresh process, as a restart after damage is: in
    the writing process orbax's OCDBT cache can serve the checkpoint from memory."""
    env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1]), JAX_PLATFORMS="cpu")
    env.update(  # the runs compile the same programs: share this session's compilation cache
        JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    cmd = [sys.executable, str(SCRIPT), ckpt, str(out), str(steps), "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def load(path: pathlib.Path) -> list:
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "straight.npz"
    script("-", out, 12)
    return load(out)


@pytest.mark.slow
@pytest.mark.parametrize("damage", [change_bytes, truncate, delete], ids=["changed", "truncated", "missing"])
def test_damaged_newest_checkpoint_resumes_from_previous_bit_identically(uninterrupted, tmp_path, damage):
    ckpt = tmp_path / "ckpt"
    script(str(ckpt), tmp_path / "first.npz", 8)
    assert steps_in(ckpt) == [4, 8]
    damage(ckpt / "8")
    resumed = script(str(ckpt), tmp_path / "resumed.npz", 12)
    warned = [line for line in resumed.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1, resumed.stderr[-3000:]
    assert "checkpoint step 8" in warned[0] and "is damaged" in warned[0]
    assert "Resuming from checkpoint step 4, the newest intact one" in warned[0]
    # changed bytes that still decompress fail the checksum (test below); here the bit may land
    # in a compressed block that no longer decodes, which orbax reports: either is named
    assert "does not match its checksum" in warned[0] or "its arrays cannot be read" in warned[0]
    for a, b in zip(load(tmp_path / "resumed.npz"), uninterrupted, strict=True):
        np.testing.assert_array_equal(a, b)  # bit-identical, including rng, step and hook state
    # the damaged one was moved aside, and the run saved steps 8 and 12 afresh
    assert (ckpt / "damaged" / "8").is_dir()
    assert steps_in(ckpt) == [8, 12]


def test_every_checkpoint_damaged_is_an_error_that_deletes_nothing(setup, tmp_path):
    run(setup, tmp_path, 20, keep=2)
    change_bytes(tmp_path / "10")
    change_bytes(tmp_path / "20")
    with pytest.raises(vk.ConfigError, match=r"every checkpoint .* is damaged \(step 20: .*step 10: ") as err:
        run(setup, tmp_path, 30)
    assert "move the damaged step directories (10, 20)" in str(err.value)
    assert "delete this one" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "20"]


def test_changed_array_bytes_fail_the_checksum(tmp_path):
    """A bit flipped in an array's compressed data still decodes, to other values: only the
    checksum can tell. (Orbax's b-tree nodes carry a CRC of their own.)"""
    state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(3, np.float32)}
    with Checkpointer(tmp_path / "clean") as ckpt:
        ckpt.save(1, state)
        tree_allclose(ckpt.restore(state)[0], state, rtol=0, atol=0)
    with Checkpointer(tmp_path / "hit") as ckpt:
        ckpt.save(1, state)
        files = [p for p in (tmp_path / "hit" / "1" / "state").rglob("*") if p.parent.name == "d"]
        largest = max(p.stat().st_size for p in files)
        for path in files:  # w's data: the largest file, in each store that holds a copy
            if path.stat().st_size == largest:
                raw = bytearray(path.read_bytes())
                raw[len(raw) // 2] ^= 0x01
                path.write_bytes(bytes(raw))
        pattern = r"step 1 .*damaged: the array at state\['w'\] does not match its checksum"
        with pytest.raises(vk.train.CheckpointDamagedError, match=pattern) as err:
            ckpt.restore(state)
    assert err.value.step == 1 and err.value.path == str(tmp_path / "hit" / "1")


def test_orbax_alone_restores_params_by_name(setup, tmp_path):
    _, params = setup
    state, _ = run(setup, tmp_path, 10)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "10" / "state")
    assert sorted(restored) == ["hook_state", "nonfinite_step", "opt_state", "params", "rng", "step"]
    tree_allclose(restored["params"], jax.device_get(state.params), rtol=0, atol=0)
    assert int(restored["step"]) == 10
    # a vk.HookState: the layers' states under "layers", NamedTuple fields by name
    assert sorted(restored["hook_state"]["layers"]["fc1"]) == ["count", "mean", "var"]
    # sgd with momentum's state is (ScaleByTraceState(trace), EmptyState()): items by index, fields by name
    trace = jax.device_get(state.opt_state[0].trace)
    tree_allclose(restored["opt_state"]["0"]["trace"], trace, rtol=0, atol=0)


def test_vk_train_restore(setup, tmp_path):
    run(setup, tmp_path, 20)
    state = vk.train.restore(tmp_path)
    assert int(state["step"]) == 20
    ten = vk.train.restore(tmp_path, step=10)
    assert int(ten["step"]) == 10
    data, params = setup
    first, _ = vk.train.fit(loss_fn, OPT, params, data, batch_size=20, steps=10, hooks=HOOKS, seed=3)
    tree_allclose(ten["params"], jax.device_get(first.params), rtol=0, atol=0)
    typed = vk.train.restore(tmp_path, step=10, target=first)
    assert type(typed) is vk.train.TrainState
    tree_allclose(typed, first, rtol=0, atol=0)
    # the newest damaged: step=None falls back with a warning and leaves the files alone
    change_bytes(tmp_path / "20")
    with pytest.warns(RuntimeWarning, match=r"checkpoint step 20 .* damaged.*Restored step 10"):
        assert int(vk.train.restore(tmp_path)["step"]) == 10
    with pytest.raises(vk.train.CheckpointDamagedError, match="step 20"):
        vk.train.restore(tmp_path, step=20)
    assert (tmp_path / "20").is_dir()
    with pytest.raises(vk.ConfigError, match="no checkpoint step 7"):
        vk.train.restore(tmp_path, step=7)
    with pytest.raises(vk.ConfigError, match="no checkpoint directory"):
        vk.train.restore(tmp_path / "nowhere")


def test_keep_option(setup, tmp_path):
    run(setup, tmp_path, 30, keep=3)
    assert steps_in(tmp_path) == [10, 20, 30]
    other = tmp_path / "one"
    run(setup, other, 30, keep=1)
    assert steps_in(other) == [30]
    with pytest.raises(vk.ConfigError, match="keep must be a positive int"):
        run(setup, tmp_path / "bad", 10, keep=0)


def test_keys_with_dots_and_slashes_stay_distinct(tmp_path):
    state = {"a.b": np.zeros(2, np.float32), "a": {"b": np.ones(2, np.float32)}, "x/y": np.full(2, 2.0)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state)
        tree_allclose(ckpt.restore(state)[0], state, rtol=0, atol=0)
    restored = vk.train.restore(tmp_path)
    assert sorted(restored) == ["a", "a%2Eb", "x%2Fy"]
    assert os.path.isdir(tmp_path / "0" / "state")


def test_restore_leaves_a_save_in_progress_alone(tmp_path):
    """A reader must not remove the temporary directory of another process's save in progress
    (a Checkpointer, which writes, lets orbax clean such leftovers up when it opens the directory)."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": np.ones(3, np.float32)})
    in_progress = tmp_path / "2.orbax-checkpoint-tmp-1700000000000000"
    in_progress.mkdir()
    (in_progress / "part").write_text("being written")
    assert int(np.asarray(vk.train.restore(tmp_path)["w"]).sum()) == 3
    assert in_progress.is_dir()
