"""vk.curvature's K-FAC optimizer (``vjpkit.curvature._kfac.kfac``) against a dense NumPy reference.

The reference below is written from the method's definition (EMA of the factors from the first
observation, pi-scaled Tikhonov damping inverted by ``np.linalg.inv``, the eigh solver as the
exact inverse of ``kron(A, G) + damping I``, refresh every N steps, momentum as a trace), in
float64, and fed the same stream of gradients and factors as the optimizer.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.tree_util import DictKey

from tests.helpers import tree_allclose
from vjpkit._errors import ConfigError
from vjpkit.curvature._kfac import KfacState, kfac
from vjpkit.curvature._types import Factors, LayerCurvature, Layout

SIZES = {"fc1": (3, 5), "fc2": (5, 4), "fc3": (4, 2)}  # a 3-5-4-2 MLP with biases
N_ROWS = 8


def _layout(
    name: str, *, weight: str = "weight", bias: str | None = "bias", kind: str = "dense", **kw
) -> Layout:
    return Layout(
        kind=kind,
        weight=weight,
        bias=bias,
        weight_leaf=(DictKey(name), DictKey(weight)),
        bias_leaf=None if bias is None else (DictKey(name), DictKey(bias)),
        **kw,
    )


def _factors(rng, d_in: int, d_out: int, *, bias: bool = True, n: int = N_ROWS):
    """``A = [a, 1]^T [a, 1] / N`` and ``G = g^T g`` from random activations and cotangents."""
    a = rng.normal(size=(n, d_in))
    if bias:
        a = np.concatenate([a, np.ones((n, 1))], axis=1)
    g = 0.3 * rng.normal(size=(n, d_out))
    return a.T @ a / n, g.T @ g


def _round32(tree):
    """The float64 values float32 holds (so both sides see the same inputs)."""
    return jax.tree.map(lambda x: np.asarray(x, np.float32).astype(np.float64), tree)


def _mlp_params(rng):
    return {n: {"weight": rng.normal(size=s), "bias": 0.1 * rng.normal(size=s[1])} for n, s in SIZES.items()}


def _stream(seed: int, steps: int):
    """Per step: gradients like the params, and ``{layer: (A, G)}``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        grads = {n: {"weight": rng.normal(size=s), "bias": rng.normal(size=s[1])} for n, s in SIZES.items()}
        facs = {n: _factors(rng, *s) for n, s in SIZES.items()}
        out.append(_round32((grads, facs)))
    return out


def _curvature(facs, dtype, estimator: str = "kfac"):
    return {
        n: LayerCurvature(
            **{estimator: Factors(jnp.asarray(A, dtype), jnp.asarray(G, dtype))}, layout=_layout(n)
        )
        for n, (A, G) in facs.items()
    }


def _to_jax(tree, dtype):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


# ---------------------------------------------------------------------------------------------
# The NumPy reference (float64, dense, from the definitions)


class _RefKfac:
    """Damped K-FAC on ``{layer: {"weight": (in, out), "bias": (out,)}}``, one step at a time."""

    def __init__(self, *, lr, damping, decay, every, solver, pi_damping, momentum):
        self.lr, self.damping, self.decay, self.every = lr, damping, decay, every
        self.solver, self.pi_damping, self.momentum = solver, pi_damping, momentum
        self.t, self.ema, self.inv, self.trace = 0, {}, {}, {}

    def step(self, params, grads, facs):
        t, decay, damping = self.t, self.decay, self.damping
        for n, (A, G) in facs.items():
            if t == 0:
                self.ema[n] = (A, G)
            else:
                old_A, old_G = self.ema[n]
                self.ema[n] = (decay * old_A + (1 - decay) * A, decay * old_G + (1 - decay) * G)
        if t % self.every == 0:
            for n, (A, G) in self.ema.items():
                dA, dG = len(A), len(G)
                if self.solver == "inverse":
                    pi = np.sqrt((np.trace(A) / dA) / (np.trace(G) / dG)) if self.pi_damping else 1.0
                    self.inv[n] = (
                        np.linalg.inv(A + pi * np.sqrt(damping) * np.eye(dA)),
                        np.linalg.inv(G + np.sqrt(damping) / pi * np.eye(dG)),
                    )
                else:  # (A kron G + damping I)^-1 acting on vec(M), M (in+1, out) flattened row-major
                    self.inv[n] = np.linalg.inv(np.kron(A, G) + damping * np.eye(dA * dG))
        lr = self.lr(t) if callable(self.lr) else self.lr
        new = {}
        for n, g in grads.items():
            M = np.vstack([g["weight"], g["bias"][None]])
            if self.solver == "inverse":
                D = self.inv[n][0] @ M @ self.inv[n][1]
            else:
                D = (self.inv[n] @ M.ravel()).reshape(M.shape)
            if self.momentum is not None:
                self.trace[n] = D + self.momentum * self.trace.get(n, 0.0)
                D = self.trace[n]
            new[n] = {"weight": params[n]["weight"] - lr * D[:-1], "bias": params[n]["bias"] - lr * D[-1]}
        self.t += 1
        return new


