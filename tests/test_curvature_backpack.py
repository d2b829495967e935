"""vk.curvature against BackPACK (PyTorch), the oracle of issue 23, on the same weights and data.

An MLP 8-16-16-4 (tanh, ReLU) and a small CNN (Conv2d 2->4, 3x3, stride 1, padding 1, ReLU,
Flatten, Linear -> 3) with ``CrossEntropyLoss(reduction="mean")``, in float64 on both sides.
Layouts: torch's ``Linear.weight`` is ``(out, in)``, vjpkit's dense ``W`` is ``(in, out)``;
``Conv2d.weight`` is OIHW, the JAX convolution's HWIO on NHWC inputs; the JAX model transposes
its NHWC activations to NCHW before the flatten, so that the Linear weights are torch's
(transposed).

BackPACK's conventions, read in its source (backpack-for-pytorch 1.7.1,
``backpack/extensions/``):

* ``KFLR`` (``secondorder/hbp/linear.py``, ``convnd.py``): ``weight.kflr = [G, A]``, with
  ``kron(G, A)`` over the ``(out, in)`` weight flattened row-major; ``G = sum_{seeds, rows} g g^T``
  from the backpropagated square root of the loss Hessian (carrying ``1/sqrt(N)``) and
  ``A = (1/N) sum a a^T`` over the layer input (a convolution's patches unfolded with features
  ordered ``(c_in, kh, kw)``); ``bias.kflr = [G]``. vjpkit's ``kron(A, G)`` over ``[W; b]``
  ``(in + 1, out)`` is compared block by block after the index permutations. For a convolution,
  BackPACK's ``G`` sums each example's cotangents over the output positions before the outer
  product (``einsum("cbij->cbi")``: the bias's own GGN), vjpkit's sums the outer products of
  every position (KFC's, kfac-jax's); see ``test_cnn_conv_kflr_is_backpacks``.
* ``Variance`` (``firstorder/variance/variance_base.py``): ``sgs / N - (grad / N)^2``, the
  variance over the examples of BackPACK's rows ``g_n = grad(l_n) / N``.
* ``SumGradSquared``: ``sum_n g_n^2``; ``BatchL2Grad``: ``||g_n||^2`` per example and parameter;
  ``DiagGGNExact``: the GGN's diagonal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

# torch==2.13.0's CPU build is what the package index serves for Python 3.11; on Python 3.12+
# pip resolves a CUDA build (a 5.6 GB venv), so CI runs this oracle in its Python 3.11 stage.
_WHY = "the BackPACK oracle: pip install 'vjpkit[curvature-oracles]' (CI: the Python 3.11 stage)"
torch = pytest.importorskip("torch", reason=_WHY)
backpack = pytest.importorskip("backpack", reason=_WHY)

from backpack import extend  # noqa: E402
from backpack.extensions import (  # noqa: E402
    KFAC,
    KFLR,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    SumGradSquared,
    Variance,
)

import vjpkit as vk  # noqa: E402

# BackPACK's hooks on the first module see an input that needs no gradient: torch warns, harmlessly
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

TOL = {"rtol": 1e-5, "atol": 1e-12}
FIRST = ["sum_grad_squared", "batch_l2"]
N = 10


def close(got, want, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_allclose(got, want, err_msg=what, **TOL)


@pytest.fixture
def f64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with jax.enable_x64(True):
            yield
    finally:
        torch.set_default_dtype(prev)


def _t(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a), dtype=torch.float64)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def run_backpack(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, *extensions) -> dict:
    """``{module name: {param name: {savefield: value}}}`` after one backward pass."""
    model = extend(model)
    lossfunc = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
    loss = lossfunc(model(_t(x)), torch.tensor(y, dtype=torch.long))
    with backpack.backpack(*extensions):
        loss.backward()
    out = {}
    for mod_name, module in model.named_children():
        for p_name, param in module.named_parameters(recurse=False):
            fields = {}
            for ext in extensions:
                value = getattr(param, ext.savefield)
                fields[ext.savefield] = [_np(v) for v in value] if isinstance(value, list) else _np(value)
            fields["grad"] = _np(param.grad)
            out.setdefault(mod_name, {})[p_name] = fields
    return {"loss": float(loss.detach()), **out}


def kron_blocks(a: np.ndarray, g: np.ndarray, n_in: int, n_out: int, perm_in=None):
    """vjpkit's ``kron(A, G)`` over ``[W; b]``: the weight block over torch's ``(out, in)``
    flattening (``perm_in`` reorders the input features first) and the bias block."""
    a, g = np.asarray(a), np.asarray(g)
    a_w = a[:n_in, :n_in]
    if perm_in is not None:
        a_w = a_w[np.ix_(perm_in, perm_in)]
    w = np.kron(g, a_w)  # (out, in) x (out, in): torch's row-major order
    return w, a[n_in, n_in] * g


# ----------------------------------------------------------------------------- the MLP

SIZES = (8, 16, 16, 4)


def mlp_setup(seed: int):
    rng = np.random.default_rng(seed)
    torch_model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    ).double()
    params = {}
    for i, idx in enumerate((0, 2, 4)):
        n_in, n_out = SIZES[i], SIZES[i + 1]
        w, b = 0.5 * rng.standard_normal((n_in, n_out)), 0.3 * rng.standard_normal(n_out)
        with torch.no_grad():
            torch_model[idx].weight.copy_(_t(w.T))
            torch_model[idx].bias.copy_(_t(b))
        params[str(idx)] = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
    x = rng.standard_normal((N, 8))
    y = rng.integers(0, 4, N)
    return torch_model, params, x, y


def mlp(p, x):
    h = jnp.tanh(x @ p["0"]["w"] + p["0"]["b"])
    h = jax.nn.relu(h @ p["2"]["w"] + p["2"]["b"])
    return h @ p["4"]["w"] + p["4"]["b"]


def _jax_stats(model, params, x, y, which, **kw):
    loss = lambda p, x, y: vk.curvature.softmax_cross_entropy(model(p, x), y)
    f = jax.jit(vk.value_and_grad(loss, capture=vk.curvature.stats("*", which, **kw)))
    return f(params, jnp.asarray(x), jnp.asarray(y, jnp.int32), **({"key": jax.random.key(0)} if kw else {}))


def test_mlp_kflr_diag_ggn_and_first_order(f64):
    torch_model, params, x, y = mlp_setup(0)
    bp = run_backpack(torch_model, x, y, KFLR(), DiagGGNExact(), SumGradSquared(), BatchL2Grad())
    (loss, grads), cap = _jax_stats(mlp, params, x, y, ["kflr", "diag_ggn", *FIRST])
    close(loss, bp["loss"], "loss")
    for i, name in enumerate(("0", "2", "4")):
        n_in, n_out = SIZES[i], SIZES[i + 1]
        w, b = bp[name]["weight"], bp[name]["bias"]
        close(grads[name]["w"].T, w["grad"], f"{name} grad")
        g_t, a_t = w["kflr"]  # BackPACK's order: [G, A]
        assert g_t.shape == (n_out, n_out) and a_t.shape == (n_in, n_in)
        ours_w, ours_b = kron_blocks(*cap[name].kflr, n_in, n_out)
        close(ours_w, np.kron(g_t, a_t), f"{name} kflr weight")
        (g_b,) = b["kflr"]
        close(ours_b, g_b, f"{name} kflr bias")
        stats = cap[name]
        close(stats.diag_ggn["w"].T, w["diag_ggn_exact"], f"{name} diag_ggn weight")
        close(stats.diag_ggn["b"], b["diag_ggn_exact"], f"{name} diag_ggn bias")
        close(stats.sum_grad_squared["w"].T, w["sum_grad_squared"], f"{name} sgs weight")
        close(stats.sum_grad_squared["b"], b["sum_grad_squared"], f"{name} sgs bias")
        close(stats.batch_l2["w"], w["batch_l2"], f"{name} batch_l2 weight")
        close(stats.batch_l2["b"], b["batch_l2"], f"{name} batch_l2 bias")


def test_mlp_variance(f64):
    torch_model, params, x, y = mlp_setup(1)
    bp = run_backpack(torch_model, x, y, Variance())
    _, cap = _jax_stats(mlp, params, x, y, ["backpack_variance"])
    for name in ("0", "2", "4"):
        close(cap[name].backpack_variance["b"], bp[name]["bias"]["variance"], f"{name} variance bias")
        close(cap[name].backpack_variance["w"].T, bp[name]["weight"]["variance"], f"{name} variance weight")


def test_mlp_monte_carlo_shapes(f64):
    """``KFAC`` / ``DiagGGNMC`` draw from torch's generator: only their shapes are comparable."""
    torch_model, params, x, y = mlp_setup(2)
    bp = run_backpack(torch_model, x, y, KFAC(mc_samples=1), DiagGGNMC(mc_samples=1))
    _, cap = _jax_stats(mlp, params, x, y, ["kfac", "diag_ggn_mc"], mc_samples=1)
    for name in ("0", "2", "4"):
        g_t, a_t = bp[name]["weight"]["kfac"]
        A, G = cap[name].kfac
        assert (G.shape, A.shape) == (g_t.shape, (a_t.shape[0] + 1,) * 2)
        close(A[:-1, :-1], a_t, f"{name} kfac A (not sampled)")
        assert cap[name].diag_ggn_mc["w"].T.shape == bp[name]["weight"]["diag_ggn_mc"].shape
        assert np.all(np.asarray(cap[name].diag_ggn_mc["w"]) >= 0)


