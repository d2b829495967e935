"""vjpkit's plain-JAX matching side by side with kfac-jax's graph matcher (issue 22's oracle).

kfac-jax finds layers in a traced program by matching graph patterns
(``kfac_jax.tag_graph_matcher.auto_register_tags``, no ``register_*`` layer calls: only
the loss is registered, as kfac-jax requires). On the same plain-jnp MLP, CNN and transformer
block, every layer kfac-jax finds (its non-``generic`` tags, compared by the parameter leaves
each uses) is a layer vjpkit finds too, and vjpkit's records are exact: their ``grad_params``
summed per leaf equal ``jax.grad``. Where kfac-jax gives up (blocks under ``lax.scan`` over
stacked weights, ``lax.cond``, a block applied twice with the same weights) the tests assert
that it does, so they document it, and that vjpkit's records stay exact there.

Only kfac-jax's layer detection runs (kfac-jax 0.0.8, the ``kfac`` extra); no optimizer step.
Skipped when kfac-jax is not installed.
"""

from __future__ import annotations

import logging
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk

# the plain-jnp transformer block the benchmark times: one definition for both
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import plain_bench
from plain_bench import block

try:  # the kfac extra; a kfac-jax that no longer imports on this jax (AttributeError) skips too
    import kfac_jax
except (ImportError, AttributeError) as err:
    pytest.skip(f"kfac-jax not available ({type(err).__name__}: {err}): pip install -e '.[kfac]'",
                allow_module_level=True)  # fmt: skip
tgm, tracer = kfac_jax.tag_graph_matcher, kfac_jax.tracer

logging.getLogger("absl").setLevel(logging.WARNING)  # auto_register_tags logs every registration
pytestmark = pytest.mark.slow  # each test compiles a model's gradient twice over (vjpkit, jax.grad)

V, D, HEADS, FF, T, B, CLASSES = 11, 16, 2, 32, 6, 3, 5


# --- plain-jnp models: no layer library ----------------------------------------------------


def xent(logits, y):
    lse = jax.nn.logsumexp(logits, -1)
    return jnp.mean(lse - jnp.take_along_axis(logits, y[..., None], -1)[..., 0])


def normal(key, shape, fan_in):
    return jax.random.normal(key, shape) / np.sqrt(fan_in)


def mlp_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "l1": {"w": normal(k1, (8, 32), 8), "b": jnp.zeros(32)},
        "l2": {"w": normal(k2, (32, 32), 32), "b": jnp.full(32, 0.1, jnp.float32)},
        "out": {"w": normal(k3, (32, CLASSES), 32), "b": jnp.zeros(CLASSES)},
    }


def mlp(p, x):
    h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    h = jax.nn.relu(h @ p["l2"]["w"] + p["l2"]["b"])
    return h @ p["out"]["w"] + p["out"]["b"]


def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def cnn_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "conv1": {"w": normal(k1, (3, 3, 1, 4), 9), "b": jnp.zeros(4)},
        "conv2": {"w": normal(k2, (3, 3, 4, 8), 36), "b": jnp.full(8, 0.1, jnp.float32)},
        "head": {"w": normal(k3, (8 * 4 * 4, CLASSES), 128), "b": jnp.zeros(CLASSES)},
    }


