"""find_nonfinite / first_nonfinite: the origin of a NaN or Inf, checked against hand-chained vjps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.models import dense_fn
from vjpkit import nn
from vjpkit.inspect._nonfinite import NonFiniteReport, find_nonfinite, first_nonfinite


def make(middle):
    """fc1 -> middle -> fc2 under a mean cross-entropy loss; ``middle`` is a plain jnp function."""
    model = nn.serial(fc1=nn.dense(4), mid=nn.layer(lambda p, h: middle(h), name="mid"), fc2=nn.dense(3))
    x = jax.random.normal(jax.random.key(0), (8, 5))
    y = jnp.arange(8) % 3
    params = model.init(jax.random.key(1), x)

    def loss_fn(params, batch, scale=1.0):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(scale * model.apply(params, x), y).mean()

    return loss_fn, params, (x, y)


def chain(middle, params, batch, scale=1.0):
    """The reference: forward and backward by hand, ``{key: {field: NaN/Inf count}}`` in backward order."""
    x, y = batch
    h1 = dense_fn(params["fc1"], x)
    a = middle(h1)
    h2 = dense_fn(params["fc2"], a)
    g2 = jax.grad(lambda h: optax.softmax_cross_entropy_with_integer_labels(scale * h, y).mean())(h2)
    gp2, ga = jax.vjp(dense_fn, params["fc2"], a)[1](g2)
    (gh1,) = jax.vjp(middle, h1)[1](ga)
    gp1, _ = jax.vjp(dense_fn, params["fc1"], x)[1](gh1)
    bad = lambda t: int(sum(np.sum(~np.isfinite(np.asarray(v))) for v in jax.tree.leaves(t)))
    return {
        "fc2": dict(input=bad(a), params=0, output=bad(h2), grad_output=bad(g2), grad_input=bad(ga),
                    grad_params=bad(gp2)),
        "mid": dict(input=bad(h1), params=0, output=bad(a), grad_output=bad(ga), grad_input=bad(gh1),
                    grad_params=0),
        "fc1": dict(input=bad(x), params=0, output=bad(h1), grad_output=bad(gh1), grad_input=0,
                    grad_params=bad(gp1)),
    }  # fmt: skip


def first(reference, order, fields):
    return next(((k, f) for k in order for f in fields if reference[k][f] > 0), (None, None))


BACKWARD = ("grad_output", "grad_input", "grad_params")


def test_log_of_a_negative_value_in_the_middle(capsys):
    loss_fn, params, batch = make(jnp.log)  # half the pre-activations are negative: NaN
    report = find_nonfinite(loss_fn, params, batch)
    ref = chain(jnp.log, params, batch)
    assert report.per_layer == ref and list(report.per_layer) == ["fc2", "mid", "fc1"]
    assert (report.layer, report.field) == first(ref, ["fc2", "mid", "fc1"], BACKWARD)
    assert report.counts == ref[report.layer] and report.call == 0
    # the forward origin is the log itself: finite input, non-finite output
    assert ref["mid"]["input"] == 0 and ref["mid"]["output"] > 0
    assert (report.forward_layer, report.forward_field) == ("mid", "output")
    assert report.forward_order == ["fc1", "mid", "fc2"]
    assert report and not report.loss_finite
    printed = capsys.readouterr().out.strip()
    assert printed == report.message and "\n" not in printed
    assert repr(report.layer) in printed and "'mid'" in printed
    assert first_nonfinite(loss_fn, params, batch) == (report.layer, report.field)


def test_inf_made_by_the_backward_pass_of_a_middle_layer():
    middle = lambda h: jnp.sqrt(h * 0.0)  # output 0 (finite); derivative 0.5 / sqrt(0) = inf
    loss_fn, params, batch = make(middle)
    report = find_nonfinite(loss_fn, params, batch, scale=2.0)  # keyword arguments reach loss_fn
    ref = chain(middle, params, batch)
    assert (
        (report.layer, report.field) == first(ref, ["fc2", "mid", "fc1"], BACKWARD) == ("mid", "grad_input")
    )
    assert report.counts["grad_input"] == ref["mid"]["grad_input"] > 0
    assert report.forward_layer is None and report.loss_finite and report


def test_non_finite_data_is_reported_as_an_input():
    loss_fn, params, (x, y) = make(jnp.tanh)
    x = x.at[0, 0].set(jnp.nan)
    report = find_nonfinite(loss_fn, params, (x, y))
    assert (report.forward_layer, report.forward_field) == ("fc1", "input")
    assert report.per_layer == chain(jnp.tanh, params, (x, y))


def test_all_finite_says_so(capsys):
    loss_fn, params, batch = make(jnp.tanh)
    report = find_nonfinite(loss_fn, params, batch)
    assert isinstance(report, NonFiniteReport) and not report
    assert report.layer is None and report.field is None and report.forward_layer is None
    assert report.counts == {} and report.loss_finite
    assert all(c == 0 for counts in report.per_layer.values() for c in counts.values())
    assert "everything is finite" in capsys.readouterr().out
    assert first_nonfinite(loss_fn, params, batch) is None


def test_a_loss_that_is_non_finite_after_the_last_layer():
    loss_fn, params, batch = make(jnp.tanh)
    report = find_nonfinite(lambda p, b: jnp.log(-loss_fn(p, b)), params, batch)  # NaN, finite derivative
    assert not report.loss_finite and report  # truthy: something is non-finite
    assert report.layer is None and report.forward_layer is None
    assert "after the last layer" in report.message


def test_no_layer(monkeypatch):
    # w * x is a scale layer found by plain-JAX matching (w, a bare array, is "arg0")
    assert "arg0" in str(find_nonfinite(lambda w, x: jnp.sum(w * x), jnp.ones(3), jnp.ones(3)))
    monkeypatch.setenv("VJPKIT_MATCH", "0")
    with pytest.raises(vk.ConfigError, match="calls no vjpkit layer"):
        find_nonfinite(lambda w, x: jnp.sum(w * x), jnp.ones(3), jnp.ones(3))
    assert first_nonfinite(lambda w, x: jnp.sum(w * x), jnp.ones(3), jnp.ones(3)) is None