# ----------------------------------------------------------------------------- the CNN

C_IN, C_OUT, HW, CLASSES = 2, 4, 5, 3


def cnn_setup(seed: int):
    rng = np.random.default_rng(seed)
    torch_model = torch.nn.Sequential(
        torch.nn.Conv2d(C_IN, C_OUT, 3, stride=1, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(C_OUT * HW * HW, CLASSES),
    ).double()
    w_conv = 0.4 * rng.standard_normal((C_OUT, C_IN, 3, 3))  # OIHW
    b_conv = 0.3 * rng.standard_normal(C_OUT)
    w_fc = 0.3 * rng.standard_normal((CLASSES, C_OUT * HW * HW))
    b_fc = 0.3 * rng.standard_normal(CLASSES)
    with torch.no_grad():
        torch_model[0].weight.copy_(_t(w_conv))
        torch_model[0].bias.copy_(_t(b_conv))
        torch_model[3].weight.copy_(_t(w_fc))
        torch_model[3].bias.copy_(_t(b_fc))
    params = {
        "0": {"w": jnp.asarray(w_conv.transpose(2, 3, 1, 0)), "b": jnp.asarray(b_conv)},  # HWIO
        "3": {"w": jnp.asarray(w_fc.T), "b": jnp.asarray(b_fc)},
    }
    x = rng.standard_normal((N, C_IN, HW, HW))  # NCHW for torch
    return torch_model, params, x, rng.integers(0, CLASSES, N)


def cnn(p, x_nchw):
    x = jnp.transpose(x_nchw, (0, 2, 3, 1))  # NHWC
    h = lax.conv_general_dilated(x, p["0"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h + p["0"]["b"])
    h = jnp.transpose(h, (0, 3, 1, 2)).reshape(x.shape[0], -1)  # torch's flatten order
    return h @ p["3"]["w"] + p["3"]["b"]


# ours: patch features (kh, kw, c_in); BackPACK's unfold: (c_in, kh, kw)
CONV_PERM = np.arange(3 * 3 * C_IN).reshape(3, 3, C_IN).transpose(2, 0, 1).reshape(-1)


def hwio_to_oihw(a) -> np.ndarray:
    return np.asarray(a).transpose(3, 2, 0, 1)


def test_cnn_diag_ggn_first_order_and_linear_kflr(f64):
    torch_model, params, x, y = cnn_setup(3)
    bp = run_backpack(torch_model, x, y, KFLR(), DiagGGNExact(), SumGradSquared(), BatchL2Grad())
    (loss, grads), cap = _jax_stats(cnn, params, x, y, ["kflr", "diag_ggn", *FIRST])
    close(loss, bp["loss"], "loss")
    conv, fc = cap["0"], cap["3"]
    w, b = bp["0"]["weight"], bp["0"]["bias"]
    close(hwio_to_oihw(grads["0"]["w"]), w["grad"], "conv grad")
    close(hwio_to_oihw(conv.diag_ggn["w"]), w["diag_ggn_exact"], "conv diag_ggn weight")
    close(conv.diag_ggn["b"], b["diag_ggn_exact"], "conv diag_ggn bias")
    close(hwio_to_oihw(conv.sum_grad_squared["w"]), w["sum_grad_squared"], "conv sgs weight")
    close(conv.sum_grad_squared["b"], b["sum_grad_squared"], "conv sgs bias")
    close(conv.batch_l2["w"], w["batch_l2"], "conv batch_l2 weight")
    close(conv.batch_l2["b"], b["batch_l2"], "conv batch_l2 bias")
    # the conv's input factor: the same unfolded-patch second moment, features permuted
    _, a_t = w["kflr"]
    close(np.asarray(conv.kflr.A)[:-1, :-1][np.ix_(CONV_PERM, CONV_PERM)], a_t, "conv kflr A")
    # the Linear after the flatten: the whole Kronecker product
    n_in = C_OUT * HW * HW
    ours_w, ours_b = kron_blocks(*fc.kflr, n_in, CLASSES)
    g_t, a_t = bp["3"]["weight"]["kflr"]
    close(ours_w, np.kron(g_t, a_t), "fc kflr weight")
    close(ours_b, bp["3"]["bias"]["kflr"][0], "fc kflr bias")
    for stat in ("diag_ggn", "sum_grad_squared"):
        field = {"diag_ggn": "diag_ggn_exact"}.get(stat, stat)
        close(getattr(fc, stat)["w"].T, bp["3"]["weight"][field], f"fc {stat} weight")
        close(getattr(fc, stat)["b"], bp["3"]["bias"][field], f"fc {stat} bias")


def test_cnn_conv_kflr_weight_is_backpacks(f64):
    torch_model, params, x, y = cnn_setup(4)
    bp = run_backpack(torch_model, x, y, KFLR())
    _, cap = _jax_stats(cnn, params, x, y, ["kflr"])
    ours_w, _ = kron_blocks(*cap["0"].kflr, 9 * C_IN, C_OUT, perm_in=CONV_PERM)
    g_t, a_t = bp["0"]["weight"]["kflr"]
    close(ours_w, np.kron(g_t, a_t), "conv kflr weight")


def test_cnn_conv_kflr_bias_is_backpacks(f64):
    torch_model, params, x, y = cnn_setup(4)
    bp = run_backpack(torch_model, x, y, KFLR())
    _, cap = _jax_stats(cnn, params, x, y, ["kflr"])
    _, ours_b = kron_blocks(*cap["0"].kflr, 9 * C_IN, C_OUT, perm_in=CONV_PERM)
    close(ours_b, bp["0"]["bias"]["kflr"][0], "conv kflr bias")


def test_cnn_conv_kflr_g_against_the_bias_ggn(f64):
    """BackPACK's conv ``G`` is the exact GGN of the bias (its diagonal is vjpkit's ``diag_ggn``
    of the bias), and it bounds the per-position ("expand") factor kfac-jax uses:
    ``T * sum_t g g^T - G`` is positive semi-definite (Cauchy-Schwarz)."""
    torch_model, params, x, y = cnn_setup(5)
    bp = run_backpack(torch_model, x, y, KFLR())
    _, cap = _jax_stats(cnn, params, x, y, ["kflr", "diag_ggn"])
    g_t = bp["0"]["weight"]["kflr"][0]
    close(bp["0"]["bias"]["kflr"][0], g_t, "BackPACK's conv G is its bias factor")
    close(np.diag(g_t), cap["0"].diag_ggn["b"], "BackPACK's conv G diagonal = vjpkit's bias diag_ggn")
    G = np.asarray(cap["0"].kflr.G)
    assert np.linalg.eigvalsh(G).min() >= -1e-12
    close(G, g_t, "vjpkit's conv G is BackPACK's")
