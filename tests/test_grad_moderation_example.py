"""The gradient-moderation example: its EMA state, step by step, against a numpy re-implementation.

The reference never uses vjpkit: each step's raw gradient is ``jax.grad`` of the plain loss at
the params the example had before that step, the EMA and the normalization are numpy (float64),
and the optimizer update is optax's. The example's params after each step must equal the
reference update of the *normalized* gradients (and differ from a plain-gradient update), so the
check fails if the hook does nothing, normalizes the wrong thing, or the state is not threaded.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import numpy as np
import optax
import pytest

import vjpkit as vk
from tests.helpers import load_example, tree_allclose

pytest.importorskip("sklearn", reason='the digits examples need scikit-learn: pip install -e ".[examples]"')

STEPS = 6


@pytest.fixture(scope="module")
def example():
    module = load_example("grad_moderation")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = module.main(["--steps", str(STEPS), "--scan-steps", "3", "--print-every", "1"])
    return module, dict(out, printed=printed.getvalue())


def at(tree, t):
    return jax.tree.map(lambda a: a[t], tree)


def ema_reference(state, raw, decay, eps=1e-8):
    """One step of ema_normalize in numpy float64: ``(new_state, normalized gradients)``."""
    count, mean, var = state
    count = count + 1
    mean = {k: decay * mean[k] + (1 - decay) * np.mean(g) for k, g in raw.items()}
    var = {k: decay * var[k] + (1 - decay) * np.var(g) for k, g in raw.items()}
    correction = 1 - decay**count
    normalized = {
        k: (g - mean[k] / correction) / (np.sqrt(var[k] / correction) + eps) for k, g in raw.items()
    }
    return (count, mean, var), normalized


def check_state(got, ref, raw, scale, decay):
    """The EMA state against the float64 reference, within float32's error on each moment.

    ``mean`` is an EMA of the mean of a gradient whose entries have both signs: it can be far
    smaller than the entries (1e-7 against 1e-3), and float32 summation errs relative to the
    entries, not to the mean. So its tolerance is relative to ``scale``, the same EMA of
    ``mean(|g|)``: 1e-5 of it covers float32 rounding (eps 1.2e-7) over a few hundred entries
    accumulated pairwise. ``var`` is a mean of squares, with no cancellation: rtol 1e-4.
    """
    count, mean, var = ref
    for k, g in raw.items():
        scale[k] = decay * scale[k] + (1 - decay) * np.mean(np.abs(g))
    assert float(got.count) == count
    for k in mean:
        np.testing.assert_allclose(got.mean[k], mean[k], rtol=1e-4, atol=1e-5 * scale[k], err_msg=k)
        np.testing.assert_allclose(got.var[k], var[k], rtol=1e-4, err_msg=k)
    expected = as_state(ref)  # and the same structure, shapes and dtypes
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype


def as_state(state):
    count, mean, var = state
    f32 = lambda d: {k: np.float32(v) for k, v in d.items()}
    return vk.EmaNormalizeState(np.float32(count), f32(mean), f32(var))


@pytest.mark.parametrize("path", ["jit", "scan"])
def test_ema_state_matches_numpy_step_by_step(example, path):
    gm, out = example
    args = out["args"]
    decay = args["decay"]
    (x_train, y_train), _ = gm.load_data(args["seed"])
    optimizer = optax.sgd(args["lr"], momentum=args["momentum"])
    run = out[path]
    history = run["history"]
    assert history["loss"].shape == (STEPS,)
    tree_allclose(at(history["params"], 0), jax.tree.map(np.asarray, out["init_params"]), rtol=0, atol=0)

    ref_state = {name: (0, {"weight": 0.0, "bias": 0.0}, {"weight": 0.0, "bias": 0.0}) for name in gm.CONVS}
    opt_state = optimizer.init(out["init_params"])
    raw_grad = jax.jit(jax.grad(gm.loss_fn))  # plain JAX: no vjpkit transform, no hooks

    @jax.jit
    def sgd(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    scale = {name: {"weight": 0.0, "bias": 0.0} for name in gm.CONVS}  # EMA of mean |g|
    for t in range(STEPS):
        params = at(history["params"], t)
        batch = out["idx"][t]
        raw = raw_grad(params, x_train[batch], y_train[batch])
        grads = dict(raw)
        for name in gm.CONVS:
            raw_np = {k: np.asarray(g, np.float64) for k, g in raw[name].items()}
            ref_state[name], normalized = ema_reference(ref_state[name], raw_np, decay)
            check_state(at(history["state"][name], t), ref_state[name], raw_np, scale[name], decay)
            grads[name] = {k: g.astype(np.float32) for k, g in normalized.items()}
            # what the example prints: raw std (from the EMA update) and normalized std (captured)
            report = run["report"][name]
            np.testing.assert_allclose(report["raw_std"][t], np.std(raw_np["weight"]), rtol=1e-3)
            np.testing.assert_allclose(report["raw_mean"][t], np.mean(raw_np["weight"]), rtol=1e-3, atol=1e-8)
            np.testing.assert_allclose(report["norm_std"][t], np.std(normalized["weight"]), rtol=1e-4)
            assert report["count"][t] == t + 1
        plain, _ = sgd(raw, opt_state, params)
        expected, opt_state = sgd(grads, opt_state, params)
        got = at(history["params"], t + 1) if t + 1 < STEPS else run["params"]
        tree_allclose(got, jax.tree.map(np.asarray, expected), rtol=1e-5, atol=2e-6)
        # and the plain-gradient update is measurably different: the hook really moderated
        diff = np.max(np.abs(np.asarray(plain["conv1"]["weight"]) - np.asarray(got["conv1"]["weight"])))
        assert diff > 1e-3
    tree_allclose(run["hook_state"], at(history["state"], STEPS - 1), rtol=0, atol=0)


def test_prints_state_and_std_every_step(example):
    _, out = example
    printed = out["printed"]
    for word in ("ema_mean", "ema_var", "raw_std", "norm_std", "BEFORE normalization", "test accuracy"):
        assert word in printed
    for path in ("jit", "scan"):
        block = printed.split(f"[{path}] ")[1]
        rows = [line.split() for line in block.splitlines()[3:] if line[:5].strip().isdigit()]
        assert [int(r[0]) for r in rows] == list(range(1, STEPS + 1))
        report = out[path]["report"]["conv1"]
        # columns: step loss | count ema_mean ema_var raw_std norm_std | ...
        for t, row in enumerate(rows):
            assert float(row[3]) == t + 1
            np.testing.assert_allclose(float(row[6]), report["raw_std"][t], rtol=1e-3)


# The docstring's account of how the jitted and scanned runs compare, checked as it is written:
# the numbers are read from the docstring, and each is checked against the two runs themselves.
CLAIM = re.compile(
    r"the first step's loss is the same to the bit, but its conv kernel gradients differ in their last"
    r" bits \(by at most about (?P<ulps>\d+) float32 ulps of the largest entry\)\. At the defaults the"
    r" parameters of the two runs stay within (?P<tol_a>\S+) of each other for the first"
    r" (?P<steps_a>\d+) steps; how soon after that the gap grows depends on the XLA build and the CPU"
    r" \(.*?\); by step (?P<sep_step>\d+) they have separated \(by more than (?P<sep>\S+)\): two"
    r" different runs of the same training, both of which learn\..*? the jitted run alone, started"
    r" from a kernel with one"
    r" entry changed by one ulp, separates from itself by more than (?P<sep_ulp>\S+) by step"
    r" (?P=sep_step) too(?: \(.*?\))?, while without the hook \(plain SGD\) the jitted and scanned"
    r" runs are still"
    r" within (?P<tol_plain>\S+) of each other at step (?P=sep_step)\."
)


@pytest.fixture(scope="module")
def claim():
    match = CLAIM.search(" ".join(load_example("grad_moderation").__doc__.split()))
    assert match, "the docstring's jit-versus-scan paragraph changed: update CLAIM and these tests"
    return {k: float(v) if "." in v or "e" in v else int(v) for k, v in match.groupdict().items()}


def test_jit_and_scan_agree_to_rounding_at_first(claim):
    """The first step's loss is equal to the bit, and the params stay within the stated bound."""
    steps = max(claim["steps_a"], 1)
    gm = load_example("grad_moderation")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = gm.main(["--steps", str(steps)])  # the defaults otherwise
    jit, scan = out["jit"], out["scan"]
    assert jit["history"]["loss"][0] == scan["history"]["loss"][0]
    gap = gm.param_gap(jit, scan)
    assert gap.shape == (steps,)
    assert np.all(gap <= claim["tol_a"]), f"largest gap {gap.max():.2e} at step {gap.argmax() + 1}"
    if jax.default_backend() == "cpu":  # "not bit for bit", which the docstring says of XLA:CPU
        assert gap[0] > 0
    # and the script prints the same gaps
    line = printed.getvalue().split("jit vs scan")[1].splitlines()[0]
    for t, value in re.findall(r"(\d+): (\S+?)(?:,|$)", line):
        np.testing.assert_allclose(float(value), gap[int(t) - 1], rtol=0.06)