def _ref_run(params, stream, **config):
    """The parameters after each step of the reference fed ``stream``."""
    ref, history = _RefKfac(**config), []
    for grads, facs in stream:
        params = ref.step(params, grads, facs)
        history.append(params)
    return history


def _jax_loop(opt, params, stream, dtype, *, jit):
    """The parameters after each step, one ``update`` call per step (jitted or eager)."""

    def step(params, state, grads, curvature):
        updates, state = opt.update(grads, state, params, curvature=curvature)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if jit else step
    params = _to_jax(params, dtype)
    state = opt.init(params)
    history = []
    for grads, facs in stream:
        params, state = step(params, state, _to_jax(grads, dtype), _curvature(facs, dtype))
        history.append(params)
    return history, state


def _jax_scan(opt, params, stream, dtype, *, estimator="kfac"):
    """The parameters after each step (stacked along axis 0): the steps as one jitted ``lax.scan``."""
    stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs), dtype), *stream)

    def body(carry, xs):
        params, state = carry
        grads, facs = xs
        updates, state = opt.update(grads, state, params, curvature=_curvature(facs, dtype, estimator))
        params = optax.apply_updates(params, updates)
        return (params, state), params

    params = _to_jax(params, dtype)
    carry = (params, opt.init(params))
    (_, state), history = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(carry, stacked)
    return history, state


def _linear_schedule(t):
    """A schedule of the update count, in the default float dtype (float64 under x64)."""
    return 0.1 + (0.02 - 0.1) * np.minimum(t, 150) / 150


def _jnp_linear_schedule(count):
    return 0.1 + (0.02 - 0.1) * jnp.minimum(count, 150).astype(float) / 150


CONFIGS = {  # between them: update_every 1 and 5, both solvers, pi on and off, momentum, a schedule
    "inverse-every1-kflr": dict(every=1, solver="inverse", pi_damping=True, momentum=None, estimator="kflr"),
    "inverse-every5-nopi-momentum-schedule": dict(
        every=5, solver="inverse", pi_damping=False, momentum=0.9, schedule=True
    ),
    "eigh-every1": dict(every=1, solver="eigh", pi_damping=True, momentum=None),
    "eigh-every5-momentum": dict(every=5, solver="eigh", pi_damping=True, momentum=0.5),
}


def _compare(cfg, dtype, rtol, steps=200):
    """Runs kfac and the reference on one stream; compares the parameters after every step.

    The absolute tolerance is ``rtol`` times the largest entry of the leaf at that step (entries
    near 0 carry the rounding of the larger ones).
    """
    rng = np.random.default_rng(0)
    params = _round32(_mlp_params(rng))
    stream = _stream(1, steps)
    damping, decay = 1e-2, 0.9
    estimator = cfg.get("estimator", "kfac")
    ref_lr = _linear_schedule if cfg.get("schedule") else 0.05
    lr = _jnp_linear_schedule if cfg.get("schedule") else 0.05
    opt = kfac(
        lr,
        like=_curvature(stream[0][1], dtype, estimator),
        estimator=estimator,
        damping=damping,
        decay=decay,
        update_every=cfg["every"],
        solver=cfg["solver"],
        pi_damping=cfg["pi_damping"],
        momentum=cfg["momentum"],
    )
    got, state = _jax_scan(opt, params, stream, dtype, estimator=estimator)
    got = jax.tree.map(np.asarray, got)
    want = _ref_run(
        params,
        stream,
        lr=ref_lr,
        damping=damping,
        decay=decay,
        every=cfg["every"],
        solver=cfg["solver"],
        pi_damping=cfg["pi_damping"],
        momentum=cfg["momentum"],
    )
    for t, w in enumerate(want):
        for n in SIZES:
            for k in ("weight", "bias"):
                assert got[n][k].dtype == dtype
                np.testing.assert_allclose(
                    got[n][k][t].astype(np.float64),
                    w[n][k],
                    rtol=rtol,
                    atol=rtol * np.abs(w[n][k]).max(),
                    err_msg=f"step {t} {n}.{k}",
                )
    assert int(state.count) == steps


