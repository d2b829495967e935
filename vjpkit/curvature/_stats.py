"""The statistics spec, and each statistic of one layer call from its records.

Contract. ``StatsSpec`` is what ``vk.curvature.stats`` (``_spec``) builds for ``capture=`` of
``vk.value_and_grad`` / ``vk.grad``. ``layer_stats(which, layout, x, d, exact, mc, n)``
computes the asked-for statistics of one (unstacked) layer call from:

* ``x``: the call's input; ``d``: its ``grad_output`` in the gradient's own backward pass (the
  empirical cotangents ``dL/dy``, each example's carrying the ``1/N`` of the mean);
* ``exact`` / ``mc``: its ``grad_output`` in the backward passes seeded with the loss Hessian's
  square-root columns / Monte-Carlo samples (stacked on axis 0), or ``None``;
* ``n``: the number of examples of the registered loss.

Every layer is read as the matrix form ``y_rows = a_rows @ M`` of ``_types``: a dense layer's
rows are every position of its input's leading axes, a convolution's rows its output positions
with ``a`` the unfolded patch. The per-example statistics group the rows by axis 0 of the
input and output, which must have ``n`` entries (the examples).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import stats as statslayer
from .._errors import ConfigError
from ._types import Diagonal, Ekfac, Factors, GradRows, LayerCurvature, Layout, stats_dtype

FACTORS = ("kflr", "kfac", "kfac_empirical")
DIAGONAL = ("diag_ggn", "diag_ggn_mc")
FIRST_ORDER = ("sum_grad_squared", "batch_l2", "backpack_variance")
BLOCKS = (*FACTORS, "ekfac")  # the fields an optimizer's blocks read (each kind answers them)
ROWS = ("grad_rows",)  # the gradient's rows of a dense call (K-FAC's records form): not per example
STATISTICS = (*BLOCKS, *DIAGONAL, *FIRST_ORDER, *ROWS)
EXACT = ("kflr", "diag_ggn")  # need the Hessian square-root pulls
SAMPLED = ("kfac", "ekfac", "diag_ggn_mc")  # need the Monte-Carlo pulls (and a key)
MAX_FACTOR_DIM = 4096  # a longer K-FAC factor side is kept as its diagonal (distributed Shampoo's)


class StatsSpec(NamedTuple):
    """What curvature to compute: see ``vk.curvature.stats``.

    ``program``: the transform that computes it (``_transform.transform``), which
    ``vk.grad`` / ``vk.value_and_grad`` call for a capture spec that brings its own program.
    """

    layers: tuple[str, ...]
    which: tuple[str, ...]
    mc_samples: int = 1
    max_factor_dim: int = MAX_FACTOR_DIM
    program: Callable | None = None

    @property
    def exact(self) -> bool:
        return any(s in EXACT for s in self.which)

    @property
    def sampled(self) -> bool:
        return any(s in SAMPLED for s in self.which)


# --------------------------------------------------------------------------------------------
# One layer call as rows of a matrix product: a (rows, in), g (..., rows, out)


def _patches(x: jax.Array, layout: Layout, kernel: tuple[int, ...]) -> jax.Array:
    """``vjpkit.stats.patches`` of a conv layer's input with the layer's own geometry."""
    return statslayer.patches(x, kernel[:-1], layout.strides, layout.padding, layout.dilation)


def _rows_in(layout: Layout, x: jax.Array, w_shape: tuple[int, ...]) -> jax.Array:
    """``a`` with the examples on axis 0 kept: ``(N, T, in)``."""
    if layout.kind == "conv":
        kernel = w_shape[:-1]
        x = _patches(x, layout, kernel)
        return x.reshape(x.shape[0], -1, x.shape[-1])
    n_in, _ = layout.matrix_shape(w_shape)
    return x.reshape(x.shape[0], -1, n_in)


# --------------------------------------------------------------------------------------------


def _gram(rows: jax.Array, max_dim: int) -> jax.Array:
    """``rows^T rows`` of ``(R, d)`` rows, or its diagonal ``sum rows^2`` when ``d > max_dim``."""
    return jnp.sum(jnp.square(rows), axis=0) if rows.shape[-1] > max_dim else rows.T @ rows


def _a_factor(a: jax.Array, n: int, bias: bool, conv: bool, max_dim: int) -> jax.Array:
    """``A = (1/N) sum_rows [a,1][a,1]^T`` of a dense layer (its diagonal past ``max_dim``).

    Convolution (BackPACK's KFLR / KFAC for convolutions): ``A = (1/N) sum_{n,t} [a,c][a,c]^T``
    over the ``T`` patches of each example with ``c = 1/sqrt(T)`` (the bias entry of ``A`` is 1);
    with ``_g_factor``'s ``G``, ``kron(A, G)``'s weight and bias blocks are BackPACK's.
    """
    t = a.shape[1]
    a = a.reshape(-1, a.shape[-1])
    if bias:
        c = 1 / math.sqrt(t) if conv else 1.0
        a = jnp.concatenate([a, jnp.full((a.shape[0], 1), c, a.dtype)], axis=1)
    return _gram(a, max_dim) / n


def _g_factor(gs: jax.Array, conv: bool, max_dim: int) -> jax.Array:
    """``G = sum_seeds sum_rows g g^T`` (its diagonal past ``max_dim``); for a convolution each
    example's cotangents are first summed over the output positions,
    ``G = sum_seeds sum_n (sum_t g_nt)(sum_t g_nt)^T``."""
    g = gs.sum(axis=-2) if conv else gs  # (..., N, T, out) -> (..., N, out) for a convolution
    return _gram(g.reshape(-1, g.shape[-1]), max_dim)


def _over_seeds(body, zero, seeds: Any) -> Any:
    """``body``'s accumulation over the seeds on axis 0 of every leaf of ``seeds``, one at a time
    (a ``lax.scan``); one seed (a Monte-Carlo sample, the gradient) without a loop around it."""
    if jax.tree.leaves(seeds)[0].shape[0] == 1:
        return body(zero, jax.tree.map(lambda s: s[0], seeds))[0]
    return lax.scan(body, zero, seeds)[0]


def _rows(rows_in: Sequence[jax.Array], gs: Sequence[jax.Array]) -> tuple[list, list]:
    """The weight's and the bias's ``statslayer.Rows`` in the ``(in, out)`` matrix layout, one
    per call of the weight: rows ``a (N, T, in)`` and cotangents ``g (N, T, out)`` each."""
    w = [statslayer.Rows(a, g, (0,), (1,), (a.shape[-1], g.shape[-1])) for a, g in zip(rows_in, gs)]
    return w, [statslayer.Rows.bias(g, (g.shape[-1],)) for g in gs]


def _per_example_sq(rows_in: Sequence[jax.Array], gs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Over seeds ``k`` and examples ``n``: ``sum (J_kn)^2`` of the weight matrix ``(in, out)``
    and of the bias ``(out,)``, where ``J_kn = sum_calls sum_t a_nt g_knt^T`` (the calls'
    contributions summed before squaring, ``vjpkit.stats.sum_sq``). Per call: ``a (N, T, in)``,
    ``gs (K, N, T, out)``."""

    def body(acc, g):  # one seed at a time
        w, b = _rows(rows_in, g)
        return (acc[0] + statslayer.sum_sq(w), acc[1] + statslayer.sum_sq(b)), None

    n_in, n_out, dtype = rows_in[0].shape[-1], gs[0].shape[-1], rows_in[0].dtype
    return _over_seeds(body, (jnp.zeros((n_in, n_out), dtype), jnp.zeros((n_out,), dtype)), list(gs))


def _per_example_fields(
    which: Sequence[str],
    layout: Layout,
    params: dict,
    grad: dict | None,
    rows_in: Sequence[jax.Array],
    rows_out: Callable[[jax.Array, int], jax.Array],
    calls: Sequence[tuple],
    n: int,
) -> dict[str, Any]:
    """The per-example statistics ``which`` of one weight (and bias) from its calls: per call
    ``(d, exact, mc)`` and its rows ``rows_in``; ``rows_out(g, k)`` lays call ``k``'s cotangents
    out as ``(..., N, T, out)``; ``grad`` the weight's gradient (the sum over its calls)."""
    w_shape = tuple(params[layout.weight].shape)
    bias = layout.bias is not None

    def as_params(w_mat, b_vec):
        tree = {layout.weight: layout.from_matrix(w_mat, w_shape)}
        if bias:
            tree[layout.bias] = b_vec.reshape(params[layout.bias].shape)
        return tree

    def seeds(pos):  # every call's seeds of one kind, laid out
        return [rows_out(c[pos], k) for k, c in enumerate(calls)]

    out: dict[str, Any] = {}
    for name, pos in (("diag_ggn", 1), ("diag_ggn_mc", 2)):
        if name in which:
            out[name] = as_params(*_per_example_sq(rows_in, seeds(pos)))
    if any(s in which for s in FIRST_ORDER):
        dd = seeds(0)
        if "sum_grad_squared" in which or "backpack_variance" in which:
            sgs = as_params(*_per_example_sq(rows_in, [d[None] for d in dd]))
            if "sum_grad_squared" in which:
                out["sum_grad_squared"] = sgs
            if "backpack_variance" in which:
                dtype = rows_in[0].dtype
                out["backpack_variance"] = {k: _variance(sgs[k], grad[k].astype(dtype), n) for k in sgs}
        if "batch_l2" in which:
            w, b = _rows(rows_in, dd)
            out["batch_l2"] = {
                layout.weight: statslayer.sq_norms(w),
                **({layout.bias: statslayer.sq_norms(b)} if bias else {}),
            }
    return out


def layer_stats(
    which: Sequence[str],
    layout: Layout,
    params: dict,
    grad_params: dict,
    x: jax.Array,
    d: jax.Array,
    exact: jax.Array | None,
    mc: jax.Array | None,
    n: int,
    where: str,
    max_dim: int = MAX_FACTOR_DIM,
) -> LayerCurvature:
    """The statistics ``which`` of one layer call (see the module contract); a factor side
    longer than ``max_dim`` is its diagonal."""
    w_shape = tuple(params[layout.weight].shape)
    n_in, n_out = layout.matrix_shape(w_shape)
    dtype = stats_dtype(x.dtype)
    a = _rows_in(layout, x.astype(dtype), w_shape)
    per_example = [s for s in which if s not in (*FACTORS, *ROWS)]
    if per_example and (a.shape[0] != n or d.shape[0] != n):
        raise ConfigError(
            f"vk.curvature.stats: {where}: the per-example statistics {per_example} read axis 0 of the "
            f"layer's input and output as the {n} examples of the registered loss, but they have "
            f"{a.shape[0]} and {d.shape[0]} entries there. Ask only for K-FAC factors "
            f"({list(FACTORS)}) of this layer, or keep the examples on axis 0."
        )

    def rows(g):  # (..., N or rows, ..., out) -> (..., N, T, out)
        lead = g.ndim - d.ndim
        return g.astype(dtype).reshape(*g.shape[:lead], a.shape[0], -1, n_out)

    bias, conv = layout.bias is not None, layout.kind == "conv"
    out: dict[str, Any] = {}
    if any(s in FACTORS for s in which):
        big_a = _a_factor(a, n, bias, conv, max_dim)  # one A for every K-FAC estimator asked for
        seeds = {"kflr": exact, "kfac": mc, "kfac_empirical": d}
        for name in (s for s in FACTORS if s in which):
            g = rows(seeds[name])
            if name == "kfac_empirical":  # each example's dL/dy carries the 1/N of the mean
                g = g * jnp.sqrt(jnp.asarray(n, dtype))
            out[name] = Factors(big_a, _g_factor(g, conv, max_dim))
    if "ekfac" in which:  # kfac's factors, and the rows of each example's gradient of [W; b]
        g = rows(mc)
        big_a = out["kfac"].A if "kfac" in out else _a_factor(a, n, bias, conv, max_dim)
        rows_a = jnp.concatenate([a, jnp.ones((*a.shape[:-1], 1), dtype)], axis=-1) if bias else a
        out["ekfac"] = Ekfac(big_a, _g_factor(g, conv, max_dim), rows_a, g)
    if "grad_rows" in which and not conv:  # the gradient of [W; b] as a^T d
        rows_a = jnp.concatenate([a, jnp.ones((*a.shape[:-1], 1), dtype)], axis=-1) if bias else a
        out["grad_rows"] = GradRows(rows_a.reshape(-1, rows_a.shape[-1]), d.astype(dtype).reshape(-1, n_out))

    out.update(
        _per_example_fields(
            which, layout, params, grad_params, [a], lambda g, _: rows(g), [(d, exact, mc)], n
        )
    )
    return LayerCurvature(**out, layout=layout)


def shared_stats(which: Sequence[str], calls: Sequence[tuple], n: int) -> dict[str, Any]:
    """The per-example statistics ``which`` of ONE weight (and bias) used by several dense calls
    with one layout: each example's gradient is the sum of the calls' (``vjpkit.stats`` keeps
    the cross terms), so ``diag_ggn`` is the diagonal of that weight's whole GGN, not the sum of
    the calls' own diagonals. ``calls``: per call ``(layout, params, grad_params, x, d, exact,
    mc)`` as ``layer_stats`` takes them (examples on axis 0). Returns ``{field: {leaf key:
    array}}`` keyed by the first call's params keys."""
    layout, params = calls[0][0], calls[0][1]
    w_shape = tuple(params[layout.weight].shape)
    n_out = layout.matrix_shape(w_shape)[1]
    dtype = stats_dtype(calls[0][3].dtype)
    rows_in = [_rows_in(layout, c[3].astype(dtype), w_shape) for c in calls]

    def rows_out(g, k):  # call k's (..., N or rows, ..., out) -> (..., N, T, out)
        lead = g.ndim - calls[k][4].ndim
        return g.astype(dtype).reshape(*g.shape[:lead], rows_in[k].shape[0], -1, n_out)

    grad = {key: sum(c[2][key].astype(dtype) for c in calls) for key in calls[0][2]}
    return _per_example_fields(which, layout, params, grad, rows_in, rows_out, [c[4:] for c in calls], n)


def _variance(sgs: jax.Array, grad: jax.Array, n: int) -> jax.Array:
    """BackPACK's ``Variance``: ``(1/N) sum_n g_n^2 - ((1/N) sum_n g_n)^2`` of the per-example
    gradients ``g_n = grad l_n / N`` (``sgs = sum_n g_n^2``, ``grad = sum_n g_n``)."""
    return sgs / n - jnp.square(grad / n)


# --------------------------------------------------------------------------------------------
# Layers without a matrix form (embeddings, norm affines, any per-example layer): the diagonal
# and first-order statistics from per-example parameter gradients, materialised one seed at a time


def local_stats(
    which: Sequence[str],
    per_example: Any,
    params: Any,
    grad_params: Any,
    d: jax.Array,
    exact: jax.Array | None,
    mc: jax.Array | None,
    n: int,
    where: str,
    axis: int = 0,
) -> dict[str, Any]:
    """The statistics of a layer with no K-FAC rule, from ``per_example`` (a ``_local.PerExample``:
    its per-example gradients' squares summed, and squared norms, for output cotangents ``g``
    with the examples on ``axis``). Its
    K-FAC fields are its diagonal block (``Diagonal``) of the same curvature."""
    factors = [s for s in which if s in BLOCKS]
    if d.shape[axis] != n:
        raise ConfigError(
            f"vk.curvature.stats: {where}: the per-example statistics {list(which)} read axis {axis} of "
            f"the layer's output as the {n} examples of the registered loss, but it has "
            f"{d.shape[axis]} entries there."
        )
    dtype = stats_dtype(d.dtype)

    def square_sum(seeds):  # sum over seeds and examples of the squared per-example gradients
        def body(acc, g):
            return jax.tree.map(lambda a, s: a + s, acc, per_example.sum_sq(g, dtype)), None

        zero = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
        return _over_seeds(body, zero, seeds)

    out: dict[str, Any] = {}
    if "diag_ggn" in which or "kflr" in which:
        out["diag_ggn"] = square_sum(exact)
    if "diag_ggn_mc" in which or "kfac" in which or "ekfac" in which:
        out["diag_ggn_mc"] = square_sum(mc)
    sgs = None
    if "sum_grad_squared" in which or "backpack_variance" in which or "kfac_empirical" in which:
        sgs = square_sum(d[None])
        if "sum_grad_squared" in which:
            out["sum_grad_squared"] = sgs
        if "backpack_variance" in which:
            out["backpack_variance"] = jax.tree.map(
                lambda s, g: _variance(s, g.astype(dtype), n), sgs, grad_params
            )
    if "batch_l2" in which:
        out["batch_l2"] = per_example.sq_norms(d, dtype)
    blocks = {  # the diagonal block of each K-FAC estimator asked for (see _types)
        "kflr": lambda: out["diag_ggn"],
        "kfac": lambda: out["diag_ggn_mc"],
        "ekfac": lambda: out["diag_ggn_mc"],
        "kfac_empirical": lambda: jax.tree.map(lambda s: s * jnp.asarray(n, s.dtype), sgs),
    }
    for name in factors:
        out[name] = Diagonal(blocks[name]())
    return {k: v for k, v in out.items() if k in which}
