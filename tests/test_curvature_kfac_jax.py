"""kfac-jax 0.0.8 as the oracle of ``vk.curvature``'s K-FAC factors, on one MLP in float64.

kfac-jax 0.0.8 needs jax <= 0.9.1 and vjpkit jax >= 0.10.1, so kfac-jax runs in its own venv
(``python benchmarks/kfac_jax_env.py`` makes it once, under ``~/.cache/vjpkit``: a CI step,
never a test) as a subprocess, ``benchmarks/kfac_jax_side.py factors``, on the same weights and
data written to an ``.npz``.
Without that environment (no network, a pip error) every test here skips with the reason.

What is compared, as Kronecker products ``kron(A, G)`` (the split of the scale between ``A`` and
``G`` is a convention), to 1e-5 relative, for every layer and for both of kfac-jax's layer
registrations (``kfac_jax.register_dense`` by hand, and its graph matcher):

* kfac-jax's ``ggn_exact`` and ``fisher_exact`` against vjpkit's ``kflr``;
* kfac-jax's ``fisher_gradients`` (one sample, rng ``k``) against vjpkit's ``kfac`` with
  ``mc_samples=1`` and the same key: both sample a single loss with the key itself
  (``jax.random.categorical(k, logits)``);
* kfac-jax's ``fisher_gradients`` with ``num_samples=M`` (sample ``m`` from
  ``jax.random.split(k, M)[m]``, the factors averaged) against vjpkit's ``kfac`` with
  ``mc_samples=M`` and the same key: there the keys agree as they are.

No scan or cond model: kfac-jax's graph matcher fails on both (``test_curvature.py`` checks
vjpkit there against the unrolled program).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import itertools
import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpkit as vk

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIDE = ROOT / "benchmarks" / "kfac_jax_side.py"
SIZES = (8, 7, 6, 5)  # distinct layer shapes: kfac-jax's blocks are matched to layers by shape
N, M = 32, 3
RTOL = 1e-5


def _env_module():
    spec = importlib.util.spec_from_file_location("kfac_jax_env", ROOT / "benchmarks" / "kfac_jax_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problem():
    rng = np.random.default_rng(0)
    params = {
        f"fc{i + 1}": {"w": 0.7 * rng.standard_normal((m, n)), "b": 0.3 * rng.standard_normal(n)}
        for i, (m, n) in enumerate(itertools.pairwise(SIZES))
    }
    x = rng.standard_normal((N, SIZES[0]))
    y = rng.integers(0, SIZES[-1], N)
    return params, x, y


def _model(p, x):
    h = x
    for i in range(len(SIZES) - 1):
        q = p[f"fc{i + 1}"]
        h = h @ q["w"] + q["b"]
        if i + 2 < len(SIZES):
            h = jnp.tanh(h)
    return h


def _loss(p, x, y):
    return vk.curvature.softmax_cross_entropy(_model(p, x), y)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """kfac-jax's factors (from the side environment) and vjpkit's, on one MLP and key."""
    env = _env_module()
    # made by a CI step (`python benchmarks/kfac_jax_env.py`), never inside a test
    python = env.side_python(create=False)
    if python is None:
        pytest.skip(
            f"no kfac-jax side environment: {env.side_reason(create=False)}; "
            "make it with `python benchmarks/kfac_jax_env.py` (CI's lower-bounds stage does)"
        )
    params, x, y = _problem()
    key = jax.random.key(7)  # vjpkit's key for both Monte-Carlo runs
    key_one = key  # one sample: both sample with the key itself
    arrays = {"x": x, "y": y, "num_samples": np.asarray(M), "activation": np.asarray("tanh")}
    for i in range(len(SIZES) - 1):
        arrays[f"w{i}"], arrays[f"b{i}"] = params[f"fc{i + 1}"]["w"], params[f"fc{i + 1}"]["b"]
    arrays["key"] = np.asarray(jax.random.key_data(key))
    arrays["key_one"] = np.asarray(jax.random.key_data(key_one))
    # One side run per test session: pytest-xdist's workers share the parent of their base temp.
    # The folder is named by what the side computes from (its script and inputs).
    base = tmp_path_factory.getbasetemp()
    base = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    digest = hashlib.sha256(SIDE.read_bytes())
    for name in sorted(arrays):
        digest.update(name.encode() + np.ascontiguousarray(arrays[name]).tobytes())
    shared = base / f"kfac_jax_side_{digest.hexdigest()[:16]}"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "out.npz").exists():
            np.savez(shared / "in.npz", **arrays)
            proc = subprocess.run(
                [
                    python,
                    str(SIDE),
                    "factors",
                    "--in",
                    str(shared / "in.npz"),
                    "--out",
                    str(shared / "part.npz"),
                ],
                capture_output=True,
                text=True,
                timeout=900,
                env=env.side_env(),
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
            (shared / "part.npz").rename(shared / "out.npz")
    theirs = dict(np.load(shared / "out.npz"))
    with jax.enable_x64(True):
        p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        xs, ys = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.int32)
        ours = {}
        for name, which, samples in (("exact", "kflr", 1), ("one", "kfac", 1), ("m", "kfac", M)):
            spec = vk.curvature.stats("*", [which], mc_samples=samples)
            f = jax.jit(vk.value_and_grad(_loss, capture=spec))
            _, captured = f(p, xs, ys, key=key)
            ours[name] = {
                layer: tuple(np.asarray(v) for v in getattr(captured[layer], which)) for layer in captured
            }
        logits = np.asarray(jax.jit(_model)(p, xs))
        labels = {
            "one": np.asarray(jax.random.categorical(key, logits, axis=-1)),
            "m": np.stack(
                [np.asarray(jax.random.categorical(k, logits, axis=-1)) for k in jax.random.split(key, M)]
            ),
            "key_itself": np.asarray(jax.random.categorical(key, logits, axis=-1)),
        }
    return {"theirs": theirs, "ours": ours, "labels": labels, "logits": logits}


def _assert_kron_close(ours, a, g, what):
    mine, theirs = np.kron(*ours), np.kron(a, g)
    assert mine.shape == theirs.shape, (what, mine.shape, theirs.shape)
    err = np.max(np.abs(mine - theirs)) / np.max(np.abs(theirs))
    assert err <= RTOL, f"{what}: kron(A, G) differs by {err:.3g} of its largest entry"


REGISTRATIONS = ("manual", "auto")
LAYERS = [f"fc{i + 1}" for i in range(len(SIZES) - 1)]


@pytest.mark.parametrize("registration", REGISTRATIONS)
@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_exact"])
def test_exact_ggn_equals_kflr(compared, registration, mode):
    theirs, ours = compared["theirs"], compared["ours"]["exact"]
    assert sorted(ours) == LAYERS
    for i, layer in enumerate(LAYERS):
        a, g = theirs[f"{registration}_{mode}_A{i}"], theirs[f"{registration}_{mode}_G{i}"]
        assert a.shape == (SIZES[i] + 1,) * 2  # the bias's ones column appended, as in vjpkit
        _assert_kron_close(ours[layer], a, g, f"{registration} {mode} {layer}")


def test_key_semantics(compared):
    """How kfac-jax draws its labels, on the arrays, and that jax 0.9.1 and 0.10.2 agree on them."""
    theirs, labels = compared["theirs"], compared["labels"]
    np.testing.assert_allclose(theirs["logits"], compared["logits"], rtol=1e-12, atol=1e-12)
    # one sample: the rng itself, in both (kfac-jax was given vjpkit's key K)
    assert bool(theirs["key_one_sample_is_categorical_of_key"])
    assert not bool(theirs["key_one_sample_is_split_1_0"])
    np.testing.assert_array_equal(theirs["key_labels_one_sample"], labels["one"])
    np.testing.assert_array_equal(labels["key_itself"], labels["one"])
    # M samples: split(K, M)[m], as vjpkit
    np.testing.assert_array_equal(theirs["key_labels_split_m"], labels["m"])
    # kfac-jax's last-layer G is that of those labels (read back from its factors)
    assert float(theirs["key_g_last_one_sample_err"]) < 1e-12
    assert float(theirs["key_g_last_m_samples_err"]) < 1e-12


@pytest.mark.parametrize("registration", REGISTRATIONS)
@pytest.mark.parametrize("samples", ["one", "m"])
def test_sampled_fisher_equals_kfac(compared, registration, samples):
    theirs, ours = compared["theirs"], compared["ours"][samples]
    mode = "fisher_gradients" if samples == "one" else "fisher_gradients_m"
    for i, layer in enumerate(LAYERS):
        a, g = theirs[f"{registration}_{mode}_A{i}"], theirs[f"{registration}_{mode}_G{i}"]
        _assert_kron_close(ours[layer], a, g, f"{registration} {mode} {layer}")
    # the samples are random: the sampled Fisher is not the exact GGN
    exact = compared["ours"]["exact"]["fc3"]
    assert not np.allclose(np.kron(*ours["fc3"]), np.kron(*exact), rtol=1e-3)


def test_versions(compared):
    versions = json.loads(str(compared["theirs"]["versions"]))
    assert versions["jax"] == "0.9.1" and versions["kfac_jax"] == "0.0.8", versions