@pytest.mark.parametrize(
    "name", ["inverse-every1-kflr", "inverse-every5-nopi-momentum-schedule", "eigh-every5-momentum"]
)
def test_matches_numpy_reference_float64(name):
    with jax.enable_x64(True):
        _compare(CONFIGS[name], jnp.float64, rtol=1e-9)


@pytest.mark.parametrize("name", ["eigh-every1"])
def test_matches_numpy_reference_float32(name):
    """float32 against the float64 reference: 200 steps of rounding stay within 1e-5 of the scale."""
    _compare(CONFIGS[name], jnp.float32, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# jit, chain, state


def test_jit_and_eager_agree():
    """One covered layer, one uncovered leaf; the refresh taken and skipped (``lax.cond``) both ways."""
    rng = np.random.default_rng(5)
    params = {"fc1": _round32(_mlp_params(rng)["fc1"]), "scale": rng.normal(size=3)}
    stream = []
    for grads, facs in _stream(6, 2):  # count 0 refreshes the inverses, count 1 reuses them
        stream.append(({"fc1": grads["fc1"], "scale": rng.normal(size=3)}, {"fc1": facs["fc1"]}))
    opt = kfac(0.05, like=_curvature(stream[0][1], jnp.float32), update_every=2, momentum=0.9)
    eager, s_eager = _jax_loop(opt, params, stream, jnp.float32, jit=False)
    jitted, s_jit = _jax_loop(opt, params, stream, jnp.float32, jit=True)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a["scale"], b["scale"], rtol=1e-6)
        for k in ("weight", "bias"):
            np.testing.assert_allclose(a["fc1"][k], b["fc1"][k], rtol=1e-5, atol=1e-6)
    assert int(s_eager.count) == int(s_jit.count) == 2


def _needs_value():
    """An extra-args member that requires its own extra argument (as ``polyak_sgd`` needs ``value``)."""

    def update(updates, state, params=None, *, value, **extra):
        del extra
        return jax.tree.map(lambda u: u * value, updates), state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def test_inside_optax_chain_with_extra_args():
    wd, steps = 0.01, 12
    rng = np.random.default_rng(7)
    params = _round32(_mlp_params(rng))
    stream = _stream(8, steps)
    opt = optax.chain(
        optax.add_decayed_weights(wd),
        kfac(0.05, like=_curvature(stream[0][1], jnp.float32), damping=1e-2, decay=0.9, update_every=2),
        _needs_value(),
    )

    @jax.jit
    def step(params, state, grads, curvature):
        updates, state = opt.update(grads, state, params, curvature=curvature, value=jnp.float32(0.5))
        return optax.apply_updates(params, updates), state

    p = _to_jax(params, jnp.float32)
    state = opt.init(p)
    ref = params
    reference = _RefKfac(  # the last member halves kfac's output: value=0.5
        lr=0.05 * 0.5, damping=1e-2, decay=0.9, every=2, solver="inverse", pi_damping=True, momentum=None
    )
    for grads, facs in stream:
        # the decayed weights enter the gradient the reference preconditions
        g = {n: {k: grads[n][k] + wd * ref[n][k] for k in ("weight", "bias")} for n in SIZES}
        p, state = step(p, state, _to_jax(grads, jnp.float32), _curvature(facs, jnp.float32))
        ref = reference.step(ref, g, facs)
    for n in SIZES:
        for k in ("weight", "bias"):
            np.testing.assert_allclose(np.asarray(p[n][k], np.float64), ref[n][k], rtol=1e-5, atol=1e-5)
    assert isinstance(state[1], KfacState)


