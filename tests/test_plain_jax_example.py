"""examples/plain_jax.py: a plain-jnp transformer learns, its layers are the ones the docs name,
and its records are exact.

The example runs once (a short run, in this process). The checks recompute what they compare
with here, independently of the example's code: ``jax.grad`` of the loss at the final params,
which the records' ``grad_params`` summed per leaf must equal, and ``jax.vmap(jax.grad)`` over
the examples, which the per-example norms must equal.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk
from tests.helpers import load_example

pytest.importorskip("matplotlib", reason='the example plots: pip install -e ".[plot]"')

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 150
DEPTH = 2  # the example's default


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain_jax")
    example = load_example("plain_jax")
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # optax's Adam mixes int and float: standard promotion
        result = example.main(["--steps", str(STEPS), "--out", str(out)])
        jax.effects_barrier()
    result["warnings"] = [str(w.message) for w in caught]
    return example, result


def documented_names() -> list[str]:
    """The layer names docs/plain-jax.md says ``vk.explain`` lists for the example, in order."""
    text = (ROOT / "docs" / "plain-jax.md").read_text()
    sentence = re.search(r"`vk\.explain` of its loss lists, in forward order, (.*?)\. It trains", text, re.S)
    assert sentence, "docs/plain-jax.md no longer lists the example's layer names"
    return re.findall(r"`([^`]+)`", sentence[1])


@pytest.mark.slow
def test_learns_and_plots(run):
    _, out = run
    loss = out["metrics"]["loss"]
    assert len(loss) == STEPS and loss[-1] < 0.8 * loss[0]
    assert out["accuracy"] > 0.5  # chance is 1/16
    for png in ("plain_jax_attention_flow.png", "plain_jax_gradient_flow.png"):
        assert (out["out"] / png).stat().st_size > 0


@pytest.mark.slow
def test_layer_names_are_the_documented_ones(run):
    _, out = run
    names = documented_names()
    assert names == out["names"]
    assert {"embed", "embed#1", "blocks/attn/q", "blocks/mlp/proj"} <= set(names)
    assert out["rows"].other_uses == ()  # every parameter is used by some layer
    # captured every step; a layer inside the scan has one norm per block
    assert [step for step, _ in out["history"]] == list(range(STEPS))
    last = out["history"][-1][1]
    assert set(last) == set(names)
    assert np.shape(last["blocks/attn/q"].grad_params["blocks/attn/q"]) == (DEPTH,)
    assert np.shape(last["embed#1"].grad_params["embed"]) == ()
    assert {f"blocks/attn/q[{i}]" for i in range(DEPTH)} <= set(out["series"])


def per_leaf(captured: dict) -> dict[str, np.ndarray]:
    """Each record's ``grad_params`` added into its leaf: keys are relative to the call's name
    (``name#k`` is call k of ``name``), or full paths when the name is one of them."""
    total: dict[str, np.ndarray] = {}
    for key, rec in captured.items():
        name = key.split("#")[0]
        grads = rec.grad_params
        for rel, g in grads.items() if name in grads else _flat(grads, name).items():
            total[rel] = total.get(rel, 0) + np.asarray(g, np.float64)
    return total


def _flat(tree: dict, prefix: str = "") -> dict:
    """``{path: leaf}``, paths ``/``-joined (under ``prefix`` when given)."""
    return {
        "/".join([*([prefix] if prefix else []), *(str(k.key) for k in path)]): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@pytest.mark.slow
def test_records_summed_per_leaf_are_jax_grad(run):
    example, out = run
    params, batch = out["state"].params, out["batch"]
    spec = vk.capture("*", fields=["grad_params"])
    grads, captured = jax.jit(vk.grad(example.loss_fn, capture=spec))(params, batch)
    reference = jax.jit(jax.grad(example.loss_fn))(params, batch)
    for got_leaf, want_leaf in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-4, atol=1e-6)
    want = {k: np.asarray(g, np.float64) for k, g in _flat(reference).items()}
    got = per_leaf(captured)
    assert set(got) == set(want)  # every leaf has records: no gradient flows outside a layer
    scale = max(float(np.max(np.abs(g))) for g in want.values())
    for path, g in want.items():
        np.testing.assert_allclose(got[path], g, rtol=1e-4, atol=1e-5 * scale, err_msg=path)
    # the tied table: the lookup's and the head's records add up to its gradient
    lookup, head = (np.asarray(captured[k].grad_params["embed"]) for k in ("embed", "embed#1"))
    assert np.abs(lookup).max() > 0 and np.abs(head).max() > 0
    np.testing.assert_allclose(lookup + head, want["embed"], rtol=1e-4, atol=1e-5 * scale)
    # the scanned layers: one record per block, stacked: the stacked leaf's gradient
    assert captured["blocks/attn/q"].grad_params["blocks/attn/q"].shape == params["blocks"]["attn"]["q"].shape


@pytest.mark.slow
def test_per_example_norms_are_vmap_grad(run):
    example, out = run
    params, batch = out["state"].params, out["batch"]
    per = jax.vmap(jax.grad(lambda p, t: example.loss_fn(p, t[None])), in_axes=(None, 0))(params, batch)
    sq = sum(np.sum(np.square(np.asarray(g)).reshape(len(batch), -1), 1) for g in jax.tree.leaves(per))
    np.testing.assert_allclose(out["norms"].total, np.sqrt(sq), rtol=1e-4, atol=1e-6)
    # the layers inside lax.scan take the fast paths (stacked leaves: per-iteration ghost norms)
    assert not [w for w in out["warnings"] if "per_example_grad_norms" in w and "passed into a 'scan'" in w]
    # the tied table (lookup + h @ embed.T) takes the fast path too: no warning at all
    assert not [w for w in out["warnings"] if "per_example_grad_norms" in w], out["warnings"]
    embed = jnp.sqrt(jnp.sum(jnp.square(per["embed"]).reshape(len(batch), -1), 1))
    np.testing.assert_allclose(out["norms"].params["embed"], embed, rtol=1e-4, atol=1e-6)
