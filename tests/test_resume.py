"""Checkpoint and resume in fit: a SIGKILLed run resumes to bit-identical parameters."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import tree_allclose
from vjpkit import nn
from vjpkit.train._checkpoint import Checkpointer  # fit imports it lazily: not an attribute before

SCRIPT = pathlib.Path(__file__).resolve().parent / "_resume_script.py"
STEPS = 40


def run(ckpt: str, out: pathlib.Path, slow: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1]), JAX_PLATFORMS="cpu")
    # The three runs compile the same programs: they share this session's compilation cache (conftest.py).
    env.update(
        JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    cmd = [sys.executable, str(SCRIPT), ckpt, str(out), str(STEPS), "1" if slow else "0"]
    # stderr goes to a file, not a pipe nobody reads while waiting: a pipe's buffer (64 KB) that
    # fills with warnings blocks the script, and the wait below would time out instead
    err = open(out.with_suffix(".stderr.txt"), "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    err.close()  # the child has its own descriptor
    return proc


def finished(proc: subprocess.Popen) -> int:
    """Waits for ``proc``, reading its stdout as it goes; its return code."""
    proc.communicate(timeout=300)
    return proc.returncode


def stderr_of(out: pathlib.Path) -> str:
    return out.with_suffix(".stderr.txt").read_text()


def load(path: pathlib.Path) -> list:
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    reference = tmp_path / "reference.npz"
    assert finished(run("-", reference)) == 0, stderr_of(reference)

    ckpt = tmp_path / "ckpt"
    proc = run(str(ckpt), tmp_path / "killed.npz", slow=True)
    kill_after = random.Random().randint(6, STEPS - 8)
    for _ in range(kill_after):  # wait for that many steps, then kill without warning
        assert proc.stdout.readline().startswith("step")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    saved = Checkpointer(ckpt).latest_step()
    assert saved is not None and saved < STEPS

    resumed = tmp_path / "resumed.npz"
    assert finished(run(str(ckpt), resumed)) == 0, stderr_of(resumed)
    for a, b in zip(load(resumed), load(reference), strict=True):
        np.testing.assert_array_equal(a, b)  # bit-identical, including rng, step and hook state


def test_checkpoint_dir_of_another_model_is_refused_before_compiling(tmp_path):
    x = np.ones((20, 3), np.float32)
    y = np.zeros((20,), np.int32)

    def make(width):
        model = nn.serial(fc1=nn.dense(width), fc2=nn.dense(2))
        params = model.init(jax.random.key(0), x[:2])
        loss = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, b[0]), b[1]).mean()
        return loss, params

    loss, params = make(4)
    state, _ = vk.train.fit(
        loss, optax.sgd(0.1), params, (x, y), batch_size=10, steps=3, checkpoint_dir=tmp_path
    )
    again, history = vk.train.fit(
        loss, optax.sgd(0.1), params, (x, y), batch_size=10, steps=5, checkpoint_dir=tmp_path
    )
    assert history["step"] == [3, 4]  # resumed at the saved step
    assert int(again.step) == 5
    other_loss, other_params = make(5)
    with pytest.raises(vk.ConfigError, match=r"another model's state.*\['fc1'\]\['bias'\].*\(5,\).*\(4,\)"):
        vk.train.fit(
            other_loss, optax.sgd(0.1), other_params, (x, y), batch_size=10, steps=5, checkpoint_dir=tmp_path
        )
    done, _ = vk.train.fit(
        loss, optax.sgd(0.1), params, (x, y), batch_size=10, steps=5, checkpoint_dir=tmp_path
    )
    tree_allclose(done.params, again.params, rtol=0, atol=0)  # already finished: restored, nothing to do