def test_state_layout_and_refresh_schedule():
    rng = np.random.default_rng(9)
    params = _to_jax(_round32(_mlp_params(rng)), jnp.float32)
    stream = _stream(10, 7)
    like = jax.eval_shape(lambda: _curvature(stream[0][1], jnp.float32))  # ShapeDtypeStructs
    opt = kfac(0.05, like=like, update_every=3)
    state = opt.init(params)
    assert isinstance(state, KfacState) and state._fields == ("count", "factors", "inverses", "inner")
    assert set(state.factors) == set(state.inverses) == set(SIZES) and int(state.count) == 0
    assert state.factors["fc2"].A.shape == (6, 6) and state.factors["fc2"].G.shape == (4, 4)
    assert state.inverses["fc2"].A.shape == (6, 6) and state.inverses["fc2"].G.shape == (4, 4)

    step = jax.jit(lambda g, s, c: opt.update(g, s, params, curvature=c)[1])
    inverses = []
    for t, (grads, facs) in enumerate(stream):
        state = step(_to_jax(grads, jnp.float32), state, _curvature(facs, jnp.float32))
        if t == 0:  # the EMA starts at the first observation
            np.testing.assert_allclose(np.asarray(state.factors["fc1"].A), facs["fc1"][0], rtol=1e-6)
        inverses.append(np.asarray(state.inverses["fc1"].A))
    same = [np.array_equal(inverses[t], inverses[t - 1]) for t in range(1, 7)]
    assert same == [True, True, False, True, True, False]  # refreshed at counts 0, 3 and 6
    assert int(state.count) == 7

    eigh = kfac(0.05, like=like, solver="eigh").init(params)
    u_a, s_a, u_g, s_g, _ = eigh.inverses["fc2"]  # and the damping
    assert (u_a.shape, s_a.shape, u_g.shape, s_g.shape) == ((6, 6), (6,), (4, 4), (4,))


# ---------------------------------------------------------------------------------------------
# layouts: how leaves map to M = [W; b]


def _pi_damped(A, G, M, damping):  # noqa: N803
    pi = np.sqrt((np.trace(A) / len(A)) / (np.trace(G) / len(G)))
    s = np.sqrt(damping)
    return np.linalg.inv(A + pi * s * np.eye(len(A))) @ M @ np.linalg.inv(G + s / pi * np.eye(len(G)))


LAYOUTS = {
    # name: (weight shape, bias shape or None, Layout keywords, leaf -> (in, out), (in, out) -> leaf)
    "dense": ((3, 4), (4,), {}, lambda w: w, lambda m: m),
    "equinox-transpose": ((4, 3), (4,), {"transpose": True}, lambda w: w.T, lambda m: m.T),
    "conv-hwio": (
        (3, 3, 2, 4),
        (4,),
        {"kind": "conv", "in_ndim": 3},
        lambda w: w.reshape(18, 4),
        lambda m: m.reshape(3, 3, 2, 4),
    ),
    "dense-general": (
        (2, 3, 2, 2),
        (2, 2),
        {"in_ndim": 2},
        lambda w: w.reshape(6, 4),
        lambda m: m.reshape(2, 3, 2, 2),
    ),
    "transpose-no-bias": ((4, 3), None, {"transpose": True}, lambda w: w.T, lambda m: m.T),
}


def test_layouts_precondition_the_matrix():
    """Each layout's leaves, mapped to ``M = [W; b]`` by hand, get ``A_d^-1 M G_d^-1`` (one optimizer)."""
    rng = np.random.default_rng(11)
    grads, curvature, expected = {}, {}, {}
    for case, (wshape, bshape, kw, to_m, from_m) in LAYOUTS.items():
        has_bias = bshape is not None
        d_in, d_out = to_m(np.zeros(wshape)).shape
        A, G = _round32(_factors(rng, d_in, d_out, bias=has_bias, n=32))
        gw = _round32(rng.normal(size=wshape))
        grads[case] = {"kernel": gw}
        M = to_m(gw)
        if has_bias:
            grads[case]["bias"] = gb = _round32(rng.normal(size=bshape))
            M = np.vstack([M, gb.reshape(1, -1)])
        layout = _layout(case, weight="kernel", bias="bias" if has_bias else None, **kw)
        curvature[f"model/{case}"] = LayerCurvature(kfac=Factors(A, G), layout=layout)
        P = -0.5 * _pi_damped(A, G, M, 1e-2)
        expected[case] = {"kernel": from_m(P[: len(P) - has_bias])}
        if has_bias:
            expected[case]["bias"] = P[-1].reshape(bshape)
    curvature = _to_jax(curvature, jnp.float32)
    opt = kfac(0.5, like=curvature, damping=1e-2)
    g32 = _to_jax(grads, jnp.float32)
    updates, _ = jax.jit(lambda g, s, c: opt.update(g, s, curvature=c))(g32, opt.init(g32), curvature)
    for case, want in expected.items():
        for k, w in want.items():
            assert updates[case][k].shape == w.shape
            np.testing.assert_allclose(np.asarray(updates[case][k]), w, rtol=2e-5, atol=1e-6, err_msg=case)


