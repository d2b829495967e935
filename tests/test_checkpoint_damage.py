"""Checkpoints that survive damage, in the standard layout, and ``vk.train.restore``.

The newest checkpoint is damaged three ways (bytes changed, a data file truncated, a data file
missing); ``fit`` must warn naming the step and what is wrong, resume from the previous
complete checkpoint, and end bit-identical to an uninterrupted run. The reference run is the
same ``fit`` without checkpoints, which is a pure function of ``(params, data, seed)``.
"""

from __future__ import annotations

import os
import pathlib
import warnings

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn
from vjpkit.train._checkpoint import Checkpointer

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
    straight, _ = vk.train.fit(loss_fn, OPT, params, (x, y), batch_size=20, steps=30, hooks=HOOKS, seed=3)
    return (x, y), params, straight


def run(setup, directory, steps, **kwargs):
    data, params, _ = setup
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


def array_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The files holding the largest array data of a checkpoint: orbax's OCDBT data files of the
    largest size (each process writes one, and the merged store at the top holds a copy)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, sorted(str(p) for p in (step_dir / "state").rglob("*"))
    largest = max(p.stat().st_size for p in files)
    return [p for p in files if p.stat().st_size == largest]


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


@pytest.mark.parametrize("damage", [change_bytes, truncate, delete], ids=["changed", "truncated", "missing"])
def test_damaged_newest_checkpoint_resumes_from_previous_bit_identically(setup, tmp_path, damage):
    _, _, straight = setup
    run(setup, tmp_path, 20)
    assert Checkpointer(tmp_path).all_steps() == [10, 20]
    damage(tmp_path / "20")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, history = run(setup, tmp_path, 30)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    damaged = [m for m in messages if "checkpoint step 20" in m and "is damaged" in m]
    assert damaged, messages
    assert "Resuming from checkpoint step 10" in damaged[0]
    # changed bytes that still decompress fail the checksum (test below); here the bit lands in
    # a compressed block that no longer decodes, which orbax reports: either is named
    assert "does not match its checksum" in damaged[0] or "its arrays cannot be read" in damaged[0]
    assert history["step"][0] == 10  # resumed from the previous complete checkpoint
    leaves = jax.tree_util.tree_leaves_with_path(resumed)
    for (path, a), b in zip(leaves, jax.tree.leaves(straight)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    # the damaged one was moved aside, and the run saved steps 20 and 30 afresh
    assert (tmp_path / "damaged" / "20").is_dir()
    assert Checkpointer(tmp_path).all_steps() == [20, 30]


def test_every_checkpoint_damaged_is_an_error_that_deletes_nothing(setup, tmp_path):
    run(setup, tmp_path, 20, keep=2)
    change_bytes(tmp_path / "10")
    change_bytes(tmp_path / "20")
    with pytest.raises(vk.ConfigError, match=r"every checkpoint .* is damaged \(step 20: .*step 10: ") as err:
        run(setup, tmp_path, 30)
    assert "move the damaged step directories (10, 20)" in str(err.value)
    assert "delete this one" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "20"]


def test_restore_flags_changed_bytes_and_the_intact_round_trip(tmp_path):
    state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(3, np.float32)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        tree_allclose(ckpt.restore(state)[0], state, rtol=0, atol=0)
        change_bytes(tmp_path / "1")
        pattern = r"step 1 .*damaged: the array at state\['w'\] does not match its checksum"
        with pytest.raises(vk.train.CheckpointDamagedError, match=pattern) as err:
            ckpt.restore(state)
    assert err.value.step == 1 and err.value.path == str(tmp_path / "1")


def test_orbax_alone_restores_params_by_name(setup, tmp_path):
    _, params, _ = setup
    state, _ = run(setup, tmp_path, 10)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "10" / "state")
    assert sorted(restored) == ["hook_state", "nonfinite_step", "opt_state", "params", "rng", "step"]
    tree_allclose(restored["params"], jax.device_get(state.params), rtol=0, atol=0)
    assert int(restored["step"]) == 10
    assert sorted(restored["hook_state"]["fc1"]) == ["count", "mean", "var"]  # NamedTuple fields by name
    # sgd with momentum's state is (ScaleByTraceState(trace), EmptyState()): items by index, fields by name
    trace = jax.device_get(state.opt_state[0].trace)
    tree_allclose(restored["opt_state"]["0"]["trace"], trace, rtol=0, atol=0)


def test_vk_train_restore(setup, tmp_path):
    run(setup, tmp_path, 20)
    state = vk.train.restore(tmp_path)
    assert int(state["step"]) == 20
    ten = vk.train.restore(tmp_path, step=10)
    assert int(ten["step"]) == 10
    data, params, _ = setup
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
    assert Checkpointer(tmp_path).all_steps() == [10, 20, 30]
    other = tmp_path / "one"
    run(setup, other, 30, keep=1)
    assert Checkpointer(other).all_steps() == [30]
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
    (a Checkpointer, which writes, cleans such leftovers up when it opens the directory)."""
    Checkpointer(tmp_path).save(1, {"w": np.ones(3, np.float32)})
    in_progress = tmp_path / "2.orbax-checkpoint-tmp-1700000000000000"
    in_progress.mkdir()
    (in_progress / "part").write_text("being written")
    assert int(np.asarray(vk.train.restore(tmp_path)["w"]).sum()) == 3
    assert in_progress.is_dir()
    Checkpointer(tmp_path).close()
    assert not in_progress.exists()
