"""Issue 21's unclear errors and traps: each reproduced, with its message checked.

Every message must say what happened, name the layer / field / tree path, and give the fix.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from vjpkit import nn
from vjpkit._engine import _run

MODEL = nn.serial(fc1=nn.dense(4), act=nn.relu(), fc2=nn.dense(2))
X = jnp.ones((3, 5))
PARAMS = MODEL.init(jax.random.key(0), X)


def loss(p, x):
    return MODEL.apply(p, x).sum()


@pytest.mark.parametrize("factory", [vk.ema_normalize, vk.clip_by_norm, vk.on_host, vk.accumulate_stats])
def test_uncalled_hook_factory(factory):
    with pytest.raises(vk.ConfigError, match=rf"glob 'fc\*' is vk\.{factory.__name__} itself.*call it"):
        vk.grad(loss, hooks={"fc*": factory})(PARAMS, X)


def test_update_returning_only_the_record():
    bad = vk.HookTransform(lambda p: {"n": jnp.zeros(())}, lambda rec, s: rec)
    g = vk.grad(loss, hooks={"fc1": bad})
    with pytest.raises(vk.HookError, match=r"layer 'fc1'.*returned Cotangents, not a pair \(rec, state\)"):
        g(PARAMS, X, hook_state=vk.init_hook_state(g, PARAMS, X))


def test_params_missing_a_child(maybe_jit):
    params = {**PARAMS, "fc1": {"w": PARAMS["fc1"]["weight"], "bias": PARAMS["fc1"]["bias"]}}
    with pytest.raises(
        vk.ConfigError, match=r"nn.dense layer 'fc1': params has no 'weight' \(it has keys \['bias', 'w'\]\)"
    ):
        maybe_jit(MODEL.apply)(params, X)
    with pytest.raises(vk.ConfigError, match=r"layer 'fc1': params has no 'weight'"):
        maybe_jit(vk.grad(loss, hooks={"fc*": lambda r: None}))(params, X)


def test_dense_fed_the_wrong_width(maybe_jit):
    with pytest.raises(
        vk.ConfigError, match=r"layer 'fc1': the input float32\[3,6\] has 6 features.*float32\[5,4\]"
    ):
        maybe_jit(vk.grad(loss, capture="fc*"))(PARAMS, jnp.ones((3, 6)))


def _fit(loss_fn, params, data):
    return vk.train.fit(loss_fn, optax.sgd(0.1), params, data, batch_size=4, steps=2, progress=False)


def _fit_loss(p, batch):
    x, y = batch
    return jnp.mean((MODEL.apply(p, x) - y) ** 2)


DATA = (np.ones((8, 5), np.float32), np.ones((8, 2), np.float32))


def test_fit_on_zero_rows():
    with pytest.raises(vk.ConfigError, match="0 examples"):
        _fit(_fit_loss, PARAMS, tuple(a[:0] for a in DATA))


def test_fit_with_a_one_argument_loss():
    with pytest.raises(vk.ConfigError, match=r"cannot be called as loss_fn\(params, batch\)"):
        _fit(lambda p: 0.0, PARAMS, DATA)


def test_fit_with_an_integer_params_leaf():
    params = {**PARAMS, "count": jnp.zeros((), jnp.int32)}
    with pytest.raises(vk.ConfigError, match=r"params leaf \['count'\] is int32\[\], not a float array"):
        _fit(_fit_loss, params, DATA)


# --- the jit trap -----------------------------------------------------------------------------------


def test_keeping_traced_records_warns_once_per_layer_and_points_to_on_host():
    kept = []
    g = jax.jit(vk.grad(loss, hooks={"fc*": lambda rec: kept.append(rec)}))
    with pytest.warns(UserWarning, match=r"layer 'fc\d'.*tracers.*vk\.on_host") as record:
        for _ in range(3):
            g(PARAMS, X)
    assert len([w for w in record if "kept the record" in str(w.message)]) == 2  # fc2, fc1: once each


@pytest.mark.parametrize(
    "hook",
    [
        lambda rec: jax.debug.print("{}", jnp.linalg.norm(rec.grad_output)),
        lambda rec: rec.replace(grad_params=jax.tree.map(lambda t: 2 * t, rec.grad_params)),
    ],
    ids=["debug-print", "rewrite"],
)
def test_hooks_that_keep_nothing_do_not_warn(hook):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.block_until_ready(jax.jit(vk.grad(loss, hooks={"fc*": hook}))(PARAMS, X))


def test_eager_hooks_may_keep_arrays():
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vk.grad(loss, hooks={"fc*": lambda rec: kept.append(rec)})(PARAMS, X)
    assert all(isinstance(r.grad_output, jax.Array) for r in kept)
    np.testing.assert_allclose(kept[0].grad_params["weight"], jax.grad(loss)(PARAMS, X)["fc2"]["weight"])


# --- eager: a transform built anew each call --------------------------------------------------------


def test_a_transform_built_per_call_reuses_its_compiled_inner_jit():
    @jax.jit
    def inner(p, x):
        return MODEL.apply(p, x)

    def jloss(p, x):
        return inner(p, x).sum()

    spec = vk.capture("fc*", reduce="norm")
    before = len(_run._JIT_CACHE)
    for _ in range(4):
        grads, _ = vk.grad(jloss, capture=spec)(PARAMS, X)
    assert len(_run._JIT_CACHE) - before <= 1
    np.testing.assert_allclose(grads["fc1"]["weight"], jax.grad(jloss)(PARAMS, X)["fc1"]["weight"], rtol=1e-6)