# ---------------------------------------------------------------------------------------------
# fallbacks, shared weights, scan axes, axis_name


def test_layer_without_leaf_path_and_uncovered_leaf_get_sgd():
    rng = np.random.default_rng(12)
    params = _to_jax(
        {
            "fc1": {"weight": rng.normal(size=(3, 5)), "bias": rng.normal(size=5)},
            "stack": {"weight": rng.normal(size=(4, 2, 2)), "bias": rng.normal(size=(4, 2))},
            "scale": rng.normal(size=3),
            "head": {"weight": rng.normal(size=(5, 2)), "bias": rng.normal(size=2)},
        },
        jnp.float32,
    )
    grads = jax.tree.map(lambda x: x + 1.0, params)
    A1, G1 = _factors(rng, 3, 5)
    As, Gs = zip(*(_factors(rng, 2, 2) for _ in range(4)))
    A3, G3 = _factors(rng, 5, 2)
    stacked = Layout(kind="dense", weight="weight", bias="bias")  # a slice of a stacked weight: no path
    no_bias_leaf = Layout(
        kind="dense", weight="weight", bias="bias", weight_leaf=(DictKey("head"), DictKey("weight"))
    )
    curvature = _to_jax(
        {
            "fc1": LayerCurvature(kfac=Factors(A1, G1), layout=_layout("fc1")),
            "scan/stack": LayerCurvature(kfac=Factors(np.stack(As), np.stack(Gs)), layout=stacked),
            "head": LayerCurvature(kfac=Factors(A3, G3), layout=no_bias_leaf),
        },
        jnp.float32,
    )
    opt = kfac(0.1, like=curvature, damping=1e-2)
    with pytest.warns(UserWarning) as caught:
        state = opt.init(params)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3, messages
    assert any("'scan/stack'" in m for m in messages) and any("'head'" in m for m in messages)
    assert any("no layer of like covers the leaves" in m and "['scale']" in m for m in messages)
    assert all("SGD" in m for m in messages)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="kfac")  # warned once: not again at trace time
        updates, state = jax.jit(lambda g, s, c: opt.update(g, s, params, curvature=c))(
            grads, state, curvature
        )
    for path in (("stack", "weight"), ("stack", "bias"), ("head", "weight"), ("head", "bias")):
        np.testing.assert_allclose(updates[path[0]][path[1]], -0.1 * grads[path[0]][path[1]], rtol=1e-6)
    np.testing.assert_allclose(updates["scale"], -0.1 * grads["scale"], rtol=1e-6)
    M = np.vstack([np.asarray(grads["fc1"]["weight"]), np.asarray(grads["fc1"]["bias"])[None]])
    P = -0.1 * _pi_damped(*_round32((A1, G1)), M, 1e-2)
    np.testing.assert_allclose(updates["fc1"]["weight"], P[:-1], rtol=2e-5, atol=1e-6)
    assert set(state.factors) == {"fc1"}