def cnn(p, x):
    h = jax.nn.relu(conv(x, p["conv1"]["w"]) + p["conv1"]["b"][None, None, None])
    h = jax.nn.relu(conv(h, p["conv2"]["w"]) + p["conv2"]["b"][None, None, None])
    n, hh, ww, c = h.shape
    h = h.reshape(n, hh // 2, 2, ww // 2, 2, c).max(axis=(2, 4))  # 2x2 max pool
    return h.reshape(n, -1) @ p["head"]["w"] + p["head"]["b"]


def block_params(key):
    return plain_bench.block_params(key, D, HEADS, FF)


def lm_params(key, **blocks):
    k1, k2 = jax.random.split(key)
    return {"embed": normal(k1, (V, D), 1), **blocks, "head": {"w": normal(k2, (D, V), D), "b": jnp.zeros(V)}}


def lm_head(p, h):
    return h @ p["head"]["w"] + p["head"]["b"]


def transformer(p, tok):
    return lm_head(p, block(p["block"], p["embed"][tok]))


def scanned(p, tok):
    h, _ = jax.lax.scan(lambda h, bp: (block(bp, h), None), p["embed"][tok], p["blocks"])
    return lm_head(p, h)


def branched(p, tok):
    h = p["embed"][tok]
    h = jax.lax.cond(tok[0, 0] > V // 2, lambda h: block(p["a"], h), lambda h: block(p["b"], h), h)
    return lm_head(p, h)


def shared(p, tok):  # one block's weights applied twice
    return lm_head(p, block(p["block"], block(p["block"], p["embed"][tok])))


def tokens():
    tok = jax.random.randint(jax.random.key(7), (B, T), 0, V)
    return tok, jnp.roll(tok, -1, axis=1)


def case(name):
    """``(apply, params, x, y)`` of a named case."""
    key = jax.random.key(0)
    if name == "mlp":
        x = jax.random.normal(jax.random.key(1), (B, 8))
        return mlp, mlp_params(key), x, jnp.arange(B) % CLASSES
    if name == "cnn":
        x = jax.random.normal(jax.random.key(1), (B, 8, 8, 1))
        return cnn, cnn_params(key), x, jnp.arange(B) % CLASSES
    tok, y = tokens()
    k1, k2 = jax.random.split(jax.random.key(3))
    if name == "transformer":
        return transformer, lm_params(key, block=block_params(k1)), tok, y
    if name == "scan":
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[block_params(k) for k in jax.random.split(k1, 3)])
        return scanned, lm_params(key, blocks=stacked), tok, y
    if name == "cond":
        return branched, lm_params(key, a=block_params(k1), b=block_params(k2)), tok, y
    if name == "shared":
        return shared, lm_params(key, block=block_params(k1)), tok, y
    raise ValueError(name)


# --- both matchers, as sets of parameter leaves per layer ----------------------------------


def leaf_paths(params):
    return ["/".join(str(k.key) for k in keys) for keys, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def kfac_loss(apply):
    def loss(params, batch):
        x, y = batch
        logits = apply(params, x)
        kfac_jax.register_softmax_cross_entropy_loss(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return xent(logits, y)

    return loss


def kfac_layers(apply, params, x, y):
    """``(layers, generic)``: kfac-jax's pattern-matched layers, each the frozenset of the leaf
    paths it uses, and the leaves it could only register as ``generic`` (no layer found)."""
    tagged = tgm.auto_register_tags(kfac_loss(apply), (params, (x, y)))
    paths = leaf_paths(params)
    index = {v: i for i, v in enumerate(tagged._func_graph.params_vars)}
    layers, generic = set(), set()
    for loc in tagged._tag_locations:
        leaves = frozenset(paths[index[v]] for v in loc.top_level_parameters)
        if "generic" in loc.base_name:
            generic |= leaves
        else:
            layers.add(leaves)
    return layers, generic


def vjpkit_records(apply, params, x, y):
    """``(layers, grads, reference, records)``: vjpkit's matched layers (frozensets of leaf
    paths, one per distinct layer; ``name#k`` calls are the same layer), its batch gradient,
    ``jax.grad``'s (compiled together, one compilation), and ``{name: {leaf path: grad_params}}``
    of every call."""
    loss = lambda p, x, y: xent(apply(p, x), y)
    spec = vk.capture("*", fields=["grad_params"])

    def both(p, x, y):
        return vk.value_and_grad(loss, capture=spec)(p, x, y), jax.grad(loss)(p, x, y)

    ((_, grads), captured), reference = jax.jit(both)(params, x, y)
    paths = set(leaf_paths(params))
    records = {}
    for name, rec in captured.items():
        base = name.split("#")[0]
        keys = list(rec.grad_params)
        # keys are relative to the name, or full paths when the name is the weight's own path
        full = {k if base in keys else f"{base}/{k}": g for k, g in rec.grad_params.items()}
        assert set(full) <= paths, (name, keys)
        records[name] = full
    return {frozenset(r) for r in records.values()}, grads, reference, records


def assert_exact(params, grads, records):
    """Records summed per leaf equal ``jax.grad``, and every leaf has a record. A record of a
    call whose backward pass did not run (a ``lax.cond`` branch not taken) is all NaN, as
    documented (docs/hooks.md); it adds nothing, and such a leaf's gradient must be zero."""
    flat = dict(zip(leaf_paths(params), jax.tree.leaves(grads)))
    summed = {}
    for rec in records.values():
        for path, g in rec.items():
            g = np.asarray(g)
            summed[path] = summed.get(path, 0) + (0 if np.isnan(g).all() else g)
    assert set(summed) == set(flat)
    for path, g in flat.items():
        np.testing.assert_allclose(summed[path], g, rtol=2e-5, atol=1e-6, err_msg=path)


def check_vjpkit(apply, params, x, y):
    layers, grads, reference, records = vjpkit_records(apply, params, x, y)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert_exact(params, reference, records)
    return layers, records


# --- the same models: vjpkit finds every layer kfac-jax finds ------------------------------


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_vjpkit_finds_every_layer_kfac_jax_finds(name):
    apply, params, x, y = case(name)
    theirs, generic = kfac_layers(apply, params, x, y)
    ours, _ = check_vjpkit(apply, params, x, y)
    assert theirs, name  # kfac-jax finds layers here: the comparison is not vacuous
    assert theirs <= ours, sorted(map(sorted, theirs - ours))
    if name == "transformer":
        # the embedding lookup (a gather) is no kfac-jax pattern: generic there, a layer here
        assert generic == {"embed"} and frozenset({"embed"}) in ours
    else:
        assert not generic and theirs == ours


EXPECTED_TRANSFORMER = {  # the layers both find in the transformer block, by leaves
    ("block/ln1/bias", "block/ln1/scale"),
    ("block/attn/wq",),
    ("block/attn/wk",),
    ("block/attn/wv",),
    ("block/attn/wo",),
    ("block/ln2/bias", "block/ln2/scale"),
    ("block/mlp/b1", "block/mlp/w1"),
    ("block/mlp/w2",),
    ("block/mlp/b2",),  # (h + m @ w2) + b2: the residual add comes between, for both matchers
    ("head/b", "head/w"),
}


def test_transformer_layers_are_the_expected_ones():
    apply, params, x, y = case("transformer")
    theirs, _ = kfac_layers(apply, params, x, y)
    assert {tuple(sorted(s)) for s in theirs} == EXPECTED_TRANSFORMER


# --- where kfac-jax gives up: vjpkit's records stay exact ----------------------------------


def test_scan_over_stacked_blocks():
    """kfac-jax tags the layers inside the scan body, but its curvature side (``ProcessedJaxpr``,
    which reads only top-level tags) leaves every stacked leaf without a block and raises."""
    apply, params, x, y = case("scan")
    with pytest.raises(ValueError, match="not assigned a block"):
        tracer.ProcessedJaxpr.make_from_func(kfac_loss(apply), (params, (x, y)))
    ours, records = check_vjpkit(apply, params, x, y)
    stacked = [p for p in leaf_paths(params) if p.startswith("blocks/")]
    assert len(stacked) == 12 and {p for layer in ours for p in layer} >= set(stacked)
    for rec in records.values():  # one record per layer for all 3 iterations: stacked gradients
        for path, g in rec.items():
            if path.startswith("blocks/"):
                assert g.shape[0] == 3, path


def test_scan_top_level_kfac_jax_still_works():
    """The same model's top level (embedding, head) goes through kfac-jax's ``ProcessedJaxpr``
    once left-out params are allowed: the failure above is the scan, not the model."""
    apply, params, x, y = case("scan")
    pj = tracer.ProcessedJaxpr.make_from_func(kfac_loss(apply), (params, (x, y)), allow_left_out_params=True)
    assert len(pj.layer_tags) == 2  # the embedding (generic) and the head (dense)


def test_cond_branches_with_layers():
    apply, params, x, y = case("cond")
    with pytest.raises(NotImplementedError):
        tgm.auto_register_tags(kfac_loss(apply), (params, (x, y)))
    ours, records = check_vjpkit(apply, params, x, y)
    for branch in ("a", "b"):  # both branches' layers are found; the one not taken gets zeros
        assert frozenset({f"{branch}/attn/wq"}) in ours
    taken = "a" if int(x[0, 0]) > V // 2 else "b"
    other = "b" if taken == "a" else "a"
    grads = [(p, np.asarray(g)) for rec in records.values() for p, g in rec.items()]
    assert all(np.isnan(g).all() for p, g in grads if p.startswith(other + "/"))  # did not run
    assert all(np.isfinite(g).all() for p, g in grads if not p.startswith(other + "/"))


def test_weakly_typed_bias():
    """A bias leaf made with ``jnp.full(n, 0.1)`` is weakly typed: its add traces through a
    ``convert_element_type``, and kfac-jax's dense pattern no longer takes it (the weight is
    a dense layer without bias, the bias ``generic``); vjpkit's span keeps the two together."""
    apply, params, x, y = case("mlp")
    params = {**params, "l2": {**params["l2"], "b": jnp.full(32, 0.1)}}
    theirs, generic = kfac_layers(apply, params, x, y)
    assert frozenset({"l2/w"}) in theirs and generic == {"l2/b"}
    ours, _ = check_vjpkit(apply, params, x, y)
    assert frozenset({"l2/w", "l2/b"}) in ours
    assert all(any(layer <= mine for mine in ours) for layer in theirs)


def test_block_applied_twice_with_shared_weights():
    """kfac-jax registers a leaf used twice as ``generic`` (no layer); vjpkit records each call
    (``name`` and ``name#1``), whose gradients add up to the leaf's."""
    apply, params, x, y = case("shared")
    theirs, generic = kfac_layers(apply, params, x, y)
    block_leaves = {p for p in leaf_paths(params) if p.startswith("block/")}
    assert generic == block_leaves | {"embed"}
    assert theirs == {frozenset({"head/b", "head/w"})}
    ours, records = check_vjpkit(apply, params, x, y)
    assert theirs <= ours
    for layer in EXPECTED_TRANSFORMER - {("head/b", "head/w")}:
        base = next(n for n, r in records.items() if set(r) == set(layer) and "#" not in n)
        assert f"{base}#1" in records and set(records[f"{base}#1"]) == set(layer), layer
