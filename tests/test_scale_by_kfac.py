"""``vk.curvature.scale_by_kfac``: K-FAC's blocks (statistics, refresh, preconditioning) alone,
for any optax tail; ``kfac`` is it followed by momentum and the learning rate."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest

import vjpkit as vk

from . import test_curvature_blocks as cb
from .helpers import tree_allclose

pytestmark = pytest.mark.usefixtures("x64")  # float64: the comparisons are to rounding

SPEC = vk.curvature.stats("*", ["kflr"], max_factor_dim=6)
OPTIONS = dict(estimator="kflr", damping=1e-2, decay=0.5, update_every=2)


def _batches(n):
    step = jax.jit(vk.value_and_grad(cb.loss, capture=SPEC))
    out = []
    for seed in range(n):
        params, x, y = cb.problem(seed)
        (_, grads), cap = step(params, x, y)
        out.append((params, grads, cap))
    return out


def test_scale_by_kfac_direction_is_the_numpy_block_table():
    """Its first direction is the preconditioned gradient of every leaf (Kronecker blocks per
    scan slice with a diagonal side, diagonal blocks, the tied table), as a float64 NumPy
    reference computes it; no learning rate, no sign."""
    (params, grads, cap), *_ = _batches(1)
    opt = vk.curvature.scale_by_kfac(like=cap, **OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no leaf is left to SGD
        direction, state = opt.update(grads, opt.init(params), params, curvature=cap)
    assert isinstance(state, vk.curvature.ScaleByKfacState) and int(state.count) == 1
    want = cb._numpy_direction(grads, cap, cb.tied(cap), OPTIONS["damping"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-14), direction, want)


def test_kfac_is_scale_by_kfac_then_momentum_and_learning_rate(maybe_jit):
    """``kfac(lr, momentum=m)`` equals ``optax.chain(scale_by_kfac, trace(m),
    scale_by_learning_rate(lr))`` over steps with and without statistics and a refresh every
    other step, and its state holds the same factors and inverses."""
    batches = _batches(3)
    params, _, like = batches[0]
    lr, m = 0.1, 0.9
    fused = vk.curvature.kfac(lr, like=like, momentum=m, **OPTIONS)
    chained = optax.chain(
        vk.curvature.scale_by_kfac(like=like, **OPTIONS), optax.trace(m), optax.scale_by_learning_rate(lr)
    )
    s1, s2 = fused.init(params), chained.init(params)
    for i, (_, grads, cap) in enumerate([*batches, batches[0]]):
        cap = None if i == 2 else cap  # a step without statistics: the cached inverses
        u1, s1 = maybe_jit(lambda g, s, c: fused.update(g, s, params, curvature=c))(grads, s1, cap)
        u2, s2 = maybe_jit(lambda g, s, c: chained.update(g, s, params, curvature=c))(grads, s2, cap)
        tree_allclose(u1, u2, rtol=0, atol=0)
    tree_allclose((s1.count, s1.factors, s1.inverses), tuple(s2[0]), rtol=0, atol=0)


def test_make_step_finds_scale_by_kfac_in_a_chain_with_adam():
    """``make_step`` passes the statistics to ``scale_by_kfac`` inside ``optax.chain`` (here
    before Adam), also with ``curvature_every``; without a statistics capture it refuses."""
    params, x, y = cb.problem()
    like = jax.eval_shape(vk.value_and_grad(cb.loss, capture=SPEC), params, x, y)[1]
    opt = optax.chain(vk.curvature.scale_by_kfac(like=like, estimator="kflr", damping=1e-2), optax.adam(1e-2))
    batch_loss = lambda p, batch: cb.loss(p, *batch)
    for every in (1, 2):
        step = vk.train.make_step(batch_loss, opt, capture=SPEC, curvature_every=every)
        state = vk.train.TrainState.create(params, opt)
        first = None
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction: float ** int32
            for _ in range(4):
                state, metrics = step(state, (x, y))
                first = float(metrics["loss"]) if first is None else first
        assert float(metrics["loss"]) < first
        assert int(state.opt_state[0].count) == 4
    with pytest.raises(vk.ConfigError, match=r"capture= has none"):
        vk.train.make_step(batch_loss, opt)(vk.train.TrainState.create(params, opt), (x, y))