def _shared_step(rng):
    """One step's gradients, and factors of ``fc1`` called twice and ``fc2`` at 3 scan iterations."""
    f1a, f1b = _round32((_factors(rng, 3, 5), _factors(rng, 3, 5)))
    f2 = _round32([_factors(rng, 5, 4) for _ in range(3)])
    f3 = _round32(_factors(rng, 4, 2))
    grads = _round32(
        {n: {"weight": rng.normal(size=s), "bias": rng.normal(size=s[1])} for n, s in SIZES.items()}
    )
    curvature = {
        "fc1": LayerCurvature(kfac=Factors(*f1a), layout=_layout("fc1")),
        "fc1#1": LayerCurvature(kfac=Factors(*f1b), layout=_layout("fc1")),
        "scan/fc2": LayerCurvature(kfac=Factors(*map(np.stack, zip(*f2))), layout=_layout("fc2")),
        "fc3": LayerCurvature(kfac=Factors(*f3), layout=_layout("fc3")),
    }
    summed = {"fc1": (f1a[0] + f1b[0], f1a[1] + f1b[1]), "fc2": tuple(sum(x) for x in zip(*f2)), "fc3": f3}
    return grads, _to_jax(curvature, jnp.float32), summed


def test_shared_weight_and_scan_iterations_sum_factors():
    """Each weight's A's are summed and its G's are summed, over calls and scan iterations."""
    rng = np.random.default_rng(13)
    params = _round32(_mlp_params(rng))
    p32 = _to_jax(params, jnp.float32)
    steps = [_shared_step(rng) for _ in range(3)]
    opt = kfac(0.05, like=steps[0][1], momentum=0.5)
    state = opt.init(p32)
    assert set(state.factors) == {"fc1", "scan/fc2", "fc3"}
    step = jax.jit(lambda g, s, c: opt.update(g, s, p32, curvature=c))
    reference = _RefKfac(
        lr=0.05, damping=1e-3, decay=0.95, every=1, solver="inverse", pi_damping=True, momentum=0.5
    )
    for grads, curvature, summed in steps:
        updates, state = step(_to_jax(grads, jnp.float32), state, curvature)
        stepped = reference.step(params, grads, summed)
        for n in SIZES:
            for k in ("weight", "bias"):
                want = stepped[n][k] - params[n][k]
                np.testing.assert_allclose(updates[n][k], want, rtol=2e-5, atol=1e-6, err_msg=f"{n}.{k}")


def test_axis_name_averages_the_factors_across_replicas():
    rng = np.random.default_rng(14)
    params = _round32(_mlp_params(rng))
    (grads, facs_a), (_, facs_b) = _stream(15, 2)
    ca, cb = _curvature(facs_a, jnp.float32), _curvature(facs_b, jnp.float32)
    opt = kfac(0.05, like=ca, axis_name="replica")
    p32, g32 = _to_jax(params, jnp.float32), _to_jax(grads, jnp.float32)
    state = opt.init(p32)
    replicated = jax.vmap(lambda c: opt.update(g32, state, p32, curvature=c)[0], axis_name="replica")
    per_replica = jax.jit(replicated)(jax.tree.map(lambda a, b: jnp.stack([a, b]), ca, cb))
    mean = {n: ((facs_a[n][0] + facs_b[n][0]) / 2, (facs_a[n][1] + facs_b[n][1]) / 2) for n in SIZES}
    reference = _RefKfac(
        lr=0.05, damping=1e-3, decay=0.95, every=1, solver="inverse", pi_damping=True, momentum=None
    )
    stepped = reference.step(params, grads, mean)
    for n in SIZES:
        for k in ("weight", "bias"):
            want = stepped[n][k] - params[n][k]
            for r in range(2):
                np.testing.assert_allclose(
                    per_replica[n][k][r], want, rtol=2e-5, atol=1e-6, err_msg=f"{r} {n}.{k}"
                )


# ---------------------------------------------------------------------------------------------
# errors


def _like():
    return _curvature(_stream(16, 1)[0][1], jnp.float32)


def _params32():
    return _to_jax(_round32(_mlp_params(np.random.default_rng(17))), jnp.float32)


def test_error_like_lacks_the_estimator_factors():
    like = _like()
    like["fc2"] = LayerCurvature(kflr=like["fc2"].kfac, layout=like["fc2"].layout)
    with pytest.raises(
        ConfigError, match=r"layer 'fc2' has no 'kfac' factors.*vk\.curvature\.stats\(\.\.\., \['kfac'"
    ):
        kfac(0.1, like=like)
    kfac(0.1, like={"fc2": like["fc2"]}, estimator="kflr")  # the field requested


def test_error_weight_leaf_not_in_params():
    like = _like()
    like["dense_9"] = LayerCurvature(kfac=like["fc1"].kfac, layout=_layout("fc9"))
    opt = kfac(0.1, like=like)
    with pytest.raises(
        ConfigError, match=r"layer 'dense_9' names the leaf \['fc9'\]\['weight'\], which is not in params"
    ):
        opt.init(_params32())