def test_first_step_kernel_gradients_differ_in_last_bits(claim):
    """The source of the difference: the conv kernel gradients of a jitted step and of one in a scan."""
    gm = load_example("grad_moderation")
    (x_train, y_train), _ = gm.load_data(0)
    idx = gm.batch_indices(len(x_train), 1, 64, 0)
    x, y = x_train[idx], y_train[idx]  # the first batch, with a leading axis of 1 for the scan
    params = gm.model.init(jax.random.key(0), x[0])
    grad = jax.grad(gm.loss_fn)
    jitted = jax.jit(grad)(params, x[0], y[0])
    scanned = jax.jit(lambda p, xs, ys: jax.lax.scan(lambda c, b: (c, grad(c, *b)), p, (xs, ys))[1])(
        params, x, y
    )
    for name in gm.CONVS:
        a, b = np.asarray(jitted[name]["weight"]), np.asarray(scanned[name]["weight"][0])
        ulps = np.max(np.abs(a - b)) / np.spacing(np.max(np.abs(a)))
        assert ulps <= 1.5 * claim["ulps"], (name, ulps)
        if jax.default_backend() == "cpu":
            assert ulps > 0, name


@pytest.mark.slow
def test_jit_and_scan_separate_later_and_both_learn(claim):
    """Within the first bound, then separated; a one-ulp nudge does the same; plain SGD does not.

    How soon after ``steps_a`` the gap grows depends on the XLA build and the CPU (the docstring
    says so): a bound in between held on one build and not on another, so none is asserted.
    """
    gm = load_example("grad_moderation")
    steps = claim["sep_step"]
    assert claim["steps_a"] <= steps
    with contextlib.redirect_stdout(io.StringIO()):
        out = gm.main(["--steps", str(steps)])
    gap = gm.param_gap(out["jit"], out["scan"])
    assert np.all(gap[: claim["steps_a"]] <= claim["tol_a"]), gap[: claim["steps_a"]].max()
    assert gap[steps - 1] > claim["sep"], gap[steps - 1]
    assert out["jit"]["accuracy"] > 0.85 and out["scan"]["accuracy"] > 0.85  # both learn (0.1 is chance)

    args = out["args"]
    (x_train, y_train), _ = gm.load_data(args["seed"])
    optimizer = optax.sgd(args["lr"], momentum=args["momentum"])
    _, step = gm.make_step(args["decay"], optimizer)
    params = out["init_params"]

    def run(path, step, params, hook_state):
        carry = (params, optimizer.init(params), hook_state)
        if path == "jit":
            final, history = gm.train_jit(step, carry, x_train, y_train, out["idx"])
        else:
            final, history = gm.train_scan(step, carry, x_train, y_train, out["idx"], args["scan_steps"])
        return dict(history=history, params=final[0])

    # the jitted run alone, from conv1's kernel with its first entry moved by one ulp
    kernel = np.array(params["conv1"]["weight"])
    kernel.flat[0] = np.nextafter(kernel.flat[0], np.float32(np.inf))
    nudged = {**params, "conv1": {**params["conv1"], "weight": jax.numpy.asarray(kernel)}}
    gap = gm.param_gap(out["jit"], run("jit", step, nudged, out["init_hook_state"]))
    assert gap[0] > 0 and gap[steps - 1] > claim["sep_ulp"], gap[steps - 1]

    # without the hook (plain SGD on the same batches), the two paths stay together
    def plain_step(params, opt_state, hook_state, x, y):
        loss, grads = jax.value_and_grad(gm.loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, hook_state, loss, {}

    none = jax.numpy.zeros(())
    gap = gm.param_gap(run("jit", plain_step, params, none), run("scan", plain_step, params, none))
    assert gap[steps - 1] <= claim["tol_plain"], gap[steps - 1]
