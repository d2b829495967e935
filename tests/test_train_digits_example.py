"""The training demo: its captured norms and params against a hand-written loop, its table, resume.

The reference loop never uses ``fit`` nor ``capture``: a jitted ``vk.value_and_grad`` step with
the example's hooks, the hook state threaded by hand, optax SGD, over the batches ``fit`` draws
for array data (``ArrayBatches(data, batch_size, seed=seed).batch(t)``). The norms it expects are
``np.linalg.norm`` of the gradients that step returns, which are the gradients after the hooks
ran, so the check also pins down that capture sees the record after the hooks.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import load_example, tree_allclose
from vjpkit.train._data import ArrayBatches

pytest.importorskip("sklearn", reason='the digits examples need scikit-learn: pip install -e ".[examples]"')

FIRST, TOTAL = 6, 10  # the first run stops at FIRST; the resumed one goes on to TOTAL
BATCH, LR, SEED = 32, 0.01, 3


def run(module, steps: int, directory: pathlib.Path, *extra: str) -> dict:
    argv = ["--steps", str(steps), "--batch-size", str(BATCH), "--lr", str(LR), "--seed", str(SEED)]
    argv += ["--checkpoint-dir", str(directory), "--checkpoint-every", "3", "--eval-every", "3"]
    argv += ["--no-progress", *extra]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = module.main(argv)
    return dict(out, printed=printed.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    td = load_example("train_digits")
    resumed_dir = tmp_path_factory.mktemp("resumed")
    first = run(td, FIRST, resumed_dir)
    resumed = run(td, TOTAL, resumed_dir)
    straight = run(td, TOTAL, tmp_path_factory.mktemp("straight"))
    scanned = run(td, TOTAL, tmp_path_factory.mktemp("scanned"), "--scan-steps", "4")
    return td, {"first": first, "resumed": resumed, "straight": straight, "scanned": scanned}


@pytest.fixture(scope="module")
def reference(runs):
    """TOTAL steps by hand: params before each step, losses and post-hook gradient norms."""
    td, _ = runs
    (x_train, y_train), _ = td.load_data()
    params = td.model.init(jax.random.key(SEED), x_train[:BATCH])
    batches = ArrayBatches((x_train, y_train), BATCH, seed=SEED)
    grad_fn = vk.value_and_grad(td.loss_fn, hooks=td.hooks())
    hook_state = vk.init_hook_state(grad_fn, params, batches.batch(0))
    optimizer = optax.sgd(LR, momentum=td.MOMENTUM)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, hook_state, batch):
        (loss, grads), hook_state = grad_fn(params, batch, hook_state=hook_state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, hook_state, loss, grads

    plain_grad = jax.jit(jax.grad(td.loss_fn))  # no vjpkit transform: no hooks
    out = {"params": [params], "hook_state": [hook_state], "loss": [], "norms": [], "plain_norms": []}
    for t in range(TOTAL):
        batch = batches.batch(t)
        plain = plain_grad(params, batch)
        params, opt_state, hook_state, loss, grads = step(params, opt_state, hook_state, batch)
        out["params"].append(params)
        out["hook_state"].append(hook_state)
        out["loss"].append(float(loss))
        norm = lambda tree: {k: np.linalg.norm(np.asarray(v, np.float64)) for k, v in tree.items()}
        out["norms"].append({name: norm(g) for name, g in grads.items() if g})
        out["plain_norms"].append({name: norm(g) for name, g in plain.items() if g})
    return out


def check_norms(got: dict, ref: dict, steps: range) -> None:
    for name, leaves in got.items():
        for leaf, values in leaves.items():
            expected = [ref["norms"][t][name][leaf] for t in steps]
            np.testing.assert_allclose(values, expected, rtol=1e-5, err_msg=f"{name}/{leaf}")


def test_captured_norms_and_params_match_the_hand_loop(runs, reference):
    _, out = runs
    first = out["first"]
    assert first["steps"].tolist() == list(range(FIRST))
    assert first["layers"] == ["conv1", "conv2", "fc"]
    assert sorted(first["norms"]) == ["conv1", "conv2", "fc"]
    assert all(sorted(first["norms"][n]) == ["bias", "weight"] for n in first["layers"])
    check_norms(first["norms"], reference, range(FIRST))
    np.testing.assert_allclose(first["history"]["loss"], reference["loss"][:FIRST], rtol=1e-5)
    state = first["state"]
    assert int(state.step) == FIRST
    tree_allclose(state.params, reference["params"][FIRST], rtol=1e-5, atol=1e-7)
    tree_allclose(state.hook_state, reference["hook_state"][FIRST], rtol=1e-5, atol=1e-9)
    assert float(state.hook_state["conv1"].count) == FIRST


def test_the_hook_rewrote_the_conv_gradients_only(runs, reference):
    """At step 0 ema_normalize standardizes a gradient exactly: its norm is sqrt(size)."""
    td, out = runs
    norms, params = out["first"]["norms"], out["first"]["init_params"]
    for name in ("conv1", "conv2"):
        size = params[name]["weight"].size
        np.testing.assert_allclose(norms[name]["weight"][0], np.sqrt(size), rtol=1e-4)
        assert abs(norms[name]["weight"][0] - reference["plain_norms"][0][name]["weight"]) > 1.0
    np.testing.assert_allclose(
        norms["fc"]["weight"], [n["fc"]["weight"] for n in reference["plain_norms"][:FIRST]], rtol=1e-5
    )


def test_eval_and_accuracy_match_the_reference_params(runs, reference):
    td, out = runs
    first = out["first"]
    assert [e["step"] for e in first["history"]["eval"]] == [3, FIRST]
    _, (x_test, y_test) = td.load_data()
    logits = td.model.apply(reference["params"][FIRST], x_test)
    expected = float(np.mean(np.asarray(jnp.argmax(logits, axis=-1)) == y_test))
    assert abs(first["accuracy"] - expected) <= 1.0 / len(y_test)
    assert f"test accuracy {first['accuracy']:.4f} after {FIRST} steps" in first["printed"]


def table_rows(printed: str) -> dict[str, list[float]]:
    block = printed.split("weight-gradient norm")[1]
    rows = {}
    for line in block.splitlines():
        match = re.match(r"(conv\d|fc)\s+(\S+)\s+" + r"\s+".join([r"([-\d.]+)"] * 4) + r"\s*$", line)
        if match:
            rows[match.group(1)] = [float(v) for v in match.groups()[2:]]
    return rows


def test_the_table_has_every_layer_and_its_numbers(runs):
    _, out = runs
    first = out["first"]
    printed = first["printed"]
    assert "AFTER" in printed and "ema_normalize" in printed
    assert f"over steps 0..{FIRST - 1}" in printed
    rows = table_rows(printed)
    assert list(rows) == first["layers"]
    for name, cells in rows.items():
        w = first["norms"][name]["weight"]
        np.testing.assert_allclose(cells, [w[0], np.median(w), w[-1], np.max(w)], atol=6e-5)


def test_rerun_on_the_same_directory_resumes(runs, reference):
    _, out = runs
    resumed, straight = out["resumed"], out["straight"]
    assert resumed["history"]["step"][0] == FIRST
    assert resumed["steps"].tolist() == list(range(FIRST, TOTAL))
    assert f"resumed from the checkpoint at step {FIRST}" in resumed["printed"]
    assert f"over steps {FIRST}..{TOTAL - 1}" in resumed["printed"]
    check_norms(resumed["norms"], reference, range(FIRST, TOTAL))
    tree_allclose(resumed["state"].params, reference["params"][TOTAL], rtol=1e-5, atol=1e-7)
    tree_allclose(resumed["state"].hook_state, reference["hook_state"][TOTAL], rtol=1e-5, atol=1e-9)
    # the hook state came back from the checkpoint: resumed == uninterrupted, bit for bit
    assert straight["steps"].tolist() == list(range(TOTAL))
    tree_allclose(resumed["state"], straight["state"], rtol=0, atol=0)


def test_scan_steps_deliver_every_steps_records(runs, reference):
    _, out = runs
    scanned = out["scanned"]
    assert scanned["steps"].tolist() == list(range(TOTAL))  # 4 + 4 in lax.scan, then 2 single steps
    check_norms(scanned["norms"], reference, range(TOTAL))
    # lax.scan compiles to other fusions: float32 rounding differs, amplified by ema_normalize
    tree_allclose(scanned["state"].params, reference["params"][TOTAL], rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_train_digits_learns():
    td = load_example("train_digits")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = td.main(["--no-progress"])
    try:
        assert out["accuracy"] > 0.85
        assert f"checkpoints: {out['checkpoint_dir']}" in printed.getvalue()  # the default: a fresh temp dir
        assert pathlib.Path(out["checkpoint_dir"], str(int(out["state"].step))).is_dir()
    finally:
        shutil.rmtree(out["checkpoint_dir"], ignore_errors=True)
