"""The bad-input catalogue: clear vjpkit errors, raised at trace time, naming layer and field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import vjpkit as vk
from tests.models import mlp_loss, mlp_setup
from vjpkit import nn


def trace(fn, *args):
    """Traces and lowers ``fn`` without running it: errors raised here are trace-time errors."""
    return jax.jit(fn).lower(*args)


def test_hook_wrong_shape():
    params, x, y = mlp_setup()
    bad = lambda rec: rec.replace(grad_input=rec.grad_input[:, :2])
    with pytest.raises(vk.HookError) as err:
        trace(vk.grad(mlp_loss, hooks={"fc2": bad}), params, x, y)
    msg = str(err.value)
    assert "'fc2'" in msg and "grad_input" in msg and "float32[6,5]" in msg and "float32[6,2]" in msg


def test_hook_wrong_dtype_bf16_layer():
    model = nn.serial(fc=nn.dense(3))
    x = jnp.ones((2, 3), jnp.bfloat16)
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x: model.apply(p, x).astype(jnp.float32).sum()
    bad = lambda rec: rec.replace(grad_params=jax.tree.map(lambda g: g.astype(jnp.float32), rec.grad_params))
    with pytest.raises(vk.HookError) as err:
        trace(vk.grad(loss, hooks={"fc": bad}), params, x)
    msg = str(err.value)
    assert "'fc'" in msg and "grad_params" in msg and "['bias']" in msg
    assert "expected bfloat16[3]" in msg and "got float32[3]" in msg


def test_hook_wrong_structure():
    params, x, y = mlp_setup()
    bad = lambda rec: rec.replace(grad_params={"weight": rec.grad_params["weight"]})
    with pytest.raises(vk.HookError, match=r"'fc1'.*grad_params.*structure.*bias"):
        trace(vk.grad(mlp_loss, hooks={"fc1": bad}), params, x, y)


def test_hook_returns_not_a_record():
    params, x, y = mlp_setup()
    with pytest.raises(vk.HookError, match=r"'fc3'.*returned dict, not a record.*rec.replace"):
        trace(vk.grad(mlp_loss, hooks={"fc3": lambda rec: rec.grad_params}), params, x, y)


def test_hook_changes_read_only_field():
    params, x, y = mlp_setup()
    bad = lambda rec: rec.replace(grad_output=2 * rec.grad_output)
    with pytest.raises(vk.HookError, match=r"'fc3'.*'grad_output'.*read-only"):
        trace(vk.grad(mlp_loss, hooks={"fc3": bad}), params, x, y)


def test_hook_sets_grad_input_that_needs_no_gradient():
    params, x, y = mlp_setup()
    bad = lambda rec: rec.replace(grad_input=jnp.zeros((6, 3)))
    with pytest.raises(vk.HookError, match=r"'fc1'.*'grad_input'.*needs no gradient"):
        trace(vk.grad(mlp_loss, hooks={"fc1": bad}), params, x, y)


def test_glob_matching_no_layer_lists_names():
    params, x, y = mlp_setup()
    with pytest.raises(vk.ConfigError) as err:
        trace(vk.grad(mlp_loss, hooks={"conv*": lambda rec: None, "fc1": lambda rec: None}), params, x, y)
    msg = str(err.value)
    assert "'conv*'" in msg and "'fc1', 'fc2', 'fc3', 'relu1', 'relu2'" in msg
    assert "'fc1'," not in msg.split("Layers called")[0]  # only the unmatched glob is blamed


def test_serial_duplicate_names():
    with pytest.raises(vk.ConfigError, match=r"two children are named 'fc'"):
        nn.serial(("fc", nn.dense(3)), ("fc", nn.dense(4)))
    with pytest.raises(vk.ConfigError, match=r"two children are named '0'"):
        nn.serial(nn.dense(3), **{"0": nn.relu()})
    with pytest.raises(vk.ConfigError, match=r"'/'"):
        nn.serial(("a/b", nn.dense(3)))
    with pytest.raises(vk.ConfigError, match=r"not an nn.Layer"):
        nn.serial(fc=jnp.tanh)


def test_non_scalar_loss_explains_seed():
    params, x, _ = mlp_setup()
    from tests.models import mlp

    def logits(p, x):
        return mlp.apply(p, x)

    for transform in (vk.grad, vk.value_and_grad):
        for hooks in (None, {"fc1": lambda rec: None}):
            with pytest.raises(vk.SeedError) as err:
                trace(transform(logits, hooks=hooks), params, x)
            msg = str(err.value)
            assert "scalar" in msg and "seed" in msg and "shape (6, 2)" in msg
            assert "vk.vjp(logits" in msg and "pullback(seed)" in msg


def test_has_aux_misuse():
    params, x, y = mlp_setup()
    with pytest.raises(vk.SeedError, match=r"has_aux=True.*pair"):
        trace(vk.grad(mlp_loss, has_aux=True), params, x, y)
    pair = lambda p, x, y: (mlp_loss(p, x, y), x)
    with pytest.raises(vk.SeedError, match=r"has_aux=True"):
        trace(vk.grad(pair), params, x, y)


def test_on_host_exception_names_layer_under_jit():
    params, x, y = mlp_setup()

    def explode(rec):
        raise KeyError("no such statistic")

    step = jax.jit(vk.grad(mlp_loss, hooks={"fc2": vk.on_host(explode)}))
    with pytest.raises(Exception) as err:  # JAX wraps it; the message is checked
        jax.block_until_ready(step(params, x, y))
    msg = str(err.value)
    assert "HostHookError" in msg and "'fc2'" in msg and "KeyError" in msg and "no such statistic" in msg
    # the runtime is still usable afterwards (nothing hangs)
    jax.block_until_ready(jax.jit(vk.grad(mlp_loss))(params, x, y))


def test_on_host_exception_eager_is_host_hook_error():
    params, x, y = mlp_setup()

    def explode(rec):
        raise ValueError("bad record")

    with pytest.raises(vk.HostHookError, match=r"'fc3'.*ValueError.*bad record") as err:
        jax.block_until_ready(vk.grad(mlp_loss, hooks={"fc3": vk.on_host(explode)})(params, x, y))
    assert isinstance(err.value.original, ValueError)


def test_bad_hook_configuration():
    params, x, y = mlp_setup()
    with pytest.raises(vk.ConfigError, match="dict"):
        vk.grad(mlp_loss, hooks=[lambda rec: None])
    with pytest.raises(vk.ConfigError, match="not a callable"):
        vk.grad(mlp_loss, hooks={"fc1": 3})
    with pytest.raises(vk.ConfigError, match="every"):
        vk.on_host(print, every=0)


def test_dropout_without_key():
    model = nn.serial(fc=nn.dense(3), drop=nn.dropout(0.5))
    x = jnp.ones((2, 3))
    params = model.init(jax.random.key(0), x)
    with pytest.raises(vk.ConfigError, match="key="):
        model.apply(params, x)
    assert model.apply(params, x, deterministic=True).shape == (2, 3)


def test_params_from_another_model():
    params, x, _ = mlp_setup()
    other = nn.serial(fc1=nn.dense(5), relu1=nn.relu(), fc2=nn.dense(4))
    with pytest.raises(vk.ConfigError, match=r"\['fc3'\]"):
        other.apply(params, x)


def test_dropout_deterministic_must_be_static():
    drop = nn.dropout(0.5)
    x = jnp.ones((2, 3))
    with pytest.raises(vk.ConfigError, match="static"):
        jax.jit(drop.apply)({}, x, deterministic=True)
    out = jax.jit(drop.apply, static_argnames="deterministic")({}, x, deterministic=True)
    assert jnp.array_equal(out, x)


def test_differentiating_an_integer_argument_names_its_path_and_dtype():
    """With hooks (vjpkit's engine); without any, vk.grad is jax.grad and JAX's own check speaks."""
    hooks = {"fc*": lambda rec: None}
    params, x, y = mlp_setup()
    with pytest.raises(vk.ConfigError, match=r"vk\.grad: args\[1\], path \(root\), has dtype int32.*argnums"):
        vk.grad(mlp_loss, argnums=(0, 1), hooks=hooks)(params, x.astype(jnp.int32), y)
    nested = {"p": params, "n": jnp.ones(3, jnp.int32)}
    with pytest.raises(vk.ConfigError, match=r"args\[0\], path \['n'\], has dtype int32"):
        vk.grad(lambda t, x, y: mlp_loss(t["p"], x, y), hooks=hooks)(nested, x, y)