def test_error_factor_shapes_do_not_fit_the_leaves():
    like = _like()
    rng = np.random.default_rng(18)
    like["fc2"] = LayerCurvature(
        kfac=Factors(*_to_jax(_factors(rng, 4, 4), jnp.float32)), layout=_layout("fc2")
    )
    with pytest.raises(ConfigError, match=r"layer 'fc2'.*\(5, 4\).*expected A \(6, 6\), G \(4, 4\)"):
        kfac(0.1, like=like).init(_params32())
    params = _params32()
    params["fc3"]["bias"] = jnp.zeros(3, jnp.float32)
    with pytest.raises(
        ConfigError, match=r"layer 'fc3': the bias leaf \['fc3'\]\['bias'\] has shape \(3,\), expected 2"
    ):
        kfac(0.1, like=_like()).init(params)


def test_error_curvature_missing_at_update():
    like, params = _like(), _params32()
    opt = kfac(0.1, like=like)
    state = opt.init(params)
    partial = {k: v for k, v in like.items() if k != "fc2"}
    with pytest.raises(
        ConfigError, match=r"'fc2' of like are missing from this step's curvature.*vk\.curvature\.stats"
    ):
        opt.update(params, state, params, curvature=partial)
    extra = {**like, "fc4": like["fc1"]}
    with pytest.raises(ConfigError, match=r"'fc4' of this step's curvature are not in like"):
        opt.update(params, state, params, curvature=extra)
    wrong = {**like, "fc1": LayerCurvature(kfac=like["fc2"].kfac, layout=like["fc1"].layout)}
    with pytest.raises(ConfigError, match=r"layer 'fc1': this step's kfac factors A \(6, 6\)"):
        opt.update(params, state, params, curvature=wrong)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"solver": "cholesky"}, "solver='cholesky'"),
        ({"estimator": "fisher"}, "estimator='fisher'"),
        ({"damping": 0.0}, "damping=0.0"),
        ({"decay": 1.0}, "decay=1.0"),
        ({"update_every": 0}, "update_every=0"),
    ],
)
def test_error_bad_options(kw, match):
    with pytest.raises(ConfigError, match=match) as info:
        kfac(0.1, like=_like(), **kw)
    assert isinstance(info.value, ValueError)


def test_a_step_without_statistics_uses_the_cached_inverses():
    """``curvature=None``: the EMA is kept and the cached inverses precondition the step, as a
    step with statistics between two refreshes does."""
    like, params = _like(), _params32()
    opt = kfac(0.1, like=like, update_every=5)
    _, state = opt.update(params, opt.init(params), params, curvature=like)  # refreshes (count 0)
    without, kept = opt.update(params, state, params)
    with_stats, _ = opt.update(params, state, params, curvature=like)  # count 1: no refresh
    tree_allclose(without, with_stats)
    tree_allclose(kept.factors, state.factors)
    tree_allclose(kept.inverses, state.inverses)
    assert int(kept.count) == int(state.count) + 1


@pytest.mark.parametrize("solver", ["inverse", "eigh"])
def test_a_jitted_first_update_without_statistics_is_nan_not_sgd(solver):
    """Under ``jax.jit`` the count is not known at trace time, so a first update without
    ``curvature=`` cannot raise: its updates are NaN (loud: a training loop stops on them), never
    the plain momentum-SGD step; eagerly it is a ``ConfigError``; with statistics it is finite."""
    like, params = _like(), _params32()
    opt = kfac(0.1, like=like, solver=solver)
    state = opt.init(params)
    updates, _ = jax.jit(lambda g, s, p: opt.update(g, s, p))(params, state, params)
    assert all(np.all(np.isnan(np.asarray(u))) for u in jax.tree.leaves(updates))
    with pytest.raises(ConfigError, match="first update"):
        opt.update(params, state, params)
    step = jax.jit(lambda g, s, p, c: opt.update(g, s, p, curvature=c))
    updates, state = step(params, state, params, like)
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))
    later, _ = jax.jit(lambda g, s, p: opt.update(g, s, p))(params, state, params)  # cached inverses
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(later))
